"""The tokens that end a generation: the model's end ids, however its config.json writes them, and the tokenizer's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from specdeploy.decoding.chat_template import end_of_sequence_ids


@pytest.mark.parametrize("model_eos, expected", [(7, {7, 2}), ([7, 8], {7, 8, 2}), ((8,), {8, 2}), (None, {2})])
def test_end_ids_are_the_models_and_the_tokenizers(model_eos, expected):
    assert end_of_sequence_ids(SimpleNamespace(eos_token_id=2), model_eos) == frozenset(expected)


def test_a_tokenizer_without_an_end_token_adds_none():
    assert end_of_sequence_ids(SimpleNamespace(eos_token_id=None), [5]) == frozenset({5})
