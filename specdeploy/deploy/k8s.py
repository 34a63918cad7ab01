"""`specdeploy k8s PIPELINE.yaml --output DIR`: a kustomize overlay for a pipeline, on the shared base.

DIR/base/ is the base (deploy/k8s_base.py, the same for every pipeline), DIR/overlays/<name>/ the pipeline's
overlay, DIR/monitoring/ the Prometheus adapter's values. The overlay carries the pipeline itself (a ConfigMap),
the image, the build Job's and the server's commands (deploy/k8s_commands.py), resources sized from the model
(deploy/sizing.py, deploy/build_memory.py), GPUs from the parallelism, placement and the data volume
(deploy/k8s_placement.py), and the PrometheusRule with the pipeline's break-even acceptance. Every object's name is
prefixed with the pipeline's name and every selector includes its instance label, so several pipelines share a
namespace. A model wider than one node is a LeaderWorkerSet (deploy/k8s_multinode.py).

`checked_overlay` refuses what the cluster could not run, `overlay_files` turns the checked overlay into every file
as data (so tests compare documents without writing), and `write_overlay` writes them.
"""

from __future__ import annotations

import functools
import hashlib
import math
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import yaml

import specdeploy
from specdeploy.build.trtllm.upstream import IMAGE_APP_DIR
from specdeploy.deploy import k8s_base as base
from specdeploy.deploy import k8s_placement as placement
from specdeploy.deploy import k8s_pod_build as pod_build
from specdeploy.deploy.build_memory import build_memory_gib
from specdeploy.deploy.k8s_commands import openai_container, openai_port, server_command, under_launcher
from specdeploy.deploy.k8s_monitoring import adapter_values, prometheus_rule, release_labels
from specdeploy.deploy.k8s_multinode import GROUP_NAME, LAUNCHER_ACCOUNT, group_disruption_budget, leader_worker_set
from specdeploy.deploy.k8s_versions import Version, version_key
from specdeploy.deploy.overlay_options import OverlayOptions
from specdeploy.deploy.sizing import PodSize, check_node_span, engine_load_seconds, pod_size
from specdeploy.errors import SpecdeployError
from specdeploy.pods.launch import STOP_GRACE_S
from specdeploy.serve.tritonserver import EXIT_MARGIN, KILL_MARGIN
from specdeploy.spec.pipeline import PipelineSpec, load_pipeline
from specdeploy.speculative.speedup import break_even_tokens_per_step

CHECKPOINTS_CLAIM = "specdeploy-checkpoints"  # the user's volume holding the checkpoints a pipeline names
CPU_IMAGE = "specdeploy-cpu"  # the CPU overlay's default: loaded into a local cluster (kind, minikube), never pulled
KUSTOMIZATION = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization"}
INSTANCE_LABEL = "app.kubernetes.io/instance"
LONGEST_NAME = f"{base.BUILD_JOB}-0123456789"  # the build Job, named after the pipeline's hash
DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
STARTUP_PERIOD_S = 15  # a GPU server's startup probe period
MONITORING_KINDS = ("PodMonitor", "HorizontalPodAutoscaler")  # base objects left out by --no-monitoring


class PlainDumper(yaml.SafeDumper):
    """Writes a value shared between two places twice, never as a YAML anchor and alias."""

    def ignore_aliases(self, data) -> bool:
        return True


@dataclass(frozen=True)
class Manifest:
    """One YAML file of the output: its documents, and the comment above them."""

    documents: dict | list[dict]
    comment: str = ""

    def text(self) -> str:
        documents = self.documents if isinstance(self.documents, list) else [self.documents]
        header = "".join(f"# {line}\n" for line in self.comment.splitlines())
        return header + "---\n".join(yaml.dump(d, Dumper=PlainDumper, sort_keys=False, width=120)
                                      for d in documents)


def base_files() -> dict[str, Manifest]:
    """The shared base, by file name."""
    objects = base.base_objects()
    files = {file: Manifest(document) for file, document in objects.items()}
    files["kustomization.yaml"] = Manifest({**KUSTOMIZATION, "resources": list(objects)},
                                           "The shared base (written by `specdeploy k8s`; overlays patch it by name).")
    return files


