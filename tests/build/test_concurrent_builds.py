"""Two processes writing one output on one volume (two build Jobs, a Job's retry beside a pod still running, two
`specdeploy build` or `package` runs): they take turns through build_lock, the second finds the first's output
up to date, and neither deletes the other's work.

The writers are forked processes going through the real engine_paths functions, with a slow step inside the staging
directory. The variant `pid-named` is the staging before this fix (`.<name>.partial-<pid>`, rmtree'd first, no lock)
with both processes given the pid 1 that every Kubernetes container has: the same tests must fail for it (xfail
strict), which shows they can tell a broken staging from a working one.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext, redirect_stderr
from pathlib import Path

import pytest
from helpers.pipelines import tiny_pipeline

from specdeploy.spec.engine_paths import build_lock, leftovers, staging_dir, write_json

PARTS = 8  # files each writer writes, one every SECONDS / PARTS
SECONDS = 1.0
FORK = multiprocessing.get_context("fork")


@contextmanager
def pid_named_staging_dir(final: Path) -> Iterator[Path]:
    """The staging before this fix, in a Kubernetes container (pid 1): the same path for every process."""
    staging = final.parent / f".{final.name}.partial-1"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    old = final.parent / f".{final.name}.old-1"
    if final.exists():
        final.rename(old)
    staging.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def unlocked(final: Path, timeout_s: float) -> nullcontext:
    return nullcontext()


STAGINGS = {"unique+locked": (build_lock, staging_dir), "pid-named": (unlocked, pid_named_staging_dir)}
VARIANTS = [pytest.param("unique+locked"),
            pytest.param("pid-named", marks=pytest.mark.xfail(strict=True, reason="the staging before the fix: the "
                                                                                  "second writer deletes the first's"))]


def write_slowly(variant: str, final: Path, writer: str, staging_started, results, stderr: Path,
                 skip_if_done: bool, timeout_s: float) -> None:
    """One writer process: under the lock, skip if `final` is complete already (skip_if_done), else stage PARTS
    files slowly and a `done` marker written last. Reports ("built" | "skipped" | "failed: <message>")."""
    lock, staging = STAGINGS[variant]
    outcome = "built"
    with open(stderr, "w") as err, redirect_stderr(err):
        try:
            with lock(final, timeout_s):
                if skip_if_done and (final / "done").is_file():
                    outcome = "skipped"
                else:
                    with staging(final) as directory:
                        staging_started.set()
                        for part in range(PARTS):
                            (directory / f"part{part}").write_text(writer)
                            time.sleep(SECONDS / PARTS)
                        (directory / "done").write_text(writer)
        except Exception as error:  # reported to the test, which names what failed
            outcome = f"failed: {type(error).__name__}: {error}"
    results.put((writer, outcome))


def race(tmp_path: Path, variant: str, skip_if_done: bool = False,
         second_timeout_s: float = 30.0) -> tuple[Path, dict[str, str], dict[str, str]]:
    """Writer "first" starts; once it is inside its staging directory, writer "second" starts on the same output.
    Returns the output, each writer's outcome and each writer's stderr."""
    final = tmp_path / "engines" / "tiny"
    results = FORK.Queue()
    processes = {}
    for writer, timeout_s in (("first", 30.0), ("second", second_timeout_s)):
        started = FORK.Event()
        process = FORK.Process(target=write_slowly, args=(variant, final, writer, started, results,
                                                          tmp_path / f"{writer}.stderr", skip_if_done, timeout_s))
        process.start()
        processes[writer] = process
        if writer == "first":
            assert started.wait(10), "the first writer never started staging"
    outcomes = dict(results.get(timeout=30) for _ in processes)
    for process in processes.values():
        process.join(10)
        assert process.exitcode == 0
    stderr = {writer: (tmp_path / f"{writer}.stderr").read_text() for writer in processes}
    return final, outcomes, stderr


def assert_complete(final: Path, writer: str) -> None:
    """`final` holds exactly one writer's full output, and nothing of an interrupted write lies beside it."""
    assert sorted(p.name for p in final.iterdir()) == sorted(["done", *(f"part{i}" for i in range(PARTS))])
    assert {p.read_text() for p in final.iterdir()} == {writer}
    assert leftovers(final) == []


@pytest.mark.parametrize("variant", VARIANTS)
def test_two_writers_take_turns_and_both_finish(tmp_path, variant):
    final, outcomes, stderr = race(tmp_path, variant)
    assert outcomes == {"first": "built", "second": "built"}
    assert_complete(final, "second")  # the second wrote after the first, and replaced its output whole
    lock = final.parent / ".tiny.lock"
    assert f"waiting up to 30 s for its lock {lock}" in stderr["second"]
    assert " pid " in stderr["second"]  # who holds it: the first writer's host and pid
    assert stderr["second"].count("\n") == 1 and stderr["first"] == ""


@pytest.mark.parametrize("variant", VARIANTS)
def test_second_writer_skips_what_the_first_made_up_to_date(tmp_path, variant):
    final, outcomes, _ = race(tmp_path, variant, skip_if_done=True)
    assert outcomes == {"first": "built", "second": "skipped"}
    assert_complete(final, "first")


def test_second_writer_refuses_after_its_timeout_naming_the_lock(tmp_path):
    final, outcomes, stderr = race(tmp_path, "unique+locked", second_timeout_s=0.2)
    assert outcomes["first"] == "built"
    assert outcomes["second"].startswith(f"failed: SpecdeployError: {final.parent / '.tiny.lock'}: still locked "
                                         f"after 0.2 s by another build of {final}")
    assert "waiting up to 0.2 s" in stderr["second"]
    assert_complete(final, "first")


