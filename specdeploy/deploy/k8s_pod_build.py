"""A single-node GPU pipeline builds in its serving pod: `specdeploy build` and `specdeploy package` are that pod's
init containers, on a GPU the pod already holds, and there is no build Job.

Why not a Job: on a ReadWriteOnce volume the Job and every serving pod share one node. A serving pod held its GPUs
while it waited for the Job, the Deployment was applied first, and a rollout surges one pod more, so whenever the
old pod, the surge pod and the Job together asked for more GPUs than the node has (12 of 8 for a tp4 pipeline) the
Job stayed Pending for good and the new pods waited for it for good. A build that runs inside the pod it serves
waits for nothing but that pod's own GPUs. Triton's autoscaling tutorial once did the same: at triton-inference-server/
tutorials@d459ddd (Deployment/Kubernetes/TensorRT-LLM_Autoscaling_and_Load_Balancing/chart/templates/deployment.yaml)
its init container ran `server.py init` with all of the pod's GPUs onto per-node hostPath engines; since 9d016f2 its
README builds the engines by hand onto shared storage, and `server.py init` no longer builds (review M8).

The build asks for build_workers GPUs, the number trtllm-build's --workers is given (plan.build_workers): with one
worker it builds every rank on GPU `rank % workers`, so one GPU is what it uses. The pod's GPUs are the larger of an
init container's and the serving containers' sum, so the pod still holds tp × pp and the build adds none. Builds of
concurrent pods (a surge pod, a scaled-out replica) take the per-output lock (spec/engine_paths.py) and skip what
is built, so the second waits for the first and then reuses its engines.

The rollout then needs only room for the pods themselves on the volume's node: `rollout` gives maxSurge 1 where the
node holds one pod more than the autoscaler's maximum, else replaces the pod in place (maxSurge 0, maxUnavailable 1).
In place, every rollout that rebuilds (a changed pipeline, image or GPU product) takes the only replica down for the
whole build and load, hours for a 70B model (review M1): `in_place_note` says so when the overlay is written.
"""

from __future__ import annotations

from dataclasses import dataclass

from specdeploy.build.trtllm.plan import build_workers
from specdeploy.deploy import k8s_base as base
from specdeploy.deploy import k8s_placement as placement
from specdeploy.deploy.k8s_versions import Version
from specdeploy.deploy.sizing import PodSize
from specdeploy.spec.pipeline import PipelineSpec


@dataclass(frozen=True)
class Rollout:
    max_surge: int
    max_unavailable: int
    max_replicas: int


def builds_in_pod(size: PodSize, access_mode: str) -> bool:
    """Whether the serving pod builds: GPUs on one node and a volume that ties every pod to that node."""
    return size.gpus > 0 and size.nodes == 1 and access_mode == placement.READ_WRITE_ONCE


def build_gpus(pipeline: PipelineSpec) -> int:
    """The GPUs a build holds: trtllm-build's --workers (one per worker; the conversions use at most one)."""
    return build_workers(pipeline.backend.settings) if pipeline.backend.kind == "trtllm" else 0


def rollout(size: PodSize, gpus_per_node: int) -> Rollout:
    """Surge and the autoscaler's maximum such that every pod a rollout or a scale-out creates fits the node beside
    the ones it waits for: at most `slots` pods of size.gpus fit, the maximum leaves one slot for the surge pod."""
    slots = gpus_per_node // size.gpus
    if slots >= 2:
        return Rollout(max_surge=1, max_unavailable=0, max_replicas=min(base.MAX_REPLICAS, slots - 1))
    return Rollout(max_surge=0, max_unavailable=1, max_replicas=1)


def in_place_note(size: PodSize, gpus_per_node: int, outage_s: int) -> str | None:
    """What the overlay's user must know where one pod fills the node (maxSurge 0), else None. `outage_s`: the
    build's deadline and the engines' load, the longest the only replica is down."""
    if rollout(size, gpus_per_node).max_surge:
        return None
    return (f"one serving pod ({size.gpus} GPUs) fills a {gpus_per_node}-GPU node, so the pod is replaced in place: "
            f"every rollout that rebuilds (a changed pipeline, image or GPU product) takes the only replica down for "
            f"its build and load, up to {outage_s} s ({outage_s / 3600:.1f} h) here. To stay up: nodes with room "
            f"for two pods (--gpus-per-node), or a ReadWriteMany volume (--access-mode ReadWriteMany "
            f"--storage-class ...), where a build Job builds beside the serving replica and the rollout surges onto "
            f"a spare node (docs/kubernetes.md)")


def init_containers(pipeline: PipelineSpec, package: list[str], step_resources: dict, mounts: list[dict],
                    version: Version, deadline_s: int) -> list[dict]:
    """build then package, each a full container (the base's pod has only the wait this replaces), each holding the
    version's lease (pods/versions.py: the build also collects superseded versions) and each under a deadline of its
    own (review M2: a Deployment's pod has no activeDeadlineSeconds, and a hung trtllm-build would hold the pod's
    GPUs for good): the build's, and for packaging (hard links and small files) the base Job's hour."""
    pipeline_file = f"{base.PIPELINE_DIR}/{base.PIPELINE_KEY}"

    def step(name: str, prefix: list[str], arguments: list[str]) -> dict:
        return {"name": name, "image": base.IMAGE, "imagePullPolicy": "IfNotPresent",
                "command": [*prefix, "specdeploy"], "args": arguments, "env": version.environment(),
                "volumeMounts": [*base.mounts(), *mounts], "securityContext": base.container_security(),
                "resources": step_resources}

    return [step("build", version.building(True, deadline_s), ["build", pipeline_file]),
            step("package", version.building(False, base.BUILD_DEADLINE_S), package)]


def pod_build_patch(containers: list[dict], volumes: list[dict]) -> dict:
    """The pod spec patch: the wait (and its token) removed, the steps added, the data volume writable for them (the
    caller gives the serving container a read-only mount), the checkpoint and scratch volumes."""
    data = {"name": "data", "persistentVolumeClaim": {"claimName": base.DATA_CLAIM, "readOnly": False}}
    return {"initContainers": [{"name": "wait-for-repository", "$patch": "delete"}, *containers],
            "volumes": [data, {"name": base.API_TOKEN_VOLUME, "$patch": "delete"}, *volumes]}


def read_only_data_mount() -> dict:
    """The serving container's mount of the data volume, which only the build steps write."""
    return {"name": "data", "mountPath": base.DATA_DIR, "readOnly": True}