def adapter_files(options: OverlayOptions) -> dict[str, Manifest]:
    """The monitoring folder: the Prometheus adapter's Helm values, by file name."""
    return {"prometheus-adapter-values.yaml": Manifest(
        adapter_values(options.prometheus_namespace),
        "helm install prometheus-adapter prometheus-community/prometheus-adapter -n monitoring "
        "-f prometheus-adapter-values.yaml\nServes the triton:queue_compute:ratio recording rule and the scheduler's "
        "waiting requests to the HPA as pods metrics.")}


def volume_files(pipeline: PipelineSpec) -> dict[str, str]:
    """The files a build reads from volumes, by pipeline key: checkpoints not embedded in a package, and the
    method's trained parts (a heads file, a head's or an adapter's folder)."""
    files = {}
    if pipeline.target.checkpoint.source != "package":
        files["target.checkpoint.path"] = pipeline.target.checkpoint.path
    draft = pipeline.speculation.draft
    if draft is not None and draft.checkpoint is not None and draft.checkpoint.source != "package":
        files["speculation.draft.checkpoint.path"] = draft.checkpoint.path
    for source in pipeline.speculation.trained_sources:
        files[source.key] = source.path
    return files


def checked_pipeline(path: Path) -> PipelineSpec:
    """The pipeline, refused when the cluster could not read a path it names: the ConfigMap holds the file alone."""
    pipeline = load_pipeline(path)
    for key, file in volume_files(pipeline).items():
        if not Path(file).is_absolute():
            raise SpecdeployError(f"{path}: {key} {file!r} is relative; in the cluster the pipeline is read from a "
                                  f"ConfigMap, so name it by its absolute path on a volume")
    return pipeline


def checkpoint_roots(pipeline: PipelineSpec) -> list[str]:
    """The top directories of the files the build reads from volumes (/models for /models/Llama-3.1-8B)."""
    return sorted({"/" + Path(file).parts[1] for file in volume_files(pipeline).values()})


def target_dimensions(pipeline: PipelineSpec, weights_gib: float | None):
    """The target's ModelConfig when its checkpoint is readable here, else None (then weights_gib is required)."""
    from specdeploy.build.checkpoints import target_config

    try:
        return target_config(pipeline)
    except SpecdeployError:
        if weights_gib is None:
            raise SpecdeployError(f"pipeline {pipeline.name}: its target checkpoint is not readable here, so the "
                                  f"model size is unknown: pass --weights-gib (the weights' size in GiB)") from None
        return None


def break_even_length(pipeline: PipelineSpec, options: OverlayOptions) -> float:
    """gamma × c + v (speculative/speedup.py): below this mean accepted length a speculative step costs more time
    than it yields."""
    cost = options.draft_cost_ratio
    if cost is None:
        cost = 0.1 if pipeline.speculation.draft is not None else 0.0
    return round(break_even_tokens_per_step(pipeline.speculation.num_draft_tokens, cost, options.verify_cost_ratio), 3)


def build_copies(pipeline: PipelineSpec) -> int:
    """How many copies of the weights a build leaves on the volume: the torch engine; or TensorRT-LLM's
    checkpoints and engines, plus the Hugging Face directory where the plan exports one (a derived model); plus,
    where a checkpoint is a GGUF file, its fp32 conversion beside the engines (build/gguf_store.py), counted as one
    more copy (twice a bf16 engine's size, which the volume's rebuild factor covers)."""
    checkpoints = [pipeline.target.checkpoint]
    if pipeline.speculation.draft is not None and pipeline.speculation.draft.checkpoint is not None:
        checkpoints.append(pipeline.speculation.draft.checkpoint)
    converted = int(any(checkpoint.source != "hf_dir" for checkpoint in checkpoints))
    if pipeline.backend.kind == "torch":
        return 1 + converted
    from specdeploy.build.trtllm.plan import build_plan

    exports = {"export target", "export draft", "export dense source"}
    return 2 + converted + any(step.action in exports for step in build_plan(pipeline, Path("/engine")))


