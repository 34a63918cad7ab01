"""Where a pipeline's pods run and how much they get: container resources (Guaranteed QoS on GPUs), the GPU product
an engine was built for, and the data volume (access mode, storage class, size).

Access mode: a ReadWriteOnce volume is attached to one node at a time, which is what kind's local-path and the
usual cloud default classes offer. It serves wherever one node holds every pod that mounts the volume; those pods
then get a required pod affinity to each other on the node (kubernetes.io/hostname), so a scaled-out replica or a
rebuild lands beside the volume instead of hanging on a second attach. A group that spans nodes (a LeaderWorkerSet)
needs ReadWriteMany, which only some classes (NFS, CephFS, cloud file stores) provide.
"""

from __future__ import annotations

import math
import re

from specdeploy.deploy import k8s_base as base
from specdeploy.deploy.sizing import PodSize
from specdeploy.errors import SpecdeployError
from specdeploy.spec.pipeline import PipelineSpec

GPU_RESOURCE = "nvidia.com/gpu"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"  # set on each GPU node by NVIDIA's gpu-feature-discovery
READ_WRITE_ONCE, READ_WRITE_MANY = "ReadWriteOnce", "ReadWriteMany"
ACCESS_MODES = (READ_WRITE_ONCE, READ_WRITE_MANY)
LABEL_VALUE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$")
HOSTNAME = "kubernetes.io/hostname"


def resources(cpu_request: int | str, cpu_limit: int | str, memory_request_gib: int, memory_limit_gib: int,
              gpus: int) -> dict:
    """Requests and limits; with GPUs, requests equal limits (Guaranteed QoS: the last to be evicted or OOM-killed
    under node pressure, and the CPU manager's static policy can pin its cores)."""
    if gpus:
        cpu_request, memory_request_gib = cpu_limit, memory_limit_gib
    requests = {"cpu": str(cpu_request), "memory": f"{memory_request_gib}Gi"}
    limits = {"cpu": str(cpu_limit), "memory": f"{memory_limit_gib}Gi"}
    if gpus:
        requests[GPU_RESOURCE] = limits[GPU_RESOURCE] = str(gpus)
    return {"requests": requests, "limits": limits}


def server_resources(size: PodSize) -> dict:
    return resources(size.cpu_request, size.cpu_limit, size.memory_request_gib, size.memory_limit_gib, size.gpus)


def checked_gpu_product(pipeline: PipelineSpec, product: str | None) -> str | None:
    """The node label value an engine is built for and served on; required for a TensorRT-LLM pipeline, whose
    engines only run on the GPU type they were built on."""
    if pipeline.backend.kind != "trtllm":
        return None
    if product is None:
        raise SpecdeployError(f"pipeline {pipeline.name}: a TensorRT-LLM engine runs only on the GPU type it was "
                              f"built on; pass --gpu-product, the {GPU_PRODUCT_LABEL} label of your GPU nodes (e.g. "
                              f"NVIDIA-H100-80GB-HBM3; kubectl get nodes -L {GPU_PRODUCT_LABEL})")
    if not LABEL_VALUE.match(product):
        raise SpecdeployError(f"--gpu-product {product!r}: not a label value (up to 63 letters, digits, '.', '_' "
                              f"or '-', starting and ending with a letter or digit)")
    return product


def scheduling(size: PodSize, gpu_product: str | None, colocate: dict | None) -> dict:
    """Pod spec fields: GPU tolerations and the GPU product's node affinity; `colocate`, the labels of the pods that
    must share the volume's node (ReadWriteOnce), else None."""
    spec: dict = {}
    if size.gpus:
        spec["tolerations"] = [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]
    affinity: dict = {}
    if gpu_product is not None:
        affinity["nodeAffinity"] = {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": GPU_PRODUCT_LABEL, "operator": "In", "values": [gpu_product]}]}]}}
    if colocate is not None:
        affinity["podAffinity"] = {"requiredDuringSchedulingIgnoredDuringExecution": [
            {"labelSelector": {"matchLabels": colocate}, "topologyKey": HOSTNAME}]}
    if affinity:
        spec["affinity"] = affinity
    return spec


def access_mode(size: PodSize, requested: str | None) -> str:
    """ReadWriteOnce where one node can hold every pod, ReadWriteMany where a group spans nodes (refused with
    ReadWriteOnce, which could never attach to the second node)."""
    if requested is not None and requested not in ACCESS_MODES:
        raise SpecdeployError(f"--access-mode {requested!r}: allowed {', '.join(ACCESS_MODES)}")
    if size.nodes > 1:
        if requested == READ_WRITE_ONCE:
            raise SpecdeployError(f"--access-mode {READ_WRITE_ONCE}: each serving group spans {size.nodes} nodes, "
                                  f"which all mount the engines; give a storage class with {READ_WRITE_MANY} "
                                  f"(--storage-class; NFS, CephFS or a cloud file store)")
        return READ_WRITE_MANY
    return requested or READ_WRITE_ONCE


def check_shared_class(mode: str, storage_class: str | None) -> None:
    """SpecdeployError for a ReadWriteMany volume on the cluster's default class: few default classes provide it
    (EBS allows ReadWriteMany for block volumes only, kubernetes-sigs/aws-ebs-csi-driver#2178), and such a claim
    stays Pending with every pod that mounts it."""
    if mode == READ_WRITE_MANY and storage_class is None:
        raise SpecdeployError(f"the data volume must be {READ_WRITE_MANY} (every node of a group, or every replica, "
                              f"mounts the engines), which the default storage class rarely provides: name one that "
                              f"does with --storage-class (NFS, CephFS, EFS, Filestore, Azure Files)")


def volume_gib(size: PodSize, build_copies: int) -> int:
    """The data volume: what a build writes (`build_copies` × the weights: engines, TensorRT-LLM checkpoints and any
    exported Hugging Face copy), twice, because a new version builds into folders of its own beside the running one
    (deploy/k8s_versions.py), plus a tenth for logs and the model repository's small files."""
    floor = 50 if size.gpus else 10
    return max(floor, math.ceil(2 * build_copies * size.weights_gib * 1.1))


def data_claim_patch(size: PodSize, mode: str, storage_class: str | None, build_copies: int) -> dict:
    spec: dict = {"accessModes": [mode], "resources": {"requests": {"storage": f"{volume_gib(size, build_copies)}Gi"}}}
    if storage_class is not None:
        spec["storageClassName"] = storage_class
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": base.DATA_CLAIM}, "spec": spec}
