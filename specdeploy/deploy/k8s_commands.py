"""The serving container's command line, by backend and shape.

- torch: `specdeploy serve` on the packaged repository (it drains on SIGTERM itself), CPUs only.
- trtllm, one GPU and one engine: the image's tritonserver as PID 1 (its --exit-timeout-secs drain runs on SIGTERM).
- trtllm on one node otherwise: TensorRT-LLM's orchestrator mode (TRTLLM_ORCHESTRATOR=1 under `mpirun -n 1`, which
  spawns one executor worker per GPU), as upstream's launch script does with --multi-model.
- trtllm across nodes: the leader's mpirun starts one tritonserver per rank on its group's pods through `kubectl
  exec` (the kubessh agent of Triton's multi-node tutorials); only rank 0 serves.
Under mpirun the command runs inside the launcher (pods/launch.py): mpirun answers SIGTERM by killing its ranks
within seconds, so the launcher hands SIGTERM to the local tritonserver instead and stops mpirun after the drain;
across nodes it first waits for every pod of the group to be Ready.
"""

from __future__ import annotations

from specdeploy.deploy import k8s_base as base
from specdeploy.deploy.sizing import PodSize
from specdeploy.serve.tritonserver import EXIT_MARGIN
from specdeploy.spec.pipeline import PipelineSpec

GROUP_KEY_LABEL = "leaderworkerset.sigs.k8s.io/group-key"  # on every pod of a LeaderWorkerSet group
GROUP_WAIT_SECONDS = 1200  # workers scheduled and their (large) image pulled
LAUNCHER = ["python3", "-m", "specdeploy.pods.launch"]


def triton_arguments(repository: str, drain_s: int, rank: int = 0, load: list[str] | None = None) -> list[str]:
    """One tritonserver's flags. Ranks above 0 of a multi-node group load only the engines and open no endpoint."""
    arguments = [f"--model-repository={repository}", "--disable-auto-complete-config",
                 f"--backend-config=python,shm-region-prefix-name=prefix{rank}_",
                 f"--exit-timeout-secs={drain_s + EXIT_MARGIN}"]
    if rank == 0:
        return [*arguments, *(f"--{name}-port={port}" for name, port in base.TRITON_PORTS.items()),
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
    from specdeploy.package.repository import trtllm_engines

    return list(trtllm_engines(pipeline))


def launcher(drain_s: int, group_size: int = 1) -> list[str]:
    """The launcher's command line up to `--`: drain tritonserver on SIGTERM, and across nodes wait for the group."""
    # Only rank 0 serves: the others would unload at once and break its tensor-parallel steps mid-drain
    command = [*LAUNCHER, "run", "--drain-timeout", str(drain_s + EXIT_MARGIN),
               "--drain-rank", "0"]
    if group_size > 1:
        command += ["--group-selector", f"{GROUP_KEY_LABEL}=$(GROUP_KEY)", "--group-size", str(group_size),
                    "--group-timeout", str(GROUP_WAIT_SECONDS)]
    return [*command, "--"]


def under_launcher(command: list[str]) -> bool:
    """Whether a container command runs inside the launcher (which stops mpirun only after the drain)."""
    return command[:3] == LAUNCHER


def server_command(pipeline: PipelineSpec, repository: str, drain_s: int, size: PodSize) -> tuple[list, list, list]:
    """(command, args, extra env) of the serving container (the leader's, across nodes)."""
    if pipeline.backend.kind == "torch":
        return (["specdeploy"], ["serve", "--model-repository", repository, "--address", "0.0.0.0",
                                 "--openai-port", str(base.OPENAI_PORT), "--drain-timeout", str(drain_s)], [])
    models = engine_models(pipeline)
    if size.nodes == 1 and size.gpus == 1 and len(models) == 1:
        return ["tritonserver"], triton_arguments(repository, drain_s), []
    if size.nodes == 1:
        arguments = [*triton_arguments(repository, drain_s), *orchestrator_arguments(size.gpus)]
        return ([*launcher(drain_s), "mpirun"], ["--allow-run-as-root", "-n", "1", "tritonserver", *arguments],
                [{"name": "TRTLLM_ORCHESTRATOR", "value": "1"}])
    hosts = ["$(POD_NAME)", *(f"$(POD_NAME)-{i}" for i in range(1, size.nodes))]
    arguments = ["--allow-run-as-root", "-mca", "plm_rsh_agent", "kubessh", "-np", str(size.gpus * size.nodes),
                 "--host", ",".join(f"{host}:{size.gpus}" for host in hosts)]
    for rank in range(size.gpus * size.nodes):
        arguments += [":"] if rank else []
        arguments += ["-n", "1", "tritonserver", *triton_arguments(repository, drain_s, rank, models)]
    env = [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
           {"name": "GROUP_KEY", "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{GROUP_KEY_LABEL}']"}}}]
    return [*launcher(drain_s, size.nodes), "mpirun"], arguments, env


def openai_port() -> dict:
    return {"name": "openai", "containerPort": base.OPENAI_PORT, "protocol": "TCP"}


def openai_container(repository: str, drain_s: int) -> dict:
    """The OpenAI endpoints beside a tritonserver that runs alone in its container (the GPU pods): the front
    process, on the repository tritonserver serves, talking to it over the pod's loopback; ready only while the
    model is, and drained by the pod's SIGTERM as tritonserver is."""
    probe = {"httpGet": {"path": "/health/ready", "port": "openai"}, "periodSeconds": 5, "failureThreshold": 3,
             "timeoutSeconds": 5}
    return {"name": "openai", "image": base.IMAGE, "imagePullPolicy": "IfNotPresent",
            "command": ["python3", "-m", "specdeploy.serve.openai_api.front"],
            "args": ["--repository", repository, "--triton", f"127.0.0.1:{base.TRITON_PORTS['grpc']}",
                     "--address", "0.0.0.0", "--port", str(base.OPENAI_PORT), "--drain-timeout", str(drain_s)],
            "env": base.environment(), "ports": [openai_port()],
            "livenessProbe": {**probe, "httpGet": {"path": "/health/live", "port": "openai"}},
            "readinessProbe": probe,
            "lifecycle": {"preStop": {"sleep": {"seconds": base.PRESTOP_SECONDS}}},
            "volumeMounts": base.mounts(pipeline=False),  # the repository's tokenizer and pipeline; /tmp
            "securityContext": base.container_security(),
            # requests equal to limits: a GPU pod is Guaranteed (every container of it)
            "resources": {"requests": {"cpu": "500m", "memory": "512Mi"}, "limits": {"cpu": "500m", "memory": "512Mi"}}}
