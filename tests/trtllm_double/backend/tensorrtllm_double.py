"""A test double of one model of Triton's `tensorrtllm` backend (TensorRT-LLM 1.2.1's in-flight batching executor
over an engine), running our torch model, so the trtllm flavour's orchestration runs for real here.

It behaves like upstream where upstream is unkind; every behaviour has its source (NVIDIA/TensorRT-LLM file and
commit) in tests/trtllm_double/README.md. In short:
- loading (`load_settings`): the four parameters read without a fallback, upstream's message when one is missing,
  gpt_model_type's values, booleans that silently take their default when misspelled, the KV cache fraction in
  (0, 1), the engine at gpt_model_path, KV block reuse required by a draft_tokens_external target;
- requests (`run`): the sequence budget (`LlmRequest::validate`, which reserves the engine's max_draft_len for a
  request without drafts, after trtllm-build added it to max_seq_len), temperature 0 and absent top-k/top-p as the
  sampling config regularises them, seed 0 when none is sent, generation logits only from an engine built to
  gather them, the end token neither returned nor followed;
- sampling: the kernels' walk over the candidates (the token crossing top_p keeps only its mass below it);
- verification (`verify`): with `draft_logits`, q is their softmax and nothing else, a draft survives when
  p(x) > u·q(x), a rejection draws from max(0, p − q); without them, a draft survives when it equals the target's
  own sample, and a rejection draws a fresh sample from p. Either way p is the target's distribution over its
  top-k/top-p set at full mass, and the request ends after that one step, whatever request_output_len says.
What it does not do: batch requests (one at a time, a lock per call) or page the KV cache (it keeps one cached
sequence and reuses its prefix, as block reuse would).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specdeploy.build.trtllm.upstream import (
    BOOLEAN_VALUES,
    GPT_MODEL_TYPES,
    INSTANCE_ERROR,
    MISSING_PARAMETER,
    TENSORRTLLM_REQUIRED_PARAMETERS,
)
from specdeploy.decoding.prompt_lookup import common_prefix_length
from specdeploy.decoding.repetition_penalty import seen_mask
from specdeploy.models.llama import ragged_forward_all
from specdeploy.models.registry import load_component

REMEMBERED = 4096  # logits of this many recent (sequence, positions) queries are kept


class DoubleError(ValueError):
    """A request the real backend would refuse; the message names the input."""


class LoadError(RuntimeError):
    """A model the real backend would fail to load, with its message."""


# ---- loading --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EngineConfig:
    """What the executor reads from the engine's config.json (`build_config`, as trtllm-build wrote it)."""

    max_input_len: int
    max_seq_len: int
    max_draft_len: int
    speculative_decoding_mode: str | None
    gather_generation_logits: bool
    world_size: int = 1

    @property
    def draft_tokens_external(self) -> bool:
        return self.speculative_decoding_mode == "draft_tokens_external"

    @classmethod
    def read(cls, engine_dir: Path) -> EngineConfig:
        config = json.loads((Path(engine_dir) / "config.json").read_text())
        build = config["build_config"]
        mapping = config.get("pretrained_config", {}).get("mapping", {})
        return cls(build["max_input_len"], build["max_seq_len"], build["max_draft_len"],
                   build["speculative_decoding_mode"], build["gather_generation_logits"], mapping.get("world_size", 1))


@dataclass(frozen=True)
class BackendSettings:
    engine: EngineConfig
    exclude_input_in_output: bool
    enable_kv_cache_reuse: bool


def load_error(error: str) -> LoadError:
    return LoadError(INSTANCE_ERROR.format(error=error))


def parameter(parameters: dict[str, str], name: str) -> str:
    """GetParameter<std::string>: the value, or the load fails."""
    if name not in parameters:
        raise load_error(MISSING_PARAMETER.format(name=name))
    return parameters[name]


def boolean(parameters: dict[str, str], name: str, default: bool) -> bool:
    """GetParameter<bool> inside a try: a value outside upstream's spellings is caught and the default taken."""
    return BOOLEAN_VALUES.get(parameters.get(name, ""), default)


def number(parameters: dict[str, str], name: str) -> float | None:
    try:
        return float(parameters[name])
    except (KeyError, ValueError):
        return None  # caught upstream: the default


