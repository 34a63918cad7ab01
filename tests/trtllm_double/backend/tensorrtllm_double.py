"""A test double of one model of Triton's `tensorrtllm` backend (TensorRT-LLM 1.2.1's in-flight batching executor
over an engine), running our torch model, so the trtllm flavour's orchestration runs for real here.

It behaves like upstream where upstream is unkind; every behaviour has its source (NVIDIA/TensorRT-LLM file and
commit) in tests/trtllm_double/README.md. In short:
- loading (`load_settings`): the four parameters read without a fallback, upstream's message when one is missing,
  gpt_model_type's values, booleans that silently take their default when misspelled, the KV cache fraction in
  (0, 1), the engine at gpt_model_path, KV block reuse required by a draft_tokens_external target; a lookahead
  engine's (W, N, G): the three lookahead_* parameters read only under decoding_mode lookahead, the executor's
  default (4, 3, 4) otherwise, and the load failing unless the engine's max_draft_len is that configuration's
  draft-token count, or with a beam width above 1;
- requests (`run`): the sequence budget (`LlmRequest::validate`, which reserves the engine's max_draft_len for a
  request without drafts, after trtllm-build added it to max_seq_len), temperature 0 and absent top-k/top-p as the
  sampling config regularises them, seed 0 when none is sent, generation logits only from an engine built to
  gather them, the end token neither returned nor followed;
- sampling: the kernels' walk over the candidates (the token crossing top_p keeps only its mass below it);
- verification (`verify`): with `draft_logits`, q is their softmax and nothing else, a draft survives when
  p(x) > u·q(x), a rejection draws from max(0, p − q); without them, a draft survives when it equals the target's
  own sample, and a rejection draws a fresh sample from p. Either way p is the target's distribution over its
  top-k/top-p set at full mass, and the request ends after that one step, whatever request_output_len says.
- lookahead (`lookahead_steps`): greedy whatever the request's sampling, a step's tokens the longest guess the
  target's argmax confirms plus one; a request's own lookahead_* tensors read as the backend reads them (keyed on
  lookahead_window_size alone) and a size above the model's failing only when its step runs.
- Medusa (`medusa_steps`): each target token sampled with top-k alone from the unscaled, unpenalised logits
  (temperature, repetition penalty and top-p dropped), nothing written (token 0 here) at a top-k of 0; a step
  verifies the tree of medusa_choices, every node's target token drawn with the step's one uniform, as upstream's
  one random state per request gives them (the heads are a stand-in: each node drafts the target's own ranked token).
What it does not do: batch requests (one at a time, a lock per call) or page the KV cache (it keeps one cached
sequence and reuses its prefix, as block reuse would). Its lookahead verifies only the n-gram pool's guesses, not
the Jacobi window's rows, so its steps accept no more than upstream's would (the text is the same: greedy).
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specdeploy.build.trtllm.upstream import (
    BOOLEAN_VALUES,
    GPT_MODEL_TYPES,
    INSTANCE_ERROR,
    LOOKAHEAD_BUILD_MODE,
    LOOKAHEAD_PARAMETERS,
    LOOKAHEAD_PARAMETERS_MISSING,
    MISSING_PARAMETER,
    TENSORRTLLM_REQUIRED_PARAMETERS,
)
from specdeploy.decoding.prompt_lookup import common_prefix_length
from specdeploy.decoding.repetition_penalty import seen_mask
from specdeploy.models.llama import ragged_forward_all
from specdeploy.models.registry import load_component
from specdeploy.speculative.lookahead import NgramPool

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


ASSERTION = "[TensorRT-LLM][ERROR] Assertion failed: {}"  # TLLM_CHECK / TLLM_CHECK_WITH_INFO's TllmException


@dataclass(frozen=True)
class LookaheadConfig:
    """executor::LookaheadDecodingConfig (cpp/tensorrt_llm/executor/decodingConfig.cpp @ 0371ba0f): W, N, G."""

    window: int
    ngram: int
    verification_set: int

    def problem(self) -> str | None:
        """The constructor's TLLM_CHECK_WITH_INFO that fails for these sizes, in its order, or None."""
        w, n, g = self.window, self.ngram, self.verification_set
        for failed, message in ((n < 1, "ngramSize requires >= 1"), (w < 1, "windowSize requires >= 1"),
                                (n == 1 and g != 0, "ngramSize=1 requires verificationSetSize=0"),
                                (n == 1 and w != 1, "ngramSize=1 requires windowSize=1"),
                                (g < 0, "verificationSetSize requires >=0")):
            if failed:
                return ASSERTION.format(message)
        return None

    @property
    def max_draft_len(self) -> int:
        """calculateSpeculativeResourceTuple's draft tokens: (N == 1 ? 0 : N - 2) + (W - 1 + G)(N - 1)."""
        n = self.ngram
        return (0 if n == 1 else n - 2) + (self.window - 1 + self.verification_set) * (n - 1)


