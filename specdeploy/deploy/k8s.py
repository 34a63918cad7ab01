"""`specdeploy k8s PIPELINE.yaml --output DIR`: a kustomize overlay for a pipeline, on the shared base.

DIR/base/ is the base (deploy/k8s_base.py, the same for every pipeline), DIR/overlays/<name>/ the pipeline's
overlay, DIR/monitoring/ the Prometheus adapter's values. The overlay carries the pipeline itself (a ConfigMap),
the image, the build Job's and the server's commands, resources sized from the model (deploy/sizing.py), GPUs from
the parallelism and the PrometheusRule with the pipeline's break-even acceptance.

Serving, by backend:
- torch: `specdeploy serve` on the packaged repository (drains on SIGTERM), CPUs only.
- trtllm on one node: the image's tritonserver. Two tensorrtllm models (draft and target) or a world size above 1
  run in TensorRT-LLM's orchestrator mode (TRTLLM_ORCHESTRATOR=1 under `mpirun -n 1`, which spawns one worker per
  GPU), as upstream's launch script does with --multi-model.
- trtllm across nodes (tp × pp > --gpus-per-node): a LeaderWorkerSet; the leader's mpirun starts one tritonserver
  per rank on its group's pods through `kubectl exec` (the kubessh agent of Triton's multi-node tutorials); only
  rank 0 serves. Orchestrator mode is single-node, so a draft-target pipeline (two engines) cannot span nodes.
"""

from __future__ import annotations

import hashlib
import shutil
from dataclasses import dataclass
from pathlib import Path

import yaml

import specdeploy
from specdeploy.deploy import k8s_base as base
from specdeploy.deploy.k8s_monitoring import adapter_values, prometheus_rule
from specdeploy.deploy.sizing import PodSize, pod_size
from specdeploy.errors import SpecdeployError
from specdeploy.pipeline import PipelineSpec, load_pipeline

EXIT_MARGIN = 10  # seconds tritonserver's exit timeout exceeds the drain (triton/server.py's margin)
GPU_RESOURCE = "nvidia.com/gpu"
CHECKPOINTS_CLAIM = "specdeploy-checkpoints"  # the user's volume holding the checkpoints a pipeline names
DEFAULT_IMAGES = {"torch": "specdeploy-cpu", "trtllm": "specdeploy-gpu"}
KUSTOMIZATION = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization"}


@dataclass(frozen=True)
class OverlayOptions:
    name: str | None = None  # the overlay's folder (default: the pipeline's name)
    image: str | None = None  # repository[:tag] (default: specdeploy-cpu / -gpu at this version)
    namespace: str = "specdeploy"
    weights_gib: float | None = None  # the model's weights, when its checkpoint is not readable here
    gpus_per_node: int = 8
    longest_generation_s: int = 120  # the drain: running requests get this long after SIGTERM
    draft_cost_ratio: float | None = None  # c (default: 0.1 for a draft model, 0 for heads and n-grams)
    verify_cost_ratio: float = 1.1  # v


class PlainDumper(yaml.SafeDumper):
    """Writes a value shared between two places twice, never as a YAML anchor and alias."""

    def ignore_aliases(self, data) -> bool:
        return True


def dump(path: Path, documents: dict | list[dict], comment: str = "") -> None:
    documents = documents if isinstance(documents, list) else [documents]
    header = "".join(f"# {line}\n" for line in comment.splitlines())
    path.write_text(header + "---\n".join(yaml.dump(d, Dumper=PlainDumper, sort_keys=False, width=120)
                                          for d in documents))


