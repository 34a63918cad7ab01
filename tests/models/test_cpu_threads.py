"""The torch thread count from the CPU a process may use (models/cpu_threads.py), against fake cgroup files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specdeploy.models import cpu_threads
from specdeploy.models.cpu_threads import cgroup_quota, derive_threads


def v2_root(tmp_path: Path, cpu_max: str | None, nested: dict[str, str] | None = None) -> tuple[Path, Path]:
    """A cgroup v2 mount whose root holds `cpu_max` (None: no file, as the host's root cgroup), with cgroups under
    it (path → cpu.max), and a /proc/self/cgroup naming the deepest."""
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpu memory pids\n")
    if cpu_max is not None:
        (root / "cpu.max").write_text(cpu_max + "\n")
    own = "/"
    for path, value in (nested or {}).items():
        (root / path).mkdir(parents=True, exist_ok=True)
        (root / path / "cpu.max").write_text(value + "\n")
        own = "/" + path
    self_cgroup = tmp_path / "self_cgroup"
    self_cgroup.write_text(f"0::{own}\n")
    return root, self_cgroup


def v1_root(tmp_path: Path, quota_us: int, period_us: int = 100000, own: str = "/") -> tuple[Path, Path]:
    """A cgroup v1 mount with the cpu controller (joined with cpuacct, as most distributions mount it)."""
    root = tmp_path / "cgroup"
    cpu = root / "cpu,cpuacct"
    cpu.mkdir(parents=True)
    (cpu / "cpu.cfs_quota_us").write_text(f"{quota_us}\n")
    (cpu / "cpu.cfs_period_us").write_text(f"{period_us}\n")
    self_cgroup = tmp_path / "self_cgroup"
    self_cgroup.write_text(f"12:memory:{own}\n4:cpu,cpuacct:{own}\n0::/\n")
    return root, self_cgroup


def test_v2_quota(tmp_path):
    root, self_cgroup = v2_root(tmp_path, "150000 100000")  # podman run --cpus 1.5
    assert cgroup_quota(root, self_cgroup) == 1.5
    derived = cpu_threads.cpu_threads({}, root, self_cgroup, affinity=64)
    assert (derived.threads, derived.source, derived.quota_cpus) == (1, "cgroup quota", 1.5)  # floor, not ceil


def test_v2_no_quota(tmp_path):
    root, self_cgroup = v2_root(tmp_path, "max 100000")
    assert cgroup_quota(root, self_cgroup) is None
    derived = cpu_threads.cpu_threads({}, root, self_cgroup, affinity=8)
    assert (derived.threads, derived.source) == (8, "affinity")


def test_v2_parent_quota_binds_its_children(tmp_path):
    """A host's process: the root cgroup has no cpu.max; a pod's slice limits 4 CPUs, its container none."""
    root, self_cgroup = v2_root(tmp_path, None, {"kubepods/pod1": "400000 100000",
                                                 "kubepods/pod1/container": "max 100000"})
    assert cgroup_quota(root, self_cgroup) == 4
    assert cpu_threads.cpu_threads({}, root, self_cgroup, affinity=64).threads == 4


def test_v1_quota(tmp_path):
    root, self_cgroup = v1_root(tmp_path, 400000)
    assert cgroup_quota(root, self_cgroup) == 4
    assert cpu_threads.cpu_threads({}, root, self_cgroup, affinity=64).threads == 4


def test_v1_no_quota(tmp_path):
    root, self_cgroup = v1_root(tmp_path, -1)
    assert cgroup_quota(root, self_cgroup) is None
    assert cpu_threads.cpu_threads({}, root, self_cgroup, affinity=2).threads == 2


def test_v1_without_a_cgroup_namespace(tmp_path):
    """Docker on v1 without a cgroup namespace: /proc/self/cgroup names a path the container's mount does not have
    (its root is the container's own cgroup), so the root's quota counts."""
    root, self_cgroup = v1_root(tmp_path, 200000, own="/docker/abc123")
    assert cgroup_quota(root, self_cgroup) == 2


def test_affinity_smaller_than_the_quota(tmp_path):
    """taskset -c 0-1 under a quota of 8 CPUs: two threads, the mask's."""
    root, self_cgroup = v2_root(tmp_path, "800000 100000")
    derived = cpu_threads.cpu_threads({}, root, self_cgroup, affinity=2)
    assert (derived.threads, derived.source) == (2, "affinity")


def test_quota_under_one_cpu_gets_one_thread(tmp_path):
    root, self_cgroup = v2_root(tmp_path, "50000 100000")
    assert cpu_threads.cpu_threads({}, root, self_cgroup, affinity=16).threads == 1
    assert derive_threads(0.5, 16) == 1 and derive_threads(3.99, 16) == 3 and derive_threads(None, 16) == 16


def test_no_cgroup_files(tmp_path):
    assert cgroup_quota(tmp_path / "absent", tmp_path / "absent_self") is None


def test_an_explicit_count_wins(tmp_path):
    root, self_cgroup = v2_root(tmp_path, "100000 100000")
    derived = cpu_threads.cpu_threads({"SPECDEPLOY_CPU_THREADS": "6", "OMP_NUM_THREADS": "3"}, root, self_cgroup,
                                      affinity=8)
    assert (derived.threads, derived.source, derived.quota_cpus) == (6, "SPECDEPLOY_CPU_THREADS", 1)
    assert cpu_threads.cpu_threads({"OMP_NUM_THREADS": "3"}, root, self_cgroup, affinity=8).threads == 3
    with pytest.raises(ValueError, match="SPECDEPLOY_CPU_THREADS='0'"):
        cpu_threads.cpu_threads({"SPECDEPLOY_CPU_THREADS": "0"}, root, self_cgroup, affinity=8)


def test_apply_sets_torch_threads(tmp_path, monkeypatch):
    """Today torch keeps its count from the host's cores whatever the quota; applied, it runs the quota's."""
    root, self_cgroup = v2_root(tmp_path, "100000 100000")  # --cpus 1
    before = torch.get_num_threads()
    monkeypatch.setattr(cpu_threads, "_applied", None)
    try:
        derived = cpu_threads.apply_cpu_threads(environ={}, root=root, self_cgroup=self_cgroup, affinity=4)
        assert torch.get_num_threads() == derived.threads == 1
        assert cpu_threads.applied() == derived
        assert "1 torch threads (cgroup quota; a CPU quota of 1" in derived.sentence()
    finally:
        torch.set_num_threads(before)
