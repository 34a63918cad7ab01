"""The GPU overlays' pods cannot deadlock on their node's GPUs: a small simulation of the scheduler and the
Deployment controller over the rendered objects (issue 49, the review's N1).

What it models: a ReadWriteOnce volume puts every pod of the pipeline on one node of `gpus_per_node` GPUs. A pod
asks for the larger of its init containers' GPUs and its containers' sum (how Kubernetes computes a pod's effective
request). The Deployment is applied before any build Job, so its pods are queued first; the scheduler places any
queued pod that fits. A pod whose init container waits for the build Job is Ready only after the Job ran; a pod that
builds in its own init containers is Ready once placed. The controller keeps at most replicas + maxSurge pods and at
least replicas - maxUnavailable available, removing an old pod only when that holds. The rollout must end with every
replica new and Ready, from each replica count the autoscaler allows, and from none (the first apply).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from helpers.rendered_overlays import K8S, OVERLAYS, REPO, containers, kustomize, objects, one

from specdeploy.build.trtllm.plan import build_workers
from specdeploy.deploy.k8s import write_overlay
from specdeploy.deploy.overlay_options import OverlayOptions
from specdeploy.spec.pipeline import load_pipeline

GPU = "nvidia.com/gpu"
SINGLE_NODE_GPU = [name for name in OVERLAYS if name.startswith("gpu-")]


def gpus(container: dict) -> int:
    return int(container.get("resources", {}).get("requests", {}).get(GPU, 0))


def pod_gpus(template: dict) -> int:
    spec = template["spec"]
    return max([0, *(gpus(c) for c in spec.get("initContainers", []))] + [sum(gpus(c) for c in spec["containers"])])


@dataclass
class Pod:
    kind: str  # old, new or job
    gpus: int
    placed: bool = False
    ready: bool = False


@dataclass
class Node:
    gpus: int
    pods: list[Pod] = field(default_factory=list)

    def free(self) -> int:
        return self.gpus - sum(p.gpus for p in self.pods if p.placed)


def rollout_completes(documents: list[dict], gpus_per_node: int, replicas: int, first: bool) -> bool:
    deployment = one(documents, "Deployment")
    template = deployment["spec"]["template"]
    strategy = deployment["spec"]["strategy"]["rollingUpdate"]
    surge, unavailable = int(strategy["maxSurge"]), int(strategy["maxUnavailable"])
    need = pod_gpus(template)
    waits = any(c["name"] == "wait-for-repository" for c in template["spec"].get("initContainers", []))
    jobs = objects(documents, "Job")
    node = Node(gpus_per_node, [] if first else [Pod("old", need, True, True) for _ in range(replicas)])
    job = Pod("job", pod_gpus(jobs[0]["spec"]["template"])) if jobs else None
    job_done = job is None
    for step in range(100):
        old = [p for p in node.pods if p.kind == "old"]
        new = [p for p in node.pods if p.kind == "new"]
        available = sum(p.ready for p in old + new)
        for pod in old:  # scale the old set down as far as maxUnavailable allows
            if available - pod.ready >= replicas - unavailable:
                node.pods.remove(pod)
                available -= pod.ready
        old = [p for p in node.pods if p.kind == "old"]
        while len(new) < replicas and len(old) + len(new) < replicas + surge:
            new.append(Pod("new", need))
            node.pods.append(new[-1])
        if step == 0 and job is not None:  # applied after the Deployment: queued behind its pods
            node.pods.append(job)
        for pod in node.pods:
            if not pod.placed and pod.gpus <= node.free():
                pod.placed = True
        if job is not None and job.placed and not job_done:
            job_done = True
            node.pods.remove(job)
        for pod in new:
            pod.ready = pod.ready or (pod.placed and (job_done or not waits))
        if not old and len(new) == replicas and all(p.ready for p in new):
            return True
    return False


def max_replicas(documents: list[dict]) -> int:
    autoscalers = objects(documents, "HorizontalPodAutoscaler")
    return autoscalers[0]["spec"]["maxReplicas"] if autoscalers else 1


def check_no_deadlock(documents: list[dict], gpus_per_node: int, name: str) -> None:
    for replicas in range(1, max_replicas(documents) + 1):
        assert rollout_completes(documents, gpus_per_node, replicas, first=False), \
            f"{name}: a rollout from {replicas} replica(s) never ends on a {gpus_per_node}-GPU node"
    assert rollout_completes(documents, gpus_per_node, 1, first=True), f"{name}: the first rollout never ends"


@pytest.mark.parametrize("name", SINGLE_NODE_GPU)
def test_no_rollout_of_a_committed_gpu_overlay_deadlocks_on_an_8_gpu_node(name):
    check_no_deadlock(kustomize(K8S / "overlays" / name), 8, name)


@pytest.mark.parametrize("gpus_per_node", [4, 8])
def test_no_rollout_deadlocks_where_two_pods_do_not_fit_the_node(tmp_path, gpus_per_node):
    """The 70B tp4 pipeline on 4-GPU nodes (one pod fills the node) and 8-GPU nodes (two pods do)."""
    pipeline, options = OVERLAYS["gpu-draft-target"]
    folder = write_overlay(REPO / pipeline, tmp_path, OverlayOptions(gpus_per_node=gpus_per_node, **options))
    check_no_deadlock(kustomize(folder), gpus_per_node, f"gpu-draft-target on {gpus_per_node} GPUs")


def test_the_simulation_finds_the_deadlock_of_a_build_job_beside_waiting_pods():
    """Today's shape before issue 49: the serving pod waits for a Job of tp GPUs; on 8 GPUs the old and the surge
    pod of a tp4 pipeline leave none for it."""
    def container(name: str, count: int) -> dict:
        return {"name": name, "resources": {"requests": {GPU: str(count)}}}

    documents = [
        {"kind": "Deployment", "spec": {"strategy": {"rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
                                        "template": {"spec": {"initContainers": [container("wait-for-repository", 0)],
                                                              "containers": [container("triton", 4)]}}}},
        {"kind": "Job", "spec": {"template": {"spec": {"containers": [container("package", 4)]}}}}]
    assert not rollout_completes(documents, 8, 1, first=False)
    assert rollout_completes(documents, 12, 1, first=False)


@pytest.mark.parametrize("name", SINGLE_NODE_GPU)
def test_the_build_holds_as_many_gpus_as_trtllm_build_has_workers(name):
    documents = kustomize(K8S / "overlays" / name)
    pipeline = load_pipeline(REPO / OVERLAYS[name][0])
    template = one(documents, "Deployment")["spec"]["template"]
    steps = {c["name"]: c for c in containers(template)}
    assert "wait-for-repository" not in steps and not objects(documents, "Job"), name
    workers = build_workers(pipeline.backend.settings)
    assert gpus(steps["build"]) == gpus(steps["package"]) == workers, name
    # the serving container reads the volume the steps write
    mounts = {m["mountPath"]: m for m in steps["triton"]["volumeMounts"]}
    assert mounts["/var/lib/specdeploy"].get("readOnly") is True