def load_settings(parameters: dict[str, str]) -> BackendSettings:
    """The instance constructor's reads, in upstream's order (getExecutorConfigFromParams, then the model path)."""
    if parameter(parameters, "gpt_model_type") not in GPT_MODEL_TYPES:
        raise load_error("Invalid gpt_model_type. Must be v1/inflight_batching/inflight_fused_batching.")
    fraction = number(parameters, "kv_cache_free_gpu_mem_fraction")
    if fraction is not None and not 0 < fraction < 1:
        raise load_error("[TensorRT-LLM][ERROR] Assertion failed: freeGpuMemoryFraction must be in (0, 1)")
    max_tokens = number(parameters, "max_tokens_in_paged_kv_cache")
    if max_tokens is not None and max_tokens <= 0:
        raise load_error("[TensorRT-LLM][ERROR] Assertion failed: maxTokens > 0")
    reuse = boolean(parameters, "enable_kv_cache_reuse", True)
    guided = {name: parameter(parameters, name) for name, reader in TENSORRTLLM_REQUIRED_PARAMETERS.items()
              if reader.endswith("getGuidedDecodingConfigFromParams")}
    if guided["guided_decoding_backend"] and guided["xgrammar_tokenizer_info_path"] \
            and not Path(guided["xgrammar_tokenizer_info_path"]).is_file():
        raise load_error(f"[TensorRT-LLM][ERROR] Assertion failed: Xgrammar's tokenizer info path at "
                         f"{guided['xgrammar_tokenizer_info_path']} does not exist.")
    path = parameters.get("gpt_model_path", "")
    if not path or not Path(path).exists():  # upstream warns, leaves it empty, then fails on both paths empty
        raise load_error("[TensorRT-LLM][ERROR] Assertion failed: Both encoder and decoder model paths are empty")
    engine = EngineConfig.read(Path(path))
    if engine.draft_tokens_external and not reuse:
        raise load_error("[TensorRT-LLM][ERROR] Assertion failed: KV cache block reuse must be enabled for "
                         "speculative decoding target model")
    return BackendSettings(engine, boolean(parameters, "exclude_input_in_output", False), reuse)


# ---- requests -------------------------------------------------------------------------------------------------
@dataclass
class Step:
    tokens: list[int]
    logits: np.ndarray | None  # [n, V] raw logits of the tokens, when asked


def responses(steps: Iterator[Step], streaming: bool) -> Iterator[Step]:
    """What the backend sends: streaming, each engine step as it comes; otherwise one response with everything."""
    if streaming:
        yield from steps
        return
    steps = list(steps)
    logits = [step.logits for step in steps if step.logits is not None]
    yield Step([token for step in steps for token in step.tokens], np.concatenate(logits) if logits else None)


def one(inputs: dict, name: str, default=None):
    value = inputs.get(name)
    if value is None:
        if default is None:
            raise DoubleError(f"{name}: required input is missing")
        return default
    if value.size != 1:
        raise DoubleError(f"{name}: expected one value per request, got shape {list(value.shape)}")
    return value.reshape(-1)[0].item()


