"""Reading a server's Prometheus metrics (the specdeploy_* series, or Triton's own), for load reports and tests."""

from __future__ import annotations

import urllib.request


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