# kDefaultLookaheadDecodingWindow / Ngram / VerificationSet (cpp/include/tensorrt_llm/executor/executor.h): what the
# executor runs on a lookahead engine that was given no lookahead configuration
DEFAULT_LOOKAHEAD = LookaheadConfig(4, 3, 4)


@dataclass(frozen=True)
class BackendSettings:
    engine: EngineConfig
    exclude_input_in_output: bool
    enable_kv_cache_reuse: bool
    lookahead: LookaheadConfig | None = None  # the (W, N, G) a lookahead engine runs (None: not a lookahead engine)
    lookahead_configured: bool = False  # the backend read the lookahead_* parameters (decoding_mode lookahead)
    medusa_choices: tuple[tuple[int, ...], ...] = ()  # a Medusa engine's tree (empty: its root alone)
    warnings: tuple[str, ...] = ()  # what upstream only logs

    @property
    def is_lookahead(self) -> bool:
        return self.lookahead is not None


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


def lookahead_parameters(parameters: dict[str, str]) -> LookaheadConfig | None:
    """getExecutorConfigFromParams (model_instance_state.cc @ 0c8de69a): under decoding_mode "lookahead" the three
    lookahead_* parameters (GetParameter<uint32_t>; a missing or unparsable one, such as the template's literal
    ${lookahead_window_size}, fails the load), then the config's own checks; under any other mode they are not
    read. The double takes only non-negative decimal integers."""
    if parameters.get("decoding_mode") != "lookahead":
        return None
    values = [parameters.get(name, "").strip() for name in LOOKAHEAD_PARAMETERS]
    if not all(value.isdigit() for value in values):
        raise load_error(LOOKAHEAD_PARAMETERS_MISSING)
    config = LookaheadConfig(*(int(value) for value in values))
    if config.problem():
        raise load_error(config.problem())
    return config


def medusa_parameters(parameters: dict[str, str]) -> tuple[tuple[int, ...], ...]:
    """The tree in medusa_choices ("{0}, {0, 0}, {1}", as `package` writes it), read under decoding_mode medusa.
    Without it upstream runs its default tree, which the double does not emulate: the root alone."""
    if parameters.get("decoding_mode") != "medusa":
        return ()
    groups = re.findall(r"\{([^}]*)\}", parameters.get("medusa_choices", ""))
    return tuple(tuple(int(index) for index in group.split(",")) for group in groups)


