"""Reading a server's Prometheus metrics (the specdeploy_* series, or Triton's own), for load reports and tests."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable


def scrape(metrics_url: str, prefix: str = "specdeploy_") -> dict[str, float]:
    """Every sample whose name starts with `prefix` (Triton's own: "nv_"): 'name{labels}' → value."""
    with urllib.request.urlopen(metrics_url, timeout=10) as reply:
        text = reply.read().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith(prefix):
            key, value = line.rsplit(" ", 1)
            values[key] = float(value)
    return values


def total(values: dict[str, float], name: str, **labels: str) -> float:
    """The sum of the series of `name` whose labels include `labels`."""
    return sum(v for k, v in values.items() if k.startswith(name + "{")
               and all(f'{label}="{value}"' in k for label, value in labels.items()))


def is_idle(values: dict[str, float], free_kv: float) -> bool:
    """No sequence in the batch, none waiting, and `free_kv` KV slots free (the idle server's count)."""
    return (total(values, "specdeploy_batch_size") == 0 and total(values, "specdeploy_waiting_requests") == 0
            and total(values, "specdeploy_free_kv_slots") == free_kv)


def wait_for(metrics_url: str, condition: Callable[[dict[str, float]], bool],
             seconds: float) -> tuple[dict[str, float], bool]:
    """Scrape until `condition(metrics)` holds or `seconds` pass: the last metrics and whether it held. The model
    updates its gauges and counters just after a request's last response, so a client can be ahead of them."""
    deadline = time.monotonic() + seconds
    while True:
        values = scrape(metrics_url)
        if condition(values):
            return values, True
        if time.monotonic() > deadline:
            return values, False
        time.sleep(0.05)
