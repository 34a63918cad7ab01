"""A failed scheduler behind a real tritonserver (issue 64 point 2): with a fault injected into the proposer
(SPECDEPLOY_TEST_FAULT, test only: runtime/fault_injection.py) of a tiny engine served by `specdeploy serve`, every
stream under load ends with an error naming the failure, the server turns not ready and exits, and `serve` exits
non-zero saying why, so that its supervisor restarts it. The injected fault exists only in this source tree's code,
so the test also shows that the server's Python stubs ran it."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
from helpers.repo import REPO

from specdeploy.errors import RequestError
from specdeploy.package.repository import write_repository
from specdeploy.serve.client import generate
from specdeploy.serve.tritonserver import free_port, is_ready

pytestmark = pytest.mark.slow
CLIENTS = 6


def test_an_injected_fault_ends_every_stream_with_an_error_and_serve_exits_non_zero(tiny_engines, tmp_path):
    repository = write_repository(tiny_engines["draft_target"].dir, tmp_path / "repository")
    grpc, http, metrics, openai = (free_port() for _ in range(4))
    log = tmp_path / "serve.log"
    # the 30th commit fails (on_commit runs for every row, drafting or not): every stream is running by then
    environment = {**os.environ, "SPECDEPLOY_TEST_FAULT": "on_commit:30"}
    with log.open("wb") as output:
        process = subprocess.Popen([sys.executable, "-m", "specdeploy.cli", "serve", "--model-repository",
                                    str(repository), "--grpc-port", str(grpc), "--http-port", str(http),
                                    "--metrics-port", str(metrics), "--openai-port", str(openai)],
                                   cwd=REPO, env=environment, stdout=output, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while not is_ready("127.0.0.1", http):
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        errors: dict[int, str] = {}
        running: set[int] = set()

        def client(index: int) -> None:
            try:
                for _ in generate(f"127.0.0.1:{grpc}", f"Tell me a story, {index}.", 200, end_id=-1, timeout=60):
                    running.add(index)
            except RequestError as exc:
                errors[index] = str(exc)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(90)
        assert not any(thread.is_alive() for thread in threads), "a stream was left waiting"
        assert sorted(errors) == list(range(CLIENTS)), errors
        assert not any("no response" in error for error in errors.values()), errors  # NoResponse: one hung
        # every stream that was running ends naming the failure; on a loaded machine a stream may start only after
        # it, and then it is refused (a failed scheduler, or a server already stopping), never left waiting
        assert running, "no stream was running when the fault fired"
        for index in running:
            assert "the scheduler failed (InjectedFault: on_commit call 30 failed" in errors[index], errors[index]
        assert process.wait(60) != 0
        assert not is_ready("127.0.0.1", http)
        text = log.read_text()
        assert "the speculative model failed: the scheduler failed (InjectedFault" in text
        assert "a fault is injected (on_commit:30)" in text  # this tree's server code ran in the stub
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_a_model_that_failed_before_serve_saw_it_ready_is_named(tmp_path):
    """On a loaded machine the model can start, serve and fail between two of serve's readiness polls: serve's
    error names the model's failure, not only that tritonserver exited before it was ready."""
    import tempfile

    from specdeploy.errors import SpecdeployError
    from specdeploy.serve.tritonserver import TritonServer

    (tmp_path / "ensemble").mkdir()
    (tmp_path / "ensemble" / "config.pbtxt").write_text('name: "ensemble"\n')  # only checked to exist
    server = TritonServer(tmp_path)
    server._workdir = tempfile.TemporaryDirectory()
    try:
        server.process = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
        server.process.wait()
        with pytest.raises(SpecdeployError, match=r"exited with status 3 before it was ready"):
            server.wait_ready(5)
        server.failure_file.write_text("the scheduler failed (InjectedFault: on_commit call 30 failed)\n")
        with pytest.raises(SpecdeployError, match=r"exited with status 3: the speculative model failed: the scheduler "
                                                  r"failed \(InjectedFault"):
            server.wait_ready(5)
    finally:
        server._workdir.cleanup()
