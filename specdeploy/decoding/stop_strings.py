"""Stop strings matched on the text a request generates, not on token ids.

A word has different token ids alone and inside text ("return" vs " return", "Paris" vs " Paris"), and a stop
string can span tokens or end inside one, so matching the ids the stop words encode to misses most of them. The
generated tokens are detokenised as they are committed (the streaming detokeniser's rules, so an incomplete UTF-8
character is not text yet) and the request ends at the first token whose text completes a stop string.

The stop string stays in the output. tensorrtllm_backend's preprocessing encodes each stop word alone
(`_to_word_list_format`: `tokenizer.encode(word, add_special_tokens=False)`, words that encode to nothing skipped
silently; all_models/inflight_batcher_llm/preprocessing/1/model.py @ e1bc742) and its postprocessing decodes the
output ids, so a matched word's tokens are in the text unless the executor drops them; that the executor keeps them
is our reading, not checked against its C++ source. Here an empty or blank stop word is refused instead of skipped.
Text the completing token carries past the stop string's end is not shown (IncrementalDetokenizer with the
request's stops). Token ids are not cut: output_ids end with the completing token.
"""

from __future__ import annotations

from specdeploy.decoding.detokenizer import IncrementalDetokenizer, first_stop_end


class StopStrings:
    """Watches one request's generated text for its stop strings."""

    def __init__(self, tokenizer, stops: list[str]) -> None:
        self.stops = list(stops)
        self.longest = max(len(stop) for stop in self.stops)
        self.detokenizer = IncrementalDetokenizer(tokenizer)

    def completes(self, token: int) -> bool:
        """Add a committed token; True when the text now holds a stop string (one ending in this token's text: an
        earlier one would have ended the request before)."""
        new = self.detokenizer.add([token])
        if not new:
            return False
        return first_stop_end(self.detokenizer.text[-(len(new) + self.longest - 1):], self.stops) is not None
