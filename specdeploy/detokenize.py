"""Incremental detokenisation: text arrives as tokens do, and never as broken UTF-8.

The whole generated sequence is decoded each time and only the new suffix is emitted. A trailing U+FFFD means a
multi-byte character is still incomplete, so that part is held back until a later token completes it.
"""

from __future__ import annotations


def visible_text(tokenizer, ids: list[int]) -> str:
    """Decoded text without a trailing incomplete character."""
    return tokenizer.decode(ids, skip_special_tokens=True).rstrip("\ufffd")


def new_text(tokenizer, ids: list[int], previous_length: int) -> str:
    """The text `ids` add beyond their first previous_length tokens (already shown): the stateless form, for a
    caller that keeps only how many tokens it has sent."""
    before = visible_text(tokenizer, ids[:previous_length]) if previous_length else ""
    now = visible_text(tokenizer, ids)
    return now[len(before):] if now.startswith(before) else ""


class IncrementalDetokenizer:
    """The stateful form: feed tokens as they come, receive the text they complete."""

    def __init__(self, tokenizer, skip_ids: set[int] = frozenset()) -> None:
        self.tokenizer, self.skip_ids = tokenizer, set(skip_ids)
        self.tokens: list[int] = []
        self.emitted = ""

    def add(self, tokens: list[int]) -> str:
        self.tokens.extend(t for t in tokens if t not in self.skip_ids)
        text = visible_text(self.tokenizer, self.tokens)
        if not text.startswith(self.emitted):
            return ""
        new, self.emitted = text[len(self.emitted):], text
        return new

    def flush(self) -> str:
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        new = text[len(self.emitted):] if text.startswith(self.emitted) else ""
        self.emitted = text
        return new
