"""Streamed text: a bounded window of tokens per response, and never broken UTF-8, whatever the chunking.

Each streamed response's text is `new_text(window, shown)` of `stream_window(ids, shown)` (what the speculative
model's detokeniser and `specdeploy generate` do); these tests drive exactly that pair over every way of cutting a
token sequence into responses, with a byte-fallback tokenizer (characters spelled as UTF-8 byte tokens,
split across responses) and with SmolLM2's byte-level BPE.
"""

from __future__ import annotations

import random

import pytest

from specdeploy.decoding.detokenizer import STREAM_CONTEXT, IncrementalDetokenizer, decode, new_text, stream_window

TEXT = "héllo wörld, 你好 🎉 naïve café ∑x² — ok"


def byte_fallback_tokenizer():
    """A Llama-style tokenizer: ASCII letters and '▁' words, every other character as its UTF-8 byte tokens."""
    import string

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for symbol in ["▁", *string.ascii_letters, *string.digits, *",.!?-"]:
        vocab[symbol] = len(vocab)
    backend = Tokenizer(models.BPE(vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def stream(tokenizer, ids: list[int], cuts: list[int]) -> list[str]:
    """The text of each response when the generated ids arrive in pieces ending at `cuts`."""
    pieces, shown = [], 0
    for cut in cuts:
        window, window_shown = stream_window(ids[:cut], shown)
        assert len(window) <= STREAM_CONTEXT + cut - shown  # bounded: never the whole sequence again
        pieces.append(new_text(tokenizer, window, window_shown))
        shown = cut
    return pieces


def chunkings(length: int, count: int, seed: int = 0) -> list[list[int]]:
    """One token per response, everything at once, and `count` random cuttings (what speculation produces)."""
    chooser = random.Random(seed)
    result = [list(range(1, length + 1)), [length]]
    for _ in range(count):
        cuts = sorted(chooser.sample(range(1, length), chooser.randint(1, min(12, length - 1))))
        result.append(cuts + [length])
    return result


def check_streams(tokenizer, text: str) -> int:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert decode(tokenizer, ids) == text
    for cuts in chunkings(len(ids), 200):
        pieces = stream(tokenizer, ids, cuts)
        assert all("\ufffd" not in piece for piece in pieces), (cuts, pieces)
        assert "".join(pieces) == text, cuts
    return len(ids)


def test_byte_fallback_characters_split_across_responses():
    tokenizer = byte_fallback_tokenizer()
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    byte_tokens = [i for i in ids if tokenizer.convert_ids_to_tokens(i).startswith("<0x")]
    assert len(byte_tokens) >= 20  # the multi-byte characters really are spelled in byte tokens
    check_streams(tokenizer, TEXT)


def test_byte_runs_longer_than_the_window():
    """Eight CJK characters are 24 byte tokens in a row: a response's window starts inside the run."""
    tokenizer = byte_fallback_tokenizer()
    assert check_streams(tokenizer, "ok 日本語のテキスト ok 你好世界你好世界") > 3 * STREAM_CONTEXT


def test_a_character_is_held_back_until_its_last_byte_arrives():
    tokenizer = byte_fallback_tokenizer()
    ids = tokenizer("a🎉b", add_special_tokens=False)["input_ids"]  # a, ▁? and four byte tokens, b
    emoji = [i for i in ids if tokenizer.convert_ids_to_tokens(i).startswith("<0x")]
    assert len(emoji) == 4
    first = ids.index(emoji[0])
    pieces = stream(tokenizer, ids, list(range(1, len(ids) + 1)))
    assert pieces[first:first + 3] == ["", "", ""] and pieces[first + 3] == "🎉"


def test_incremental_detokenizer_matches_the_stream():
    tokenizer = byte_fallback_tokenizer()
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces = [detokenizer.add(ids[i:i + 3]) for i in range(0, len(ids), 3)]
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) + detokenizer.flush() == TEXT


@pytest.mark.smollm2
def test_smollm2_byte_level_bpe_streams(smollm2_fp32_engines):
    tokenizer = smollm2_fp32_engines["draft-target"].tokenizer
    count = check_streams(tokenizer, TEXT + " Ünïcödé 🚀🚀 日本語のテキスト")
    assert count > 30


def test_detokenizer_never_emits_broken_utf8(tiny_engines):
    from transformers import AutoTokenizer

    engine = tiny_engines["ngram"]
    tokenizer = AutoTokenizer.from_pretrained(engine.dir / "target")
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces = [detokenizer.add([t]) for t in tokenizer("hello, world")["input_ids"]]
    assert "".join(pieces) + detokenizer.flush() == "hello, world"


def test_detokenizer_holds_back_partial_characters():
    class ByteTokenizer:  # ids are UTF-8 bytes; a multi-byte character spans several ids
        def decode(self, ids, skip_special_tokens=True):
            return bytes(ids).decode("utf-8", errors="replace")

    detokenizer = IncrementalDetokenizer(ByteTokenizer())
    out = [detokenizer.add([b]) for b in "añ€".encode()]
    assert out == ["a", "", "ñ", "", "", "€"]
