"""One engine folder and one repository folder per version of a pipeline on the data volume, and the lease that keeps
a version's folders while a pod may still load them (issue 63, review W2).

A version is `<pipeline name>-<key>`, the key a hash of the pipeline file, the image and the GPU product
(deploy/k8s.py `Overlay.version`): its engines live under `engines/<version>/` (the build's SPECDEPLOY_ENGINES), its
repository is `models/<version>/`, and its lease is the file `models/<version>.lease`. A pod of one version therefore
never builds over, nor loads, another version's files: during a rollout an old-ReplicaSet pod that starts (the
autoscaler scales both ReplicaSets, an eviction, a node restart) finds its own build, and so does a revert.

The lease: every container that builds, packages or serves a version holds a shared flock on its lease for its whole
life (`hold`; a serving container execs its server with the lock's descriptor inherited, so the lock lives exactly as
long as the server); the build and package steps also set the lease's mtime, the version's last start. A superseded
version is collected only by taking the lease's lock exclusively, so never while a container of it runs, and only
when its last start is older than `--collect-after` (set past the build's deadline and the engines' load: a pod
between its steps and its server, which holds no lock for a moment, started within that time). The collector
removes the folders, then the lease; a holder that waited on a removed lease opens it again (`lock_lease`).

flock is local to a node on a ReadWriteOnce volume (every pod of a pipeline shares that node) and spans nodes on
NFSv4 (Linux NFS clients turn flock into whole-file POSIX locks), as the build lock does (spec/engine_paths.py).

    python3 -m specdeploy.pods.versions hold --lease L [--touch] [--collect-after S --engines E] [--deadline S]
        [--wait] -- CMD...
Standard library only: it wraps the first command of the pod.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

LEASE_SUFFIX = ".lease"
KEY = re.compile(r"^[0-9a-f]{10}$")  # a version's key (deploy/k8s.py version_key)
DEADLINE_EXIT = 124  # as timeout(1): the step ran past its deadline
WAIT_POLL_S = 5.0
KILL_AFTER_S = 30  # after SIGTERM at the deadline, the step's time to exit before SIGKILL


def lock_lease(lease: Path, touch: bool) -> int:
    """A descriptor holding a shared lock on `lease` (created where `touch`, whose mtime it then sets). Waits while a
    collector holds it, and opens it again where the collector removed it meanwhile. Raises FileNotFoundError where
    the lease is missing and may not be created (a read-only serving container)."""
    if touch:
        lease.parent.mkdir(parents=True, exist_ok=True)
    while True:
        descriptor = os.open(lease, os.O_RDONLY | (os.O_CREAT if touch else 0), 0o644)
        fcntl.flock(descriptor, fcntl.LOCK_SH)
        try:
            same = os.stat(lease).st_ino == os.fstat(descriptor).st_ino
        except FileNotFoundError:
            same = False
        if same:
            if touch:
                os.utime(lease)
            return descriptor
        os.close(descriptor)
        if not touch:
            raise FileNotFoundError(lease)


def version_of(lease: Path) -> tuple[str, str]:
    """(pipeline name, version) of a lease file's name `<name>-<key>.lease`."""
    version = lease.name.removesuffix(LEASE_SUFFIX)
    return version.rpartition("-")[0], version


def version_folders(lease: Path, engines: Path) -> list[Path]:
    """What a version owns: its engines root, its repository, the repository's journal, lock and staging leftovers."""
    _, version = version_of(lease)
    models = lease.parent
    return [engines / version, models / version, models / f"{version}.build-journal",
            *sorted(models.glob(f".{version}.*"))]


def collect(lease: Path, engines: Path, idle_s: float, now: float | None = None) -> list[str]:
    """Remove every other version of this lease's pipeline that no container holds and none started within idle_s;
    the versions removed."""
    name, own = version_of(lease)
    removed = []
    for other in sorted(lease.parent.glob(f"*{LEASE_SUFFIX}")):
        other_name, version = version_of(other)
        if other_name != name or version == own or not KEY.match(version[len(name) + 1:]):
            continue
        try:
            descriptor = os.open(other, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a container of that version runs
            # read once locked: a step that started since has set it
            if (now or time.time()) - os.fstat(descriptor).st_mtime < idle_s:
                continue
            for path in version_folders(other, engines):
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
            other.unlink(missing_ok=True)  # last, still locked: a waiting holder then opens a new lease
            removed.append(version)
        finally:
            os.close(descriptor)
    return removed


def run_with_deadline(command: list[str], deadline_s: float) -> int:
    """The command's exit status; past deadline_s it is stopped (SIGTERM, then SIGKILL) and this says so and returns
    DEADLINE_EXIT. SIGTERM and SIGINT to this process go to the command."""
    child = subprocess.Popen(command)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda received, _frame: child.send_signal(received))
    try:
        return child.wait(timeout=deadline_s)
    except subprocess.TimeoutExpired:
        pass
    print(f"giving up: {' '.join(command[:3])} ran past its deadline of {deadline_s:.0f} s and is stopped, so that "
          f"a hung build does not hold the pod's GPUs for good; its output above says how far it got. If it is only "
          f"slow, regenerate the overlay with a larger --weights-gib or build ahead of the rollout "
          f"(docs/kubernetes.md)", file=sys.stderr, flush=True)
    child.terminate()
    try:
        child.wait(timeout=KILL_AFTER_S)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
    return DEADLINE_EXIT


def hold(lease: Path, touch: bool, command: list[str], collect_after_s: float | None = None,
         engines: Path | None = None, deadline_s: float | None = None, wait: bool = False) -> int:
    """Hold the lease, collect superseded versions where asked, then run the command: under a deadline as a child
    (returning its status), else in place of this process with the lock inherited (never returns). `wait`: until
    the lease exists (a multinode worker starts beside its leader, before the build Job has made it)."""
    while wait and not touch and not lease.exists():
        time.sleep(WAIT_POLL_S)
    try:
        descriptor = lock_lease(lease, touch)
    except FileNotFoundError:
        print(f"{lease} is missing: this version's repository was collected or never built; delete this pod so "
              f"that a new one builds it", file=sys.stderr, flush=True)
        return 1
    if collect_after_s is not None and engines is not None:
        for version in collect(lease, engines, collect_after_s):
            print(f"removed superseded version {version} (no pod holds it)", flush=True)
    if deadline_s is not None:
        return run_with_deadline(command, deadline_s)
    os.set_inheritable(descriptor, True)
    os.execvp(command[0], command)
    return 1  # not reached


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m specdeploy.pods.versions")
    commands = parser.add_subparsers(dest="command", required=True)
    command = commands.add_parser("hold")
    command.add_argument("--lease", type=Path, required=True)
    command.add_argument("--touch", action="store_true", help="create the lease and record this start (build steps)")
    command.add_argument("--collect-after", type=float, help="collect versions idle this many seconds")
    command.add_argument("--engines", type=Path, help="the engines root holding one folder per version")
    command.add_argument("--deadline", type=float, help="seconds the command may run")
    command.add_argument("--wait", action="store_true", help="wait for the lease to exist (multinode workers)")
    command.add_argument("step_command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    step_command = args.step_command[1:] if args.step_command[:1] == ["--"] else args.step_command
    if not step_command:
        parser.error("hold: give the command after --")
    return hold(args.lease, args.touch, step_command, args.collect_after, args.engines, args.deadline, args.wait)


if __name__ == "__main__":
    sys.exit(main())