def lookahead_engine(engine: EngineConfig, configured: LookaheadConfig | None, beam_width: int
                     ) -> tuple[LookaheadConfig, list[str]]:
    """What a lookahead engine's executor runs, or the load's failure (trtGptModelInflightBatching.cpp @ b35ac1b6,
    lookaheadDecodingLayer.cpp @ 3585984b):
    - without a lookahead configuration (decoding_mode not lookahead): a warning, the mode overwritten, and the
      layer's default (4, 3, 4), whose 16 tokens per step must equal the engine's max_draft_len + 1 ("16 != 40" in
      tensorrtllm_backend issue #710);
    - with one needing more draft tokens than the engine has: "maxDraftTokens <= ..." (setupSpeculativeDecodingModule);
    - with one needing fewer: "<a> != <b>". The code read shrinks the module to the executor's count first, so this
      is harsher than that code path; examples/lookahead/README.md asks for them equal and a review of another
      deployment (Baseten truss PR #1391) reports a non-exact match failing at runtime;
    - a beam width above 1: "Lookahead requires beam width = 1" (CpuAlgorithmResources)."""
    warnings = []
    config = configured
    if config is None:
        warnings.append("Model is Lookahead, but decoding mode is not Lookahead. Overwriting decoding mode to "
                        "Lookahead.")
        config = DEFAULT_LOOKAHEAD
    elif config.max_draft_len > engine.max_draft_len:
        raise load_error(ASSERTION.format("maxDraftTokens <= mModelConfig.getMaxDecodingDraftTokens()"))
    if config.max_draft_len != engine.max_draft_len:
        raise load_error(ASSERTION.format(f"{config.max_draft_len + 1} != {engine.max_draft_len + 1}"))
    if beam_width > 1:
        raise load_error(ASSERTION.format("Lookahead requires beam width = 1"))
    return config, warnings


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
    configured = lookahead_parameters(parameters)
    beam_width = int(number(parameters, "max_beam_width") or 1)
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
    lookahead, warnings = None, []
    if engine.speculative_decoding_mode == LOOKAHEAD_BUILD_MODE:
        lookahead, warnings = lookahead_engine(engine, configured, beam_width)
    elif configured is not None:  # the executor falls back to top-k/top-p (beam 1) with a warning
        warnings.append("Model is not built with Lookahead decoding, but decoding mode is Lookahead. Overwriting "
                        "decoding mode.")
    return BackendSettings(engine, boolean(parameters, "exclude_input_in_output", False), reuse, lookahead,
                           configured is not None, medusa_parameters(parameters), tuple(warnings))


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
        return self.draw_at(probs, uniform(generator))

    def draw_at(self, probs: torch.Tensor, u: float) -> int:
        """draw, with the uniform given."""
        order, cumulative = self.candidates(probs)
        threshold = u * self.top_p * float(cumulative[-1])
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