def build_deadline_s(pipeline: PipelineSpec, size: PodSize) -> int:
    """The Job's activeDeadlineSeconds: an hour for a torch build (SmolLM2 builds in minutes); for TensorRT-LLM
    two hours plus a minute per GiB of weights (an estimate: conversion and engine build read and write every
    weight a few times), so a hung build does not hold its GPUs forever."""
    if pipeline.backend.kind == "torch":
        return 3600
    return 7200 + 60 * math.ceil(size.weights_gib)


def package_arguments(pipeline: PipelineSpec, repository: str) -> list[str]:
    package = ["package", f"{base.PIPELINE_DIR}/{base.PIPELINE_KEY}", "--output", repository]
    if pipeline.backend.kind == "trtllm":
        package += ["--served-at", repository]
        if pipeline.backend.settings.line == "llm_api":  # Triton's LLM-API model code, from the image's /app
            package += ["--trtllm-source", IMAGE_APP_DIR]
    return package


def build_volumes(pipeline: PipelineSpec) -> tuple[list[dict], list[dict]]:
    """The build steps' extra mounts and the pod's extra volumes: the checkpoints (read-only) and, for TensorRT-LLM,
    a larger /tmp (its builder and the conversions write scratch files)."""
    roots = checkpoint_roots(pipeline)
    mounts = [{"name": f"checkpoints-{i}", "mountPath": root, "readOnly": True} for i, root in enumerate(roots)]
    volumes = [{"name": f"checkpoints-{i}", "persistentVolumeClaim": {
        "claimName": CHECKPOINTS_CLAIM, "readOnly": True}} for i, _ in enumerate(roots)]
    if pipeline.backend.kind == "trtllm":
        volumes.append({"name": "tmp", "emptyDir": {"sizeLimit": "32Gi"}})
    return mounts, volumes


def step_resources(pipeline: PipelineSpec, size: PodSize, memory_gib: int) -> dict:
    """A build step's: the build's memory, and as many GPUs as trtllm-build has workers (pod_build.build_gpus)."""
    return placement.resources(size.cpu_request, size.cpu_limit, memory_gib, memory_gib, pod_build.build_gpus(pipeline))


def build_job_patch(pipeline: PipelineSpec, version: Version, size: PodSize, memory_gib: int,
                    placement_spec: dict) -> dict:
    """The base's Job for this pipeline: its steps hold the version's lease (the build also collects superseded
    versions) and write the version's folders."""
    pipeline_file = f"{base.PIPELINE_DIR}/{base.PIPELINE_KEY}"
    mounts, volumes = build_volumes(pipeline)
    step = {"resources": step_resources(pipeline, size, memory_gib),
            "env": [{"name": "SPECDEPLOY_ENGINES", "value": version.engines},
                    *base.journal_environment(version.repository)], **({"volumeMounts": mounts} if mounts else {})}
    spec = {"initContainers": [{"name": "build", "command": [*version.building(True), *base.step_command("build")],
                                "args": ["build", pipeline_file], **step}],
            "containers": [{"name": "package", "command": [*version.building(False), *base.step_command("package")],
                            "args": package_arguments(pipeline, version.repository), **step}],
            **placement_spec, **({"volumes": volumes} if volumes else {})}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": base.BUILD_JOB},
            "spec": {"activeDeadlineSeconds": build_deadline_s(pipeline, size), "template": {"spec": spec}}}


