"""`make image`: build/Dockerfile.cpu built with podman on a machine that has no image registry and no Docker daemon.

Podman runs here as root from Debian's packages, with the vfs storage driver, cgroupfs and runc (crun and the
default ulimits are refused in this sandbox, hence build/podman/containers.conf). The base image is bootstrapped
locally with mmdebstrap (Debian bookworm, Python 3.11, as the public python:3.11-slim-bookworm the Dockerfile names
by default) and passed as PYTHON_IMAGE, so the same Dockerfile builds here and elsewhere. Package installs inside
the build reach the registries as the host's pip does: its settings (`pip config list`: CA bundle, find-links,
extra indexes, where the local CPU build of torch lies) become PIP_* build arguments, and what they name on disk is
mounted read-only into the build.

    python scripts/podman_image.py cpu          # the CPU image, as the CPU overlay names it
    python scripts/podman_image.py gpu-layer    # build/Dockerfile.gpu's specdeploy layer on a stand-in base
    python scripts/podman_image.py podman ...   # podman itself, with this machine's flags
    python scripts/podman_image.py tested       # exit 0 when the image test passed on the current inputs

Stdlib only: tests/deploy/test_image_runs.py imports it to run the image the same way.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlparse

REPO = Path(__file__).resolve().parents[1]
CONTAINERS_CONF = REPO / "build" / "podman" / "containers.conf"
PODMAN_FLAGS = ["--storage-driver", "vfs", "--cgroup-manager", "cgroupfs", "--runtime", "runc"]
DEBIAN_PACKAGES = ["podman", "runc", "mmdebstrap"]
CPU_IMAGE = "localhost/specdeploy-cpu:0.1.0"  # the CPU overlay's image (specdeploy k8s --name cpu)
# What the public python:3.11-slim-bookworm offers that the image uses: `python` (bookworm names the interpreter
# python3 unless python-is-python3 is installed), venv, CA certificates, and the shared libpython3.11.so.1.0 that
# tritonserver's Python backend stub links against (without it every Python model fails to load).
BASE_PACKAGES = ["python3", "python3-venv", "python-is-python3", "libpython3.11", "ca-certificates"]
CA_BUNDLE_IN_BUILD = "/run/host-ca-bundle.crt"  # the host's CA bundle, mounted for the build's RUN steps only
# build/Dockerfile.gpu's base cannot be pulled or run here: its layer is built on a stand-in (see that Dockerfile)
STANDIN_DOCKERFILE = "build/podman/Dockerfile.trtllm-standin"
GPU_LAYER_IMAGE = "localhost/specdeploy-gpu:0.1.0-standin"
# What the image test proves: when none of these changed since its last passing run (the digest in TESTED, which
# `make image-test` writes and whoever ran it commits), .ci/run skips it; otherwise it builds the images and runs
# the test (about 10 minutes). Everything the images copy (.dockerignore, specdeploy/, pipelines/), every overlay
# the test reads, and the test's own code.
IMAGE_INPUTS = [".dockerignore", "build", "scripts/podman_image.py", "k8s/base", "k8s/overlays", "specdeploy",
                "pipelines", "setup.cfg", "pyproject.toml", "Makefile", "tests/conftest.py",
                "tests/helpers", "tests/deploy/test_image_runs.py"]
TESTED = REPO / "build" / "podman" / "image-test.sha256"


def short_digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


# The local bases are tagged by their definitions, so a changed definition builds a new one instead of reusing it.
BASE_IMAGE = f"localhost/specdeploy-base:bookworm-{short_digest(' '.join(BASE_PACKAGES))}"
TRTLLM_STANDIN = f"localhost/specdeploy-trtllm-standin:26.04-{short_digest((REPO / STANDIN_DOCKERFILE).read_text())}"


def podman_environment() -> dict[str, str]:
    return {**os.environ, "CONTAINERS_CONF": str(CONTAINERS_CONF)}


def podman(*args: str, check: bool = True, capture: bool = False, **kwargs) -> subprocess.CompletedProcess:
    """podman with this machine's storage, cgroup manager and runtime."""
    return subprocess.run(["podman", *PODMAN_FLAGS, *args], env=podman_environment(), check=check, text=True,
                          capture_output=capture, **kwargs)


def missing_tools() -> list[str]:
    return [name for name in DEBIAN_PACKAGES if shutil.which(name) is None]


def ensure_tools() -> None:
    """Install podman, runc and mmdebstrap from Debian's packages when they are missing (as root)."""
    missing = missing_tools()
    if not missing:
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise SystemExit(f"make image needs {', '.join(missing)}: install them (Debian: apt-get install -y "
                         f"{' '.join(DEBIAN_PACKAGES)}) or run as root on a Debian machine")
    print(f"installing {' '.join(DEBIAN_PACKAGES)} from Debian's packages", flush=True)
    quiet = {"env": {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}, "check": True, "stdout": subprocess.DEVNULL}
    subprocess.run(["apt-get", "update", "-qq"], **quiet)
    subprocess.run(["apt-get", "install", "-y", "-qq", *DEBIAN_PACKAGES], **quiet)


