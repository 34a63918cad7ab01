"""What the trtllm flavour's `speculative` model reads of the target's config.json: its vocabulary size and end ids,
as transformers' AutoConfig gives them, without importing transformers when the file holds both."""

from __future__ import annotations

import json

import pytest
from helpers.tiny_models import TINY

from specdeploy.serve.model_files import model_vocabulary


@pytest.mark.parametrize("eos", [2, [2, 7], None])
def test_a_config_with_both_fields_is_read_as_written(tmp_path, eos):
    from transformers import AutoConfig, LlamaConfig

    LlamaConfig(**{**TINY, "eos_token_id": eos}).save_pretrained(tmp_path)
    config = AutoConfig.from_pretrained(tmp_path)
    assert model_vocabulary(tmp_path) == (config.vocab_size, config.eos_token_id) == (TINY["vocab_size"], eos)


def test_a_field_the_file_leaves_out_takes_the_model_class_default(tmp_path):
    """A hand-written config.json without eos_token_id: Llama's default end id, as AutoConfig has it."""
    from transformers import AutoConfig

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 100}))
    config = AutoConfig.from_pretrained(tmp_path)
    assert model_vocabulary(tmp_path) == (100, config.eos_token_id)
    assert config.eos_token_id is not None