def server_pod_patch(pipeline: PipelineSpec, version: Version, size: PodSize, options: OverlayOptions,
                     pipeline_hash: str, placement_spec: dict, build_job: str) -> dict:
    """`build_job`: the build Job's name as applied (prefixed), whose status the wait reads. Every container that
    reads the version's repository holds its lease for life (pods/versions.py)."""
    drain = options.longest_generation_s
    repository = version.repository
    command, arguments, env = server_command(pipeline, repository, drain, size)
    container = {"name": "triton", "command": [*version.holding(), *command], "args": arguments,
                 "resources": placement.server_resources(size)}
    # the OpenAI endpoints: `specdeploy serve` runs them in this container; beside a bare tritonserver, a sidecar does,
    # on repositories with the `speculative` model (the llm_api line serves Triton's own llmapi model instead)
    sidecars = []
    if command[0] == "specdeploy":
        container["ports"] = [openai_port()]
    elif pipeline.backend.settings.line == "engine":
        sidecar = openai_container(repository, drain)
        sidecars.append({**sidecar, "command": [*version.holding(), *sidecar["command"]]})
    if env:
        container["env"] = env
    if pipeline.backend.kind == "trtllm":  # loading engines of tens to hundreds of GB from the data volume
        load_s = engine_load_seconds(size, options.volume_read_gibps)
        container["startupProbe"] = base.probe("/v2/health/ready", STARTUP_PERIOD_S,
                                               math.ceil(load_s / STARTUP_PERIOD_S))
    return {"metadata": {"annotations": {"specdeploy.dev/pipeline": pipeline_hash}},
            "spec": {"terminationGracePeriodSeconds": base.PRESTOP_SECONDS + drain + EXIT_MARGIN + KILL_MARGIN
                     + (STOP_GRACE_S if under_launcher(command) else 0),
                     "initContainers": [{"name": "wait-for-repository",
                                         "env": base.wait_environment(repository, build_deadline_s(pipeline, size),
                                                                             build_job)}],
                     "containers": [container, *sidecars],
                     "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{size.shm_gib}Gi"}}],
                     **placement_spec}}


def deployment_patch(pod: dict, progress_deadline_s: int, rollout: pod_build.Rollout | None = None) -> dict:
    """The base's Deployment with the pod, a progress deadline that covers the build (the default 600 s would report
    every rollout that builds as failed: review N11, and M6 for the build Job's overlays) and, with a build in the pod,
    the rollout that fits the node."""
    spec: dict = {"template": pod, "progressDeadlineSeconds": progress_deadline_s}
    if rollout is not None:
        spec["strategy"] = {"rollingUpdate": {"maxSurge": rollout.max_surge,
                                              "maxUnavailable": rollout.max_unavailable}}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": base.SERVER}, "spec": spec}


def with_pod_build(overlay: Overlay, pod: dict) -> dict:
    """The serving pod patch with the build as its init containers (deploy/k8s_pod_build.py)."""
    pipeline = overlay.pipeline
    mounts, volumes = build_volumes(pipeline)
    steps = pod_build.init_containers(pipeline, package_arguments(pipeline, overlay.repository),
                                      step_resources(pipeline, overlay.size, overlay.build_memory_gib), mounts,
                                      overlay.version, build_deadline_s(pipeline, overlay.size))
    patch = pod_build.pod_build_patch(steps, volumes)
    triton = {**pod["spec"]["containers"][0], "volumeMounts": [pod_build.read_only_data_mount()]}
    sidecars = [{**container, "volumeMounts": [pod_build.read_only_data_mount(), {"name": "tmp", "mountPath": "/tmp"}]}
                for container in pod["spec"]["containers"][1:]]
    spec = {**pod["spec"], "initContainers": patch["initContainers"], "containers": [triton, *sidecars],
            "volumes": [*pod["spec"]["volumes"], *patch["volumes"]]}
    return {**pod, "spec": spec}


