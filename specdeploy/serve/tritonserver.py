"""Run a real `tritonserver` on a model repository.

Locally the binary and the Python backend come from the `nvidia-pytriton` wheel. The backend directory is
assembled in a temporary folder (the wheel's Python backend plus the stub built for this interpreter's version),
and the stub's embedded interpreter is pointed at this environment: the libpython it was built for, the packages
installed here and the directory holding `specdeploy`. In a container image the image's own tritonserver is
used instead (`binary` and `backend_directory` arguments).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import os
import secrets
import shutil
import signal
import site
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request
from pathlib import Path

import specdeploy
from specdeploy.errors import SpecdeployError
from specdeploy.serve.drain_hold import HOLD_MODEL, DrainHold
from specdeploy.serve.model_files import DRAIN_FILE_VARIABLE, FAILURE_FILE_VARIABLE, drained_file

DRAIN_TIMEOUT = 30.0  # seconds running requests get to finish after a shutdown begins
EXIT_MARGIN = 10  # seconds Triton's exit timeout exceeds the drain: enough to unload the models after it
KILL_MARGIN = 5  # seconds a server past its exit timeout still gets to exit before it is killed
ADMIN_KEY_NAME = "specdeploy-admin-key"
ADMIN_APIS = ("logging", "shared-memory", "model-repository", "trace")  # what only the admin key may call
PR_SET_PDEATHSIG = 1
SHM_REGION_PREFIX = "triton_python_backend_shm_region_"


def pytriton_dist() -> Path:
    """The tritonserver distribution inside the nvidia-pytriton wheel."""
    import pytriton

    return Path(pytriton.__file__).parent / "tritonserver"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def prepare_backends(directory: Path) -> Path:
    """A backend directory with the Python backend and the stub for this interpreter. Returns it."""
    dist = pytriton_dist()
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = dist / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise SpecdeployError(f"nvidia-pytriton has no Python backend stub for Python {version} ({stub})")
    python_backend = directory / "python"
    shutil.copytree(dist / "backends" / "python", python_backend, dirs_exist_ok=True)
    shutil.copy2(stub, python_backend / "triton_python_backend_stub")
    return directory


def server_environment() -> dict[str, str]:
    """Environment for tritonserver and the Python backend stubs it spawns."""
    env = dict(os.environ)
    libraries = [str(pytriton_dist().parent.parent / "nvidia_pytriton.libs"), sysconfig.get_config_var("LIBDIR")]
    if env.get("LD_LIBRARY_PATH"):
        libraries.append(env["LD_LIBRARY_PATH"])
    env["LD_LIBRARY_PATH"] = ":".join(libraries)
    # The stub embeds the base interpreter: give it this environment's packages and the specdeploy source.
    paths = [str(Path(specdeploy.__file__).parent.parent), *site.getsitepackages()]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = ":".join(paths)
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def backend_shared_memory(server_pid: int) -> list[str]:
    """The shared-memory regions of the Python-backend stubs a tritonserver runs (named on their command lines)."""
    regions = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            if parent != server_pid:
                continue
            arguments = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue  # a process that ended meanwhile
        regions += [a.decode() for a in arguments if a.startswith(SHM_REGION_PREFIX.encode())]
    return regions


def is_ready(address: str, http_port: int) -> bool:
    """Whether the tritonserver on this HTTP port answers ready (false while it starts, drains or is gone)."""
    try:
        with urllib.request.urlopen(f"http://{address}:{http_port}/v2/health/ready", timeout=2) as reply:
            return reply.status == 200
    except OSError:
        return False


def die_with_parent() -> None:
    """In the child before exec: have the kernel send SIGTERM when the process that started it dies, so a
    supervisor killed outright (SIGKILL) does not leave a server holding its ports."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class TritonServer:
    """A tritonserver process. Use as a context manager, or call start() / stop().

    Shutdown drains: `drain()` writes a deadline to a file the `speculative` model watches (its path is in the
    server's environment as SPECDEPLOY_DRAIN_FILE), opens a sequence on the `drain_hold` model that keeps Triton
    from unloading the models (serve/drain_hold.py) and sends tritonserver SIGTERM. Triton turns not ready and
    answers new requests UNAVAILABLE; the model ends queued requests and lets running ones finish until the
    deadline, then ends the rest with an error saying the server is shutting down. Once it has no request left,
    the sequence ends, and Triton unloads the models and exits.

    A failed scheduler (runtime/scheduler.py) ends every request with an error, writes why to the file named by
    SPECDEPLOY_FAILURE_FILE and sends tritonserver SIGTERM; `failure()` reads that file, and `specdeploy serve`
    exits non-zero with it, so that whatever supervises it restarts the server.

    The admin endpoints (logging, shared memory, model repository, trace) need the header or gRPC metadata
    `specdeploy-admin-key` (`triton-grpc-protocol-specdeploy-admin-key` over gRPC) set to `admin_key`: the one given,
    else $SPECDEPLOY_ADMIN_KEY, else a random key made for this server. Inference, health, metadata, model config
    and statistics stay open.
    """

    def __init__(self, model_repository: str | Path, grpc_port: int | None = None, http_port: int | None = None,
                 metrics_port: int | None = None, address: str = "127.0.0.1", binary: str | None = None,
                 backend_directory: str | None = None, log_file: str | Path | None = None,
                 extra_args: list[str] | None = None, drain_timeout: float = DRAIN_TIMEOUT,
                 admin_key: str | None = None) -> None:
        self.model_repository = Path(model_repository).resolve()
        if not (self.model_repository / "ensemble" / "config.pbtxt").is_file():
            raise SpecdeployError(f"{self.model_repository}: not a specdeploy model repository "
                                  "(no ensemble/config.pbtxt); run specdeploy package")
        self.grpc_port = grpc_port or free_port()
        self.http_port = http_port or free_port()
        self.metrics_port = metrics_port or free_port()
        self.address = address
        self.binary = binary
        self.backend_directory = backend_directory
        self.log_file = Path(log_file) if log_file else None
        self.extra_args = extra_args or []
        self.drain_timeout = drain_timeout
        self.admin_key = admin_key or os.environ.get("SPECDEPLOY_ADMIN_KEY") or secrets.token_urlsafe(24)
        self.process: subprocess.Popen | None = None
        self.draining = False
        self.shared_memory: list[str] = []  # the Python backends' regions, noted when a drain begins
        self._workdir: tempfile.TemporaryDirectory | None = None

    @property
    def grpc_url(self) -> str:
        return f"{self.address}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.address}:{self.metrics_port}/metrics"

    @property
    def drain_file(self) -> Path:
        return Path(self._workdir.name) / "drain"

    @property
    def failure_file(self) -> Path:
        return Path(self._workdir.name) / "failure"

    def failure(self) -> str | None:
        """Why the served model's scheduler failed, when it did (read before stop() or cleanup() removes the file)."""
        if self._workdir is None or not self.failure_file.is_file():
            return None
        return self.failure_file.read_text().strip()

    def command(self) -> list[str]:
        binary = self.binary or str(pytriton_dist() / "bin" / "tritonserver")
        restricted = f"{','.join(ADMIN_APIS)}:{ADMIN_KEY_NAME}={self.admin_key}"
        return [binary, f"--model-repository={self.model_repository}",
                f"--backend-directory={self.backend_directory}",
                f"--grpc-address={self.address}", f"--grpc-port={self.grpc_port}",
                f"--http-address={self.address}", f"--http-port={self.http_port}",
                f"--metrics-address={self.address}", f"--metrics-port={self.metrics_port}",
                "--allow-metrics=true", "--allow-gpu-metrics=false",
                # Triton's own deadline, past ours: the model ends what is left at ours, then Triton can unload.
                f"--exit-timeout-secs={math.ceil(self.drain_timeout) + EXIT_MARGIN}",
                f"--http-restricted-api={restricted}", f"--grpc-restricted-protocol={restricted}",
                *self.extra_args]

    def start(self, timeout: float = 180.0) -> TritonServer:
        self._workdir = tempfile.TemporaryDirectory(prefix="specdeploy-triton-")
        if self.backend_directory is None:
            self.backend_directory = str(prepare_backends(Path(self._workdir.name)))
        environment = {**server_environment(), DRAIN_FILE_VARIABLE: str(self.drain_file),
                       FAILURE_FILE_VARIABLE: str(self.failure_file)}
        # Without a log file the server's log goes to this process's terminal (what `specdeploy serve` wants).
        output = open(self.log_file, "ab") if self.log_file else None
        self.process = subprocess.Popen(self.command(), env=environment, stdout=output,
                                        stderr=subprocess.STDOUT if output else None, start_new_session=True,
                                        preexec_fn=die_with_parent)
        self.wait_ready(timeout)
        return self

    def ready(self) -> bool:
        return is_ready(self.address, self.http_port)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                if self.draining:
                    return  # told to stop while starting: not a failure
                # the model may have started, served and failed between two of these polls (a loaded machine)
                failure = self.failure()
                stopped = f"tritonserver exited with status {self.process.returncode}"
                raise SpecdeployError(f"{stopped}: the speculative model failed: {failure}{self._log_hint()}"
                                      if failure else f"{stopped} before it was ready{self._log_hint()}")
            if self.ready() or self.draining:
                return
            time.sleep(0.5)
        self.stop()
        raise SpecdeployError(f"tritonserver was not ready after {timeout:.0f} s{self._log_hint()}")

    def _log_hint(self) -> str:
        return f" (log: {self.log_file})" if self.log_file else ""

    def drain(self) -> None:
        """Begin a graceful shutdown (see the class docstring); returns at once. A second call kills the server."""
        if self.process is None or self.process.poll() is not None:
            return
        if self.draining:
            os.killpg(self.process.pid, signal.SIGKILL)
            return
        self.draining = True
        self.shared_memory = backend_shared_memory(self.process.pid)
        deadline = time.time() + self.drain_timeout
        partial = self.drain_file.with_suffix(".partial")
        partial.write_text(str(deadline))
        partial.replace(self.drain_file)
        if (self.model_repository / HOLD_MODEL).is_dir():  # keep the models loaded until the drain is over
            drained = drained_file(self.drain_file)
            DrainHold(self.grpc_url, deadline, drained.exists).begin()
        self.process.send_signal(signal.SIGTERM)

    def stop(self) -> int | None:
        """Drain, wait for the server to exit (killing it if it outlives its own deadline), and remove the
        temporary files. Returns the exit status."""
        if self.process is not None and self.process.poll() is None:
            self.drain()
            try:
                self.process.wait(self.drain_timeout + EXIT_MARGIN + KILL_MARGIN)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.cleanup()
        return None if self.process is None else self.process.returncode

    def cleanup(self) -> None:
        """Remove what the server leaves when it could not unload its models in time: its temporary directory, and
        the shared-memory regions of its Python backends (Triton removes those itself on a clean exit)."""
        for region in self.shared_memory:
            Path("/dev/shm", region).unlink(missing_ok=True)
        if self._workdir is not None:
            self._workdir.cleanup()
            self._workdir = None

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