def write_base(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    objects = base.base_objects()
    for file, document in objects.items():
        dump(directory / file, document)
    dump(directory / "kustomization.yaml", {**KUSTOMIZATION, "resources": list(objects)},
         "The shared base (written by `specdeploy k8s`; overlays patch it by name).")


def volume_files(pipeline: PipelineSpec) -> dict[str, str]:
    """The files a build reads from volumes, by pipeline key: checkpoints not embedded in a package, Medusa heads."""
    files = {}
    if pipeline.target.checkpoint.source != "package":
        files["target.checkpoint.path"] = pipeline.target.checkpoint.path
    draft = pipeline.speculation.draft
    if draft is not None and draft.checkpoint is not None and draft.checkpoint.source != "package":
        files["speculation.draft.checkpoint.path"] = draft.checkpoint.path
    if pipeline.speculation.method == "medusa":
        files["speculation.medusa.heads"] = pipeline.speculation.medusa.heads
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
    from specdeploy.builders.checkpoints import target_config

    try:
        return target_config(pipeline)
    except SpecdeployError:
        if weights_gib is None:
            raise SpecdeployError(f"pipeline {pipeline.name}: its target checkpoint is not readable here, so the "
                                  f"model size is unknown: pass --weights-gib (the weights' size in GiB)") from None
        return None


def resources(size: PodSize) -> dict:
    requests = {"cpu": str(size.cpu_request), "memory": f"{size.memory_request_gib}Gi"}
    limits = {"cpu": str(size.cpu_limit), "memory": f"{size.memory_limit_gib}Gi"}
    if size.gpus:
        requests[GPU_RESOURCE] = limits[GPU_RESOURCE] = str(size.gpus)
    return {"requests": requests, "limits": limits}


def triton_arguments(repository: str, drain_s: int, rank: int = 0, load: list[str] | None = None) -> list[str]:
    """One tritonserver's flags. Ranks above 0 of a multi-node group load only the engines and open no endpoint."""
    arguments = [f"--model-repository={repository}", "--disable-auto-complete-config",
                 f"--backend-config=python,shm-region-prefix-name=prefix{rank}_",
                 f"--exit-timeout-secs={drain_s + EXIT_MARGIN}"]
    if rank == 0:
        return [*arguments, *(f"--{name}-port={port}" for name, port in base.PORTS.items()),
                "--allow-metrics=true", "--allow-gpu-metrics=true"]
    return [*arguments, "--allow-http=false", "--allow-grpc=false", "--allow-metrics=false",
            "--model-control-mode=explicit", *(f"--load-model={name}" for name in load or [])]


def orchestrator_arguments(gpus: int) -> list[str]:
    """The orchestrating tritonserver runs no engine (the executor workers it spawns hold the GPUs), so it keeps
    no pinned or CUDA memory pool and no peer access on them, as upstream's launch script does with --multi-model
    (triton_backend/scripts/launch_triton_server.py, add_multi_model_config; tensorrtllm_backend 7970847f "Avoid
    Triton using GPU memory in orchestrator mode")."""
    return ["--pinned-memory-pool-byte-size=0", "--enable-peer-access=false",
            *(f"--cuda-memory-pool-byte-size={gpu}:0" for gpu in range(gpus))]


def engine_models(pipeline: PipelineSpec) -> list[str]:
    from specdeploy.triton.repository import trtllm_engines

    return list(trtllm_engines(pipeline))


def server_command(pipeline: PipelineSpec, repository: str, drain_s: int, size: PodSize) -> tuple[list, list, list]:
    """(command, args, extra env) of the serving container (the leader's, across nodes)."""
    if pipeline.backend.kind == "torch":
        return (["specdeploy"], ["serve", "--model-repository", repository, "--address", "0.0.0.0",
                                 "--drain-timeout", str(drain_s)], [])
    models = engine_models(pipeline)
    if size.nodes == 1 and size.gpus == 1 and len(models) == 1:
        return ["tritonserver"], triton_arguments(repository, drain_s), []
    if size.nodes == 1:
        arguments = [*triton_arguments(repository, drain_s), *orchestrator_arguments(size.gpus)]
        return (["mpirun"], ["--allow-run-as-root", "-n", "1", "tritonserver", *arguments],
                [{"name": "TRTLLM_ORCHESTRATOR", "value": "1"}])
    hosts = ",".join(["$(POD_NAME)", *(f"$(POD_NAME)-{i}" for i in range(1, size.nodes))])
    arguments = ["--allow-run-as-root", "-mca", "plm_rsh_agent", "kubessh", "-np", str(size.gpus * size.nodes),
                 "--host", ",".join(f"{host}:{size.gpus}" for host in hosts.split(","))]
    for rank in range(size.gpus * size.nodes):
        arguments += [":"] if rank else []
        arguments += ["-n", "1", "tritonserver", *triton_arguments(repository, drain_s, rank, models)]
    return ["mpirun"], arguments, [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]


def break_even_length(pipeline: PipelineSpec, options: OverlayOptions) -> float:
    """gamma × c + v: below this mean accepted length a speculative step costs more time than it yields."""
    cost = options.draft_cost_ratio
    if cost is None:
        cost = 0.1 if pipeline.speculation.method == "draft_target" else 0.0
    return round(pipeline.speculation.num_draft_tokens * cost + options.verify_cost_ratio, 3)


def gpu_scheduling(size: PodSize) -> dict:
    return {"tolerations": [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]} if size.gpus else {}


def build_job_patch(pipeline: PipelineSpec, repository: str, size: PodSize) -> dict:
    pipeline_file = f"{base.PIPELINE_DIR}/{base.PIPELINE_KEY}"
    package = ["package", pipeline_file, "--output", repository]
    if pipeline.backend.kind == "trtllm":
        package += ["--served-at", repository]
    roots = checkpoint_roots(pipeline)
    mounts = [{"name": f"checkpoints-{i}", "mountPath": root, "readOnly": True} for i, root in enumerate(roots)]
    step = {"resources": resources(size), **({"volumeMounts": mounts} if mounts else {})}
    spec = {"initContainers": [{"name": "build", "args": ["build", pipeline_file], **step}],
            "containers": [{"name": "package", "args": package, **step}], **gpu_scheduling(size)}
    spec["volumes"] = [{"name": f"checkpoints-{i}", "persistentVolumeClaim": {
        "claimName": CHECKPOINTS_CLAIM, "readOnly": True}} for i, _ in enumerate(roots)]
    if pipeline.backend.kind == "trtllm":  # TensorRT's builder and the conversions write scratch files
        spec["volumes"].append({"name": "tmp", "emptyDir": {"sizeLimit": "32Gi"}})
    if not spec["volumes"]:
        del spec["volumes"]
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": base.BUILD_JOB},
            "spec": {"template": {"spec": spec}}}


