"""Incremental detokenisation: text arrives as tokens do, and never as broken UTF-8."""

from __future__ import annotations


class IncrementalDetokenizer:
    """Decode the whole generated sequence each time and emit only the new suffix. A trailing U+FFFD means a
    multi-byte character is still incomplete, so that text is held back until the next token completes it."""

    def __init__(self, tokenizer, skip_ids: set[int] = frozenset()) -> None:
        self.tokenizer, self.skip_ids = tokenizer, set(skip_ids)
        self.tokens: list[int] = []
        self.emitted = ""

    def add(self, tokens: list[int]) -> str:
        self.tokens.extend(t for t in tokens if t not in self.skip_ids)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if text.endswith("\ufffd") or not text.startswith(self.emitted):
            return ""
        new, self.emitted = text[len(self.emitted):], text
        return new

    def flush(self) -> str:
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        new = text[len(self.emitted):] if text.startswith(self.emitted) else ""
        self.emitted = text
        return new