def image_reference(pipeline: PipelineSpec, image: str | None) -> dict:
    """kustomize's `images` entry for `--image`: repository:tag (a pinned tag) or repository@sha256:digest (what
    production should pin: a tag can be moved, a digest cannot). A GPU cluster's nodes pull their image from a
    registry, so a trtllm pipeline needs `--image` naming one (review N15: a bare default name could not be pulled)."""
    gpu = pipeline.backend.kind == "trtllm"
    if image is None and gpu:
        raise SpecdeployError("--image is required for a trtllm pipeline: GPU nodes pull the serving image from a "
                              "registry. Build build/Dockerfile.gpu, push it where the cluster pulls from, and pass "
                              "--image REGISTRY/specdeploy-gpu@sha256:<digest> (or REGISTRY/specdeploy-gpu:<tag>)")
    reference = image or f"{CPU_IMAGE}:{specdeploy.__version__}"
    if "@" in reference:
        name, _, digest = reference.partition("@")
        if not name or not DIGEST.match(digest):
            raise SpecdeployError(f"--image {reference!r}: a digest reference is repository@sha256:<64 hex digits>")
        entry = {"name": base.IMAGE, "newName": name, "digest": digest}
    else:
        name, _, tag = reference.rpartition(":")
        if not name or "/" in tag:
            raise SpecdeployError(f"--image {reference!r}: give repository:tag (a pinned tag, not latest) or "
                                  f"repository@sha256:digest")
        if tag == "latest":
            raise SpecdeployError(f"--image {reference!r}: the tag latest is refused (pin a version or a digest)")
        entry = {"name": base.IMAGE, "newName": name, "newTag": tag}
    if gpu:
        check_pullable(reference, entry["newName"])
    return entry


def check_pullable(reference: str, name: str) -> None:
    """A name with no registry or namespace in it is Docker Hub's official library (docker.io/library/NAME), where
    no specdeploy image lives: on GPU nodes it could only fail with ErrImagePull."""
    if "/" not in name:
        raise SpecdeployError(f"--image {reference!r}: a trtllm pipeline's image must name the registry the GPU "
                              f"nodes pull from, REGISTRY/{name}; a bare name means Docker Hub's library")


def image_text(entry: dict) -> str:
    return f"{entry['newName']}@{entry['digest']}" if "digest" in entry else f"{entry['newName']}:{entry['newTag']}"


def checked_prefix(pipeline: PipelineSpec, path: Path) -> str:
    """The object names' prefix; a name too long for the Job's pod labels (63 characters) is refused."""
    prefix = f"{pipeline.name}-"
    if len(prefix + LONGEST_NAME) > 63:
        raise SpecdeployError(f"{path}: name {pipeline.name!r} is too long for Kubernetes object names in the "
                              f"overlay (at most {63 - len(LONGEST_NAME) - 1} characters)")
    return prefix


def delete_patch(kind: str, api_version: str, name: str) -> dict:
    return {"$patch": "delete", "apiVersion": api_version, "kind": kind, "metadata": {"name": name}}


def json_patch(kind: str, name: str, operations: list[dict]) -> dict:
    return {"target": {"kind": kind, "name": name}, "patch": yaml.safe_dump(operations)}


