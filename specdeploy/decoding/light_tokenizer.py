"""A tokenizer directory loaded without transformers: `tokenizers` for the ids, jinja2 for the chat template.

Importing transformers and building an AutoTokenizer costs a served model's process about 2.5 s of a 2-core CPU at
every tritonserver start, for what `tokenizers` (tokenizer.json) and jinja2 (the chat template) do themselves.
LightTokenizer offers what serving asks of a tokenizer (chat_template.encode_prompt, end_of_sequence_ids,
detokenizer.decode) and gives what transformers 5 gives for a directory that transformers saved as a plain
`tokenizers` backend (tokenizer_class TokenizersBackend or PreTrainedTokenizerFast):

- tokenizer.json as it is, without truncation or padding (a transformers call that asks for neither turns them off);
  special-token text in the input is matched as the special token unless the config sets split_special_tokens;
- the named special tokens (bos_token, eos_token, ..., and the config's other `*_token` entries) and the extra ones,
  added to the backend as special tokens when tokenizer.json does not hold them;
- decoding by the backend's decoder, special tokens skipped on request;
- the chat template from chat_template.jinja, else tokenizer_config.json's "chat_template" (several named templates:
  the "default" one), rendered in a sandboxed jinja2 environment set up as transformers sets up its own:
  trim_blocks and lstrip_blocks, the loopcontrols extension and the `{% generation %}` block, `raise_exception`,
  `strftime_now`, a JSON `tojson` filter that escapes no HTML and keeps non-ASCII text, a `namespace` that refuses
  underscore names; the template sees the messages (keys whose value is None dropped, a message's reasoning under
  both `thinking` and `reasoning_content`), `tools` and `documents` as None, `add_generation_prompt` and the
  named special tokens' text.

`load_tokenizer_files` returns transformers' AutoTokenizer for any other directory (`light_unsupported` says why),
so a checkpoint in a form this module does not reproduce is served as before, only slower to load.
tests/decoding/test_light_tokenizer.py compares both on the served tokenizers.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

TOKENIZER_FILE, CONFIG_FILE, TEMPLATE_FILE, TEMPLATE_DIR = (
    "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "additional_chat_templates")
# tokenizer classes whose transformers loader takes tokenizer.json as it is (a model-specific class may rebuild the
# backend from the vocabulary with its own normalizer and pre-tokenizer)
PLAIN_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# older files and settings transformers merges in or acts on, which this module does not reproduce
LEGACY_FILES = ("special_tokens_map.json", "added_tokens.json")
UNSUPPORTED_KEYS = ("auto_map", "fast_tokenizer_files", "fix_mistral_regex")
REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")  # the names a message's reasoning goes by


def light_unsupported(directory: str | Path) -> str | None:
    """Why LightTokenizer would not load `directory` as transformers does; None when it does."""
    directory = Path(directory)
    for name in (TOKENIZER_FILE, CONFIG_FILE):
        if not (directory / name).is_file():
            return f"no {name}"
    config = json.loads((directory / CONFIG_FILE).read_text(encoding="utf-8"))
    if config.get("tokenizer_class") not in PLAIN_CLASSES:
        return f"tokenizer_class {config.get('tokenizer_class')!r} (not one of {', '.join(PLAIN_CLASSES)})"
    present = [name for name in LEGACY_FILES if (directory / name).exists()]
    present += [key for key in UNSUPPORTED_KEYS if config.get(key)]
    if config.get("clean_up_tokenization_spaces"):
        present.append("clean_up_tokenization_spaces")
    return f"{', '.join(present)} in the tokenizer's files" if present else None


def load_tokenizer_files(directory: str | Path):
    """A LightTokenizer for a directory it reproduces, else transformers' AutoTokenizer."""
    if light_unsupported(directory) is None:
        return LightTokenizer(directory)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory)


class LightTokenizer:
    """A tokenizer directory's tokenizer as serving uses it (see the module docstring); `backend` is the
    tokenizers.Tokenizer. Encoding and decoding change none of the backend's settings (a transformers call sets
    its truncation, padding and special-token splitting each time)."""

    def __init__(self, directory: str | Path) -> None:
        from tokenizers import Tokenizer

        directory = Path(directory)
        reason = light_unsupported(directory)
        if reason is not None:
            raise ValueError(f"{directory}: not a plain tokenizers directory ({reason}); use load_tokenizer_files")
        config = json.loads((directory / CONFIG_FILE).read_text(encoding="utf-8"))
        self.backend = Tokenizer.from_file(str(directory / TOKENIZER_FILE))
        self.backend.no_truncation()
        self.backend.no_padding()
        self.backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
        self.named_tokens = named_tokens(config)  # name → AddedToken
        self._add_missing_tokens(config)
        self.special_tokens_map = {name: token.content for name, token in self.named_tokens.items()}
        eos = self.special_tokens_map.get("eos_token")
        self.eos_token_id = None if eos is None else self.backend.token_to_id(eos)
        self.chat_template = chat_templates(directory, config)
        self._templates: dict[str, object] = {}  # source → compiled

    def _add_missing_tokens(self, config: dict) -> None:
        """Add what tokenizer.json does not hold, in transformers' order: the config's added tokens (older saves
        list them), the named special tokens, the extra special tokens."""
        held = {token.content for token in self.backend.get_added_tokens_decoder().values()}
        listed = sorted(config.get("added_tokens_decoder", {}).items(), key=lambda item: int(item[0]))
        extra = extra_tokens(config)
        new = []
        for token in [*(added_token(entry) for _, entry in listed), *self.named_tokens.values(),
                      *(added_token(entry) for entry in (extra if isinstance(extra, list) else []))]:
            if token.content not in held:
                held.add(token.content)
                new.append(token)
        if new:
            self.backend.add_tokens(new)

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        """transformers' call on one text, for its input_ids."""
        return {"input_ids": self.encode(text, add_special_tokens)}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; add_special_tokens: with those tokenizer.json's post-processor adds."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, conversation: list[dict], *, tokenize: bool, add_generation_prompt: bool = False,
                            **template_kwargs) -> str:
        """The conversation rendered in the chat template, as text (tokenize=False; encode it with
        add_special_tokens=False, as transformers does). template_kwargs: more variables for the template."""
        if tokenize:
            raise ValueError("LightTokenizer.apply_chat_template renders text: pass tokenize=False and encode it")
        if not conversation:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        source = self._template_source()
        if source not in self._templates:
            self._templates[source] = chat_environment().from_string(source)
        return self._templates[source].render(
            messages=[template_message(message) for message in conversation], tools=None, documents=None,
            add_generation_prompt=add_generation_prompt, **{**self.special_tokens_map, **template_kwargs})

    def _template_source(self) -> str:
        if isinstance(self.chat_template, dict):
            if "default" not in self.chat_template:
                raise ValueError(f"the tokenizer has several chat templates ({', '.join(sorted(self.chat_template))})"
                                 " and no default")
            return self.chat_template["default"]
        if not self.chat_template:
            raise ValueError("the tokenizer has no chat template")
        return self.chat_template


