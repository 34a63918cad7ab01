"""The build Job's journal on the data volume, so that serving pods waiting for a repository can tell "still
building" from "the build has failed for good" (with the Job's own status where they can read it:
pods/job_status.py).

`record` wraps one step of the build Job (`specdeploy build`, then `specdeploy package`): it appends a JSON line when
the step starts and one when it fails, keyed by the pipeline file's SHA-256 and the Job's uid, and exits with the
step's status. A SIGKILL of the step alone (the OOM killer on cgroup v1) is recorded by this wrapper; on cgroup v2
the kubelet makes every container one OOM group (memory.oom.group, kubernetes@b94367ca pkg/kubelet/kuberuntime/
kuberuntime_container_linux.go), so the wrapper dies with the step and records nothing: the wait's deadline ends
that case.
`wait` is the serving pods' init container: it returns once the package stamp records the pipeline's digest and
this image's specdeploy and Triton model code (a new image waits for its own build Job's repository), and
gives up with a message naming the failure once the build Job's own status says it failed (pods/job_status.py,
where the pod holds a token for it) or that it completed while the stamp is still another version's (a
Complete Job never runs again: review W1), or once the newest Job of this pipeline has failed as often as its
backoffLimit allows by the journal, or with exit status 2 (a configuration error: the Job's podFailurePolicy fails it
at once).

    python3 -m specdeploy.pods.build_journal record --journal J --pipeline P --job-uid UID --step build -- CMD...
    python3 -m specdeploy.pods.build_journal wait --journal J --pipeline P --stamp S --backoff-limit 2
It imports little beyond the standard library (the stamp's check): it runs before anything else in the pod.
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

from specdeploy.package.package_stamp import model_code_files, stale_for_this_code
from specdeploy.pods.job_status import JobReader, completed, failure
from specdeploy.pods.launch import exit_status

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


def stamp_state(stamp: Path, digest: str, code: dict[str, str | None]) -> str | None:
    """None once the repository's stamp says this image (its Triton model code: `code`) packaged it from this
    pipeline, else why not yet."""
    try:
        recorded = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return "no complete repository yet"
    return stale_for_this_code(recorded, digest, code)


def read_job(job: JobReader | None, said: set[str]) -> dict | None:
    """The build Job as the API has it, or None where it does not exist, there is no reader or the API cannot be read
    (said once)."""
    if job is None:
        return None
    try:
        return job.read()
    except (OSError, ValueError) as error:
        if "unreadable" not in said:
            said.add("unreadable")
            print(f"cannot read the build Job {job.job}'s status ({error}); going on with the journal and the "
                  f"deadline", file=sys.stderr, flush=True)
        return None


def wait(journal: Path, pipeline: Path, stamp: Path, backoff_limit: int, poll_s: float,
         give_up_after_s: float | None = None, job: JobReader | None = None) -> int:
    """0 once the repository is this pipeline's and this image's; 1, naming why, once the build Job has failed by
    its own status (`job`, pods/job_status.py) or for good by the journal, or after give_up_after_s (the Job's
    activeDeadlineSeconds and a margin), the last resort where the API cannot be read: by then the Job has ended
    whatever the journal holds."""
    digest, code = pipeline_digest(pipeline), model_code_files()  # this image's code does not change while it waits
    said: set[str] = set()
    state_said = None
    started = time.monotonic()
    while True:
        stale = stamp_state(stamp, digest, code)
        if stale is None:
            print(f"the repository is packaged from this pipeline ({digest[:12]}) by this image's specdeploy",
                  flush=True)
            return 0
        status = read_job(job, said)
        failed = failure(status)
        if failed is not None:
            print(f"giving up: the build Job {job.job} has failed ({failed}). kubectl describe job/{job.job} and "
                  f"its logs (kubectl logs job/{job.job} --all-containers) say why; fix the cause, delete the Job "
                  f"and apply again", file=sys.stderr, flush=True)
            return 1
        # A Complete Job never runs again: re-applying its name (a revert within its TTL) starts nothing, so a stamp
        # still stale once it has completed (read again: the package step may have written it since) never changes
        if completed(status) and (stale := stamp_state(stamp, digest, code)) is not None:
            print(f"giving up: the build Job {job.job} has completed, but {stamp} is not this pipeline's and this "
                  f"image's ({stale}): a Job that has completed does not run again when applied again. kubectl delete "
                  f"job/{job.job}, then apply again (kubectl apply -k <overlay>) to rebuild", file=sys.stderr,
                  flush=True)
            return 1
        history = entries(journal, digest)
        reason = verdict(history, backoff_limit)
        if reason is not None:
            print(f"giving up: {reason}. Read its logs (kubectl logs job/<name> --all-containers), fix the cause, "
                  f"delete the Job and apply again; journal: {journal}", file=sys.stderr, flush=True)
            return 1
        if give_up_after_s is not None and time.monotonic() - started > give_up_after_s:
            print(f"giving up after {give_up_after_s:.0f} s, past the build Job's activeDeadlineSeconds: the Job "
                  f"has ended without packaging this repository ({stale}). Its journal shows "
                  f"{len(history)} entries; what it cannot show: DeadlineExceeded, an OOM kill of the whole "
                  f"container, a pod never scheduled or an image that cannot be pulled. kubectl describe job/<name>, "
                  f"fix the cause, delete the Job and apply again", file=sys.stderr, flush=True)
            return 1
        state = f"{'building' if history else 'waiting for the build Job to start'}: {stamp}: {stale}"
        if state != state_said:
            print(state, flush=True)
            state_said = state
        time.sleep(poll_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m specdeploy.pods.build_journal")
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
    commands.choices["wait"].add_argument("--give-up-after", type=float, help="seconds (the Job's deadline and more)")
    commands.choices["wait"].add_argument("--job", help="the build Job's name, whose status the wait reads where the "
                                                         "pod has a token for it")
    args = parser.parse_args(argv)
    if args.command == "record":
        step_command = args.step_command[1:] if args.step_command[:1] == ["--"] else args.step_command
        if not step_command:
            parser.error("record: give the step's command after --")
        return record(args.journal, args.pipeline, args.job_uid, args.step, step_command)
    job = JobReader.in_cluster(args.job) if args.job else None
    return wait(args.journal, args.pipeline, args.stamp, args.backoff_limit, args.poll, args.give_up_after, job)


if __name__ == "__main__":
    sys.exit(main())
