"""Measuring speculation. `specdeploy bench` (command.py) either runs the in-process bench or load-tests a running
server. The in-process bench (run.py) decodes every prompt (prompts.py) plain and with speculation, then builds one
typed BenchReport (results.py) from summary.py's maths, measure.py's ceilings and verify costs, greedy_check.py, and
moe_curve.py or medusa_tree.py for those pipelines (peers.py: other implementations on the same weights).
printing.py prints it, comparison.py puts pipelines side by side, and markdown.py writes report.md with plots.py's
plots. Against a server, server_runs.py runs the concurrency levels (server_load.py sends the requests) into a typed
ServerBenchReport (server_results.py), which server_printing.py prints and server_markdown.py writes as report.md.
context_sweep.py measures speedup against context length (context_printing.py, context_markdown.py). The cost
model they all use is speculative/speedup.py."""