def image_exists(name: str) -> bool:
    return podman("image", "exists", name, check=False).returncode == 0


def ensure_base() -> None:
    """The bookworm base image, bootstrapped with mmdebstrap from apt's configured sources (about 20 s)."""
    if image_exists(BASE_IMAGE):
        return
    print(f"bootstrapping {BASE_IMAGE} (mmdebstrap: {', '.join(BASE_PACKAGES)})", flush=True)
    with tempfile.TemporaryDirectory() as work:
        tarball = Path(work) / "base.tar"
        subprocess.run(["mmdebstrap", "--quiet", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}",
                        "bookworm", str(tarball)], check=True)
        podman("import", str(tarball), BASE_IMAGE, stdout=subprocess.DEVNULL)


PIP_SCOPES = (":env:", "install", "global")  # the sections `pip install` reads, the first that sets a key winning


def host_pip_settings() -> dict[str, str]:
    """The settings `pip install` takes from the host's configuration."""
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                            check=True).stdout
    return pip_settings(listed)


def pip_settings(listed: str) -> dict[str, str]:
    """`pip config list`'s lines (scope.key=a Python literal) as one value per key: environment variables over the
    install section over the global one; a value of several lines becomes one of several words."""
    found: dict[tuple[int, str], str] = {}
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        scope, _, name = key.partition(".")
        if scope in PIP_SCOPES:
            found[PIP_SCOPES.index(scope), name] = " ".join(str(ast.literal_eval(value)).split())
    return {name: value for (_, name), value in sorted(found.items(), reverse=True)}


def local_folder(location: str) -> str | None:
    """The folder on this machine that a find-links or index location needs, or None for a remote one. A PEP 503
    index in a folder named simple links to files beside it, so the folder above it is what must be reachable."""
    path = urlparse(location).path if location.startswith("file:") else location
    if "://" in location and not location.startswith("file:"):
        return None
    folder = Path(path.rstrip("/"))
    return str(folder.parent if folder.name == "simple" else folder)


def build_arguments(settings: dict[str, str]) -> list[str]:
    """podman build's --build-arg and --volume options that give the build the host's pip settings."""
    options, folders = [], set()
    for setting in ("index-url", "extra-index-url", "find-links"):
        if value := settings.get(setting):
            options += ["--build-arg", f"PIP_{setting.upper().replace('-', '_')}={value}"]
            folders |= {f for location in value.split() if (f := local_folder(location))}
    if cert := settings.get("cert"):
        options += ["--build-arg", f"PIP_CERT={CA_BUNDLE_IN_BUILD}", "--volume", f"{cert}:{CA_BUNDLE_IN_BUILD}:ro"]
    for folder in sorted(folders):
        options += ["--volume", f"{folder}:{folder}:ro"]
    return options


def build(dockerfile: str, tag: str, base_argument: str, base: str) -> None:
    started = time.monotonic()
    # --layers=false: vfs copies the whole filesystem at every committed layer, so only the final image is kept
    podman("build", "--layers=false", "--network", "host", "--file", dockerfile, "--tag", tag,
           "--build-arg", f"{base_argument}={base}", *build_arguments(host_pip_settings()), str(REPO))
    size = int(podman("image", "inspect", "--format", "{{.Size}}", tag, capture=True).stdout)
    print(f"built {tag}: {size / 1e9:.2f} GB in {(time.monotonic() - started) / 60:.1f} min", flush=True)


def inputs_digest(root: Path = REPO, inputs: list[str] = IMAGE_INPUTS) -> str:
    """sha256 over the tracked files under the inputs (paths and contents, as the working tree has them)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--", *inputs], cwd=root, capture_output=True,
                            check=True).stdout.decode().split("\0")
    digest = hashlib.sha256()
    for name in sorted(n for n in listed if n and root / n != TESTED):
        digest.update(name.encode() + b"\0" + (root / name).read_bytes() + b"\0")
    return digest.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["cpu", "gpu-layer", "podman", "digest", "tested"])
    parser.add_argument("arguments", nargs=argparse.REMAINDER)
    options = parser.parse_args()
    if options.what == "digest":  # make image-test records it, taken before the test, once the test passed
        print(inputs_digest())
        return
    if options.what == "tested":  # exit status 0 when the image test passed on these very inputs
        recorded = TESTED.read_text().strip() if TESTED.is_file() else ""
        raise SystemExit(0 if recorded == inputs_digest() else 1)
    ensure_tools()
    if options.what == "podman":
        raise SystemExit(podman(*options.arguments, check=False).returncode)
    ensure_base()
    if options.what == "cpu":
        build("build/Dockerfile.cpu", CPU_IMAGE, "PYTHON_IMAGE", BASE_IMAGE)
    else:
        if not image_exists(TRTLLM_STANDIN):
            build(STANDIN_DOCKERFILE, TRTLLM_STANDIN, "PYTHON_IMAGE", BASE_IMAGE)
        build("build/Dockerfile.gpu", GPU_LAYER_IMAGE, "TRITON_IMAGE", TRTLLM_STANDIN)


if __name__ == "__main__":
    main()