def server_pod_patch(pipeline: PipelineSpec, repository: str, size: PodSize, options: OverlayOptions,
                     pipeline_hash: str) -> dict:
    drain = options.longest_generation_s
    command, arguments, env = server_command(pipeline, repository, drain, size)
    container = {"name": "triton", "command": command, "args": arguments, "resources": resources(size)}
    if env:
        container["env"] = env
    if pipeline.backend.kind == "trtllm":  # loading engines of tens of GB: up to 30 minutes
        container["startupProbe"] = base.probe("/v2/health/ready", 15, 120)
    return {"metadata": {"annotations": {"specdeploy.dev/pipeline": pipeline_hash}},
            "spec": {"terminationGracePeriodSeconds": base.PRESTOP_SECONDS + drain + EXIT_MARGIN + 5,
                     "initContainers": [{"name": "wait-for-repository",
                                         "env": [{"name": "REPOSITORY", "value": repository}]}],
                     "containers": [container],
                     "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{size.shm_gib}Gi"}}],
                     **gpu_scheduling(size)}}


def deployment_patch(pod: dict) -> dict:
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": base.SERVER},
            "spec": {"template": pod}}


def merged(document: dict, patch: dict) -> dict:
    """A strategic-merge-like merge for building the LeaderWorkerSet's pods from the base pod (lists of named
    items merge by name, other lists are replaced)."""
    result = dict(document)
    for key, value in patch.items():
        old = result.get(key)
        if isinstance(old, dict) and isinstance(value, dict):
            result[key] = merged(old, value)
        elif isinstance(old, list) and isinstance(value, list) and all(isinstance(v, dict) and "name" in v
                                                                        for v in old + value):
            by_name = {item["name"]: item for item in old}
            for item in value:
                by_name[item["name"]] = merged(by_name.get(item["name"], {}), item)
            result[key] = list(by_name.values())
        else:
            result[key] = value
    return result


