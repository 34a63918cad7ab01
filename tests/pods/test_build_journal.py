"""The build journal (specdeploy/pods/build_journal.py): the build Job's steps record their failures on the data
volume, and the serving pods' wait gives up once the newest Job of the pipeline has failed for good, by the journal
or by the Job's own status (pods/job_status.py, against a stand-in API server)."""

from __future__ import annotations

import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from specdeploy.pods import build_journal
from specdeploy.pods.job_status import JobReader

MODULE = [sys.executable, "-m", "specdeploy.pods.build_journal"]


@pytest.fixture
def volume(tmp_path) -> dict[str, Path]:
    pipeline = tmp_path / "pipeline.yaml"
    pipeline.write_text("name: p\n")
    return {"journal": tmp_path / "models" / "p.build-journal", "pipeline": pipeline,
            "stamp": tmp_path / "models" / "p" / "stamp.json"}


def record(volume: dict, job: str, *command: str) -> subprocess.CompletedProcess:
    return subprocess.run([*MODULE, "record", "--journal", str(volume["journal"]), "--pipeline",
                           str(volume["pipeline"]), "--job-uid", job, "--step", "build", "--", *command],
                          capture_output=True, text=True, timeout=30)


def wait(volume: dict, timeout: float = 1.5, *extra: str) -> subprocess.CompletedProcess | None:
    """The wait's result, or None while it still waits after `timeout` seconds."""
    try:
        return subprocess.run([*MODULE, "wait", "--journal", str(volume["journal"]), "--pipeline",
                               str(volume["pipeline"]), "--stamp", str(volume["stamp"]), "--backoff-limit", "2",
                               "--poll", "0.2", *extra], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


OOM_KILLED = ("python3", "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")  # the step alone


def test_a_killed_step_is_recorded_and_the_wait_gives_up_after_backoff_limit_plus_one_failures(volume):
    """A step SIGKILLed alone (the OOM killer on cgroup v1) is recorded by its wrapper."""
    assert wait(volume) is None  # no Job yet: waiting
    for attempt in range(3):
        assert record(volume, "job-1", *OOM_KILLED).returncode == 137
        if attempt < 2:
            assert wait(volume) is None, f"gave up after {attempt + 1} failures; the Job retries twice"
    result = wait(volume)
    assert result is not None and result.returncode == 1
    assert "failed 3 times" in result.stderr and "SIGKILL" in result.stderr and "job-1" in result.stderr
    lines = [json.loads(line) for line in volume["journal"].read_text().splitlines()]
    assert [e["event"] for e in lines] == ["start", "failed"] * 3


def test_a_configuration_error_gives_up_at_once_and_a_new_job_waits_again(volume):
    assert record(volume, "job-1", sys.executable, "-c", "raise SystemExit(2)").returncode == 2
    result = wait(volume)
    assert result is not None and result.returncode == 1 and "configuration error" in result.stderr
    assert record(volume, "job-2", "true").returncode == 0  # a new Job (after the fix) started and runs
    assert wait(volume) is None


def test_only_this_pipelines_and_this_images_repository_ends_the_wait(volume):
    """The stamp must record this pipeline file, this specdeploy and this image's Triton model code: pods of a new
    image (an image-only rollout) wait for their own build Job's repository instead of loading the old model.py
    (review N5)."""
    import hashlib

    import specdeploy
    from specdeploy.package.package_stamp import model_code_files

    digest = hashlib.sha256(volume["pipeline"].read_bytes()).hexdigest()
    current = {"specdeploy": specdeploy.__version__, "files": {"pipeline_file": digest, **model_code_files()}}
    first_code = next(iter(model_code_files()))
    volume["stamp"].parent.mkdir(parents=True)
    for stale in ({**current, "files": {**current["files"], "pipeline_file": "0" * 64}},  # another pipeline
                  {**current, "specdeploy": "0.0.1"},  # packaged by an older image
                  {**current, "files": {**current["files"], first_code: "0" * 64}}):  # other model code
        volume["stamp"].write_text(json.dumps(stale))
        assert wait(volume) is None, stale
    volume["stamp"].write_text(json.dumps(current))
    result = wait(volume)
    assert result is not None and result.returncode == 0


def test_the_wait_gives_up_past_the_jobs_deadline_whatever_the_journal_holds(volume):
    """What the journal cannot show: on cgroup v2 the OOM killer takes the wrapper with the step (one OOM group per
    container), the Job's deadline deletes its pods, a pod is never scheduled. The journal then holds a start and
    nothing more, and the wait ends once the Job's deadline (and a margin) has passed (review N3)."""
    wrapper = subprocess.Popen([*MODULE, "record", "--journal", str(volume["journal"]), "--pipeline",
                                str(volume["pipeline"]), "--job-uid", "job-1", "--step", "build", "--", "sleep", "30"],
                               start_new_session=True)
    deadline = time.monotonic() + 10
    while not (volume["journal"].is_file() and volume["journal"].read_text()):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.killpg(wrapper.pid, signal.SIGKILL)  # the container's whole OOM group: wrapper and step
    wrapper.wait()
    assert [json.loads(line)["event"] for line in volume["journal"].read_text().splitlines()] == ["start"]
    assert wait(volume, 1.5) is None  # without a bound it would wait for good
    result = wait(volume, 10, "--give-up-after", "1")
    assert result is not None and result.returncode == 1
    assert "past the build Job's activeDeadlineSeconds" in result.stderr and "OOM" in result.stderr


def test_a_stopped_pod_is_not_counted_as_a_failure(volume):
    """SIGTERM (eviction, preemption) reaches the step and is recorded as interrupted, not failed: the Job's
    podFailurePolicy does not count such pods either."""
    step = subprocess.Popen([*MODULE, "record", "--journal", str(volume["journal"]), "--pipeline",
                             str(volume["pipeline"]), "--job-uid", "job-1", "--step", "build", "--", "sleep", "30"])
    deadline = time.monotonic() + 10
    while not (volume["journal"].is_file() and volume["journal"].read_text()):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    step.send_signal(signal.SIGTERM)
    assert step.wait(timeout=10) == 143
    events = [json.loads(line)["event"] for line in volume["journal"].read_text().splitlines()]
    assert events == ["start", "interrupted"]
    for _ in range(3):
        record(volume, "job-1", "sh", "-c", "kill -TERM $$")  # a step killed by a signal of its own is a failure
    assert wait(volume) is not None


class StandInApi:
    """A stand-in for the API server's Job endpoint: answers every GET with `status` and `body`, and keeps the
    requests' paths and Authorization headers."""

    def __init__(self, status: int, body: dict | None = None):
        self.status, self.body, self.requests = status, body or {}, []
        api = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                api.requests.append((self.path, self.headers.get("Authorization")))
                payload = json.dumps(api.body).encode()
                self.send_response(api.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def reader(self, credentials: Path) -> JobReader:
        credentials.mkdir(exist_ok=True)
        (credentials / "token").write_text("token-1\n")
        (credentials / "namespace").write_text("specdeploy\n")
        return JobReader("p-engine-build-0123456789", f"http://127.0.0.1:{self.server.server_port}", credentials)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


FAILED_JOB = {"kind": "Job", "status": {"failed": 1, "conditions": [
    {"type": "FailureTarget", "status": "True", "reason": "DeadlineExceeded",
     "message": "Job was active longer than specified deadline"},
    {"type": "Failed", "status": "True", "reason": "DeadlineExceeded",
     "message": "Job was active longer than specified deadline"}]}}


def wait_with_job(volume, api, tmp_path) -> tuple[int, float]:
    """The wait (2 s poll budget, 60 s deadline) reading the Job through the stand-in API: its status and seconds."""
    try:
        started = time.monotonic()
        status = build_journal.wait(volume["journal"], volume["pipeline"], volume["stamp"], 2, 0.1,
                                    give_up_after_s=60, job=api.reader(tmp_path / "credentials"))
    finally:
        api.close()
    return status, time.monotonic() - started


def test_the_wait_gives_up_when_the_jobs_own_status_says_it_failed(volume, tmp_path, capsys):
    """Review N3: a Job past its activeDeadlineSeconds (its pods deleted; also where its pod was never scheduled or
    its image never pulled) leaves the journal silent. The wait reads the Job's Failed condition and gives up at
    once, naming the reason, rather than at its own deadline."""
    api = StandInApi(200, FAILED_JOB)
    status, seconds = wait_with_job(volume, api, tmp_path)
    assert status == 1 and seconds < 10
    error = capsys.readouterr().err
    assert "p-engine-build-0123456789 has failed (DeadlineExceeded: Job was active longer" in error
    assert api.requests[0] == ("/apis/batch/v1/namespaces/specdeploy/jobs/p-engine-build-0123456789", "Bearer token-1")


COMPLETE_JOB = {"kind": "Job", "status": {"succeeded": 1, "conditions": [
    {"type": "SuccessCriteriaMet", "status": "True"}, {"type": "Complete", "status": "True"}]}}


def test_a_complete_job_with_another_versions_stamp_ends_the_wait_at_once(volume, tmp_path, capsys):
    """Review W1: a revert names a Job that has already completed, which `kubectl apply` does not rerun, over a
    repository another version stamped. The wait gives up at once, saying to delete the Job, not at its deadline."""
    volume["stamp"].parent.mkdir(parents=True)
    volume["stamp"].write_text(json.dumps({"specdeploy": "0.0.0", "files": {"pipeline_file": "another"}}))
    api = StandInApi(200, COMPLETE_JOB)
    status, seconds = wait_with_job(volume, api, tmp_path)
    assert status == 1 and seconds < 10
    error = capsys.readouterr().err
    assert "has completed" in error and "kubectl delete job/p-engine-build-0123456789" in error


def test_a_complete_job_whose_stamp_is_this_versions_ends_the_wait_ready(volume, tmp_path):
    import specdeploy
    from specdeploy.package.package_stamp import model_code_files

    volume["stamp"].parent.mkdir(parents=True)
    volume["stamp"].write_text(json.dumps({"specdeploy": specdeploy.__version__, "files": {
        "pipeline_file": build_journal.pipeline_digest(volume["pipeline"]), **model_code_files()}}))
    api = StandInApi(200, COMPLETE_JOB)
    try:
        assert build_journal.wait(volume["journal"], volume["pipeline"], volume["stamp"], 2, 0.1,
                                  give_up_after_s=60, job=api.reader(tmp_path / "credentials")) == 0
    finally:
        api.close()


@pytest.mark.parametrize("status, body", [(200, {"kind": "Job", "status": {"active": 1}}), (404, {}), (403, {})])
def test_a_running_missing_or_unreadable_job_leaves_the_wait_to_its_journal_and_deadline(volume, tmp_path, capsys,
                                                                                        status, body):
    """A running Job, one not created yet (404), or a Role that does not let the pod read it (403): the wait goes on
    (saying once why it cannot read the Job) and ends as it did without the API, here at its deadline."""
    api = StandInApi(status, body)
    try:
        result = build_journal.wait(volume["journal"], volume["pipeline"], volume["stamp"], 2, 0.1,
                                    give_up_after_s=0.8, job=api.reader(tmp_path / "credentials"))
    finally:
        api.close()
    error = capsys.readouterr().err
    assert result == 1 and "past the build Job's activeDeadlineSeconds" in error
    assert len(api.requests) >= 3
    assert error.count("cannot read the build Job") == (1 if status == 403 else 0)


def test_the_reader_is_made_only_where_the_pod_has_a_token(tmp_path, monkeypatch):
    credentials = tmp_path / "serviceaccount"
    credentials.mkdir()
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "fd00::1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    assert JobReader.in_cluster("job", credentials) is None  # no token mounted: the journal alone
    (credentials / "token").write_text("t")
    assert JobReader.in_cluster("job", credentials).api == "https://[fd00::1]:443"
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST")
    assert JobReader.in_cluster("job", credentials) is None