def medusa_sampling(sampling: Sampling) -> Sampling:
    """What a Medusa engine samples its target tokens with. DecodingMode::Medusa has neither the temperature nor an
    occurrence-penalty bit (cpp/include/tensorrt_llm/executor/types.h @ a98a9061, index copy), and the penalty layer
    applies each only under its bit (penaltyLayer.cpp @ 2a9abd95, index copy): temperature and repetition penalty
    are dropped. samplePrimeHeadTokens passes top-k alone (medusaDecodingLayer.cpp @ 015884d6): top-p is dropped."""
    return Sampling(1.0, sampling.top_k, 1.0, 1.0, sampling.seed)


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
            hidden = ragged_forward_all(self.model, self.cache, fed, [reuse]).hidden
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
        requested = self.request_lookahead(inputs)
        # the input comes back only in a non-streamed answer (LlmRequest::createResult sends new tokens when streaming)
        streaming = bool(one(inputs, "streaming", False))
        echo = [] if self.settings.exclude_input_in_output or streaming else list(tokens)
        with self.lock:
            if self.settings.is_lookahead:
                yield from self.lookahead_steps(tokens, count, end_id, requested or self.settings.lookahead, echo)
                return
            if drafts:
                step = self.verify(tokens, drafts, inputs.get("draft_logits"), sampling, generator)
                if end_id in step.tokens:  # not returned, and nothing after it
                    step.tokens = step.tokens[:step.tokens.index(end_id)]
                if echo or step.tokens:
                    yield Step(echo + step.tokens, None)
                return  # a target request that brought drafts ends after this one step
            if self.engine.speculative_decoding_mode == "medusa":
                yield from self.medusa_steps(tokens, count, end_id, sampling, generator, echo)
                return
            for _ in range(count):
                logits = self.logits(tokens, 1)
                token = sampling.draw(sampling.probabilities(logits[0], self.seen(tokens)), generator)
                if token == end_id:
                    return  # the executor stops at the end token without returning it
                tokens.append(token)
                yield Step(echo + [token], logits.numpy() if with_logits else None)
                echo = []

    def request_lookahead(self, inputs: dict) -> LookaheadConfig | None:
        """A request's own (w, n, g), as the C++ backend reads them at enqueue (getLookaheadDecodingFromTensors,
        utils.cc @ 19290813): only when lookahead_window_size is there (n and g alone are silently ignored), then
        all three or "Failed to extract <name>", one value each, the config's own checks, and a model configured for
        lookahead. Nothing compares them with the model's (W, N, G) there; the decoder does when the request's step
        runs (LookaheadAlgorithm::setup, lookaheadAlgorithm.cpp @ 3585984b), which fails the step ("Encountered an
        error in forward function"), not the enqueue."""
        if "lookahead_window_size" not in inputs:
            return None
        values = []
        for name in LOOKAHEAD_PARAMETERS:
            if name not in inputs:
                raise DoubleError(f"Failed to extract {name}")
            if inputs[name].size != 1:
                raise DoubleError(f"Invalid size for tensor {name}")
            values.append(int(inputs[name].reshape(-1)[0]))
        config = LookaheadConfig(*values)
        if config.problem():
            raise DoubleError(config.problem())
        if not self.settings.lookahead_configured:
            raise DoubleError("Cannot set the request lookahead decoding configuration when model instance "
                              "lookahead parameters are not set.")
        return config

    def lookahead_steps(self, tokens: list[int], count: int, end_id: int, config: LookaheadConfig, echo: list[int]
                        ) -> Iterator[Step]:
        """A lookahead engine's steps, greedy whatever the request's sampling (LookaheadDecodingLayer draws top-1
        at every position; its decoding mode has no temperature or penalty bit). Per step: the pool's newest
        min(W, G) n-grams keyed by the last token (issue #4003: LookaheadAlgorithm::guess asks the pool for W, and
        a key keeps at most G), each verified against the target's argmax; the longest confirmed prefix plus the
        target's next token is the step. The pool (at most G n-grams of N tokens per key, the oldest dropped) is
        seeded with the prompt's n-grams and takes the committed text's."""
        model = self.settings.lookahead
        for key, asked, most in (("w", config.window, model.window), ("n", config.ngram, model.ngram),
                                 ("g", config.verification_set, model.verification_set)):
            if asked > most:  # the step fails, as the executor's forward does
                failed = ASSERTION.format(f"lookahead requires setup {key} ({asked}) <= max_{key} ({most})")
                raise DoubleError(f"Encountered an error in forward function: {failed}")
        pool = NgramPool(config.ngram, config.verification_set)
        pool.insert_text(tokens)

        def next_step() -> list[int]:
            best = [int(self.logits(tokens, 1)[0].argmax())]
            for guess in pool.guesses(tokens[-1], min(config.window, config.verification_set)):
                if guess[0] != best[0]:
                    continue
                targets = self.logits(tokens + list(guess), len(guess) + 1).argmax(-1).tolist()
                confirmed = targets[:common_prefix_length(list(guess), targets) + 1]
                if len(confirmed) > len(best):
                    best = confirmed
            return best

        pooled = len(tokens)

        def committed() -> None:
            nonlocal pooled
            pool.insert_text(tokens, pooled)
            pooled = len(tokens)

        yield from engine_steps(tokens, count, end_id, echo, next_step, committed)

    def medusa_steps(self, tokens: list[int], count: int, end_id: int, sampling: Sampling,
                     generator: torch.Generator, echo: list[int]) -> Iterator[Step]:
        """A Medusa engine's steps: each the accepted path of the tree plus the target's token after it. A top-k of 0
        (sent, not absent) makes the top-k kernel write nothing (samplingTopKKernels.cu @ 03961722): every token
        is whatever the buffer held, here 0, one a step."""
        yield from engine_steps(tokens, count, end_id, echo, lambda: [0] if sampling.top_k == 0 else
                                self.medusa_step(tokens, medusa_sampling(sampling), generator))

    def medusa_step(self, tokens: list[int], sampling: Sampling, generator: torch.Generator) -> list[int]:
        """One step over the tree (settings.medusa_choices, top-k index paths): the target's token at the root and
        at every node (its logits after the node's drafted path), then from the root down, while a child drafted
        the token its parent's target drew, that child is accepted; the step is the accepted drafts plus the
        target's token at the last accepted node (acceptDraftTokensByIdsWithPaths).
        The draws share one uniform: upstream keeps one curand state per request (MedusaDecodingLayer's
        mCurandStatesDevice, batchSize states) and samples every node in one call (samplePrimeHeadTokens over
        tokensPerStep = getMaxDecodingTokens()), and the top-k kernel runs one block per (request, node) whose thread
        0 calls curand_uniform(curandState + batchSlot) (topKStage2Sampling on grid(batchSize, maxTokensPerStep),
        samplingTopKKernels.cu, index copy with strictTopPBoundary) — NVIDIA/TensorRT-LLM@1a43c7d6
        cpp/tensorrt_llm/layers/medusaDecodingLayer.cpp. Concurrent reads of one state give the nodes (mostly) one
        uniform, so a child's draw given its parent's accepted draw is biased; the trtllm orchestration refuses
        sampled Medusa for that reason (test_orchestration shows the distribution test catching it).
        The heads are a stand-in: node (c1, …, cd) drafts the target's c_d-th most likely token after its parent's
        path (drafts that never depend on the step's uniform, as the real heads' do not)."""
        choices = sorted(self.settings.medusa_choices, key=len)  # parents first
        drafts: dict[tuple[int, ...], int] = {}
        for path in choices:
            parent = [drafts[path[:depth]] for depth in range(1, len(path))]
            drafts[path] = int(torch.argsort(self.logits(tokens + parent, 1)[0], descending=True)[path[-1]])
        uniforms = self.medusa_uniforms(generator, 1 + len(choices))
        node, emitted = (), []
        while True:
            path = [drafts[node[:depth]] for depth in range(1, len(node) + 1)]
            u = uniforms[0 if not node else 1 + choices.index(node)]
            token = sampling.draw_at(self.logits(tokens + path, 1)[0].double().softmax(-1), u)
            emitted.append(token)
            child = next((c for c in choices if c[:-1] == node and len(c) == len(node) + 1 and drafts[c] == token),
                         None)
            if child is None:
                return emitted
            node = child

    def medusa_uniforms(self, generator: torch.Generator, nodes: int) -> list[float]:
        """The uniforms of one step's nodes (the root first): one, shared, as upstream's one state per request
        gives them (medusa_step)."""
        return [uniform(generator)] * nodes

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


def engine_steps(tokens: list[int], count: int, end_id: int, echo: list[int], next_step: Callable[[], list[int]],
                 committed: Callable[[], None] = lambda: None) -> Iterator[Step]:
    """Steps of an engine that commits several tokens a step (next_step() proposes them, after `tokens`), up to
    `count` tokens: an end_id is not returned and ends the request with nothing after it; committed() runs after
    each step's tokens join `tokens`. The echoed prompt rides on the first step."""
    produced = 0
    while produced < count:
        step = next_step()[:count - produced]
        if end_id in step:
            step = step[:step.index(end_id)]
            if echo or step:
                yield Step(echo + step, None)
            return
        tokens.extend(step)
        produced += len(step)
        committed()
        yield Step(echo + step, None)
        echo = []
