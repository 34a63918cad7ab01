"""The torch model reports its torch threads, and how the count was chosen, as a gauge and in its load log; the
image and the overlays set no count by hand (the engine derives it, models/cpu_threads.py)."""

from __future__ import annotations

import re
from types import SimpleNamespace

from helpers.repo import REPO

from specdeploy.serve.torch.server import TorchServer


class FakeMetric:
    def __init__(self, family: FakeFamily, labels: dict, buckets=None) -> None:
        self.family, self.labels, self.value = family, labels, None
        family.metrics.append(self)

    def set(self, value) -> None:
        self.value = value

    def increment(self, value) -> None:
        self.value = (self.value or 0) + value

    def observe(self, value) -> None:
        pass


class FakeFamily:
    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
    made: list[FakeFamily] = []

    def __init__(self, name: str, description: str, kind: str) -> None:
        self.name, self.kind, self.metrics = name, kind, []
        FakeFamily.made.append(self)

    def Metric(self, labels: dict, buckets=None) -> FakeMetric:  # noqa: N802 (the backend's name)
        return FakeMetric(self, labels, buckets)


def fake_pb_utils(logged: list[str]) -> SimpleNamespace:
    logger = SimpleNamespace(log_info=logged.append, log_warn=logged.append, log_error=logged.append)
    return SimpleNamespace(MetricFamily=FakeFamily, Logger=logger)


def test_the_served_model_reports_its_threads(tiny_engines):
    import torch

    logged: list[str] = []
    server = TorchServer(tiny_engines["ngram"].dir, "speculative", fake_pb_utils(logged))
    try:
        family = next(family for family in FakeFamily.made if family.name == "specdeploy_cpu_threads")
        (metric,) = family.metrics
        threads = server.engine.cpu_threads
        assert family.kind == "gauge" and metric.value == threads.threads == torch.get_num_threads()
        assert metric.labels == {"model": "speculative", "method": "ngram", "source": threads.source}
        assert any(threads.sentence() in line for line in logged)
    finally:
        server.stop()


def test_the_image_and_overlays_set_no_thread_count():
    """What the engine derives is not set by hand: a fixed count would outlive a changed CPU limit."""
    files = [*REPO.glob("build/Dockerfile*"), *REPO.glob("build/podman/Dockerfile*"), *REPO.glob("k8s/**/*.yaml"),
             *REPO.glob("specdeploy/deploy/**/*.py")]
    pattern = re.compile(r"OMP_NUM_THREADS|MKL_NUM_THREADS|SPECDEPLOY_CPU_THREADS|set_num_threads")
    assert files and not [str(path) for path in files if pattern.search(path.read_text())]
