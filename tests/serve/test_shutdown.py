"""`specdeploy serve` as an operator runs it: SIGTERM drains and exits 0 leaving nothing behind, live streams end
complete or with an error saying the server is shutting down, and a killed supervisor takes the server with it."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from specdeploy.errors import RequestError
from specdeploy.package.repository import write_repository
from specdeploy.serve.client import ServerRefusal, generate
from specdeploy.serve.serve_process import ServeProcess, alive
from specdeploy.serve.tritonserver import TritonServer, backend_shared_memory

pytestmark = [pytest.mark.smollm2, pytest.mark.slow]
DRAIN = 4.0  # seconds: the drain timeout the tests give serve


@pytest.fixture(scope="module")
def repository(smollm2_fp32_engines, tmp_path_factory) -> Path:
    return write_repository(smollm2_fp32_engines["draft-target"].dir, tmp_path_factory.mktemp("shutdown") / "repo")


def server_files(triton_pid: int) -> set[str]:
    """What a running tritonserver may leave on this machine: the temporary directory it was started with (its
    backends are copied there) and its Python-backend stubs' shared-memory regions. Named per server, so that
    servers of other tests running meanwhile (pytest-xdist) are not counted."""
    arguments = Path(f"/proc/{triton_pid}/cmdline").read_bytes().decode().split("\0")
    (backends,) = [Path(a.split("=", 1)[1]) for a in arguments if a.startswith("--backend-directory=")]
    workdir = next(p for p in (backends, *backends.parents) if p.name.startswith("specdeploy-triton-"))
    return {str(workdir)} | {f"/dev/shm/{region}" for region in backend_shared_memory(triton_pid)}


def leftovers(files: set[str]) -> set[str]:
    return {path for path in files if os.path.exists(path)}


class Serve(ServeProcess):
    """`specdeploy serve` with the tests' drain timeout, and the files its tritonserver may leave."""

    def __init__(self, repository: Path, log: Path) -> None:
        super().__init__(repository, log, drain_timeout=DRAIN)
        self.files = server_files(self.triton)


@pytest.fixture
def serve(repository, tmp_path):
    server = Serve(repository, tmp_path / "serve.log")
    yield server
    server.close()


def test_sigterm_while_idle_exits_zero_and_leaves_nothing(serve):
    serve.process.send_signal(signal.SIGTERM)
    assert serve.process.wait(DRAIN + 20) == 0
    assert not alive(serve.triton) and not alive(serve.front)
    assert leftovers(serve.files) == set()


def test_sigterm_drains_live_streams(serve, smollm2_fp32_engines):
    """Eight streams (two through the ensemble): the short ones complete, the rest end at the drain timeout with
    an error saying the server is shutting down; a request after SIGTERM is refused; serve exits 0."""
    engine = smollm2_fp32_engines["draft-target"]
    outcomes: dict[int, tuple[str, str | None, float]] = {}
    started = threading.Event()

    def client(index: int) -> None:
        short = index % 2 == 0
        text, error = "", None
        try:
            for chunk in generate(serve.url, "Tell me a story.", 6 if short else 1500, end_id=-1, timeout=60,
                                  model="ensemble" if index >= 6 else "speculative"):
                text += chunk.text
                started.set()
        except RequestError as exc:
            error = str(exc)
        outcomes[index] = (text, error, time.monotonic())

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    assert started.wait(120)
    time.sleep(1.0)
    signalled = time.monotonic()
    serve.process.send_signal(signal.SIGTERM)
    time.sleep(1.0)
    assert not serve.ready()  # readiness goes false at once
    with pytest.raises(RequestError, match="stopping|shutting down"):  # refused, and told why
        list(generate(serve.url, "Hello", 4, timeout=30))
    for thread in threads:
        thread.join(DRAIN + 30)
    assert sorted(outcomes) == list(range(8))
    expected_short = engine.decode(engine.generate(engine.encode_prompt("Tell me a story."),
                                                   engine.pipeline.sampling.params(), 6, 0).run())
    for index, (text, error, ended) in outcomes.items():
        assert ended - signalled <= DRAIN + 5, index
        if error is None:
            assert text == expected_short, index  # complete (only the short ones can finish)
        else:
            assert "shutting down" in error, (index, error)
    assert sum(error is not None for _, error, _ in outcomes.values()) >= 4  # the long ones were cut
    assert serve.process.wait(DRAIN + 20) == 0
    assert not alive(serve.triton)
    assert leftovers(serve.files) == set()


