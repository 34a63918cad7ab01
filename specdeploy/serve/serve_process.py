"""`specdeploy serve` run as an operator runs it, in its own process on free loopback ports: for the shutdown tests
and the soak (scripts/soak.py), which stop it with SIGTERM and check what the drain leaves."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import specdeploy
from specdeploy.errors import SpecdeployError
from specdeploy.serve.tritonserver import DRAIN_TIMEOUT, EXIT_MARGIN, KILL_MARGIN, free_port, is_ready

ADDRESS = "127.0.0.1"


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid`, from /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # a process that ended meanwhile
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def alive(pid: int) -> bool:
    """Running, and not a zombie waiting to be reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class ServeProcess:
    """`specdeploy serve --model-repository …` started and waited for until ready, with its tritonserver and OpenAI
    front found among its children. `stop()` sends SIGTERM and waits as long as the drain may take."""

    def __init__(self, repository: Path, log: Path, drain_timeout: float = DRAIN_TIMEOUT,
                 ready_timeout: float = 240) -> None:
        self.ports = [free_port() for _ in range(4)]  # gRPC, HTTP, metrics, OpenAI
        self.drain_timeout = drain_timeout
        command = [sys.executable, "-m", "specdeploy.cli", "serve", "--model-repository", str(repository),
                   "--address", ADDRESS, "--grpc-port", str(self.ports[0]), "--http-port", str(self.ports[1]),
                   "--metrics-port", str(self.ports[2]), "--openai-port", str(self.ports[3]),
                   "--drain-timeout", str(drain_timeout)]
        self.log_path = log
        self.log = log.open("wb")
        # From the folder holding the specdeploy this process runs, so that `-m` serves the same source tree.
        source = Path(specdeploy.__file__).resolve().parent.parent
        self.process = subprocess.Popen(command, cwd=source, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + ready_timeout
        while not self.ready() or len(children(self.process.pid)) < 2:
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise SpecdeployError(f"specdeploy serve was not ready (log: {log}):\n"
                                      f"{log.read_text(errors='replace')[-2000:]}")
            time.sleep(0.5)
        (self.triton,) = [pid for pid in children(self.process.pid)
                          if Path(f"/proc/{pid}/comm").read_text().strip() == "tritonserver"]
        (self.front,) = [pid for pid in children(self.process.pid) if pid != self.triton]  # the OpenAI front

    @property
    def url(self) -> str:
        return f"{ADDRESS}:{self.ports[0]}"

    @property
    def metrics_url(self) -> str:
        return f"http://{ADDRESS}:{self.ports[2]}/metrics"

    def ready(self) -> bool:
        return is_ready(ADDRESS, self.ports[1])

    def stop(self) -> int | None:
        """SIGTERM, then wait for `serve` to exit: its status, or None when it outlived the drain, Triton's exit
        margin and the kill margin (then it is killed)."""
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(self.drain_timeout + EXIT_MARGIN + KILL_MARGIN)
        except subprocess.TimeoutExpired:
            self.close()
            return None

    def close(self) -> None:
        """Kill whatever of `serve`, its tritonserver and its front is still running."""
        for pid in (self.process.pid, getattr(self, "triton", None), getattr(self, "front", None)):
            if pid is not None and alive(pid):
                os.kill(pid, signal.SIGKILL)
        self.process.wait()
        self.log.close()
