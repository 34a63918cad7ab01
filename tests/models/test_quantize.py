"""Weight-only quantization: int4 round trip and kernel, its bf16 copy for wide forwards, and the int4 head rescored
in int8."""

from __future__ import annotations

import torch

from specdeploy.models.quantize import (
    Int4Linear,
    Int8Linear,
    RescoredHead,
    dequantize_int4,
    quantize_int4,
    quantize_int8,
    unpack_codes,
)
from specdeploy.models.row_invariance import invariant_rows


def test_int4_round_trip_and_kernel():
    weight = torch.randn(64, 96, generator=torch.Generator().manual_seed(0))
    parts = quantize_int4(weight)
    restored = dequantize_int4(**parts)
    group_range = weight.reshape(64, 3, 32).amax(-1) - weight.reshape(64, 3, 32).amin(-1)
    assert ((restored - weight).abs().reshape(64, 3, 32).amax(-1) <= group_range / 30 + 1e-6).all()
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(1))
    expected = x.bfloat16().float() @ restored.t()
    torch.testing.assert_close(Int4Linear(**parts)(x), expected, atol=0.1, rtol=0.02)


def test_rescored_head_keeps_the_int8_winner_and_int4_elsewhere():
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(512, 64, generator=generator)
    coarse, fine = Int4Linear(**quantize_int4(weight)), Int8Linear(**quantize_int8(weight))
    head = RescoredHead(coarse, **quantize_int8(weight), rescored=4)
    x = torch.randn(3, 7, 64, generator=generator).bfloat16()
    logits, int4_logits, int8_logits = head(x), coarse(x).float(), fine(x).float()
    assert logits.shape == (3, 7, 512) and logits.dtype == torch.float32
    # At most 4 entries per row differ from the int4 logits, all among the int4 top 4 (ties included) ...
    rescored = logits != int4_logits
    assert (rescored.sum(-1) <= 4).all() and rescored.sum() > 3 * 7 * 2
    fourth = int4_logits.topk(4, dim=-1).values[..., -1:]
    assert (int4_logits[rescored] >= fourth.expand_as(logits)[rescored]).all()
    # ... and they are the int8 logits up to the kernels' accumulation order, rounded to bf16.
    torch.testing.assert_close(logits[rescored], int8_logits[rescored], atol=0.07, rtol=0.01)
    assert torch.equal(logits.argmax(-1), int8_logits.argmax(-1))


def test_dequantized_is_what_the_int4_kernel_multiplies_by():
    parts = quantize_int4(torch.randn(64, 96, generator=torch.Generator().manual_seed(3)))
    layer = Int4Linear(**parts)
    scales, zeros = layer.scales_and_zeros.float().unbind(-1)  # [G, N] each, bf16 values
    codes = unpack_codes(parts["codes"]).float().view(64, 3, 32)
    expected = ((codes - 8) * scales.T[..., None] + zeros.T[..., None]).view(64, 96)
    assert torch.equal(layer.dequantized(), expected)
    torch.testing.assert_close(expected, dequantize_int4(**parts), atol=0.02, rtol=0.01)


def test_bf16_copy_serves_wide_forwards_only_and_computes_the_int4_values():
    generator = torch.Generator().manual_seed(4)
    layer = Int4Linear(**quantize_int4(torch.randn(192, 128, generator=generator)))
    x = torch.randn(12, 128, generator=generator).bfloat16()
    int4 = {width: layer(x[:width]).float() for width in (1, 2, 4, 6, 8, 12)}
    copied_bytes = layer.keep_bf16_copy(from_rows=6)
    if copied_bytes == 0:  # no oneDNN bf16 kernels here: the layer keeps int4 only
        return
    assert copied_bytes == 192 * 128 * 2
    assert layer.weight_bytes == layer.packed.numel()  # a one-row forward still reads the int4 codes only
    for width, expected in int4.items():
        out = layer(x[:width]).float()
        if width < 6:
            assert torch.equal(out, expected)  # below the switch: the int4 kernel, unchanged
        else:  # the same values rounded to bf16, summed in another order
            torch.testing.assert_close(out, expected, atol=0.1, rtol=0.02)


def test_batch_invariance_probe_keeps_a_switching_layer_below_its_switch():
    """A width switch changes a row's result with its company, so a batch-invariant engine computes such a layer
    in blocks below the switch (one kernel path): the probe finds it like any kernel's own width dependence."""
    generator = torch.Generator().manual_seed(5)
    layer = Int4Linear(**quantize_int4(torch.randn(192, 128, generator=generator)))
    if layer.keep_bf16_copy(from_rows=5) == 0:
        return
    assert invariant_rows(layer, 128, torch.bfloat16, torch.device("cpu"), max_rows=16) <= 4
