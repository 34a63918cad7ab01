"""Stop strings match the generated text (across tokens, inside a token, inside a burst), not token ids."""

from __future__ import annotations

import pytest

from specdeploy.decoding.detokenizer import IncrementalDetokenizer
from specdeploy.decoding.draft_length import ProposalLength
from specdeploy.decoding.sequence import Sequence
from specdeploy.errors import RequestError
from specdeploy.spec.request import GenerationRequest, check_stop_strings
from specdeploy.spec.sampling_params import SamplingParams

pytestmark = pytest.mark.smollm2


def sequence(tokenizer, stops: list[str]) -> Sequence:
    request = GenerationRequest([1, 2], 64, SamplingParams(), stop_strings=stops)
    return Sequence.for_request(request, ProposalLength("constant", 4), frozenset(), tokenizer=tokenizer)


@pytest.mark.parametrize("text, stop, shown", [
    ("def square(num):\n    return num ** 2\n", " return", "def square(num):\n    return"),
    ("The capital of France is Paris, of course.", " Paris", "The capital of France is Paris"),
    ("The capital of France is Paris, of course.", "Paris", "The capital of France is Paris"),
    ("The capital of France is Paris, of course.", "is Par", "The capital of France is Par"),  # ends inside a token
    ("The capital of France is Paris, of course.", "France is", "The capital of France is"),  # spans tokens
])
def test_a_burst_stops_at_the_token_completing_the_stop_string(smollm2_fp32_engines, text, stop, shown):
    """The whole text arrives as one accepted burst: the sequence keeps tokens up to the one whose text completes
    the stop string, and the streamed text ends with the stop string. Token-id matching misses these: the stop
    word alone encodes to other ids than inside text."""
    tokenizer = smollm2_fp32_engines["draft-target"].tokenizer
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    seq = sequence(tokenizer, [stop])
    kept = seq.append(ids)
    assert seq.finish_reason == "stop" and len(kept) < len(ids)
    assert stop in tokenizer.decode(kept) and stop not in tokenizer.decode(kept[:-1])
    detokenizer = IncrementalDetokenizer(tokenizer, [stop])
    assert detokenizer.add(kept[:2]) + detokenizer.add(kept[2:]) + detokenizer.flush() == shown
    plain = sequence(tokenizer, [])
    plain.stop_sequences = [tokenizer(stop, add_special_tokens=False)["input_ids"]]
    if stop in ("Paris", "is Par"):
        plain.append(ids)
        assert plain.finish_reason is None  # what the id-matching did: never stopped


@pytest.mark.parametrize("stops, message", [
    ([""], "stop_words: word 0 is empty"), (["ok", "  "], "stop_words: word 1 is only whitespace"),
    (["x" * 300], "stop_words: word 0 has 300 characters"), (["a"] * 17, "stop_words: at most 16"),
])
def test_empty_blank_or_oversized_stop_words_are_refused_naming_the_field(stops, message):
    with pytest.raises(RequestError, match=message):
        check_stop_strings(stops)
    check_stop_strings(["\n", " return"])
