"""A pipeline version's lease (specdeploy/pods/versions.py): held by every container of the version, it keeps the
version's folders from collection; an unheld version idle past the limit is collected, folders first; a step past its
deadline is stopped with a message."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specdeploy.pods import versions

MODULE = [sys.executable, "-m", "specdeploy.pods.versions", "hold"]


@pytest.fixture
def data(tmp_path) -> Path:
    """A data volume with three versions of pipeline p (and one of pipeline p-x, which is not p's)."""
    for version in ("p-aaaaaaaaaa", "p-bbbbbbbbbb", "p-cccccccccc", "p-x-dddddddddd"):
        (tmp_path / "engines" / version / "p").mkdir(parents=True)
        (tmp_path / "models" / version).mkdir(parents=True)
        (tmp_path / "models" / f"{version}.build-journal").write_text("{}\n")
        (tmp_path / "models" / f"{version}.lease").touch()
    return tmp_path


def lease(data: Path, version: str) -> Path:
    return data / "models" / f"{version}.lease"


def test_only_unheld_idle_versions_of_the_same_pipeline_are_collected(data):
    held = versions.lock_lease(lease(data, "p-bbbbbbbbbb"), touch=False)  # a running pod of b
    try:
        removed = versions.collect(lease(data, "p-aaaaaaaaaa"), data / "engines", idle_s=60, now=time.time() + 3600)
    finally:
        os.close(held)
    assert removed == ["p-cccccccccc"]
    assert not (data / "models" / "p-cccccccccc").exists() and not (data / "engines" / "p-cccccccccc").exists()
    assert not lease(data, "p-cccccccccc").exists() and not (data / "models" / "p-cccccccccc.build-journal").exists()
    for kept in ("p-aaaaaaaaaa", "p-bbbbbbbbbb", "p-x-dddddddddd"):
        assert (data / "models" / kept).is_dir() and (data / "engines" / kept).is_dir(), kept
    # a version started within the limit stays, held or not
    assert versions.collect(lease(data, "p-aaaaaaaaaa"), data / "engines", idle_s=3600) == []


def test_a_server_holds_its_lease_for_its_life_through_exec(data):
    """The serving container execs its server with the lock inherited: while it runs its version is kept."""
    server = subprocess.Popen([*MODULE, "--lease", str(lease(data, "p-bbbbbbbbbb")), "--", "sleep", "30"])
    try:
        deadline = time.monotonic() + 20
        while server.poll() is None and time.monotonic() < deadline:
            probe = os.open(lease(data, "p-bbbbbbbbbb"), os.O_RDONLY)
            try:
                fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released by the close below
            except BlockingIOError:
                break  # the server (exec'd in the wrapper's place) holds it
            finally:
                os.close(probe)
            time.sleep(0.1)
        removed = versions.collect(lease(data, "p-aaaaaaaaaa"), data / "engines", 0, now=time.time() + 10)
        assert "p-bbbbbbbbbb" not in removed and (data / "models" / "p-bbbbbbbbbb").is_dir()
    finally:
        server.kill()
        server.wait()
    assert "p-bbbbbbbbbb" in versions.collect(lease(data, "p-aaaaaaaaaa"), data / "engines", 0,
                                              now=time.time() + 10)


def test_a_serving_container_whose_lease_was_collected_says_what_to_do(tmp_path):
    result = subprocess.run([*MODULE, "--lease", str(tmp_path / "models" / "p-aaaaaaaaaa.lease"), "--", "true"],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 1 and "delete this pod" in result.stderr


def test_a_step_past_its_deadline_is_stopped_with_a_message(tmp_path):
    """Review M2: an in-pod build has no Job deadline; a hung one must not hold the pod's GPUs for good."""
    started = time.monotonic()
    result = subprocess.run([*MODULE, "--lease", str(tmp_path / "models" / "p-aaaaaaaaaa.lease"), "--touch",
                             "--deadline", "1", "--", "sleep", "60"], capture_output=True, text=True, timeout=30)
    assert result.returncode == versions.DEADLINE_EXIT and time.monotonic() - started < 20
    assert "ran past its deadline of 1 s" in result.stderr
    ok = subprocess.run([*MODULE, "--lease", str(tmp_path / "models" / "p-aaaaaaaaaa.lease"), "--touch",
                         "--deadline", "30", "--", "sh", "-c", "exit 3"], timeout=30)
    assert ok.returncode == 3
