"""What `specdeploy k8s` takes beside the pipeline, with its defaults: the CLI's options read them from here, so
each default has one home. Only dataclasses are imported, so the CLI loads it without the sizing code."""

from __future__ import annotations

from dataclasses import dataclass


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
    gpu_product: str | None = None  # the nvidia.com/gpu.product label value engines are built and served on
    storage_class: str | None = None  # the data volume's class (default: the cluster's default class)
    volume_read_gibps: float = 0.25  # the rate engines are read from the data volume (GPU startup probes)
    access_mode: str | None = None  # ReadWriteOnce / ReadWriteMany (default: by how many nodes a group spans)
    monitoring: bool = True  # PodMonitor, PrometheusRule and the HPA (need prometheus-operator's CRDs)
    prometheus_release: str = "prometheus"  # kube-prometheus-stack's Helm release, which selects by `release`
    prometheus_namespace: str = "monitoring"  # where that Prometheus runs (the adapter's URL)
