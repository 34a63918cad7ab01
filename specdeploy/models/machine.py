"""The machine a measurement ran on: the CPU, the instruction sets that decide how a bf16 matmul runs, and the
kernel PyTorch uses for it.

Speculation pays only while verifying n tokens costs little more than decoding one. On a CPU that is true when
the matmul streams the weights once for all n rows: oneDNN's bf16 kernels do (AMX, or AVX-512 with BF16 or BW/VL/
DQ, or AVX-NE-CONVERT). Without them PyTorch runs bf16 matmuls in a generic kernel whose time grows with every
row, and a verify costs several plain steps (measured on an AVX2-only CPU: docs/benchmarks.md, "The CPU decides"
and "Figures behind the code").
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

from specdeploy.models.cpu_threads import applied

# the flags (as /proc/cpuinfo spells them) that decide which bf16 and fp32 kernels a CPU gets
MATMUL_FLAGS = ("amx_bf16", "avx512_bf16", "avx512bw", "avx_ne_convert", "avx2", "fma")


def cpu_info() -> dict[str, str]:
    """The first processor's fields from /proc/cpuinfo ({} where there is none)."""
    path = Path("/proc/cpuinfo")
    fields: dict[str, str] = {}
    if not path.is_file():
        return fields
    for line in path.read_text().splitlines():
        if not line.strip():
            break
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def onednn_bf16() -> bool:
    """Whether oneDNN's bf16 matmul kernels run here (else bf16 matmuls take PyTorch's generic kernel)."""
    return (torch.backends.mkldnn.is_available()
            and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))


def describe() -> dict:
    """What a benchmark report records about the machine."""
    info = cpu_info()
    flags = set(info.get("flags", "").split())
    return {"cpu": info.get("model name") or platform.processor() or platform.machine(),
            "cores": os.cpu_count(), "threads": torch.get_num_threads(), "cpu_threads": applied().as_record(),
            "matmul_flags": [flag for flag in MATMUL_FLAGS if flag in flags],
            "bf16_matmul": "oneDNN" if onednn_bf16() else "generic (time grows with rows)",
            "weight_only_kernels": weight_only_kernels(), "torch": torch.__version__}


def weight_only_kernels() -> str:
    """The code path of torch's CPU int4 and int8 weight-only matmuls (a weight-only target's or a derived draft's):
    ATen's vectorized kernels at the CPU capability torch dispatched to (AVX512, AVX2 or DEFAULT, scalar)."""
    return f"ATen {torch.backends.cpu.get_cpu_capability()}"
