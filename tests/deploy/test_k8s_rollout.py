"""Rollouts that rebuild (issue 63: M1, M3, M6 at the end).

Versions on one data volume during a rollout (review W2): a simulation of the pods of two rendered versions of a
single-node GPU overlay, their init steps and servers run against a temporary data volume with the real lease and
collection (pods/versions.py) and stand-ins for `specdeploy build`, `specdeploy package` and the server.

The stand-ins do what the real steps do with their folders: the build rebuilds the engine under its
SPECDEPLOY_ENGINES unless it holds this version's build; the package step repackages its --output from that engine;
the server loads its --model-repository. Each writes or checks the version it belongs to (the pod template's pipeline
annotation). The scenario: version A serves; B rolls out; mid-rollout the autoscaler adds a pod to A's ReplicaSet (the
Deployment controller scales both ReplicaSets); a serving container of each version restarts; B is rolled back to A;
then a day later, B unheld, a start of A collects B. No pod may ever load another version's files, and the revert must
find A's build ready.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers.rendered_overlays import OVERLAYS, REPO, containers, kustomize, one, serving_container

from specdeploy.cli import cli
from specdeploy.deploy import k8s_base as base
from specdeploy.deploy.k8s import Overlay, checked_overlay, write_overlay
from specdeploy.deploy.overlay_options import OverlayOptions
from specdeploy.pods import versions

DAY_S = 24 * 3600


def option(command: list[str], name: str) -> str | None:
    return command[command.index(name) + 1] if name in command else None


@dataclass
class Template:
    """What the simulation reads of a rendered pod template, its paths on the temporary volume."""

    version: str  # the pipeline annotation: what every file this pod writes or loads must carry
    build_lease: Path
    collect_after_s: float
    engines_root: Path  # the version folders' parent, the collector's --engines
    engines: Path  # the build's SPECDEPLOY_ENGINES
    repository: Path  # the package step's --output
    serving_lease: Path
    served: Path  # the server's --model-repository

    @classmethod
    def of(cls, documents: list[dict], data: Path) -> Template:
        def here(path: str) -> Path:
            return Path(path.replace(base.DATA_DIR, str(data)))

        template = one(documents, "Deployment")["spec"]["template"]
        steps = {c["name"]: c for c in containers(template)}
        build, package, triton = steps["build"], steps["package"], serving_container(template)
        env = {item["name"]: item["value"] for item in build["env"] if "value" in item}
        served = next(a for a in triton["args"] if a.startswith("--model-repository=")).partition("=")[2]
        return cls(template["metadata"]["annotations"]["specdeploy.dev/pipeline"],
                   here(option(build["command"], "--lease")), float(option(build["command"], "--collect-after")),
                   here(option(build["command"], "--engines")), here(env["SPECDEPLOY_ENGINES"]),
                   here(option(package["args"], "--output")), here(option(triton["command"], "--lease")), here(served))


@dataclass
class Volume:
    clock: float = field(default_factory=time.time)  # the collector's now: the scenario moves it on
    builds: list[str] = field(default_factory=list)
    loads: list[tuple[str, str]] = field(default_factory=list)  # (pod's version, loaded version)


@dataclass
class Pod:
    template: Template
    volume: Volume
    held: int | None = None

    def start(self) -> None:
        """The init steps (build, then package, each under the lease), then the server."""
        t = self.template
        step = versions.lock_lease(t.build_lease, touch=True)
        try:
            versions.collect(t.build_lease, t.engines_root, t.collect_after_s, now=self.volume.clock)
            manifest = t.engines / "pipeline" / "build_manifest.json"
            if not manifest.is_file() or json.loads(manifest.read_text())["version"] != t.version:
                manifest.parent.mkdir(parents=True, exist_ok=True)
                manifest.write_text(json.dumps({"version": t.version}))
                self.volume.builds.append(t.version)
        finally:
            os.close(step)
        step = versions.lock_lease(t.build_lease, touch=True)
        try:
            t.repository.mkdir(parents=True, exist_ok=True)
            (t.repository / "stamp.json").write_text(manifest.read_text())
        finally:
            os.close(step)
        self.serve()

    def serve(self) -> None:
        """The serving container's start (also after a restart, which reruns no init step): lease, then load."""
        self.stop()
        self.held = versions.lock_lease(self.template.serving_lease, touch=False)
        loaded = json.loads((self.template.served / "stamp.json").read_text())["version"]
        self.volume.loads.append((self.template.version, loaded))

    def stop(self) -> None:
        if self.held is not None:
            os.close(self.held)
            self.held = None


def rendered_versions(tmp_path: Path) -> list[list[dict]]:
    """gpu-medusa rendered for two images: two versions of one pipeline (the Makefile's, and a new specdeploy)."""
    pipeline, options = OVERLAYS["gpu-medusa"]
    return [kustomize(write_overlay(REPO / pipeline, tmp_path / tag, OverlayOptions(
        **{**options, "image": f"registry.example/specdeploy-gpu:{tag}"}))) for tag in ("0.1.0", "0.2.0")]