def leader_worker_set(pod_patch: dict, size: PodSize, image: str) -> list[dict]:
    """The LeaderWorkerSet (one group = size.nodes pods) and the RBAC its leader's kubessh needs."""
    leader_labels = base.SERVER_LABELS  # the Service, PDB and PodMonitor select the leaders
    worker_labels = {**base.SERVER_LABELS, "app.kubernetes.io/component": "worker"}
    leader = merged({"metadata": {"labels": leader_labels}, "spec": base.server_pod()}, pod_patch)
    leader["spec"]["automountServiceAccountToken"] = True
    worker = merged(leader, {"metadata": {"labels": worker_labels}})
    worker["spec"] = {**worker["spec"], "initContainers": [],
                      "containers": [{**worker["spec"]["containers"][0], "command": ["sleep"], "args": ["infinity"]}]}
    # Workers only host the ranks the leader starts in them: no ports of their own to probe
    for key in ("startupProbe", "livenessProbe", "readinessProbe", "ports", "lifecycle"):
        worker["spec"]["containers"][0].pop(key, None)
    del worker["spec"]["initContainers"]
    for template in (leader, worker):
        for container in template["spec"].get("initContainers", []) + template["spec"]["containers"]:
            container["image"] = image
    lws = {"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet",
           "metadata": {"name": base.SERVER, "labels": base.SERVER_LABELS},
           "spec": {"replicas": 1, "startupPolicy": "LeaderReady",
                    "rolloutStrategy": {"type": "RollingUpdate",
                                        "rollingUpdateConfiguration": {"maxUnavailable": 0, "maxSurge": 1}},
                    "leaderWorkerTemplate": {"size": size.nodes, "restartPolicy": "RecreateGroupOnPodRestart",
                                             "leaderTemplate": leader, "workerTemplate": worker}}}
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": "specdeploy-mpi"},
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]},
                      {"apiGroups": [""], "resources": ["pods/exec"], "verbs": ["create"]}]}
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
               "metadata": {"name": "specdeploy-mpi"},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "specdeploy-mpi"},
               "subjects": [{"kind": "ServiceAccount", "name": base.SERVICE_ACCOUNT}]}
    # MPI and NCCL between a group's pods use ports of their own choosing
    group_traffic = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                     "metadata": {"name": "specdeploy-group"},
                     "spec": {"podSelector": {"matchLabels": {"leaderworkerset.sigs.k8s.io/name": base.SERVER}},
                              "policyTypes": ["Ingress"],
                              "ingress": [{"from": [{"podSelector": {"matchLabels": {
                                  "leaderworkerset.sigs.k8s.io/name": base.SERVER}}}]}]}}
    return [lws, role, binding, group_traffic]


def image_reference(pipeline: PipelineSpec, image: str | None) -> tuple[str, str]:
    reference = image or f"{DEFAULT_IMAGES[pipeline.backend.kind]}:{specdeploy.__version__}"
    name, _, tag = reference.rpartition(":")
    if not name or "/" in tag:
        raise SpecdeployError(f"--image {reference!r}: give repository:tag (a pinned tag, not latest)")
    if tag == "latest":
        raise SpecdeployError(f"--image {reference!r}: the tag latest is refused (pin a version)")
    return name, tag


