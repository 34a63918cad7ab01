"""Where things live: the engines root, an engine directory and the files in it, the default model repository.

An engine directory `engines/<pipeline name>/` holds one folder per component (`target/`, `draft/`), the
validated pipeline it was built from (`pipeline.json`, which every later stage re-parses) and the build manifest,
written last, whose presence marks the engine complete. For serving.policy.gamma_cap: measured, `specdeploy build`
then adds `measured_policy.json`: the gamma cap it measured for this engine on this machine (a rebuild measures it
again; `bench --measure-gamma-cap` measures it again on the bench's prompts), and for
speculation.early_exit.exit_layer: measured, `measured_exit_layer.json` (tune/exit_layer.py).

Beside an engine (and a packaged model repository): `.<name>.lock`, which a build holds while it writes (it stays),
and while one writes, `.<name>.partial-<random>`, the staging directory renamed into place at the end.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import secrets
import shutil
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

from specdeploy.errors import SpecdeployError
from specdeploy.spec.pipeline import PipelineSpec, load_pipeline

ENGINES_DIR = Path("engines")  # the default root of engines/<name>/ ($SPECDEPLOY_ENGINES overrides it in the CLI)
MODEL_REPOSITORIES_DIR = Path("model_repository")  # the default root of `specdeploy package` outputs
REPOSITORIES_VARIABLE = "SPECDEPLOY_REPOSITORIES"  # overrides MODEL_REPOSITORIES_DIR (the CPU image sets both roots)
PIPELINE_FILE = "pipeline.json"
MANIFEST_FILE = "build_manifest.json"
MEASURED_POLICY_FILE = "measured_policy.json"
# speculation.early_exit.exit_layer: measured: the exit layer `specdeploy build` picked on this machine
MEASURED_EXIT_FILE = "measured_exit_layer.json"
# How long a build waits for another build of the same output before refusing: longer than any build we know takes
# (a TensorRT-LLM build of a 405B target takes hours), short enough that a Job waiting on a stuck one ends.
LOCK_TIMEOUT_S = 6 * 3600.0
LOCK_POLL_S = 0.5


def engine_path(engines_root: Path, pipeline: PipelineSpec) -> Path:
    """engines_root/<name>, refused unless it is a directory directly inside the root (not a link elsewhere): a
    build replaces and removes this path, and must never reach anything outside the engine it builds."""
    root = Path(engines_root)
    path = root / pipeline.name
    if path.resolve().parent != root.resolve():
        raise SpecdeployError(f"{path}: an engine must be a directory directly inside {root}, not a link elsewhere")
    return path


def directory_bytes(directory: Path) -> int:
    """The bytes of every file under `directory`."""
    return sum(p.stat().st_size for p in Path(directory).rglob("*") if p.is_file())


def check_engine(directory: Path) -> Path:
    """`directory` if it holds a complete engine; otherwise an error saying how to get one."""
    directory = Path(directory)
    if not (directory / MANIFEST_FILE).is_file():
        raise SpecdeployError(f"{directory}: not a complete engine (no {MANIFEST_FILE}); run specdeploy build")
    return directory


def engine_pipeline(directory: Path) -> PipelineSpec:
    """The validated pipeline an engine was built from, a gamma cap of "measured" replaced by the engine's
    measurement (None while it has none)."""
    pipeline = load_pipeline(check_engine(directory) / PIPELINE_FILE)
    if getattr(pipeline.speculation.settings, "exit_layer", None) == "measured":
        layer = measured_exit_layer(directory)
        if layer is not None:
            pipeline = pipeline.with_exit_layer(layer)
    if pipeline.serving.policy.gamma_cap != "measured":
        return pipeline
    return pipeline.with_gamma_cap(measured_gamma_cap(directory))


def measured_exit_layer(directory: Path) -> int | None:
    """The early-exit layer `specdeploy build` measured into the engine at `directory`, None if none was."""
    return measured_integer(Path(directory) / MEASURED_EXIT_FILE, "exit_layer", "a measured exit layer", 1)


def measured_gamma_cap(directory: Path) -> int | None:
    """The gamma cap measured into the engine at `directory` (by build or bench --measure-gamma-cap), None if none
    was."""
    return measured_integer(Path(directory) / MEASURED_POLICY_FILE, "gamma_cap", "a measured policy", 0)


def measured_integer(path: Path, key: str, what: str, minimum: int) -> int | None:
    """`key` of the measurement file at `path` (an integer ≥ minimum), None when there is no such file; an error
    saying how to measure it again when the file is not what a build writes."""
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text())[key]
    except (ValueError, KeyError, TypeError):
        raise SpecdeployError(f"{path}: not {what} (no {key}); delete it and rerun specdeploy build, which "
                              f"measures it again") from None
    if type(value) is not int or value < minimum:
        raise SpecdeployError(f"{path}: {key} must be an integer ≥ {minimum}, got {value!r}")
    return value


def write_json(path: Path, data: object) -> None:
    """Write JSON so that a reader never sees a half-written file (a temporary file renamed into place)."""
    partial = unique_sibling(Path(path), "partial")
    try:
        with open(partial, "x") as file:  # "x": never shares a temporary file with another writer
            file.write(json.dumps(data, indent=2))
        partial.replace(path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def save_engine_pipeline(directory: Path, pipeline: PipelineSpec) -> None:
    """Save the pipeline with absolute checkpoint paths, so the copy means the same wherever it is read."""
    write_json(Path(directory) / PIPELINE_FILE, pipeline.resolved().to_dict())


def unique_sibling(path: Path, kind: str) -> Path:
    """A hidden name beside `path` that no other process uses: `.<name>.<kind>-<random>`. Not the pid, which is 1 in
    every Kubernetes container, so two build Jobs on one volume would share it."""
    return path.parent / f".{path.name}.{kind}-{secrets.token_hex(6)}"


@contextmanager
def staging_dir(final: Path) -> Iterator[Path]:
    """A hidden directory beside `final` (on its file system, so the rename into place is atomic) that replaces it
    on success and disappears on failure. Take build_lock(final) around it: the replacement is not safe against
    another process replacing `final` at the same time."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    # Not tempfile.mkdtemp: its directory is private (0700) and would become the output's mode once renamed;
    # mkdir applies the umask like any directory the build writes, and fails rather than share a name.
    staging = unique_sibling(final, "partial")
    staging.mkdir()
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    old = unique_sibling(final, "old")
    if final.exists():
        final.rename(old)
    staging.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def leftovers(final: Path) -> list[Path]:
    """What interrupted writes of `final` left beside it: staging directories and replaced outputs."""
    final = Path(final)
    prefixes = (f".{final.name}.partial-", f".{final.name}.old-")
    return sorted(path for path in final.parent.iterdir() if path.name.startswith(prefixes))