def build_tiny(pipeline_path: Path, engines: Path, slow: bool, inside_staging, at_lock, results,
               stderr: Path) -> None:
    """One `specdeploy build` of the tiny pipeline in a spawned process, through the real torch builder. The slow
    one pauses before its manifest (patched in its own process only) until the other has come to the lock and
    waited a while; the other starts its build once the slow one is inside its staging directory."""
    from specdeploy.build import torch_engine as builder
    from specdeploy.workflows import load_spec

    if slow:
        write_manifest = builder.write_manifest

        def write_manifest_slowly(staging: Path, inputs: dict, started: float) -> None:
            inside_staging.set()
            assert at_lock.wait(60), "the other build never started"
            time.sleep(SECONDS)  # the other hashes its tiny sources and reaches the lock well within this
            write_manifest(staging, inputs, started)

        builder.write_manifest = write_manifest_slowly
    else:
        assert inside_staging.wait(60), "the slow build never reached its manifest"
        at_lock.set()
    with open(stderr, "w") as err, redirect_stderr(err):
        result = builder.build(load_spec(pipeline_path), engines, quiet=True)
    results.put(("slow" if slow else "fast", result.built))


def test_real_build_waits_then_finds_the_engine_up_to_date(tmp_path, tiny_checkpoints):
    """Without the lock the second build would check before the first wrote its manifest and build again."""
    pipeline = tiny_pipeline(tmp_path, "tiny", tiny_checkpoints["target"], draft=tiny_checkpoints["draft"])
    engines = tmp_path / "engines"
    spawn = multiprocessing.get_context("spawn")  # not fork: the parent's torch thread pools do not survive it
    results, inside_staging, at_lock = spawn.Queue(), spawn.Event(), spawn.Event()
    processes = [spawn.Process(target=build_tiny, args=(pipeline, engines, slow, inside_staging, at_lock, results,
                                                        tmp_path / f"{slow}.stderr")) for slow in (True, False)]
    for process in processes:
        process.start()
    outcomes = dict(results.get(timeout=60) for _ in processes)
    for process in processes:
        process.join(10)
        assert process.exitcode == 0
    assert outcomes == {"slow": True, "fast": False}
    assert "waiting up to" in (tmp_path / "False.stderr").read_text()  # it came while the slow one built
    assert (engines / "tiny" / "build_manifest.json").is_file() and leftovers(engines / "tiny") == []


def test_holder_removes_leftovers_of_its_own_output_only(tmp_path):
    engines = tmp_path / "engines"
    final = engines / "tiny"
    crashed = [engines / ".tiny.partial-1", engines / ".tiny.partial-0a1b2c", engines / ".tiny.old-1"]
    for directory in crashed:
        (directory / "target").mkdir(parents=True)
    others = [engines / ".tiny-moe.partial-1", engines / ".tinier.partial-1"]  # other outputs' (maybe live) staging
    for directory in others:
        directory.mkdir()
    assert leftovers(final) == sorted(crashed)
    with build_lock(final):
        assert leftovers(final) == []
        with staging_dir(final) as staging:
            (staging / "done").write_text("x")
    assert all(directory.is_dir() for directory in others)
    assert (final / "done").is_file() and leftovers(final) == []


def test_outputs_get_the_umask_not_private_modes(tmp_path):
    """Staged under a unique name, the output still gets the modes of any directory (mkdtemp's would be 0700)."""
    umask = os.umask(0o022)
    try:
        final = tmp_path / "tiny"
        with build_lock(final), staging_dir(final) as staging:
            write_json(staging / "manifest.json", {"a": 1})
        assert final.stat().st_mode & 0o777 == 0o755
        assert (final / "manifest.json").stat().st_mode & 0o777 == 0o644
        assert sorted(p.name for p in final.iterdir()) == ["manifest.json"]  # no temporary file left
    finally:
        os.umask(umask)


def test_lock_is_free_again_after_a_failed_write(tmp_path):
    final = tmp_path / "tiny"
    with pytest.raises(RuntimeError), build_lock(final), staging_dir(final):
        raise RuntimeError("the build failed")
    assert not final.exists() and leftovers(final) == []
    with build_lock(final, timeout_s=0):  # taken at once: the failure released it
        pass


def test_no_wait_message_without_contention(tmp_path, capsys):
    with build_lock(tmp_path / "tiny"):
        pass
    assert capsys.readouterr().err == ""



def test_a_folder_that_cannot_be_written_is_one_error_naming_it(tmp_path, monkeypatch):
    """A read-only file system (the image run --read-only without a volume) or a folder of another user: one
    SpecdeployError naming the folder and what points engines and repositories elsewhere, not an OSError (the
    image test runs it for real, read-only, as uid 10001)."""
    import errno

    from specdeploy.errors import SpecdeployError

    def read_only(self, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(self))

    monkeypatch.setattr(Path, "mkdir", read_only)
    expected = r"engines: cannot write here \(Read-only file system\).*SPECDEPLOY_REPOSITORIES.*-v DIR"
    with pytest.raises(SpecdeployError, match=expected):
        with build_lock(tmp_path / "engines" / "tiny"):
            pass


def test_default_repositories_follow_the_environment(tmp_path, monkeypatch):
    from specdeploy.spec.engine_paths import MODEL_REPOSITORIES_DIR, model_repositories_dir

    monkeypatch.delenv("SPECDEPLOY_REPOSITORIES", raising=False)
    assert model_repositories_dir() == MODEL_REPOSITORIES_DIR
    monkeypatch.setenv("SPECDEPLOY_REPOSITORIES", str(tmp_path / "repos"))
    assert model_repositories_dir() == tmp_path / "repos"
