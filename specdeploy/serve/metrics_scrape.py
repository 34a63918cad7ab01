"""Reading a server's Prometheus metrics (the specdeploy_* series), for load reports and tests."""

from __future__ import annotations

import urllib.request


def scrape(metrics_url: str) -> dict[str, float]:
    """Every specdeploy_* sample: 'name{labels}' → value."""
    with urllib.request.urlopen(metrics_url, timeout=10) as reply:
        text = reply.read().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith("specdeploy_"):
            key, value = line.rsplit(" ", 1)
            values[key] = float(value)
    return values


def total(values: dict[str, float], name: str, **labels: str) -> float:
    """The sum of the series of `name` whose labels include `labels`."""
    return sum(v for k, v in values.items() if k.startswith(name + "{")
               and all(f'{label}="{value}"' in k for label, value in labels.items()))
