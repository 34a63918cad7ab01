"""OpenAI-compatible HTTP endpoints in front of the `speculative` Triton model (issue 61): /v1/chat/completions,
/v1/completions, /v1/models and health routes, on Starlette and uvicorn, streaming to Triton over gRPC.

Triton's own OpenAI frontend (triton-inference-server/server, python/openai) runs Triton in-process through the
`tritonserver` Python API and cannot attach to a tritonserver that is already running, which is what `specdeploy
serve`, the image and the overlays run; it is ready to run only in NGC's -vllm images, does not cancel a request when
its client disconnects, and answers errors in FastAPI's shapes rather than OpenAI's (docs/serving.md, "OpenAI
API"). So this front runs everywhere, beside tritonserver: protocol.py reads and checks a request and writes the
responses, upstream.py streams it to Triton, app.py routes, front.py runs it and drains it."""
