"""The serving pods' PID 1 where tritonserver runs under mpirun: `python3 -m specdeploy.pods.launch run|hold`.

Standard library only: it runs inside the serving image's pods, with `kubectl` on PATH.

run [--group-selector S --group-size N] [--drain-timeout S] -- COMMAND...
  1. Group wait (multi-node leader). mpirun's kubessh agent `kubectl exec`s into the group's pods, so it must not
     start before they are all Ready; upstream's LWS TensorRT-LLM example waits the same way before its mpirun
     (kubernetes-sigs/lws docs/examples/tensorrt-llm/build/server.py, wait_for_workers, at 4aaf9d50). The group's
     pods carry `leaderworkerset.sigs.k8s.io/group-key=<key>` and `leaderworkerset.sigs.k8s.io/worker-index=<i>`,
     the leader's index being 0 (kubernetes-sigs/lws api/leaderworkerset/v1/leaderworkerset_types.go,
     GroupUniqueHashLabelKey and WorkerIndexLabelKey, at 024af084). The leader's own pod cannot be Ready before
     its mpirun serves, so it counts as Ready (--own-pod, $POD_NAME by default); a selector adding
     `leaderworkerset.sigs.k8s.io/worker-index!=0` (with the size less one) leaves it out instead.
  2. Drain. On SIGTERM Open MPI's mpirun does not let its ranks drain: it orders every daemon to kill its local
     ranks, which sends SIGCONT, waits, SIGTERM, waits, then SIGKILL. Open MPI 4.1 waits
     odls_base_sigkill_timeout = 1 s each time (open-mpi/ompi v4.1.8 ea8f4d03: orte/mca/ess/hnp/ess_hnp_module.c
     abort_signal_callback → clean_abort → terminate_orteds; orte/mca/odls/base/odls_base_default_fns.c
     kill_local_procs; orte/mca/odls/base/odls_base_frame.c); Open MPI 5 (PRRTE) waits 0.25 s (openpmix/prrte
     2e893392, the submodule of ompi v5.0.9: src/tools/prte/prte.c, src/mca/odls/base/odls_base_default_fns.c).
     Either way tritonserver's --exit-timeout-secs never runs out. The pinned image
     (nvcr.io/nvidia/tritonserver:26.04-trtllm-python-py3) ships HPC-X's Open MPI in /opt/hpcx/ompi
     (triton-inference-server/tutorials EKS_Multinode_Triton_TRTLLM/.../triton_trt_llm.containerfile at 3f3424fc
     removes that directory to swap MPIs; tensorrtllm_backend dockerfile/Dockerfile.triton.trt_llm_backend at
     0046c234 installs no MPI over its base); which Open MPI version that HPC-X holds is not readable here.
     So this launcher keeps SIGTERM from mpirun: it sends it to the tritonserver processes below the command in
     this pod (optionally only MPI rank N, from OMPI_COMM_WORLD_RANK, which Open MPI 4.1 sets in
     orte/mca/schizo/ompi/schizo_ompi.c and 5 in openpmix a84ed686 src/mca/pmdl/ompi/pmdl_ompi.c), waits for
     them to exit, and only then SIGTERMs the command. Ranks in other pods are reached through mpirun's
     teardown only.
hold
  Workers' PID 1: `sleep infinity` as PID 1 ignores SIGTERM (the kernel drops signals PID 1 has no handler for),
  so every rollout waited out the whole grace period. On SIGTERM or SIGINT hold waits until the tritonserver
  processes in its pod (ranks the leader's mpirun started there) have exited, at most --drain-timeout, then exits 0.
  LWS deletes the workers a few seconds after their leader (the leader pod owns the worker StatefulSet:
  kubernetes-sigs/lws@060ab4da pkg/controllers/pod_controller.go), so a worker that exited at once took its ranks
  down while the leader was still draining, and mpirun aborted the requests in flight. Waiting keeps them until
  mpirun's teardown ends them, after the leader's drain.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

KUBECTL_TIMEOUT_S = 30  # one `kubectl get` longer than this counts as a failed attempt
POLL_S = 0.1  # how often run checks on the command and its drain
STOP_GRACE_S = 30  # mpirun's own teardown (kill ranks, close kubessh sessions) gets this long before SIGKILL


def log(message: str) -> None:
    print(f"launch: {message}", flush=True)


class GroupNotReady(Exception):
    pass


# --- group wait ---------------------------------------------------------------------------------------------

def group_pods(selector: str) -> list[dict]:
    """The pods the selector matches, as kubectl returns them. Raises GroupNotReady when kubectl fails."""
    try:
        done = subprocess.run(["kubectl", "get", "pods", "-l", selector, "-o", "json"], capture_output=True,
                              text=True, timeout=KUBECTL_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise GroupNotReady(f"kubectl failed: {error}") from error
    if done.returncode != 0:
        reason = done.stderr.strip().splitlines()[-1:] or [f"exit status {done.returncode}"]
        raise GroupNotReady(f"kubectl failed: {reason[0]}")
    try:
        return json.loads(done.stdout)["items"]
    except (ValueError, KeyError, TypeError) as error:
        raise GroupNotReady(f"kubectl printed no pod list: {error}") from error


def is_ready(pod: dict) -> bool:
    """Ready=True and not being deleted (a terminating pod stays Ready until its containers stop)."""
    if pod["metadata"].get("deletionTimestamp"):
        return False
    conditions = pod.get("status", {}).get("conditions", [])
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


@dataclass(frozen=True)
class Group:
    """The pods to wait for. own_pod (this launcher's pod) counts as Ready: its readiness probe waits for the
    very server this launcher has yet to start."""

    selector: str
    size: int
    own_pod: str | None = None

    def state(self) -> str:
        """'' when `size` pods match and all are Ready, else what is still missing."""
        pods = group_pods(self.selector)
        waiting = sorted(pod["metadata"]["name"] for pod in pods
                         if pod["metadata"]["name"] != self.own_pod and not is_ready(pod))
        missing = max(self.size - len(pods), 0)
        parts = [f"not Ready: {', '.join(waiting)}"] if waiting else []
        if missing:
            parts.append(f"{missing} of {self.size} pods not created yet")
        return "; ".join(parts)


def wait_for_group(group: Group, timeout_s: float, poll_s: float, signals: list[int]) -> bool:
    """True once the group is Ready, False when a signal arrived first (appended to `signals` by the caller's
    handler); raises GroupNotReady naming what is missing after timeout_s."""
    deadline = time.monotonic() + timeout_s
    last = None
    while not signals:
        try:
            state = group.state()
        except GroupNotReady as error:
            state = str(error)  # no permission yet, API server busy: retried until the deadline
        if not state:
            log(f"group ready ({group.selector})")
            return True
        if state != last:
            log(f"waiting for the group ({group.selector}): {state}")
            last = state
        if time.monotonic() >= deadline:
            raise GroupNotReady(f"group not ready after {timeout_s:g} s ({group.selector}): {state}")
        time.sleep(poll_s)
    return False


# --- processes through /proc --------------------------------------------------------------------------------

def stat_fields(pid: int) -> list[str]:
    """/proc/PID/stat after the command name (which may hold spaces and parentheses): state, ppid, ..."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def descendants(root: int) -> list[int]:
    """root and every process below it, parents first."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                children.setdefault(int(stat_fields(int(entry.name))[1]), []).append(int(entry.name))
            except (OSError, IndexError):
                continue  # exited while we looked
    found, queue = [], [root]
    while queue:
        pid = queue.pop(0)
        found.append(pid)
        queue += sorted(children.get(pid, []))
    return found


def alive(pid: int) -> bool:
    """Running, and not a zombie waiting for its parent (mpirun) to reap it."""
    try:
        return stat_fields(pid)[0] != "Z"
    except (OSError, IndexError):
        return False


def mpi_rank(pid: int) -> int | None:
    try:
        environment = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in environment:
        if item.startswith(b"OMPI_COMM_WORLD_RANK="):
            return int(item.split(b"=", 1)[1])
    return None


def drain_targets(root: int, name: str, rank: int | None) -> list[int]:
    """The processes called `name` at or below root (and of MPI rank `rank`, when given)."""
    targets = []
    for pid in descendants(root):
        try:
            matches = Path(f"/proc/{pid}/comm").read_text().strip() == name
        except OSError:
            continue
        if matches and alive(pid) and (rank is None or mpi_rank(pid) == rank):
            targets.append(pid)
    return targets


# --- run and hold -------------------------------------------------------------------------------------------

def exit_status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def stop_command(command: subprocess.Popen) -> int:
    if command.poll() is None:
        log(f"sending SIGTERM to the command (pid {command.pid})")
        command.send_signal(signal.SIGTERM)
        try:
            command.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            log(f"the command did not exit within {STOP_GRACE_S} s: SIGKILL")
            command.kill()
            command.wait()
    log(f"the command exited with status {exit_status(command.returncode)}")
    return exit_status(command.returncode)


def drain(command: subprocess.Popen, name: str, rank: int | None, timeout_s: float) -> bool:
    """SIGTERM the `name` processes below the command and wait for them; True when they all exited in time."""
    targets = drain_targets(command.pid, name, rank)
    if not targets:
        log(f"no {name} process below the command to drain")
        return False
    log(f"draining {name} (pids {', '.join(map(str, targets))}) for up to {timeout_s:g} s")
    for pid in targets:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and command.poll() is None and any(map(alive, targets)):
        time.sleep(POLL_S)
    running = [pid for pid in targets if alive(pid)]
    if running:
        log(f"drain incomplete: {name} pids {', '.join(map(str, running))} still running")
        return False
    log("drain complete")
    return True


def run(arguments: argparse.Namespace) -> int:
    received: list[int] = []
    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, lambda signum, _frame: received.append(signum))
    if arguments.group_selector:
        try:
            group = Group(arguments.group_selector, arguments.group_size, arguments.own_pod)
            ready = wait_for_group(group, arguments.group_timeout, arguments.poll_interval, received)
        except GroupNotReady as error:
            log(str(error))
            return 1
        if not ready:
            log(f"{signal.Signals(received[0]).name} before the command started: exiting")
            return 0
    log(f"starting: {' '.join(arguments.command)}")
    command = subprocess.Popen(arguments.command)
    while command.poll() is None and not received:
        time.sleep(POLL_S)
    if not received:
        log(f"the command exited by itself with status {exit_status(command.returncode)}")
        return exit_status(command.returncode)
    log(f"{signal.Signals(received[0]).name} received")
    drained = drain(command, arguments.drain_process, arguments.drain_rank, arguments.drain_timeout)
    status = stop_command(command)
    return 0 if drained else status


def processes_named(name: str) -> list[int]:
    """Every live process called `name` in this PID namespace. A worker's ranks are not PID 1's children: the
    leader's mpirun starts them through `kubectl exec`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            matches = (entry / "comm").read_text().strip() == name
        except OSError:
            continue
        if matches and alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def hold(process: str, timeout_s: float) -> int:
    """A worker pod's PID 1: wait for SIGTERM or SIGINT, then for the `process` processes it hosts to exit (at most
    timeout_s), then exit 0. The leader drains the group through mpirun; a worker that exited at once would take its
    ranks with it while the leader still serves, and mpirun would abort the requests in flight."""
    # Blocked signals are queued even for PID 1 (which drops those left at their default action), and sigwait
    # takes them off the queue without a handler's race between checking a flag and sleeping.
    stop = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)
    log("holding until SIGTERM or SIGINT")
    received = signal.sigwait(stop)
    running = processes_named(process)
    log(f"{signal.Signals(received).name} received: waiting up to {timeout_s:g} s for the {process} processes here "
        f"({', '.join(map(str, running)) or 'none'}) to exit")
    deadline = time.monotonic() + timeout_s
    while running and time.monotonic() < deadline:
        time.sleep(POLL_S)
        running = processes_named(process)
    log(f"{process} still running (pids {', '.join(map(str, running))}): exiting anyway" if running
        else "exiting")
    return 0


