"""`python3 -m specdeploy.pods.launch` as the serving pods run it, with stand-ins for kubectl, mpirun and
tritonserver on PATH: the leader starts mpirun only once its group is Ready, SIGTERM drains tritonserver where
mpirun alone would kill it, and `hold` exits promptly on SIGTERM."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.repo import REPO

SELECTOR = "leaderworkerset.sigs.k8s.io/group-key=abc"
LEADER = "lws-0"  # the pod the launcher runs in: never Ready before its command serves

# Answers `kubectl get pods -l SELECTOR -o json` from the state file the test rewrites, and logs each call.
KUBECTL = """
import json, os, sys
with open(os.environ["KUBECTL_CALLS"], "a") as calls:
    calls.write(json.dumps(sys.argv[1:]) + "\\n")
state = json.loads(open(os.environ["KUBECTL_STATE"]).read())
if state.get("error"):
    sys.exit(print(state["error"], file=sys.stderr) or 1)
print(json.dumps({"kind": "List", "items": state["pods"]}))
"""

# Open MPI's mpirun on SIGTERM: the ranks get SIGTERM, then SIGKILL odls_base_sigkill_timeout = 1 s later
# (open-mpi/ompi v4.1.8: orte/mca/odls/base/odls_base_default_fns.c kill_local_procs, odls_base_frame.c). Here:
# `mpirun -np N PROGRAM ARGS...` starts N ranks with OMPI_COMM_WORLD_RANK set, as Open MPI does.
MPIRUN = """
import os, signal, subprocess, sys, time
count, program = int(sys.argv[2]), sys.argv[3:]
ranks = [subprocess.Popen(program, env={**os.environ, "OMPI_COMM_WORLD_RANK": str(rank)}) for rank in range(count)]
stop = []
signal.signal(signal.SIGTERM, lambda signum, frame: stop.append(signum))
while not stop and any(rank.poll() is None for rank in ranks):
    time.sleep(0.05)
if stop:
    for rank in ranks:
        rank.send_signal(signal.SIGTERM)
    time.sleep(1)
    for rank in ranks:
        rank.kill()
        rank.wait()
    sys.exit(1)
sys.exit(max(rank.returncode for rank in ranks))
"""

# tritonserver: on SIGTERM it drains its streams for 2 s, then writes MARKER_DIR/drained-RANK and exits 0.
TRITONSERVER = """
import os, signal, sys, time
rank = os.environ.get("OMPI_COMM_WORLD_RANK", "0")
directory = os.environ["MARKER_DIR"]
def drain(signum, frame):
    time.sleep(2)
    open(os.path.join(directory, "drained-" + rank), "w").close()
    sys.exit(0)
signal.signal(signal.SIGTERM, drain)
open(os.path.join(directory, "serving-" + rank), "w").close()
while True:
    time.sleep(1)
"""


def stand_in(directory: Path, name: str, source: str) -> None:
    # A direct interpreter path (not /usr/bin/env) keeps the script's name as the process name, as
    # tritonserver's binary has.
    path = directory / name
    path.write_text(f"#!{sys.executable}\n{source}")
    path.chmod(0o755)


@pytest.fixture
def pod(tmp_path):
    """A pod's PATH with the stand-ins, and the files the test reads and writes. Whatever a test started is
    killed afterwards, stand-ins included (each start is a process group of its own)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, source in (("kubectl", KUBECTL), ("mpirun", MPIRUN), ("tritonserver", TRITONSERVER)):
        stand_in(bin_dir, name, source)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "KUBECTL_STATE": str(tmp_path / "state.json"),
           "KUBECTL_CALLS": str(tmp_path / "calls.jsonl"), "MARKER_DIR": str(tmp_path),
           "POD_NAME": LEADER}
    started: list[subprocess.Popen] = []
    yield {"env": env, "dir": tmp_path, "log": tmp_path / "launch.log", "started": started}
    for process in started:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()


def set_pods(pod: dict, pods: list[dict], error: str = "") -> None:
    state = pod["dir"] / "state.json"
    state.with_suffix(".tmp").write_text(json.dumps({"pods": pods, "error": error}))
    os.replace(state.with_suffix(".tmp"), state)  # kubectl never reads half a file


def worker(name: str, ready: bool) -> dict:
    return {"metadata": {"name": name, "labels": {"leaderworkerset.sigs.k8s.io/group-key": "abc"}},
            "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": str(ready)}]}}