@dataclass(frozen=True)
class Overlay:
    """A pipeline's overlay before it is files: the checked pipeline and what its files are written from."""

    path: Path  # the pipeline file as the user named it
    pipeline: PipelineSpec
    options: OverlayOptions
    size: PodSize
    prefix: str  # every object's name prefix
    image: dict  # kustomize's `images` entry
    pipeline_hash: str  # of the pipeline file and the image: a change rolls the servers (and names a new build Job)
    gpu_product: str | None  # the GPU nodes' product label the pods are pinned to
    access_mode: str  # the data volume's
    build_memory_gib: int

    @functools.cached_property
    def build_job_name(self) -> str:
        """Before kustomize's name prefix: named after a hash of the pipeline, the image and the whole Job as written
        (the base's and the overlay's), since a Job's pod template cannot be changed in place (kubernetes review
        N8): another --gpu-product, --weights-gib or version of the Job gets a new Job, not a rejected apply."""
        job = yaml.safe_dump([base.build_job(), overlay_build_job(self)], sort_keys=True)
        digest = hashlib.sha256(f"{self.pipeline_hash}\n{job}".encode()).hexdigest()
        return f"{base.BUILD_JOB}-{digest[:10]}"

    @functools.cached_property
    def version(self) -> Version:
        """This pipeline version's folders and lease on the data volume (deploy/k8s_versions.py): collected once
        unheld for longer than a build, a wait's margin and a load take."""
        idle = build_deadline_s(self.pipeline, self.size) + base.WAIT_MARGIN_S + engine_load_seconds(
            self.size, self.options.volume_read_gibps)
        return Version(f"{self.pipeline.name}-{version_key(self.pipeline_hash, self.gpu_product)}", idle)

    @property
    def repository(self) -> str:
        return self.version.repository

    @property
    def instance(self) -> dict[str, str]:
        return {INSTANCE_LABEL: self.pipeline.name}

    @property
    def folder(self) -> str:
        """The overlay's folder under the output folder."""
        return f"overlays/{self.options.name or self.pipeline.name}"

    @property
    def builds_in_pod(self) -> bool:
        return pod_build.builds_in_pod(self.size, self.access_mode)

    @property
    def progress_deadline_s(self) -> int:
        """How long a rollout may take: the build's deadline (and the wait's margin past a build Job's), then
        loading the engines (the startup probe's allowance)."""
        margin = 0 if self.builds_in_pod else base.WAIT_MARGIN_S
        return build_deadline_s(self.pipeline, self.size) + margin + engine_load_seconds(
            self.size, self.options.volume_read_gibps)

    @property
    def notes(self) -> list[str]:
        """What `specdeploy k8s` says about the overlay beside writing it (and its kustomization's comment)."""
        if not self.builds_in_pod:
            return []
        note = pod_build.in_place_note(self.size, self.options.gpus_per_node, self.progress_deadline_s)
        return [note] if note else []

    @property
    def rollout(self) -> pod_build.Rollout:
        return pod_build.rollout(self.size, self.options.gpus_per_node)

    @property
    def placement(self) -> dict:
        """The pods' scheduling fields. A ReadWriteOnce volume attaches to one node: every pod of this pipeline
        goes to that node."""
        colocate = self.instance if self.access_mode == placement.READ_WRITE_ONCE else None
        return placement.scheduling(self.size, self.gpu_product, colocate)


def checked_overlay(pipeline_path: Path, options: OverlayOptions) -> Overlay:
    """The overlay of the pipeline at `pipeline_path`, refused (SpecdeployError) where the cluster could not run it."""
    pipeline = checked_pipeline(pipeline_path)
    size = pod_size(pipeline, target_dimensions(pipeline, options.weights_gib), options.weights_gib,
                    options.gpus_per_node)
    check_node_span(pipeline, size, options.gpus_per_node, pipeline_path)
    prefix = checked_prefix(pipeline, pipeline_path)
    gpu_product = placement.checked_gpu_product(pipeline, options.gpu_product)
    mode = placement.access_mode(size, options.access_mode)
    placement.check_shared_class(mode, options.storage_class)
    image = image_reference(pipeline, options.image)
    text = pipeline_path.read_text()
    pipeline_hash = hashlib.sha256(f"{text}\n{image_text(image)}".encode()).hexdigest()[:10]
    return Overlay(pipeline_path, pipeline, options, size, prefix, image, pipeline_hash, gpu_product, mode,
                   build_memory_gib(pipeline, size.weights_gib))


def server_files(overlay: Overlay) -> dict[str, Manifest]:
    """The serving pods: the base's Deployment patched, or across nodes a LeaderWorkerSet that replaces it."""
    pod = server_pod_patch(overlay.pipeline, overlay.version, overlay.size, overlay.options, overlay.pipeline_hash,
                           overlay.placement, overlay.prefix + overlay.build_job_name)
    if overlay.builds_in_pod:
        return {"deployment.yaml": Manifest(deployment_patch(with_pod_build(overlay, pod), overlay.progress_deadline_s,
                                                             overlay.rollout))}
    if overlay.size.nodes == 1:
        return {"deployment.yaml": Manifest(deployment_patch(pod, overlay.progress_deadline_s))}
    group = leader_worker_set(pod, overlay.size, image_text(overlay.image), overlay.prefix, overlay.instance,
                              overlay.version)
    return {"leaderworkerset.yaml": Manifest(group),
            "deployment-delete.yaml": Manifest(delete_patch("Deployment", "apps/v1", base.SERVER))}