@dataclass(frozen=True)
class Sampling:
    """A request's sampling as the executor runs it (runtime::SamplingConfig after validate and
    regularizeTopKTopP): temperature 0 becomes 1 with top-k 1 if top-k was sent and top-p 1 if top-p was; a
    request with neither top-k nor top-p is greedy; top-k without top-p gets top-p 1."""

    temperature: float
    top_k: int
    top_p: float
    repetition_penalty: float
    seed: int

    @classmethod
    def of(cls, inputs: dict) -> Sampling:
        temperature = float(one(inputs, "temperature", 1.0))
        top_k = one(inputs, "runtime_top_k", None) if "runtime_top_k" in inputs else None
        top_p = one(inputs, "runtime_top_p", None) if "runtime_top_p" in inputs else None
        if top_p is not None and top_p <= 0:
            top_p = None  # the backend drops it (utils.cc)
        if temperature == 0:
            temperature = 1.0
            top_k = 1 if top_k is not None else None
            top_p = 1.0 if top_p is not None else None
        top_k, top_p = int(top_k or 0), float(top_p or 0.0)
        if top_k == 0 and top_p == 0.0:
            top_k = 1
        if top_k > 0 and top_p == 0.0:
            top_p = 1.0
        seed = int(inputs["seed"].reshape(-1)[0]) if "seed" in inputs else 0  # the default seed is 0
        return cls(temperature, top_k, top_p, float(one(inputs, "repetition_penalty", 1.0)), seed)

    def probabilities(self, logits: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
        """penaltyKernels.cu: logits × 1/(T + 1e-6), then the repetition penalty on seen tokens; softmax.
        logits [V] fp32, seen [V] bool → [V] float64."""
        scaled = logits.double() / (self.temperature + 1e-6)
        penalised = torch.where(scaled < 0, scaled * self.repetition_penalty, scaled / self.repetition_penalty)
        return torch.where(seen, penalised, scaled).softmax(-1)

    def candidates(self, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernels' candidates: the top k (every token at k 0), descending, and their cumulative mass. Equal
        values in the kernels' reduction order, which nothing documents: here the highest token id first, an
        order of its own (torch's topk is not bound to one)."""
        vocab = probs.shape[-1]
        k = self.top_k if 0 < self.top_k < vocab else vocab
        order = (vocab - 1 - torch.argsort(probs.flip(0), descending=True, stable=True))[:k]
        return order, probs[order].cumsum(0)

    def draw(self, probs: torch.Tensor, generator: torch.Generator) -> int:
        """samplingTopKKernels.cu / samplingTopPKernels.cu: the first candidate whose cumulative mass reaches
        u × top_p × S (u in (0, 1]), else the last."""
        order, cumulative = self.candidates(probs)
        threshold = uniform(generator) * self.top_p * float(cumulative[-1])
        index = int((cumulative < threshold).sum())
        return int(order[min(index, order.shape[0] - 1)])

    def selected(self, probs: torch.Tensor) -> torch.Tensor:
        """The verification's target p (returnAllSelectedTokens, then invokeMaskTargetLogits): the candidates up to
        and including the one whose cumulative mass reaches top_p × S, renormalised at full mass. [V] float64."""
        order, cumulative = self.candidates(probs)
        count = min(int((cumulative < self.top_p * float(cumulative[-1])).sum()) + 1, order.shape[0])
        kept = torch.zeros_like(probs)
        kept[order[:count]] = probs[order[:count]]
        return kept / kept.sum()


def uniform(generator: torch.Generator) -> float:
    return 1.0 - float(torch.rand((), generator=generator, dtype=torch.float64))  # curand_uniform: (0, 1]


def multinomial(probs: torch.Tensor, generator: torch.Generator) -> int:
    """multinomialSampling over already-masked probabilities (top-p 1): inverse CDF at u."""
    cumulative = probs.cumsum(0)
    index = int((cumulative < uniform(generator) * float(cumulative[-1])).sum())
    return min(index, probs.shape[0] - 1)


class TensorrtllmDouble:
    def __init__(self, component_dir: Path, settings: BackendSettings,
                 logits_dtype: torch.dtype = torch.float32) -> None:
        """logits_dtype: the precision of the engine's logits (a bf16 engine's carry bf16's, with its frequent ties;
        tests that compare greedy text with an fp32 torch engine keep fp32)."""
        self.model = load_component(Path(component_dir))
        self.logits_dtype = logits_dtype
        self.settings, self.engine = settings, settings.engine
        self.vocab_size = self.model.config.vocab_size
        self.padded_vocab = -(-self.vocab_size // self.engine.world_size) * self.engine.world_size
        self.cache = self.model.new_cache(1, self.engine.max_seq_len + 1)
        self.cached: list[int] = []  # the tokens whose keys and values cache row 0 holds
        self.remembered: dict[tuple[tuple[int, ...], int], torch.Tensor] = {}
        self.lock = threading.Lock()

    @classmethod
    def load(cls, component_dir: Path, parameters: dict[str, str],
             logits_dtype: torch.dtype = torch.float32) -> TensorrtllmDouble:
        """The double of a model with these config parameters (LoadError: the backend would fail to load it)."""
        return cls(component_dir, load_settings(parameters), logits_dtype)

    def logits(self, tokens: list[int], last: int) -> torch.Tensor:
        """fp32 logits [last, V] at the last `last` positions of `tokens`, reusing the cached prefix. The forward is
        deterministic, so recent answers are remembered (the distribution tests ask about a few contexts often)."""
        key = (tuple(tokens), last)
        if key in self.remembered:
            return self.remembered[key]
        reuse = min(common_prefix_length(self.cached, tokens), len(tokens) - last)
        fed = torch.tensor([tokens[reuse:]], dtype=torch.long)
        with torch.inference_mode():
            hidden = ragged_forward_all(self.model, self.cache, fed, [reuse])
            logits = self.model.logits(hidden[0, -last:]).to(self.logits_dtype).float()
        self.cached = list(tokens)
        if len(self.remembered) >= REMEMBERED:
            self.remembered.pop(next(iter(self.remembered)))
        self.remembered[key] = logits
        return logits

    def seen(self, tokens: list[int]) -> torch.Tensor:
        """[V] bool: the tokens the repetition penalty applies to (prompt and output)."""
        return seen_mask(torch.tensor(tokens, dtype=torch.long), self.vocab_size)

    def validate(self, prompt: int, count: int, drafts: list[int]) -> tuple[int, list[int]]:
        """LlmRequest::validate (llmRequest.cpp): (max new tokens, drafts) as the executor keeps them."""
        engine = self.engine
        max_draft = engine.max_draft_len if engine.speculative_decoding_mode else 0  # getMaxDecodingDraftTokens
        if prompt > engine.max_input_len:
            raise DoubleError(f"Prompt length ({prompt}) exceeds maximum input length ({engine.max_input_len}).")
        if len(drafts) > max_draft:
            raise DoubleError(f"Draft tokens length ({len(drafts)}) exceeds maximum draft tokens length "
                              f"({max_draft}).")
        reserved = len(drafts) if drafts else max_draft
        if drafts and prompt + len(drafts) > engine.max_input_len:  # a warning: the drafts are cut
            drafts = drafts[:engine.max_input_len - prompt]
            reserved = len(drafts)
        if prompt + count + reserved > engine.max_seq_len:  # a warning: the request's length is cut
            count = engine.max_seq_len - prompt - reserved
        if count < 1:
            raise DoubleError(f"Input length ({prompt}) + max new tokens ({count}) + draft tokens ({reserved}) "
                              f"must be less than max sequence length ({engine.max_seq_len}).")
        return count, drafts

    def run(self, inputs: dict):
        """One request's responses (a generator of Step); DoubleError for a request the backend refuses."""
        ids = inputs.get("input_ids")
        if ids is None or ids.ndim != 2 or ids.shape[0] != 1:
            raise DoubleError("input_ids: expected [1, L] int32")
        tokens = ids.reshape(-1).astype(int).tolist()
        if one(inputs, "input_lengths") != len(tokens):
            raise DoubleError(f"input_lengths: {one(inputs, 'input_lengths')} is not the {len(tokens)} input_ids")
        count = one(inputs, "request_output_len")
        sampling = Sampling.of(inputs)
        generator = torch.Generator().manual_seed(sampling.seed)
        end_id = one(inputs, "end_id", -1)
        with_logits = bool(one(inputs, "return_generation_logits", False))
        if with_logits and not self.engine.gather_generation_logits:
            raise DoubleError("To return generation logits, gather_generation_logits must be enabled in "
                              "ExecutorConfig")
        drafts = inputs.get("draft_input_ids")
        drafts = drafts.reshape(-1).astype(int).tolist() if drafts is not None else []
        count, drafts = self.validate(len(tokens), count, drafts)
        # the input comes back only in a non-streamed answer (LlmRequest::createResult sends new tokens when streaming)
        streaming = bool(one(inputs, "streaming", False))
        echo = [] if self.settings.exclude_input_in_output or streaming else list(tokens)
        with self.lock:
            if drafts:
                step = self.verify(tokens, drafts, inputs.get("draft_logits"), sampling, generator)
                if end_id in step.tokens:  # not returned, and nothing after it
                    step.tokens = step.tokens[:step.tokens.index(end_id)]
                if echo or step.tokens:
                    yield Step(echo + step.tokens, None)
                return  # a target request that brought drafts ends after this one step
            for _ in range(count):
                logits = self.logits(tokens, 1)
                token = sampling.draw(sampling.probabilities(logits[0], self.seen(tokens)), generator)
                if token == end_id:
                    return  # the executor stops at the end token without returning it
                tokens.append(token)
                yield Step(echo + [token], logits.numpy() if with_logits else None)
                echo = []

    def verify(self, tokens: list[int], drafts: list[int], draft_logits: np.ndarray | None, sampling: Sampling,
               generator: torch.Generator) -> Step:
        """ExternalDraftTokensLayer over the k drafts: accepted ones, then a recovered or bonus token."""
        k = len(drafts)
        q = None
        if draft_logits is not None:
            if draft_logits.dtype != np.float32 or draft_logits.shape != (1, k, self.padded_vocab):
                raise DoubleError(f"draft_logits: the engine copies [{k}, {self.padded_vocab}] float32 for {k} "
                                  f"draft tokens, got {list(draft_logits.shape)} {draft_logits.dtype}")
            q = torch.from_numpy(draft_logits[0, :, :self.vocab_size]).double().softmax(-1)  # softmax only
        logits = self.logits(tokens + drafts, k + 1)
        emitted = []
        for i, drafted in enumerate(drafts):
            probs = sampling.probabilities(logits[i], self.seen(tokens + drafts[:i]))
            p = sampling.selected(probs)
            if q is not None:
                survives = float(p[drafted]) > uniform(generator) * float(q[i, drafted])
                recover = (p - q[i]).clamp(min=0)
            else:  # the target's own sample, drawn among its candidates by the kernels' walk
                survives = sampling.draw(probs, generator) == drafted
                recover = p  # a fresh sample from p, which may be the rejected draft again
            if not survives:
                return Step(emitted + [multinomial(recover, generator)], None)
            emitted.append(drafted)
        p = sampling.selected(sampling.probabilities(logits[k], self.seen(tokens + drafts)))
        return Step(emitted + [multinomial(p, generator)], None)
