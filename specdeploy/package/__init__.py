"""`specdeploy package`: the code the CLI runs to write a Triton model repository from a built engine
(repository.py; trtllm_models.py and llmapi_repository.py for the trtllm flavour's models; package_stamp.py so that
unchanged inputs package nothing). It reads the build stage's plans and writes what serve/ loads inside
tritonserver; serve/ imports nothing from here or from build/, so the server process never loads packaging code."""
