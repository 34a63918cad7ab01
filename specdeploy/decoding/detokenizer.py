"""Token ids into text as they arrive, never as broken UTF-8.

Incremental detokenisation decodes a window of tokens and emits what its newest tokens add. A trailing U+FFFD
means a multi-byte character is still incomplete, so the tokens of that character are held back until a later
token completes it. The window starts a few tokens before the first new one: decoding both the window and its
already-shown part from the same first token cancels tokenizer effects at the window's start (a leading-space
marker a decoder strips), and covers the tokens of a held-back character. Each response therefore decodes only
`STREAM_CONTEXT` shown tokens plus the new ones, and the cost of a stream grows linearly with its length.
"""

from __future__ import annotations

HELD_BACK = 4  # a UTF-8 character has at most 4 bytes, so at most 4 byte tokens await its completion
# Shown tokens resent before the new ones: held-back tokens, then room for the decoding to start at a character
# boundary and for a decoder's start-of-text effects.
STREAM_CONTEXT = 8


def decode(tokenizer, ids: list[int]) -> str:
    """The text of generated ids (special tokens, such as the end-of-sequence token, are not text)."""
    return tokenizer.decode(ids, skip_special_tokens=True)


def visible_text(tokenizer, ids: list[int]) -> str:
    """The text of `ids` without an incomplete trailing character. A byte-fallback decoder (Llama-style <0xNN>
    tokens) turns a whole run of byte tokens into U+FFFD when its last character is incomplete, so the tokens of
    that character are dropped (at most HELD_BACK of them), not just the replacement characters."""
    for end in range(len(ids), max(len(ids) - HELD_BACK, 0) - 1, -1):
        text = decode(tokenizer, ids[:end])
        if not text.endswith("\ufffd"):
            return text
    return decode(tokenizer, ids).rstrip("\ufffd")  # invalid bytes, not an incomplete character


def new_text(tokenizer, window: list[int], shown: int) -> str:
    """The text the tokens of `window` after its first `shown` add: the stateless form, for a caller that keeps
    only how many tokens it has shown. Text held back at the end of the shown part comes out here.

    Decoding starts at the window's first token that begins a character (a window may start in the middle of
    one, whose bytes alone decode to U+FFFD), so the shown part and the whole window decode alike.
    """
    start = next((i for i in range(shown + 1) if begins_character(tokenizer, window, i)), shown)
    before = visible_text(tokenizer, window[start:shown])
    now = visible_text(tokenizer, window[start:])
    return now[len(before):] if now.startswith(before) else ""


def begins_character(tokenizer, ids: list[int], index: int) -> bool:
    """Whether ids[index] starts a character: some prefix of at most HELD_BACK tokens from it decodes to text that
    does not start with U+FFFD. (The whole rest is not decoded: a byte-fallback decoder turns a run of byte tokens
    ending in an incomplete character entirely into U+FFFD.)"""
    return any(not decode(tokenizer, ids[index:end]).startswith("\ufffd")
               for end in range(index + 1, min(index + HELD_BACK, len(ids)) + 1))


def stream_window(ids: list[int], shown: int) -> tuple[list[int], int]:
    """What a streamed response carries for `ids` of which the first `shown` were sent before: the window
    (at most STREAM_CONTEXT shown tokens, then the new ones) and how many of its tokens were shown."""
    start = max(0, shown - STREAM_CONTEXT)
    return ids[start:], shown - start


def first_stop_end(text: str, stops: list[str]) -> int | None:
    """The end of the earliest-ending stop string in `text` (None: none occurs)."""
    ends = [found + len(stop) for stop in stops if (found := text.find(stop)) >= 0]
    return min(ends) if ends else None


class IncrementalDetokenizer:
    """The stateful form: feed tokens as they come, receive the text they complete. stops: the request's stop
    strings; the text ends with the first one (what its completing token carries past it is not shown)."""

    def __init__(self, tokenizer, stops: list[str] | tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stops = list(stops)
        self.tokens: list[int] = []
        self.text = ""

    def add(self, tokens: list[int]) -> str:
        shown = len(self.tokens)
        self.tokens.extend(tokens)
        window, window_shown = stream_window(self.tokens, shown)
        return self._shown(new_text(self.tokenizer, window, window_shown))

    def flush(self) -> str:
        """At the end: whatever is still held back (an incomplete final character comes out as U+FFFD)."""
        full = decode(self.tokenizer, self.tokens)
        return self._shown(full[len(self.text):] if full.startswith(self.text) else "")

    def _shown(self, new: str) -> str:
        """Append `new` to the text, cut after the first stop string; returns what of it is shown."""
        self.text += new
        end = first_stop_end(self.text, self.stops) if self.stops else None
        if end is None or end >= len(self.text):
            return new
        cut = len(self.text) - end
        self.text = self.text[:end]
        return new[:max(len(new) - cut, 0)]
