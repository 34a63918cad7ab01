"""Weight-only quantization: int4 round trip and kernel, and the int4 head rescored in int8."""

from __future__ import annotations

import torch

from specdeploy.models.quantize import (
    Int4Linear,
    Int8Linear,
    RescoredHead,
    dequantize_int4,
    quantize_int4,
    quantize_int8,
)


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
