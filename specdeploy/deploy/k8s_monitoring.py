"""Prometheus rules for a deployment, and the Prometheus adapter rule behind the autoscaler.

Recording rules (per namespace and pod, as the adapter serves them to the HPA):
- `triton:queue_compute:ratio`: Triton's queue time over its compute time, the autoscaling signal of Triton's
  Kubernetes tutorials.
- `specdeploy:acceptance_rate:rate5m` = accepted / drafted tokens, and `specdeploy:mean_accepted_length:rate5m` =
  tokens per verification step = (accepted + steps) / steps, from the `specdeploy_` counters;
  `specdeploy:acceptance_rate_by_kind:rate5m`, the same acceptance per `request_kind` (serving.request_kinds).
- `specdeploy:time_to_first_token_seconds:p50_5m` and `:p99_5m`, and the same for
  `specdeploy:inter_token_latency_seconds`: histogram_quantile over the model's histograms (serve/latency.py defines
  what they observe; inter-token latency is genai-perf's per-request figure).
Alert `SpeculationAcceptanceCollapsed`: the mean accepted length fell below the break-even length, gamma × c + v
(c: draft cost ratio, v: verify cost over a plain decode step; the cost model in speculative/speedup.py), for 10
minutes: speculation then costs more than it saves.
"""

from __future__ import annotations

from specdeploy.deploy.k8s_base import QUEUE_COMPUTE_METRIC, SERVER, WAITING_METRIC
from specdeploy.speculative.speedup import STEP_COST_IN_WORDS

# The exported series the rules read (tests check each against a real server's scrape).
TRITON_QUEUE = "nv_inference_queue_duration_us"
TRITON_COMPUTE = "nv_inference_compute_infer_duration_us"
ACCEPTED, DRAFTED, STEPS = ("specdeploy_accepted_tokens_total", "specdeploy_drafted_tokens_total",
                            "specdeploy_verification_steps_total")
ACCEPTANCE_RATE = "specdeploy:acceptance_rate:rate5m"
ACCEPTANCE_RATE_BY_KIND = "specdeploy:acceptance_rate_by_kind:rate5m"
MEAN_ACCEPTED_LENGTH = "specdeploy:mean_accepted_length:rate5m"
LATENCY_HISTOGRAMS = ("specdeploy_time_to_first_token_seconds", "specdeploy_inter_token_latency_seconds")
QUANTILES = {"p50": 0.5, "p99": 0.99}
BY = "namespace, pod"
KIND_BY = f"{BY}, request_kind"
WINDOW = "5m"


def rate(metric: str, window: str = WINDOW, by: str = BY) -> str:
    return f"sum by ({by}) (rate({metric}[{window}]))"


def recording_rules() -> list[dict]:
    """The autoscaling ratio divides by clamp_min(compute, 1) as upstream's rule does (triton-inference-server/
    tutorials Deployment/Kubernetes/EKS_Multinode_Triton_TRTLLM/multinode_helm_chart/triton-metrics_prometheus-rule.yaml
    @ 66481c48): an idle pod then reads 0, so the HPA, which skips scaling while a pod's metric is missing, can scale
    down. The acceptance ratios keep `> 0`: an idle pod has no acceptance to report, and no alert should fire."""
    return [{"record": QUEUE_COMPUTE_METRIC,
             "expr": f"{rate(TRITON_QUEUE, '1m')} / clamp_min({rate(TRITON_COMPUTE, '1m')}, 1)"},
            {"record": ACCEPTANCE_RATE, "expr": f"{rate(ACCEPTED)} / ({rate(DRAFTED)} > 0)"},
            {"record": ACCEPTANCE_RATE_BY_KIND, "expr": f"{rate(ACCEPTED, by=KIND_BY)} / ({rate(DRAFTED, by=KIND_BY)} "
                                                        "> 0)"},
            {"record": MEAN_ACCEPTED_LENGTH, "expr": f"({rate(ACCEPTED)} + {rate(STEPS)}) / ({rate(STEPS)} > 0)"},
            *latency_rules()]


def latency_rules() -> list[dict]:
    """p50 and p99 of each latency histogram over WINDOW, per pod (an idle pod's quantile is NaN: no requests, no
    latency to report)."""
    return [{"record": f"{name.replace('specdeploy_', 'specdeploy:', 1)}:{label}_{WINDOW}",
             "expr": f"histogram_quantile({quantile}, sum by ({BY}, le) (rate({name}_bucket[{WINDOW}])))"}
            for name in LATENCY_HISTOGRAMS for label, quantile in QUANTILES.items()]


def collapse_alert(break_even_length: float) -> dict:
    return {"alert": "SpeculationAcceptanceCollapsed",
            "expr": f"{MEAN_ACCEPTED_LENGTH} < {break_even_length:g}", "for": "10m",
            "labels": {"severity": "warning"},
            "annotations": {
                "summary": "Speculation costs more than it saves on {{ $labels.pod }}",
                "description": f"Mean accepted length {{{{ $value | printf \"%.2f\" }}}} tokens per step is below "
                               f"the break-even {break_even_length:g} ({STEP_COST_IN_WORDS}) for 10 "
                               f"minutes. Check the traffic's acceptance ({ACCEPTANCE_RATE}); lower gamma or turn "
                               f"speculation off (num_draft_tokens 0) until it recovers."}}


def release_labels(release: str) -> dict:
    """kube-prometheus-stack's Prometheus selects PodMonitors and PrometheusRules labelled with its Helm release
    (podMonitorSelectorNilUsesHelmValues and ruleSelectorNilUsesHelmValues default to true); Triton's tutorials
    label theirs `release: prometheus` (tutorials Deployment/Kubernetes/TensorRT-LLM_Autoscaling_and_Load_Balancing/
    chart/templates/pod-monitor.yaml @ 3f7025cd)."""
    return {"release": release}


def prometheus_rule(break_even_length: float, release: str) -> dict:
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
            "metadata": {"name": SERVER, "labels": release_labels(release)},
            "spec": {"groups": [{"name": "specdeploy.rules", "interval": "15s", "rules": recording_rules()},
                                {"name": "specdeploy.alerts", "rules": [collapse_alert(break_even_length)]}]}}


def adapter_rule(series: str) -> dict:
    return {"seriesQuery": f'{series}{{namespace!="",pod!=""}}',
            "resources": {"overrides": {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}},
            "name": {"matches": "^(.*)$", "as": series},
            "metricsQuery": "sum(<<.Series>>{<<.LabelMatchers>>}) by (<<.GroupBy>>)"}


def adapter_values(prometheus_namespace: str) -> dict:
    """Helm values for prometheus-community/prometheus-adapter: serve the autoscaler's two signals (the
    queue/compute recording rule, the scheduler's queued requests) as pods metrics of the custom metrics API.
    prometheus.url must name the Prometheus to query (the chart's default points at none that kube-prometheus-stack
    creates): `prometheus-operated`, the Service prometheus-operator creates beside every Prometheus it runs, whatever
    the Helm release is called."""
    return {"prometheus": {"url": f"http://prometheus-operated.{prometheus_namespace}.svc", "port": 9090},
            "metricsRelistInterval": "15s",
            "rules": {"default": False, "custom": [adapter_rule(QUEUE_COMPUTE_METRIC), adapter_rule(WAITING_METRIC)]}}