def monitoring_files(overlay: Overlay) -> dict[str, Manifest]:
    """The PrometheusRule and PodMonitor, or with --no-monitoring the deletion of the base's PodMonitor and HPA."""
    options = overlay.options
    if not options.monitoring:
        return {"monitoring-delete.yaml": Manifest([
            delete_patch("PodMonitor", "monitoring.coreos.com/v1", base.SERVER),
            delete_patch("HorizontalPodAutoscaler", "autoscaling/v2", base.SERVER)])}
    rule = prometheus_rule(break_even_length(overlay.pipeline, options), options.prometheus_release)
    monitor = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor",
               "metadata": {"name": base.SERVER, "labels": release_labels(options.prometheus_release)},
               "spec": {"selector": {"matchLabels": {**base.SERVER_LABELS, **overlay.instance}}}}
    return {"prometheusrule.yaml": Manifest(rule), "podmonitor.yaml": Manifest(monitor)}


def group_patches(overlay: Overlay) -> list[dict]:
    """Across nodes: the base's disruption budget and autoscaler pointed at the LeaderWorkerSet's group."""
    patches = [json_patch("PodDisruptionBudget", base.SERVER, [
        {"op": "replace", "path": "/spec/selector",
         "value": group_disruption_budget(overlay.prefix)["spec"]["selector"]}])]
    if overlay.options.monitoring:
        patches.append(json_patch("HorizontalPodAutoscaler", base.SERVER, [
            {"op": "replace", "path": "/spec/scaleTargetRef",
             "value": {"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet",
                       "name": overlay.prefix + GROUP_NAME}}]))
    return patches


def overlay_build_job(overlay: Overlay) -> dict:
    return build_job_patch(overlay.pipeline, overlay.version, overlay.size, overlay.build_memory_gib,
                           overlay.placement)


def build_status_role(overlay: Overlay) -> list[dict]:
    """What the serving pods' wait may read: the build Job's status, that Job alone (review N3). Bound to the
    account the waiting pods run under; only the wait's container mounts a token (k8s_base.api_token_volume)."""
    job = overlay.prefix + overlay.build_job_name  # kustomize does not prefix resourceNames
    account = LAUNCHER_ACCOUNT if overlay.size.nodes > 1 else base.SERVICE_ACCOUNT  # across nodes the leader waits
    rules = [{"apiGroups": ["batch"], "resources": ["jobs"], "verbs": ["get"], "resourceNames": [job]}]
    return base.bound_role("build-status", rules, account)