def added_token(entry, named: bool = False):
    """A tokenizers AddedToken from the config's form: a text (a special token), or a dict of AddedToken's fields
    (a named token is special whatever its dict says)."""
    from tokenizers import AddedToken

    if isinstance(entry, str):
        return AddedToken(entry, special=True)
    fields = {key: value for key, value in entry.items() if key not in ("__type", "id")}
    return AddedToken(**{**fields, "special": True} if named else fields)


def extra_tokens(config: dict) -> list | dict:
    """extra_special_tokens (a list, or a dict of named ones), under its older name when it is empty or absent."""
    return config.get("extra_special_tokens") or config.get("additional_special_tokens") or []


def named_tokens(config: dict) -> dict:
    """The config's named special tokens, name → AddedToken, in the order transformers adds missing ones: the
    standard names, the config's other `*_token` entries (those written as an AddedToken's dict, then those written
    as text) and a dict of extra_special_tokens."""
    others = [(key, value) for key, value in config.items() if key.endswith("_token") and key not in NAMED_TOKENS]
    names = {key: config[key] for key in NAMED_TOKENS if config.get(key) is not None}
    names |= {key: value for key, value in others if isinstance(value, dict) and value.get("__type") == "AddedToken"}
    names |= {key: value for key, value in others if isinstance(value, str)}
    if isinstance(extra := extra_tokens(config), dict):
        names |= extra
    return {name: added_token(value, named=True) for name, value in names.items()}


def chat_templates(directory: Path, config: dict) -> str | dict[str, str] | None:
    """The chat template: chat_template.jinja and additional_chat_templates/*.jinja when there are any (one
    default template as text, several as name → text), else the config's "chat_template" (a list of named ones
    as a dict)."""
    found = {}
    if (directory / TEMPLATE_FILE).is_file():
        found["default"] = (directory / TEMPLATE_FILE).read_text(encoding="utf-8")
    if (directory / TEMPLATE_DIR).is_dir():
        for path in sorted((directory / TEMPLATE_DIR).glob("*.jinja")):
            found[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if found:
        return found["default"] if list(found) == ["default"] else found
    template = config.get("chat_template")
    if isinstance(template, list):
        return {entry["name"]: entry["template"] for entry in template}
    return template


def template_message(message: dict) -> dict:
    """A message as the template sees it: plain data, without None values, its reasoning under both names."""
    message = {key: plain(value) for key, value in message.items() if value is not None}
    reasoning = next((message[key] for key in REASONING_KEYS if message.get(key) is not None), None)
    return message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning}


def plain(value):
    """JSON-like data rebuilt from plain types (the sandbox is safe with these, not with arbitrary objects)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, dict):
        return {plain(key): plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(plain(item) for item in value)
    raise TypeError(f"chat messages hold JSON-like data (text, numbers, lists, dicts), not {type(value).__name__}")


def chat_environment(trim_blocks: bool = True, lstrip_blocks: bool = True):
    """The sandboxed jinja2 environment chat templates are written for (the options exist for the tests' negative
    controls: a template rendered without them differs)."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        """`{% generation %}...{% endgeneration %}` marks the assistant's text for training masks; rendering
        keeps the body as it is (in a scope of its own, as a call block)."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class SafeNamespace(jinja2.utils.Namespace):
        """`namespace(...)` that refuses attributes named with a leading underscore."""

        def __init__(*args, **kwargs):  # Namespace's own signature trick: namespace(self=...) stays possible
            self, args = args[0], args[1:]
            values = dict(*args, **kwargs)
            for name in values:
                SafeNamespace.check(name)
            jinja2.utils.Namespace.__init__(self, values)

        def __setitem__(self, name, value):
            SafeNamespace.check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def check(name) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"chat templates cannot store underscore-prefixed attributes on"
                                                      f" a namespace, got {name!r}")

    class DictMaker:
        """`dict(...)` and `dict.fromkeys(...)`, without the dict type's other attributes."""

        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def strftime_now(format):  # the name templates may pass it by
        return datetime.now().strftime(format)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    environment = ImmutableSandboxedEnvironment(trim_blocks=trim_blocks, lstrip_blocks=lstrip_blocks,
                                                extensions=[GenerationBlock, loopcontrols])
    environment.filters["tojson"] = tojson
    environment.globals.update(raise_exception=raise_exception, strftime_now=strftime_now,
                               dict=DictMaker(), namespace=SafeNamespace)
    return environment