def parser() -> argparse.ArgumentParser:
    main_parser = argparse.ArgumentParser(prog="python3 -m specdeploy.pods.launch", description=__doc__,
                                          formatter_class=argparse.RawDescriptionHelpFormatter)
    modes = main_parser.add_subparsers(dest="mode", required=True)
    run_parser = modes.add_parser("run", help="wait for the group, run COMMAND, drain it on SIGTERM/SIGINT")
    run_parser.add_argument("--group-selector", help="label selector of the group's pods, e.g. "
                            "leaderworkerset.sigs.k8s.io/group-key=$(GROUP_KEY)")
    run_parser.add_argument("--group-size", type=int, default=1, help="how many pods the selector must match")
    run_parser.add_argument("--own-pod", default=os.environ.get("POD_NAME"),
                            help="this pod, counted Ready while it waits (default: $POD_NAME)")
    run_parser.add_argument("--group-timeout", type=float, default=600.0, help="seconds before giving up")
    run_parser.add_argument("--poll-interval", type=float, default=2.0, help="seconds between kubectl calls")
    run_parser.add_argument("--drain-timeout", type=float, default=60.0,
                            help="seconds the drained processes get before the command is stopped anyway")
    run_parser.add_argument("--drain-process", default="tritonserver", help="name of the processes to drain")
    run_parser.add_argument("--drain-rank", type=int, help="drain only this MPI rank (OMPI_COMM_WORLD_RANK)")
    run_parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    hold_parser = modes.add_parser("hold", help="sleep until SIGTERM or SIGINT, wait for the hosted processes to "
                                                "exit, then exit 0")
    hold_parser.add_argument("--drain-process", default="tritonserver", help="name of the processes to wait for")
    hold_parser.add_argument("--drain-timeout", type=float, default=60.0,
                             help="seconds to wait for them after the signal")
    return main_parser


def main(argv: list[str] | None = None) -> int:
    arguments = parser().parse_args(argv)
    if arguments.mode == "hold":
        return hold(arguments.drain_process, arguments.drain_timeout)
    if arguments.command[:1] == ["--"]:
        arguments.command = arguments.command[1:]
    if not arguments.command:
        parser().error("run needs a command after --")
    return run(arguments)


if __name__ == "__main__":
    sys.exit(main())