def test_a_rollout_scaled_mid_way_and_rolled_back_never_loads_another_versions_files(tmp_path):
    data = tmp_path / "data"
    a, b = (Template.of(documents, data) for documents in rendered_versions(tmp_path))
    assert a.version != b.version
    volume = Volume()
    old = [Pod(a, volume) for _ in range(2)]
    for pod in old:
        pod.start()
    surge = Pod(b, volume)  # B rolls out: a surge pod
    surge.start()
    scaled = Pod(a, volume)  # the autoscaler scales A's ReplicaSet too, mid-rollout
    scaled.start()
    old.append(scaled)
    second = Pod(b, volume)
    second.start()
    old.pop(0).stop()  # the rollout retires an A pod
    for pod in (old[0], surge):  # a serving container of each version restarts (liveness): no init step reruns
        pod.serve()
    volume.clock += DAY_S
    reverted = Pod(a, volume)  # rolled back to A, a day on: B is still held by its pods
    reverted.start()
    for pod in (surge, second):
        pod.stop()
    assert b.repository.is_dir(), "a version a pod held was collected"
    volume.clock += DAY_S
    Pod(a, volume).start()  # a later start of A: B, unheld and idle, is collected
    assert all(pod == loaded for pod, loaded in volume.loads), volume.loads
    assert volume.builds == [a.version, b.version], "the revert did not find its earlier build ready"
    assert not b.repository.exists() and not b.engines.exists() and a.repository.is_dir()


# --- rollouts that rebuild (review M1, M6) and the checkpoints claim (M3) -------------------------------------------

def overlay_of(name: str, **changes) -> Overlay:
    pipeline, options = OVERLAYS[name]
    return checked_overlay(REPO / pipeline, OverlayOptions(**{**options, **changes}))


def test_where_one_pod_fills_the_node_the_generator_says_the_only_replica_goes_down(tmp_path):
    """Review M1: 70B tp4 on 4-GPU nodes is replaced in place, so a rollout that rebuilds is an outage of the build
    and the load. The generator says so, with the figure and the alternatives, on stderr and in the kustomization."""
    assert overlay_of("gpu-draft-target").notes == []  # 8-GPU nodes: room for a surge pod
    overlay = overlay_of("gpu-draft-target", gpus_per_node=4)
    [note] = overlay.notes
    assert "only replica down" in note and f"{overlay.progress_deadline_s} s" in note and "ReadWriteMany" in note
    pipeline, options = OVERLAYS["gpu-draft-target"]
    arguments = ["k8s", str(REPO / pipeline), "--output", str(tmp_path), "--gpus-per-node", "4", "--weights-gib",
                 str(options["weights_gib"]), "--gpu-product", options["gpu_product"], "--image", options["image"]]
    result = CliRunner().invoke(cli, arguments)
    assert result.exit_code == 0, result.output
    assert "note: one serving pod (4 GPUs) fills a 4-GPU node" in result.stderr
    comment = (tmp_path / "overlays" / "llama70b-draft-target" / "kustomization.yaml").read_text()
    assert "# Note: one serving pod (4 GPUs) fills a 4-GPU node" in comment


@pytest.mark.parametrize("name, changes", [(name, {}) for name in OVERLAYS if name != "multinode"]
                         + [("gpu-medusa", {"access_mode": "ReadWriteMany", "storage_class": "nfs-client"})])
def test_every_deployment_has_a_progress_deadline_past_its_build_and_load(tmp_path, name, changes):
    """Review M6 (and N11): the default 600 s reports every rollout that builds as failed. In-pod builds and build
    Job overlays alike (a ReadWriteMany single-node GPU overlay has a Job) allow the build, the wait and the load."""
    pipeline, options = OVERLAYS[name]
    documents = kustomize(write_overlay(REPO / pipeline, tmp_path, OverlayOptions(**{**options, **changes})))
    deployment = one(documents, "Deployment")
    jobs = [job["spec"]["activeDeadlineSeconds"] for job in documents if job["kind"] == "Job"]
    build_s = jobs[0] + base.WAIT_MARGIN_S if jobs else int(option(
        containers(deployment["spec"]["template"])[0]["command"], "--deadline"))
    assert deployment["spec"]["progressDeadlineSeconds"] > build_s + 600, name


def test_the_kustomization_says_which_access_mode_the_checkpoints_claim_needs(tmp_path):
    """Review M3: in-pod builds mount specdeploy-checkpoints for the pod's life (a pod's volumes are the pod's), so a
    ReadWriteOnce claim would pin every pipeline that mounts it to one node; a build Job holds it only while it
    builds."""
    in_pod = (REPO / "k8s" / "overlays" / "gpu-medusa" / "kustomization.yaml").read_text()
    assert "specdeploy-checkpoints" in in_pod and "ReadOnlyMany or ReadWriteMany" in in_pod
    assert "while it builds" in (REPO / "k8s" / "overlays" / "multinode" / "kustomization.yaml").read_text()
