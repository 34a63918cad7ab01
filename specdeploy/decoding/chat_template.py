"""Text into token ids: a prompt in the model's chat template, and the tokens that end a generation."""

from __future__ import annotations

from collections.abc import Iterable

from specdeploy.errors import RequestError


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Token ids for a user message; wrapped in the chat template when the tokenizer has one."""
    if not text or not text.strip():
        raise RequestError("text_input: must not be empty")
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(text)["input_ids"]


def end_of_sequence_ids(tokenizer, model_eos_ids: int | Iterable[int] | None) -> frozenset[int]:
    """The tokens that end a generation by default: the model's end-of-sequence ids (one, several or none, as a
    config.json's eos_token_id has them) and the tokenizer's."""
    ids = {model_eos_ids} if isinstance(model_eos_ids, int) else set(model_eos_ids or ())
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
