"""Weight-only quantization for derived drafts: int4 groups for the projections, int8 rows for the vocabulary head
(or, for `derive: int8`, int8 rows for everything).

Int4: a weight row is split into groups of `group_size`; each group stores 4-bit codes q in [0, 15] with a scale and
a minimum, so w ≈ q * scale + minimum (the same shape as GGUF's Q4_1 blocks, which therefore round-trip almost
exactly). Int8: one symmetric scale per row. The embedding/vocabulary matrix of SmolLM2's GGUF is Q8_0, not Q4_1,
and an int4 head costs the draft much of its agreement with the target, while int8 keeps it for little more
cost. A derived draft's head is therefore two-stage (`RescoredHead`): int4 logits for every token, then the top few
recomputed from int8 rows. Reading half the bytes makes the draft's forward cheaper, and the int8 argmax has always
been among the int4 top 4 where measured, so the draft agrees with the target as often as with a full int8 head
(figures: docs/benchmarks.md, "Figures behind the code"). The matmuls run in torch's weight-only kernels (CPU, or
tinygemm on an NVIDIA GPU).
"""

from __future__ import annotations

import torch
from torch import nn

from specdeploy.models.machine import onednn_bf16
from specdeploy.models.reductions import topk_indices

GROUP_SIZE = 32
INT4_KERNEL_ROWS = 16  # torch's CPU int4 kernel packs output rows in blocks of 16
TINYGEMM_CAPABILITY = (8, 0)  # the GPU int4 kernel needs Ampere or newer