def kustomization(overlay: Overlay) -> Manifest:
    """The overlay's kustomization.yaml: the base, the overlay's objects and patches, its names and labels."""
    options, size, multinode = overlay.options, overlay.size, overlay.size.nodes > 1
    resources = ["../../base"]
    patches = [{"path": "deployment-delete.yaml" if multinode else "deployment.yaml"}]
    if overlay.builds_in_pod:
        patches += [{"path": "pvc.yaml"}, {"path": "build-job-delete.yaml"}]
        if options.monitoring:
            patches.append(json_patch("HorizontalPodAutoscaler", base.SERVER, [
                {"op": "replace", "path": "/spec/maxReplicas", "value": overlay.rollout.max_replicas}]))
    else:
        patches += [{"path": "build-job.yaml"}, {"path": "pvc.yaml"},
                    json_patch("Job", base.BUILD_JOB, [{"op": "replace", "path": "/metadata/name",
                                                        "value": overlay.build_job_name}])]
        resources.append("build-status.yaml")
    if options.monitoring:
        resources.append("prometheusrule.yaml")
    patches.append({"path": "podmonitor.yaml" if options.monitoring else "monitoring-delete.yaml"})
    if multinode:
        resources.append("leaderworkerset.yaml")
        patches += group_patches(overlay)
    document = {**KUSTOMIZATION, "namespace": options.namespace, "namePrefix": overlay.prefix,
                "resources": resources, "labels": [{"pairs": overlay.instance, "includeSelectors": True}],
                "configMapGenerator": [{"name": base.PIPELINE_CONFIGMAP, "files": [base.PIPELINE_KEY]}],
                "generatorOptions": {"disableNameSuffixHash": True}, "images": [overlay.image], "patches": patches}
    roots = checkpoint_roots(overlay.pipeline)
    memory_of = "build memory" if overlay.builds_in_pod else "build Job memory"
    builder = "The serving pods' build steps mount" if overlay.builds_in_pod else "The build Job mounts"
    # review M3: a pod mounts its volumes for its life, so in-pod builds keep the claim mounted while they serve
    held = (" for their life (a pod's volumes are mounted for the pod's life): with ReadWriteOnce every pod of every "
            "pipeline that mounts it must share one node, so give it ReadOnlyMany or ReadWriteMany"
            if overlay.builds_in_pod else " while it builds")
    needs = (f"\n{builder} the PersistentVolumeClaim {CHECKPOINTS_CLAIM} (yours, holding the checkpoints) "
             f"at {', '.join(roots)}{held}." if roots else "")
    volume = f"the data volume {overlay.access_mode}" + (
        f" on class {options.storage_class}" if options.storage_class else " on the default storage class")
    notes = "".join(f"\nNote: {note}." for note in overlay.notes)
    return Manifest(document, f"specdeploy k8s {overlay.path.name}: {size.comment()}; {memory_of} "
                              f"{overlay.build_memory_gib} GiB; {volume}.{needs}{notes}\nRender: kubectl kustomize "
                              f"<this folder>; apply: kubectl apply -k <this folder>")


def overlay_files(overlay: Overlay) -> dict[str, Manifest]:
    """Every YAML file `write_overlay` writes for `overlay`, by its path under the output folder: base/,
    monitoring/ and the overlay's folder (the pipeline file's copy aside)."""
    pipeline, size, options = overlay.pipeline, overlay.size, overlay.options
    if overlay.builds_in_pod:  # the serving pods build (deploy/k8s_pod_build.py)
        build = {"build-job-delete.yaml": Manifest([
            delete_patch("Job", "batch/v1", base.BUILD_JOB),
            delete_patch("NetworkPolicy", "networking.k8s.io/v1", base.BUILD_JOB)])}
    else:
        build = {"build-job.yaml": Manifest(overlay_build_job(overlay)),
                 "build-status.yaml": Manifest(build_status_role(overlay))}
    files = {**build,
             "pvc.yaml": Manifest(placement.data_claim_patch(size, overlay.access_mode, options.storage_class,
                                                             build_copies(pipeline))),
             **monitoring_files(overlay), **server_files(overlay), "kustomization.yaml": kustomization(overlay)}
    return {**{f"base/{name}": manifest for name, manifest in base_files().items()},
            **{f"monitoring/{name}": manifest for name, manifest in adapter_files(options).items()},
            **{f"{overlay.folder}/{name}": manifest for name, manifest in files.items()}}


def write_overlay(pipeline_path: Path, output: Path, options: OverlayOptions = OverlayOptions()) -> Path:
    """Write DIR/base, DIR/monitoring and DIR/overlays/<name> for the pipeline (write_checked). Returns the overlay
    directory."""
    return write_checked(checked_overlay(Path(pipeline_path), options), Path(output))


def write_checked(overlay: Overlay, output: Path) -> Path:
    """Write the overlay, its folder replaced whole (no file of an earlier run lingers), with a copy of the pipeline
    file beside its manifests. Returns the overlay directory."""
    folder = output / overlay.folder
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    shutil.copy2(overlay.path, folder / base.PIPELINE_KEY)
    for path, manifest in overlay_files(overlay).items():
        (output / path).parent.mkdir(parents=True, exist_ok=True)
        (output / path).write_text(manifest.text())
    return folder