def try_lock(file: TextIO) -> bool:
    try:
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def model_repositories_dir() -> Path:
    """The root of default model repositories (<root>/<pipeline name>): $SPECDEPLOY_REPOSITORIES, else
    ./model_repository."""
    return Path(os.environ.get(REPOSITORIES_VARIABLE) or MODEL_REPOSITORIES_DIR)


def open_in_writable_folder(path: Path) -> TextIO:
    """`path` opened to append (created, with its folder, if needed); a folder that cannot be written (permissions,
    a read-only file system) becomes one SpecdeployError naming it and what points the engines and repositories
    elsewhere, not a traceback."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return open(path, "a+")
    except OSError as exc:
        if exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
        raise SpecdeployError(
            f"{path.parent.resolve()}: cannot write here ({exc.strerror}); engines and model repositories need a "
            f"writable folder: set SPECDEPLOY_ENGINES and {REPOSITORIES_VARIABLE} (or --engines-dir, --output) to "
            f"one, or in the image mount a writable volume at /var/lib/specdeploy (podman run -v "
            f"DIR:/var/lib/specdeploy)") from None


@contextmanager
def build_lock(final: Path, timeout_s: float = LOCK_TIMEOUT_S) -> Iterator[None]:
    """Hold the lock of `final` (the file `.<name>.lock` beside it) while checking whether it is up to date and
    writing it, so that two builds of one output (two Jobs, a Job's retry beside a pod still running, two commands
    on one shared volume) take turns and the second finds the first's output. A second build waits, saying so once
    on stderr, and after timeout_s refuses with a SpecdeployError naming the lock file. Holding the lock, it removes
    the leftovers of interrupted writes of `final`: no live build can own them.

    flock: the kernel releases it when its holder dies, however it dies. Linux NFS clients implement flock as POSIX
    byte-range locks on the whole file, so it also holds across nodes on NFSv4 (and NFSv3 with lockd, not with
    `nolock`). The lock file stays: removing it while another process waits on it would let a third lock a new
    file of the same name."""
    final = Path(final)
    path = final.parent / f".{final.name}.lock"
    deadline = time.monotonic() + timeout_s
    with open_in_writable_folder(path) as lock:  # a+: creates the file, never truncates what the holder wrote
        if not try_lock(lock):
            holder = path.read_text().strip() or "another process"
            print(f"{final}: another build is writing it ({holder}); waiting up to {timeout_s:g} s for its lock "
                  f"{path}", file=sys.stderr, flush=True)
            while not try_lock(lock):
                if time.monotonic() >= deadline:
                    raise SpecdeployError(f"{path}: still locked after {timeout_s:g} s by another build of "
                                          f"{final} ({path.read_text().strip() or 'holder unknown'}); let it "
                                          f"finish or stop it, then run again")
                time.sleep(min(LOCK_POLL_S, max(deadline - time.monotonic(), 0.0)))
        try:
            lock.truncate(0)
            lock.write(f"{socket.gethostname()} pid {os.getpid()} since "
                       f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}\n")
            lock.flush()
            os.fsync(lock.fileno())  # a waiter on another NFS client reads it from the server
            for leftover in leftovers(final):
                if leftover.is_dir() and not leftover.is_symlink():
                    shutil.rmtree(leftover, ignore_errors=True)
                else:
                    leftover.unlink(missing_ok=True)
            yield
        finally:
            lock.truncate(0)
            fcntl.flock(lock, fcntl.LOCK_UN)