def start(pod: dict, command: list[str]) -> subprocess.Popen:
    with open(pod["log"], "w") as log:
        process = subprocess.Popen(command, cwd=REPO, env=pod["env"], stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    pod["started"].append(process)
    return process


def launch(pod: dict, *arguments: str) -> subprocess.Popen:
    return start(pod, [sys.executable, "-m", "specdeploy.pods.launch", *arguments])


def wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def snapshot_command(pod: dict) -> list[str]:
    """A command that copies the pods kubectl answers at the moment it starts."""
    return ["--", sys.executable, "-c", "import shutil, sys; shutil.copy(sys.argv[1], sys.argv[2])",
            str(pod["dir"] / "state.json"), str(pod["dir"] / "seen.json")]


def test_command_starts_only_once_late_pods_are_ready(pod):
    leader = worker(LEADER, False)
    set_pods(pod, [leader])
    launcher = launch(pod, "run", "--group-selector", SELECTOR, "--group-size", "3", "--poll-interval", "0.05",
                      *snapshot_command(pod))
    for pods in ([worker("lws-0-1", False)], [worker("lws-0-1", True), worker("lws-0-2", False)]):
        time.sleep(0.4)
        set_pods(pod, [leader, *pods])
    time.sleep(0.4)
    assert not (pod["dir"] / "seen.json").exists()
    final = [leader, worker("lws-0-1", True), worker("lws-0-2", True)]
    set_pods(pod, final)
    assert launcher.wait(10) == 0
    assert json.loads((pod["dir"] / "seen.json").read_text())["pods"] == final
    log = pod["log"].read_text()
    for waiting in ("2 of 3 pods not created yet", "not Ready: lws-0-1; 1 of 3 pods not created yet",
                    "not Ready: lws-0-2\n", "group ready"):
        assert waiting in log
    calls = [json.loads(line) for line in (pod["dir"] / "calls.jsonl").read_text().splitlines()]
    assert calls[0] == ["get", "pods", "-l", SELECTOR, "-o", "json"]


def test_group_timeout_names_what_is_missing(pod):
    set_pods(pod, [worker(LEADER, False), worker("lws-0-1", False)])
    launcher = launch(pod, "run", "--group-selector", SELECTOR, "--group-size", "3", "--group-timeout", "1",
                      "--poll-interval", "0.05", *snapshot_command(pod))
    assert launcher.wait(10) != 0
    log = pod["log"].read_text()
    assert "group not ready after 1 s" in log
    assert log.splitlines()[-1].endswith(": not Ready: lws-0-1; 1 of 3 pods not created yet")
    assert not (pod["dir"] / "seen.json").exists()


def test_kubectl_failures_are_retried_and_reported(pod):
    set_pods(pod, [], error='Error from server (Forbidden): pods is forbidden: User "x" cannot list')
    launcher = launch(pod, "run", "--group-selector", SELECTOR, "--group-size", "1", "--poll-interval", "0.05",
                      *snapshot_command(pod))
    wait_for(lambda: "Forbidden" in pod["log"].read_text())
    set_pods(pod, [worker(LEADER, False)])
    assert launcher.wait(10) == 0
    assert (pod["dir"] / "seen.json").exists()
    assert "kubectl failed: Error from server (Forbidden)" in pod["log"].read_text()


def test_command_exit_status_passes_through(pod):
    launcher = launch(pod, "run", "--", sys.executable, "-c", "raise SystemExit(3)")
    assert launcher.wait(10) == 3


def start_serving(pod: dict, *command: str, ranks: int = 1) -> subprocess.Popen:
    process = launch(pod, *command) if command[0] == "run" else start(pod, list(command))
    wait_for(lambda: all((pod["dir"] / f"serving-{rank}").exists() for rank in range(ranks)))
    return process


def test_sigterm_to_mpirun_loses_the_drain(pod):
    mpirun = start_serving(pod, "mpirun", "-np", "1", "tritonserver")
    mpirun.send_signal(signal.SIGTERM)
    assert mpirun.wait(10) != 0
    assert not (pod["dir"] / "drained-0").exists()  # SIGKILLed 1 s into its 2 s drain


def test_launcher_lets_tritonserver_drain_under_mpirun(pod):
    launcher = start_serving(pod, "run", "--drain-timeout", "10", "--", "mpirun", "-np", "1", "tritonserver")
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(15) == 0
    assert (pod["dir"] / "drained-0").exists()
    assert "drain complete" in pod["log"].read_text()


def test_drain_rank_drains_only_that_rank(pod):
    launcher = start_serving(pod, "run", "--drain-rank", "0", "--", "mpirun", "-np", "2", "tritonserver", ranks=2)
    launcher.send_signal(signal.SIGINT)
    assert launcher.wait(15) == 0
    assert (pod["dir"] / "drained-0").exists()
    assert not (pod["dir"] / "drained-1").exists()  # left to mpirun's teardown


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_hold_exits_promptly_when_it_hosts_no_rank(pod, signum):
    holder = launch(pod, "hold", "--drain-process", f"rank-{os.getpid()}")
    wait_for(lambda: "holding" in pod["log"].read_text())
    sent = time.monotonic()
    holder.send_signal(signum)
    assert holder.wait(5) == 0
    assert time.monotonic() - sent < 1.0


def test_hold_keeps_the_worker_until_the_ranks_it_hosts_have_exited(pod):
    """A worker's ranks were started by the leader's mpirun (no child of hold); on SIGTERM hold waits for them, so
    the pod outlives them while the leader drains (review N2), and gives up at --drain-timeout."""
    name = f"rank-{os.getpid()}"[:15]  # a process's comm: at most 15 characters
    (pod["dir"] / name).symlink_to(shutil.which("sleep"))

    def rank() -> subprocess.Popen:  # started apart from hold, as mpirun's orted starts it
        process = subprocess.Popen([str(pod["dir"] / name), "30"], start_new_session=True)
        pod["started"].append(process)
        return process

    hosted = rank()
    holder = launch(pod, "hold", "--drain-process", name, "--drain-timeout", "20")
    wait_for(lambda: "holding" in pod["log"].read_text())
    holder.send_signal(signal.SIGTERM)
    wait_for(lambda: f"({hosted.pid}) to exit" in pod["log"].read_text())
    time.sleep(1.0)
    assert holder.poll() is None  # still holding while the rank runs
    hosted.kill()
    hosted.wait()
    assert holder.wait(5) == 0 and "exiting" in pod["log"].read_text()
    late = rank()
    bounded = launch(pod, "hold", "--drain-process", name, "--drain-timeout", "1")
    wait_for(lambda: "holding" in pod["log"].read_text())
    bounded.send_signal(signal.SIGTERM)
    assert bounded.wait(5) == 0 and f"still running (pids {late.pid})" in pod["log"].read_text()
