"""The OpenAI front as a process: `python -m specdeploy.serve.openai_api.front --repository DIR --triton HOST:PORT
--port P`, and OpenAIFront, which `specdeploy serve` starts beside tritonserver.

It serves the repository's pipeline under the pipeline's name, tokenising with the repository's own tokenizer
(the preprocessing model's folder) through decoding/light_tokenizer.py. On SIGTERM it drains as tritonserver does:
readiness turns false and new requests get 503 at once, running streams go on until they end or the drain timeout
passes, then the process exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import subprocess
import sys
import time
from pathlib import Path

from specdeploy.errors import SpecdeployError
from specdeploy.serve.tritonserver import DRAIN_TIMEOUT, die_with_parent, free_port

DEFAULT_PORT = 9000  # Triton's OpenAI frontend's default
MAX_REQUESTS = 128  # requests running through the front at once before new ones get 429 (TGI's default limit)
TOKENIZER_FOLDER = Path("preprocessing") / "1" / "tokenizer"
PIPELINE_FILE = Path("speculative") / "1" / "pipeline.json"


def served_name(repository: Path) -> str:
    """The pipeline's name, as /v1/models lists it and requests name it."""
    import json

    for path in (repository / PIPELINE_FILE, *sorted(repository.glob("speculative/1/**/pipeline.json"))):
        if path.is_file():
            return json.loads(path.read_text())["name"]
    raise SpecdeployError(f"{repository}: no speculative/1/…/pipeline.json (package it with specdeploy package)")


def draining_server_class():
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn's server without its own signal handling (it would close the live streams at once, and raise the
        signal again when it has): SIGTERM is the front's, a drain first (serve_forever)."""

        @contextlib.contextmanager
        def capture_signals(self):
            yield

    return DrainingServer


async def serve_forever(repository: Path, triton_url: str, address: str, port: int, drain_timeout: float,
                        max_requests: int = MAX_REQUESTS) -> None:
    import tritonclient.grpc.aio as grpcclient
    import uvicorn

    from specdeploy.decoding.light_tokenizer import load_tokenizer_files
    from specdeploy.serve.openai_api.app import FrontState, create_app

    DrainingServer = draining_server_class()  # noqa: N806 - a class, made where uvicorn is imported
    tokenizer = load_tokenizer_files(repository / TOKENIZER_FOLDER)
    state = FrontState(grpcclient.InferenceServerClient(triton_url), tokenizer, served_name(repository),
                       max_requests)
    server = DrainingServer(uvicorn.Config(create_app(state), host=address, port=port, log_level="warning",
                                           timeout_graceful_shutdown=1))

    async def drain() -> None:
        state.draining = True
        deadline = time.monotonic() + drain_timeout
        while state.running and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        server.should_exit = True

    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, lambda: loop.create_task(drain()))
    print(f"openai front ready: http://{address}:{port}/v1 serving {state.model_name} via {triton_url}",
          file=sys.stderr, flush=True)
    await server.serve()
    await state.client.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repository", type=Path, required=True, help="the model repository tritonserver serves")
    parser.add_argument("--triton", required=True, help="tritonserver's gRPC address, HOST:PORT")
    parser.add_argument("--address", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--drain-timeout", type=float, default=DRAIN_TIMEOUT)
    parser.add_argument("--max-requests", type=int, default=MAX_REQUESTS, help="running at once; more get 429")
    options = parser.parse_args(argv)
    asyncio.run(serve_forever(options.repository.resolve(), options.triton, options.address, options.port,
                              options.drain_timeout, options.max_requests))


class OpenAIFront:
    """The front's process beside a TritonServer: start() waits until it answers, drain() sends it SIGTERM."""

    def __init__(self, repository: Path, triton_url: str, port: int | None = None, address: str = "127.0.0.1",
                 drain_timeout: float = DRAIN_TIMEOUT, max_requests: int = MAX_REQUESTS) -> None:
        self.repository, self.triton_url, self.address = Path(repository), triton_url, address
        self.max_requests = max_requests
        self.port = port or free_port()
        self.drain_timeout = drain_timeout
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.address}:{self.port}/v1"

    def start(self, timeout: float = 60.0) -> OpenAIFront:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "specdeploy.serve.openai_api.front", "--repository", str(self.repository),
             "--triton", self.triton_url, "--address", self.address, "--port", str(self.port),
             "--drain-timeout", str(self.drain_timeout), "--max-requests", str(self.max_requests)],
            preexec_fn=die_with_parent)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SpecdeployError(f"the OpenAI front exited with status {self.process.returncode} before it "
                                      f"answered")
            if self.answers():
                return self
            time.sleep(0.2)
        self.stop()
        raise SpecdeployError(f"the OpenAI front did not answer on port {self.port} within {timeout:.0f} s")

    def answers(self) -> bool:
        import urllib.request

        try:
            with urllib.request.urlopen(f"http://{self.address}:{self.port}/health/live", timeout=1) as response:
                return response.status == 200
        except OSError:
            return False

    def drain(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def stop(self) -> int | None:
        if self.process is None:
            return None
        self.drain()
        try:
            self.process.wait(self.drain_timeout + 10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        return self.process.returncode

    def __enter__(self) -> OpenAIFront:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


if __name__ == "__main__":
    main()
