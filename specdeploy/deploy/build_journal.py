"""The build Job's journal on the data volume, so that serving pods waiting for a repository can tell "still
building" from "the build has failed for good" without API access.

`record` wraps one step of the build Job (`specdeploy build`, then `specdeploy package`): it appends a JSON line when
the step starts and one when it fails, keyed by the pipeline file's SHA-256 and the Job's uid, and exits with the
step's status (a SIGKILL from the OOM killer is recorded by this wrapper, which the step itself could not do).
`wait` is the serving pods' init container: it returns once the package stamp records the pipeline's digest, and
gives up with a message naming the failure once the newest Job of this pipeline has failed as often as its
backoffLimit allows, or with exit status 2 (a configuration error: the Job's podFailurePolicy fails it at once).

    python3 -m specdeploy.deploy.build_journal record --journal J --pipeline P --job-uid UID --step build -- CMD...
    python3 -m specdeploy.deploy.build_journal wait --journal J --pipeline P --stamp S --backoff-limit 2
Standard library only: it runs before anything else in the pod.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from specdeploy.deploy.launch import exit_status

CONFIGURATION_ERROR = 2  # specdeploy's exit status for a bad pipeline or input: retrying cannot help
INTERRUPTED = "interrupted"  # the pod was stopped (eviction, preemption, deletion): not the build's failure


def pipeline_digest(pipeline: Path) -> str:
    return hashlib.sha256(Path(pipeline).read_bytes()).hexdigest()


def append(journal: Path, entry: dict) -> None:
    """One JSON line; a single short write with O_APPEND, so concurrent writers do not interleave lines."""
    journal.parent.mkdir(parents=True, exist_ok=True)
    line = (json.dumps({**entry, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}) + "\n").encode()
    descriptor = os.open(journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(descriptor, line)
    finally:
        os.close(descriptor)


def record(journal: Path, pipeline: Path, job_uid: str, step: str, command: list[str]) -> int:
    entry = {"pipeline": pipeline_digest(pipeline), "job": job_uid, "step": step}
    child: subprocess.Popen | None = None
    stopped = []

    def stop(signum, _frame) -> None:
        stopped.append(signum)
        if child is not None:
            child.send_signal(signum)

    # before the journal says the step started: a signal from then on is the step's, recorded as an interruption
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    append(journal, {**entry, "event": "start"})
    child = subprocess.Popen(command)
    if stopped:  # arrived while the child was starting
        child.send_signal(stopped[0])
    status = child.wait()
    if status != 0:
        status = exit_status(status)
        append(journal, {**entry, "event": INTERRUPTED if stopped else "failed", "status": status})
        return status
    return 0


def entries(journal: Path, digest: str) -> list[dict]:
    if not journal.is_file():
        return []
    found = []
    for line in journal.read_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:  # a torn line from a crash: skip it
            continue
        if isinstance(entry, dict) and entry.get("pipeline") == digest:
            found.append(entry)
    return found


def verdict(history: list[dict], backoff_limit: int) -> str | None:
    """Why the newest build Job in this pipeline's journal `history` can no longer produce the repository, or None
    while it still can."""
    if not history:
        return None
    job = history[-1]["job"]
    failures = [e for e in history if e["job"] == job and e["event"] == "failed"]
    if not failures:
        return None
    last = failures[-1]
    how = f"last: step {last['step']}, exit status {last['status']} at {last['time']}"
    if last["status"] == 137:
        how += " (killed: SIGKILL, usually the memory limit)"
    if last["status"] == CONFIGURATION_ERROR:
        return (f"the build Job (uid {job}) failed with a configuration error ({how}); its podFailurePolicy ends it "
                f"without retrying")
    if len(failures) > backoff_limit:
        return f"the build Job (uid {job}) failed {len(failures)} times, its backoffLimit is {backoff_limit} ({how})"
    return None


def wait(journal: Path, pipeline: Path, stamp: Path, backoff_limit: int, poll_s: float) -> int:
    digest = pipeline_digest(pipeline)
    said = None
    while True:
        if stamp.is_file() and digest in stamp.read_text(errors="replace"):
            print(f"the repository is packaged from this pipeline ({digest[:12]})", flush=True)
            return 0
        history = entries(journal, digest)
        reason = verdict(history, backoff_limit)
        if reason is not None:
            print(f"giving up: {reason}. Read its logs (kubectl logs job/<name> --all-containers), fix the cause, "
                  f"delete the Job and apply again; journal: {journal}", file=sys.stderr, flush=True)
            return 1
        state = "building" if history else "waiting for the build Job to start"
        if state != said:
            print(f"{state}: {stamp} does not record pipeline {digest[:12]} yet", flush=True)
            said = state
        time.sleep(poll_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m specdeploy.deploy.build_journal")
    commands = parser.add_subparsers(dest="command", required=True)
    for name in ("record", "wait"):
        command = commands.add_parser(name)
        command.add_argument("--journal", type=Path, required=True)
        command.add_argument("--pipeline", type=Path, required=True)
    commands.choices["record"].add_argument("--job-uid", required=True)
    commands.choices["record"].add_argument("--step", required=True)
    commands.choices["record"].add_argument("step_command", nargs=argparse.REMAINDER)
    commands.choices["wait"].add_argument("--stamp", type=Path, required=True)
    commands.choices["wait"].add_argument("--backoff-limit", type=int, required=True)
    commands.choices["wait"].add_argument("--poll", type=float, default=5.0)
    args = parser.parse_args(argv)
    if args.command == "record":
        step_command = args.step_command[1:] if args.step_command[:1] == ["--"] else args.step_command
        if not step_command:
            parser.error("record: give the step's command after --")
        return record(args.journal, args.pipeline, args.job_uid, args.step, step_command)
    return wait(args.journal, args.pipeline, args.stamp, args.backoff_limit, args.poll)


if __name__ == "__main__":
    sys.exit(main())
