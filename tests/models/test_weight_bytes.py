"""The weight bytes a token's forward reads (LlamaModel.weight_bytes_per_token): what bench divides a bandwidth by
for the ceiling on plain decode, counted in every form a pipeline can store its weights in."""

from __future__ import annotations

import torch
from helpers.pipelines import tiny_pipeline

from specdeploy.build.checkpoints import load_checkpoint
from specdeploy.build.torch_engine import quantized_state
from specdeploy.models.llama import LlamaModel
from specdeploy.spec.pipeline import load_pipeline


def test_every_stored_form_counts_each_matrix_a_token_reads(tiny_checkpoints, tmp_path):
    """fp32 is four bytes a weight, int8 rows one; int4 keeps the head as int8 rows (target.weight_only: int4) or
    reads a rescored head's int4 pass (a derived draft). An int8 row used to count nothing, so an int8 target's
    ceiling divided by zero."""
    pipeline = load_pipeline(tiny_pipeline(tmp_path, "tiny-bytes", tiny_checkpoints["target"], method="ngram"))
    dense = load_checkpoint(pipeline.target.checkpoint, pipeline)
    weights = LlamaModel(dense.config, dense.state).weight_bytes_per_token() // 4
    head = dense.config.vocab_size * dense.config.hidden_size

    def stored(precision: str, rescored_head: bool = False) -> int:
        state = quantized_state(dense.state, precision, rescored_head)
        return LlamaModel(dense.config, state, torch.bfloat16).weight_bytes_per_token()

    assert LlamaModel(dense.config, dense.state, torch.bfloat16).weight_bytes_per_token() == 2 * weights
    assert stored("int8") == weights
    assert stored("int4") == (weights - head) // 2 + head
    assert stored("int4", rescored_head=True) == weights // 2
