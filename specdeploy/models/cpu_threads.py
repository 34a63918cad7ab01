"""How many intra-op threads torch runs on this CPU: as many as the CPU time the process may use, not the host's cores.

torch sizes its thread pool from the cores it sees (os.cpu_count and the affinity mask), and a container's CPU limit
is no mask but a CFS quota: under `podman run --cpus 1`, or a Kubernetes CPU limit of 4 on a 64-core node, torch
still starts a thread per core, they exhaust the quota early in every CFS period, and each parallel op then waits
for its throttled threads until the next period. So the count is derived from the cgroup quota (v2 `cpu.max`, v1
`cpu.cfs_quota_us` / `cpu.cfs_period_us`, the smallest on the way from the process's cgroup to the root) and the
affinity mask:

    threads = max(1, min(affinity CPUs, floor(quota / period)))

floor, not ceil: torch's parallel ops end at a barrier, so a quota of 1.5 CPUs run by two threads throttles both
for the last quarter of every period and every op in flight waits it out (a latency spike per period); one thread
leaves half a CPU unused but is never throttled. A quota under one CPU still gets one thread.

An explicit setting wins: SPECDEPLOY_CPU_THREADS, else OMP_NUM_THREADS (which torch itself reads, and which the
test suite sets for its workers).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

THREADS_VARIABLE = "SPECDEPLOY_CPU_THREADS"
CGROUP_ROOT = Path("/sys/fs/cgroup")
SELF_CGROUP = Path("/proc/self/cgroup")


@dataclass(frozen=True)
class CpuThreads:
    """The thread count, where it came from ("SPECDEPLOY_CPU_THREADS", "OMP_NUM_THREADS", "cgroup quota" or
    "affinity"), and what it was derived from: the quota in CPUs (None: no quota) and the CPUs in the affinity mask."""

    threads: int
    source: str
    quota_cpus: float | None
    affinity_cpus: int

    def as_record(self) -> dict:
        return asdict(self)

    def sentence(self) -> str:
        quota = "no CPU quota" if self.quota_cpus is None else f"a CPU quota of {self.quota_cpus:g}"
        return f"{self.threads} torch threads ({self.source}; {quota}, {self.affinity_cpus} CPUs in the affinity mask)"


def cgroup_paths(self_cgroup: Path) -> tuple[str | None, str | None]:
    """The process's cgroup path under the v2 hierarchy and under v1's cpu controller (None where not listed)."""
    v2 = v1 = None
    if not self_cgroup.is_file():
        return v2, v1
    for line in self_cgroup.read_text().splitlines():
        number, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if number == "0" and controllers == "":
            v2 = path
        elif "cpu" in controllers.split(","):
            v1 = path
    return v2, v1


def ancestors(path: str | None) -> list[str]:
    """`path` and every cgroup above it up to the root ("/a/b" → "a/b", "a", ""): a parent's limit binds its
    children. Inside a container's cgroup namespace the process's own cgroup is "/", the mount's root."""
    parts = [part for part in (path or "").split("/") if part]
    return ["/".join(parts[:end]) for end in range(len(parts), -1, -1)]


def read_v2(folder: Path) -> float | None:
    """CPUs a v2 cgroup's `cpu.max` ("QUOTA PERIOD", QUOTA "max" for none) allows; None without a quota or file."""
    path = folder / "cpu.max"
    if not path.is_file():
        return None
    quota, period = path.read_text().split()
    return None if quota == "max" else int(quota) / int(period)


def read_v1(folder: Path) -> float | None:
    """CPUs a v1 cpu cgroup's cfs_quota_us / cfs_period_us allows; None without a quota (-1) or files."""
    quota, period = folder / "cpu.cfs_quota_us", folder / "cpu.cfs_period_us"
    if not (quota.is_file() and period.is_file()):
        return None
    microseconds = int(quota.read_text())
    return None if microseconds <= 0 else microseconds / int(period.read_text())


def cgroup_quota(root: Path = CGROUP_ROOT, self_cgroup: Path = SELF_CGROUP) -> float | None:
    """The CPUs this process's cgroups allow (the smallest quota from its cgroup up to the root, v2 or v1), None
    when none has a quota. A path that does not exist under the mount (v1 without a cgroup namespace, where the
    mount's root is the container's own cgroup) is skipped, so the root's file still counts."""
    v2, v1 = cgroup_paths(self_cgroup)
    quotas = []
    if (root / "cgroup.controllers").is_file():  # the unified (v2) hierarchy is mounted here
        quotas = [read_v2(root / path) for path in ancestors(v2)]
    else:
        cpu = next((root / name for name in ("cpu", "cpu,cpuacct", "cpuacct,cpu") if (root / name).is_dir()), None)
        if cpu is not None:
            quotas = [read_v1(cpu / path) for path in ancestors(v1)]
    found = [quota for quota in quotas if quota is not None]
    return min(found) if found else None


def affinity_cpus() -> int:
    """CPUs this process may run on (its affinity mask; os.cpu_count where the platform has no mask)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def derive_threads(quota_cpus: float | None, affinity: int) -> int:
    """max(1, min(affinity, floor(quota))): the module docstring says why floor."""
    allowed = affinity if quota_cpus is None else min(affinity, math.floor(quota_cpus))
    return max(1, allowed)


def explicit_threads(environ: Mapping[str, str]) -> tuple[int, str] | None:
    """(threads, variable) where the environment sets a count; ValueError for one that is not a positive integer."""
    for variable in (THREADS_VARIABLE, "OMP_NUM_THREADS"):
        value = environ.get(variable, "").strip()
        if value:
            if not value.isdigit() or int(value) < 1:
                raise ValueError(f"{variable}={value!r}: a thread count is a positive integer")
            return int(value), variable
    return None


def cpu_threads(environ: Mapping[str, str] | None = None, root: Path = CGROUP_ROOT, self_cgroup: Path = SELF_CGROUP,
                affinity: int | None = None) -> CpuThreads:
    """The thread count this process should run (nothing is set: apply_cpu_threads does that)."""
    environ = os.environ if environ is None else environ
    quota = cgroup_quota(root, self_cgroup)
    affinity = affinity_cpus() if affinity is None else affinity
    explicit = explicit_threads(environ)
    if explicit is not None:
        return CpuThreads(explicit[0], explicit[1], quota, affinity)
    source = "cgroup quota" if quota is not None and math.floor(quota) < affinity else "affinity"
    return CpuThreads(derive_threads(quota, affinity), source, quota, affinity)


_applied: CpuThreads | None = None


def apply_cpu_threads(**overrides) -> CpuThreads:
    """Derive the count (cpu_threads, given `overrides`) and set torch's intra-op threads to it; remembered for
    `applied`. Called where a process starts its work (the CLI, a served model, a build's timing process), before
    any torch op runs on its threads, because each thread takes the count at its first parallel op."""
    global _applied
    _applied = cpu_threads(**overrides)
    torch.set_num_threads(_applied.threads)
    return _applied


def apply_once() -> CpuThreads:
    """apply_cpu_threads the first time a process asks (its first engine, a build's timing process), and what was
    applied after: a caller that sets torch's threads after that keeps its own count."""
    return applied() if _applied is not None else apply_cpu_threads()


def applied() -> CpuThreads:
    """What apply_cpu_threads set, or, where it did not run (a library caller), torch's count as found."""
    if _applied is not None and _applied.threads == torch.get_num_threads():
        return _applied
    return CpuThreads(torch.get_num_threads(), "torch default or the caller", cgroup_quota(), affinity_cpus())