def post_json(port: int, path: str, body: dict) -> tuple[int, bytes]:
    """An HTTP POST to the server on this port: the status and the body."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def test_a_draining_server_answers_new_work_unavailable(serve):
    """Issue 65: with only `speculative` streams live (nothing that Triton counts as in flight), a drain used to
    unload the models at once and new requests got NOT_FOUND "unknown model", which clients take as permanent.
    One second after SIGTERM: readiness is false; a stream to `speculative` or to the ensemble is refused as
    UNAVAILABLE (on a stream Triton gives the message only, which the client reads); Triton's HTTP port and the
    idle OpenAI front's are closed (connection refused); the live streams still finish."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    outcomes: dict[int, tuple[str, str | None]] = {}
    started = [threading.Event() for _ in range(3)]

    def client(index: int) -> None:
        text, error = "", None
        try:
            # short streams: two tokens left after the first must finish inside the drain on a busy 2-core runner
            for chunk in generate(serve.url, "Tell me a story.", 3 if index else 1500, end_id=-1, timeout=60):
                text += chunk.text
                started[index].set()
        except RequestError as exc:
            error = str(exc)
        outcomes[index] = (text, error)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    assert all(event.wait(120) for event in started)  # all three running, none queued
    serve.process.send_signal(signal.SIGTERM)
    time.sleep(1.0)
    assert not serve.ready()
    for model in ("speculative", "ensemble"):
        with pytest.raises(ServerRefusal) as refused:
            list(generate(serve.url, "Hello", 4, timeout=30, model=model))
        assert refused.value.code == "StatusCode.UNAVAILABLE", (model, refused.value.code, str(refused.value))
    text = grpcclient.InferInput("text_input", [1, 1], "BYTES")
    text.set_data_from_numpy(np.array([[b"Hello"]], dtype=object))
    with pytest.raises(InferenceServerException) as unary:
        grpcclient.InferenceServerClient(serve.url).infer("ensemble", [text], client_timeout=30)
    # a decoupled model takes no unary request, drain or not; before, the model was not even found
    assert unary.value.status() == "StatusCode.UNIMPLEMENTED", (unary.value.status(), unary.value.message())
    with pytest.raises(ConnectionRefusedError):  # Triton closes its HTTP port when the drain begins
        post_json(serve.ports[1], "/v2/models/ensemble/generate_stream", {"text_input": "Hello", "max_tokens": 2})
    # the front, with no stream of its own to finish, has already exited; with some it answers 503 meanwhile
    with pytest.raises(ConnectionRefusedError):
        post_json(serve.ports[3], "/v1/completions", {"prompt": "Hello", "max_tokens": 2})
    for thread in threads:
        thread.join(DRAIN + 30)
    assert outcomes[1][1] is None or outcomes[2][1] is None, outcomes  # live streams went on and finished
    assert all(error is None or "shutting down" in error for _, error in outcomes.values()), outcomes
    assert "shutting down" in outcomes[0][1]  # the long one was cut at the drain timeout
    assert serve.process.wait(DRAIN + 20) == 0
    assert leftovers(serve.files) == set()


def test_an_unclean_exit_still_leaves_no_shared_memory(repository):
    """When Triton cannot unload its models (killed here; in the wild, its exit timeout expiring), the Python
    backends' shared memory is not removed by Triton: stop() removes the regions it noted at the drain."""
    server = TritonServer(repository, drain_timeout=DRAIN).start()
    regions = backend_shared_memory(server.process.pid)
    assert len(regions) == 3 and all(Path("/dev/shm", region).exists() for region in regions)  # three Python models
    files = server_files(server.process.pid)
    server.drain()
    server.drain()  # the second kills it at once
    assert server.stop() == -signal.SIGKILL
    assert leftovers(files) == set()


def test_a_killed_supervisor_takes_the_server_down(serve):
    """SIGKILL gives serve no chance to stop tritonserver; the kernel tells it (parent-death signal)."""
    os.kill(serve.process.pid, signal.SIGKILL)
    serve.process.wait()
    deadline = time.monotonic() + DRAIN + 30
    while alive(serve.triton) or alive(serve.front):
        assert time.monotonic() < deadline, "tritonserver or the OpenAI front outlived its supervisor"
        time.sleep(0.2)
    assert not serve.ready()
    # tritonserver stopped cleanly (its shared memory is gone); only serve's temporary directory remains, which a
    # process killed outright cannot remove
    left = leftovers(serve.files)
    assert len(left) == 1 and left.pop().startswith("/tmp/specdeploy-triton-"), left
    shutil.rmtree(*leftovers(serve.files))