def write_overlay(pipeline_path: Path, output: Path, options: OverlayOptions = OverlayOptions()) -> Path:
    """Write DIR/base, DIR/monitoring and DIR/overlays/<name> for the pipeline. Returns the overlay directory."""
    pipeline_path, output = Path(pipeline_path), Path(output)
    pipeline = checked_pipeline(pipeline_path)
    size = pod_size(pipeline, target_dimensions(pipeline, options.weights_gib), options.weights_gib,
                    options.gpus_per_node)
    if size.nodes > 1:
        settings = pipeline.backend.settings
        if (settings.tp_size * settings.pp_size) % options.gpus_per_node:
            raise SpecdeployError(f"{pipeline_path}: tp_size × pp_size = {settings.tp_size * settings.pp_size} "
                                  f"spans nodes but is not a multiple of --gpus-per-node {options.gpus_per_node}")
        if len(engine_models(pipeline)) > 1:
            raise SpecdeployError(f"{pipeline_path}: a draft-target pipeline on TensorRT-LLM runs its two engines "
                                  f"in orchestrator mode, which is single-node; tp_size × pp_size = "
                                  f"{settings.tp_size * settings.pp_size} exceeds --gpus-per-node "
                                  f"{options.gpus_per_node} (use Medusa or n-gram speculation across nodes)")
    name, tag = image_reference(pipeline, options.image)
    text = pipeline_path.read_text()
    pipeline_hash = hashlib.sha256(f"{text}\n{name}:{tag}".encode()).hexdigest()[:10]
    repository = f"{base.MODELS_DIR}/{pipeline.name}"
    overlay = output / "overlays" / (options.name or pipeline.name)
    write_base(output / "base")
    monitoring = output / "monitoring"
    monitoring.mkdir(parents=True, exist_ok=True)
    dump(monitoring / "prometheus-adapter-values.yaml", adapter_values(),
         "helm install prometheus-adapter prometheus-community/prometheus-adapter -f prometheus-adapter-values.yaml\n"
         "Serves the triton:queue_compute:ratio recording rule to the HPA as a pods metric.")
    if overlay.exists():
        shutil.rmtree(overlay)
    overlay.mkdir(parents=True)
    shutil.copy2(pipeline_path, overlay / base.PIPELINE_KEY)
    pod = server_pod_patch(pipeline, repository, size, options, pipeline_hash)
    resources_list = ["../../base", "prometheusrule.yaml"]
    patches = [{"path": "build-job.yaml"}, {"path": "pvc.yaml"},
               {"target": {"kind": "Job", "name": base.BUILD_JOB},
                "patch": yaml.safe_dump([{"op": "replace", "path": "/metadata/name",
                                          "value": f"{base.BUILD_JOB}-{pipeline_hash}"}])}]
    dump(overlay / "build-job.yaml", build_job_patch(pipeline, repository, size))
    dump(overlay / "pvc.yaml", {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                                "metadata": {"name": base.DATA_CLAIM},
                                "spec": {"resources": {"requests": {"storage": f"{size.volume_gib}Gi"}}}})
    dump(overlay / "prometheusrule.yaml", prometheus_rule(break_even_length(pipeline, options)))
    if size.nodes == 1:
        dump(overlay / "deployment.yaml", deployment_patch(pod))
        patches.insert(0, {"path": "deployment.yaml"})
    else:
        dump(overlay / "leaderworkerset.yaml", leader_worker_set(pod, size, f"{name}:{tag}"))
        resources_list.append("leaderworkerset.yaml")
        dump(overlay / "deployment-delete.yaml", {"$patch": "delete", "apiVersion": "apps/v1", "kind": "Deployment",
                                                  "metadata": {"name": base.SERVER}})
        patches.insert(0, {"path": "deployment-delete.yaml"})
        patches.append({"target": {"kind": "HorizontalPodAutoscaler", "name": base.SERVER},
                        "patch": yaml.safe_dump([{"op": "replace", "path": "/spec/scaleTargetRef", "value": {
                            "apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet",
                            "name": base.SERVER}}])})
    kustomization = {**KUSTOMIZATION, "namespace": options.namespace, "resources": resources_list,
                     "labels": [{"pairs": {"app.kubernetes.io/instance": pipeline.name}}],
                     "configMapGenerator": [{"name": base.PIPELINE_CONFIGMAP, "files": [base.PIPELINE_KEY]}],
                     "generatorOptions": {"disableNameSuffixHash": True},
                     "images": [{"name": base.IMAGE, "newName": name, "newTag": tag}], "patches": patches}
    roots = checkpoint_roots(pipeline)
    needs = (f"\nThe build Job mounts the PersistentVolumeClaim {CHECKPOINTS_CLAIM} (yours, holding the checkpoints) "
             f"at {', '.join(roots)}." if roots else "")
    dump(overlay / "kustomization.yaml", kustomization,
         f"specdeploy k8s {pipeline_path.name}: {size.comment()}.{needs}\n"
         "Render: kubectl kustomize <this folder>; apply: kubectl apply -k <this folder>")
    return overlay