def quantize_int4(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> dict[str, torch.Tensor]:
    """weight: [N, K] float → {"codes": uint8 [N, K/2] (two codes per byte), "scales", "minimums": fp32 [N, K/g]}."""
    out_features, in_features = weight.shape
    if in_features % group_size:
        raise ValueError(f"in_features {in_features} is not a multiple of the int4 group size {group_size}")
    groups = weight.float().reshape(out_features, in_features // group_size, group_size)
    minimum = groups.amin(-1)
    scale = ((groups.amax(-1) - minimum) / 15).clamp(min=1e-10)
    codes = ((groups - minimum[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.uint8)
    codes = codes.reshape(out_features, in_features)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return {"codes": packed, "scales": scale, "minimums": minimum}


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] → int32 [N, K] codes in [0, 15]."""
    low, high = packed & 0xF, packed >> 4
    return torch.stack([low, high], dim=-1).reshape(packed.shape[0], -1).to(torch.int32)


def dequantize_int4(codes: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor) -> torch.Tensor:
    """Inverse of quantize_int4 up to rounding: fp32 [N, K]."""
    values = unpack_codes(codes).float()
    out_features, in_features = values.shape
    group_size = in_features // scales.shape[1]
    groups = values.reshape(out_features, -1, group_size)
    return (groups * scales[..., None] + minimums[..., None]).reshape(out_features, in_features)


class Int4Linear(nn.Module):
    """y = x @ dequant(W).T with W stored as int4 groups. x: [..., K] → [..., N] in x's dtype.

    The codes are packed at construction for the kernel of the device they are on: torch's CPU int4 kernel, or on a
    GPU the tinygemm kernel (`_weight_int4pack_mm`), which takes the first of two codes in a byte's high nibble
    (ours keep it in the low one) and needs an Ampere or newer GPU, N a multiple of 8 and K of 16 × its inner K
    tiles. Any other GPU layer is dequantized to bf16 once instead.

    On a CPU, `keep_bf16_copy` adds a bf16 copy of the same int4 values for forwards of many rows: torch's CPU int4
    kernel unpacks its weights again for every block of rows, so a verify's cost grows with its width, where
    oneDNN's bf16 matmul from prepacked weights barely does. Measured, the copies pay only from about 9 rows and
    cost 4x the codes' memory, so no engine keeps them yet (docs/benchmarks.md, "Verify widths on the int4 path").
    With a copy, a row's result depends on how many rows it comes with: a batch-invariant engine's probe
    (row_invariance.invariant_rows) then computes the layer in blocks below `wide_from_rows`, from int4 only."""

    # The bf16 copy (prepacked for oneDNN) and the row count from which a forward uses it; None: int4 only.
    wide: torch.Tensor | None = None
    wide_from_rows: int | None = None

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor) -> None:
        super().__init__()
        self.out_features = codes.shape[0]
        self.in_features = codes.shape[1] * 2
        self.group_size = self.in_features // scales.shape[1]
        self.on_gpu = codes.device.type == "cuda"
        tiles = inner_k_tiles(self.in_features)
        self.dense = None
        if self.on_gpu and (tiles is None or self.out_features % 8 or torch.cuda.get_device_capability(codes.device)
                            < TINYGEMM_CAPABILITY):
            self.dense = dequantize_int4(codes, scales, minimums).to(torch.bfloat16)
            return
        # the kernels compute (q - 8) * scale + zero, so zero = minimum + 8 * scale.
        zeros = minimums + 8 * scales
        self.register_buffer("scales_and_zeros",
                             torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16))
        if self.on_gpu:
            self.register_buffer("packed", torch._convert_weight_to_int4pack(high_nibble_first(codes), tiles))
        else:
            self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(unpack_codes(codes), 1))

    def keep_bf16_copy(self, from_rows: int) -> int:
        """Run forwards of `from_rows` rows or more from a bf16 copy of this layer's int4 values, prepacked for
        oneDNN: each weight as the int4 kernel computes it, (q - 8) * scale + zero from the bf16 scales and zeros
        in fp32, rounded once to bf16. A CPU without oneDNN's bf16 kernels, or a GPU layer, keeps int4 only.
        Returns the copy's bytes (0 where none is kept)."""
        if self.on_gpu or not onednn_bf16():
            return 0
        values = self.dequantized().to(torch.bfloat16)
        self.wide = torch.ops.mkldnn._reorder_linear_weight(values, 1)
        self.wide_from_rows = from_rows
        return values.numel() * values.element_size()

    def dequantized(self) -> torch.Tensor:
        """fp32 [N, K]: the weights the CPU int4 kernel multiplies by, read back through the kernel itself (the
        identity's rows times the weights are the weights, each product and sum exact in fp32; fp32 rows take
        fp32 scales and zeros, which hold the bf16 ones exactly). Slow, as the kernel takes K rows in blocks of 4:
        92 s for SmolLM2-135M's 120 int4 layers (2 threads); an engine keeping copies at load should dequantize
        the codes it loads instead (the same values, test_quantize.py)."""
        identity = torch.eye(self.in_features)
        return torch._weight_int4pack_mm_for_cpu(identity, self.packed, self.group_size,
                                                 self.scales_and_zeros.float()).T.contiguous()

    @property
    def weight_bytes(self) -> int:
        """Bytes of the codes a one-row forward reads (packed for its kernel, or dequantized to bf16 on a GPU it
        does not suit; not a bf16 copy kept for wide forwards); the scales and zeros are not counted."""
        matrix = self.packed if self.dense is None else self.dense
        return matrix.numel() * matrix.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = as_bf16_rows(x)
        if self.dense is not None:
            out = rows @ self.dense.T
        elif self.wide is not None and rows.shape[0] >= self.wide_from_rows:
            out = torch.ops.mkldnn._linear_pointwise(rows, self.wide, None, "none", [], "")
        elif self.on_gpu:
            out = torch._weight_int4pack_mm(rows, self.packed, self.group_size, self.scales_and_zeros)
        else:
            out = torch._weight_int4pack_mm_for_cpu(rows, self.packed, self.group_size, self.scales_and_zeros)
        return from_bf16_rows(out, x)


def inner_k_tiles(in_features: int) -> int | None:
    """The GPU int4 kernel's inner K tiles for rows of in_features (the largest of 8, 4, 2 that divides them into
    tiles of 16), or None when none does."""
    return next((tiles for tiles in (8, 4, 2) if in_features % (tiles * 16) == 0), None)


def high_nibble_first(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] with code 2i in the low nibble → the same codes with code 2i in the high nibble (the GPU
    kernel's order)."""
    return (packed << 4) | (packed >> 4)


def quantize_int8(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """weight: [N, K] float → {"int8": int8 [N, K], "row_scales": fp32 [N]} with w ≈ int8 * row_scale."""
    scale = (weight.float().abs().amax(-1) / 127).clamp(min=1e-10)
    return {"int8": (weight.float() / scale[:, None]).round().clamp(-127, 127).to(torch.int8), "row_scales": scale}


class Int8Linear(nn.Module):
    """y = x @ (int8 * row_scale).T. x: [..., K] → [..., N] in x's dtype."""

    def __init__(self, int8: torch.Tensor, row_scales: torch.Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = int8.shape
        # a fresh (64-byte aligned) copy: the CPU kernel's 4-row path crashed on a view into a loaded safetensors
        # buffer, whose data sit 8-byte aligned (torch 2.13)
        self.register_buffer("weight_int8", int8.clone())
        self.register_buffer("row_scales", row_scales.to(torch.bfloat16))

    @property
    def weight_bytes(self) -> int:
        """Bytes of the int8 rows a forward reads (the row scales are not counted)."""
        return self.weight_int8.numel() * self.weight_int8.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return from_bf16_rows(torch._weight_int8pack_mm(as_bf16_rows(x), self.weight_int8, self.row_scales), x)


class RescoredHead(nn.Module):
    """Vocabulary head read at int4 with the top `rescored` logits recomputed from int8 rows.
    x: [..., K] → fp32 logits [..., V]. The result is one fixed function of x, so whatever a draft samples from it
    is its q; only how closely it tracks the int8 logits depends on the int8 winner being in the int4 top few."""

    def __init__(self, coarse: Int4Linear, int8: torch.Tensor, row_scales: torch.Tensor, rescored: int = 4) -> None:
        super().__init__()
        self.coarse = coarse
        self.register_buffer("weight_int8", int8)
        self.register_buffer("row_scales", row_scales.float())
        self.rescored = rescored

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.coarse(x).float()
        flat, flat_logits = x.reshape(-1, x.shape[-1]).float(), logits.view(-1, logits.shape[-1])
        top = topk_indices(flat_logits, self.rescored)  # [N, k]
        rows = self.weight_int8[top].float()  # [N, k, K]
        exact = torch.einsum("nk,njk->nj", flat, rows) * self.row_scales[top]
        # Rounded to x's dtype like the target's logits: a bf16 target's argmax among equal bf16 values is the
        # lowest index, and a draft resolving those ties in fp32 disagrees with it (acceptance 0.94 vs 0.96).
        flat_logits.scatter_(-1, top, exact.to(x.dtype).float())
        return logits


def as_bf16_rows(x: torch.Tensor) -> torch.Tensor:
    """[..., K] → the contiguous bf16 [N, K] the weight-only kernels take (no copy when it already is)."""
    flat = x.reshape(-1, x.shape[-1])
    return flat if flat.dtype == torch.bfloat16 and flat.is_contiguous() else flat.to(torch.bfloat16).contiguous()


def from_bf16_rows(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """[N, N_out] kernel output → [..., N_out] in x's dtype."""
    out = out.view(*x.shape[:-1], out.shape[-1])
    return out if out.dtype == x.dtype else out.to(x.dtype)
