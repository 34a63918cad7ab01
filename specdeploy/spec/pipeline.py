"""PipelineSpec: the one validated configuration, loaded from a pipeline YAML (or the JSON a build saves).

Every section is a frozen dataclass validated when it is constructed, so a spec built in code is checked exactly
like one loaded from a file; spec/strict_yaml.py reads the file and walks its data against the sections' type
hints, so unknown keys, wrong types and values outside a Literal are errors naming the file, the key path, the bad
value and what is allowed. Defaults are defined here and nowhere else; this module imports neither torch nor the
runtime.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from specdeploy.errors import PipelineError
from specdeploy.spec.sampling_params import SamplingParams, sampling_problems
from specdeploy.spec.strict_yaml import NOT_IN_FILE, Problem, Section, build, plain_data, quoted, read_yaml
from specdeploy.spec.token_tree import TokenTree

SourceKind = Literal["package", "gguf", "hf_dir"]
DType = Literal["float32", "bfloat16"]
# The speculation methods. Adding one touches: its name here and its row in METHODS below (the code that builds,
# serves and sizes a pipeline asks SpeculationSpec's predicates, which read that row, never the name), its settings
# section in SpeculationSpec if it has settings, its proposer module in speculative/ and one line in
# speculative/registry.py.
Method = Literal["draft_target", "ngram", "medusa", "eagle", "early_exit", "lookahead", "none"]
# exact: every emitted token is distributed as the target's. typical: Medusa's typical acceptance, LOSSY (it accepts
# more and changes the distribution); only for medusa, and never the default.
Acceptance = Literal["exact", "typical"]
Schedule = Literal["constant", "heuristic"]  # proposal length per step: always gamma, or adaptive up to gamma
BackendKind = Literal["torch", "trtllm"]
Device = Literal["cpu", "cuda"]  # where the torch backend runs: the CPU, or an NVIDIA GPU
# batch_invariant: each request's positions computed as a lone plain decode step would; batch_dependent: each step's
# rows through the kernels together (ServingSpec.determinism)
Determinism = Literal["batch_invariant", "batch_dependent"]
StepsMode = Literal["measured", "compiled", "eager"]


@dataclass(frozen=True)
class MethodTraits:
    """What a speculation method is, in the terms its callers ask about (read through SpeculationSpec's
    predicates; a method that is none of these proposes inside the target by other means)."""

    draft_model: bool = False  # a separate draft model proposes: built, converted, served and sized beside the target
    heads: bool = False  # heads on the target's hidden state propose: trained apart, built and sized with the target
    from_context: bool = False  # proposals are looked up in the sequence itself: no model proposes
    tree: bool = False  # proposals form a token tree verified in one step, not a chain of up to gamma tokens
    features: bool = False  # a one-layer draft fed by the target's own hidden states proposes (EAGLE-3)
    own_layers: bool = False  # the target's own first layers propose (early exit): no weights beside the target's
    lookahead: bool = False  # the target guesses ahead in its own verify forward (Jacobi), pooling the n-grams


METHODS: dict[str, MethodTraits] = {
    "none": MethodTraits(),  # plain decoding: nothing is proposed
    "draft_target": MethodTraits(draft_model=True),
    "ngram": MethodTraits(from_context=True),
    "medusa": MethodTraits(heads=True, tree=True),
    "eagle": MethodTraits(features=True, tree=True),
    "early_exit": MethodTraits(own_layers=True),
    "lookahead": MethodTraits(lookahead=True, tree=True),
}

_NEUTRAL = SamplingParams()

MAX_REQUEST_KINDS = 16
REQUEST_KIND = re.compile(r"[a-z][a-z0-9_]{0,31}")
UNSPECIFIED_KIND = "unspecified"  # the acceptance counters' label for requests that give no request_kind


def request_kind_problem(kind: str) -> str | None:
    """What is wrong with `kind` as a request kind's label, or None."""
    if not isinstance(kind, str) or not REQUEST_KIND.fullmatch(kind):
        return (f"{quoted(kind)} is not a kind: a lowercase letter, then up to 31 lowercase letters, digits or "
                f"underscores")
    if kind == UNSPECIFIED_KIND:
        return f"{quoted(kind)} is the label of requests without a kind"
    return None


@dataclass(frozen=True)
class CheckpointSpec(Section):
    """Where weights come from. package: '<python package>/<file inside it>'; gguf: a .gguf file; hf_dir: a
    directory with config.json, *.safetensors and tokenizer files. Relative paths are relative to the YAML file."""

    source: SourceKind
    path: str

    def check(self) -> None:
        if not self.path.strip():
            raise Problem("path", "must not be empty")
        if self.source == "package" and "/" not in self.path:
            raise Problem("path", f"package paths look like '<package>/<file>', got {quoted(self.path)}")


@dataclass(frozen=True)
class MoESpec(Section):
    """Derive a Mixtral-architecture MoE target from a dense checkpoint with `experts` experts per layer, each token
    routed to `experts_per_token` of them. `method`: upcycle (build/moe_upcycle.py: every expert a copy of the whole
    dense MLP, `expert_noise` × each matrix's spread of seeded noise per expert, a seeded random router) or
    neuron_split (build/moe_derive.py: each MLP's neurons split into experts, a fitted router). Both read
    `calibration_tokens` of openly licensed text: upcycling scales its router's logits on them, the split clusters
    neurons and fits its router on them."""

    method: Literal["upcycle", "neuron_split"] = "upcycle"
    experts: int = 8
    experts_per_token: int = 2
    calibration_tokens: int = 8192
    expert_noise: float = 0.0
    seed: int = 0

    def check(self) -> None:
        if self.experts < 2:
            raise Problem("experts", f"must be ≥ 2, got {self.experts}")
        if not 1 <= self.experts_per_token <= self.experts:
            raise Problem("experts_per_token", f"must be in [1, experts ({self.experts})], got "
                                               f"{self.experts_per_token}")
        if self.calibration_tokens < 256:
            raise Problem("calibration_tokens", f"must be ≥ 256, got {self.calibration_tokens}")
        if not 0.0 <= self.expert_noise < 1.0:
            raise Problem("expert_noise", f"must be in [0, 1) (a fraction of each matrix's standard deviation), got "
                                          f"{self.expert_noise}")
        if self.expert_noise and self.method != "upcycle":
            raise Problem("expert_noise", f"only perturbs upcycled experts, and method is {self.method!r}")


@dataclass(frozen=True)
class TargetSpec(Section):
    """The target model; `moe`, when given, turns a dense checkpoint into a Mixtral-architecture MoE at build.
    `weight_only` stores its projections quantized at build (int4 groups of 32 with a scale and a minimum, what a
    GGUF's Q4_1 blocks hold, or int8 rows) and its vocabulary head as int8 rows; activations, norms, the embedding
    table and the KV cache stay in `dtype`, which must then be bfloat16 (the weight-only kernels take bf16)."""

    checkpoint: CheckpointSpec
    dtype: DType = "bfloat16"
    moe: MoESpec | None = None
    weight_only: Literal["int4", "int8"] | None = None

    def check(self) -> None:
        if self.weight_only is not None and self.dtype != "bfloat16":
            raise Problem("weight_only", f"{self.weight_only} needs dtype: bfloat16 (the weight-only kernels take "
                                         f"bf16 activations), got dtype: {self.dtype}")


@dataclass(frozen=True)
class DraftSpec(Section):
    """The draft model. `derive: int4` quantizes the target into a draft (same tokenizer by construction; an MoE
    target gives an int4 MoE); `int8` quantizes it to int8 rows instead (1.6× int4's bytes, closer to the target;
    which pays depends on the device's kernels: bench both side by side); `int4_dense`, for a target derived with
    target.moe, quantizes the dense model it was derived from to int4 instead; `derive: none` takes `checkpoint` as
    it is (its tokenizer must match the target's)."""

    derive: Literal["int4", "int8", "int4_dense", "none"] = "int4"
    checkpoint: CheckpointSpec | None = None
    dtype: DType = "bfloat16"
    early_stop_threshold: float = 0.0  # stop drafting when the draft's top-1 probability falls below this

    @property
    def weight_only(self) -> Literal["int4", "int8"] | None:
        """The precision the derived draft's weights are quantized to; None for a checkpoint taken as it is."""
        return {"int4": "int4", "int4_dense": "int4", "int8": "int8", "none": None}[self.derive]

    def check(self) -> None:
        if self.derive == "none" and self.checkpoint is None:
            raise Problem("checkpoint", "required when derive is 'none'")
        if self.derive != "none" and self.checkpoint is not None:
            raise Problem("checkpoint", f"not allowed when derive is {self.derive!r} (the draft is derived from the "
                                        f"target)")
        if not 0.0 <= self.early_stop_threshold < 1.0:
            raise Problem("early_stop_threshold", f"must be in [0, 1), got {self.early_stop_threshold}")


WEIGHT_BITS = {None: 16, "int8": 8, "int4": 4}


def draft_is_smaller(draft: DraftSpec, target: TargetSpec) -> bool:
    """Whether a derived draft stores fewer bits per projection weight than the target it is derived from (a
    checkpoint draft, or one derived from an MoE's dense source, is another model and always qualifies)."""
    if draft.derive in ("none", "int4_dense"):
        return True
    return WEIGHT_BITS[draft.weight_only] < WEIGHT_BITS[target.weight_only]


@dataclass(frozen=True)
class NgramSpec(Section):
    """Prompt lookup: match the last n tokens (max_n down to min_n) of prompt + output against earlier text."""

    min_n: int = 2
    max_n: int = 4

    def check(self) -> None:
        if self.min_n < 1:
            raise Problem("min_n", f"must be ≥ 1, got {self.min_n}")
        if self.max_n < self.min_n:
            raise Problem("max_n", f"must be ≥ min_n ({self.min_n}), got {self.max_n}")


# A small tree for a CPU, where verifying each extra position costs real time (a GPU preset of 63 nodes would not
# pay here); `specdeploy bench` reports the tree built from measured head accuracies and verify costs.
DEFAULT_MEDUSA_CHOICES = ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0))


@dataclass(frozen=True)
class MedusaSpec(Section):
    """Medusa heads on the target's last hidden state. heads: the safetensors file `specdeploy train-medusa` writes
    (relative to the YAML). choices: the tree of their candidates in TensorRT-LLM's medusa_choices format (paths
    of top-k indices, [0] = the first head's best token, [0, 1] = the second head's second best below it)."""

    heads: str = ""
    num_heads: int = 4
    num_layers: int = 1
    choices: tuple[tuple[int, ...], ...] = DEFAULT_MEDUSA_CHOICES

    def check(self) -> None:
        if self.num_heads < 1:
            raise Problem("num_heads", f"must be ≥ 1, got {self.num_heads}")
        if self.num_layers < 1:
            raise Problem("num_layers", f"must be ≥ 1, got {self.num_layers}")
        try:
            tree = TokenTree.from_choices([list(path) for path in self.choices])
        except ValueError as exc:
            raise Problem("choices", str(exc).removeprefix("medusa_choices: ")) from None
        if tree.depth > self.num_heads:
            raise Problem("choices", f"the tree is {tree.depth} deep but there are {self.num_heads} heads")


@dataclass(frozen=True)
class EagleSpec(Section):
    """An EAGLE-3 draft head: one decoder layer fed by the target's hidden states from three of its layers, with its
    own LM head over a reduced draft vocabulary (speculative/eagle_head.py). head: the folder `specdeploy
    train-eagle` writes (config.json and model.safetensors as vLLM's and SGLang's EAGLE-3 loaders read them),
    relative to the YAML. Each step grows a tree as EAGLE-2/3 do: the `top_k` most likely children of each of the
    `top_k` best frontier nodes, num_draft_tokens levels deep, then the `max_nodes` nodes with the highest draft
    probability of their path are verified in one target forward."""

    head: str = ""
    top_k: int = 4
    max_nodes: int = 12

    def check(self) -> None:
        if self.top_k < 1:
            raise Problem("top_k", f"must be ≥ 1, got {self.top_k}")
        if self.max_nodes < 1:
            raise Problem("max_nodes", f"must be ≥ 1, got {self.max_nodes}")


# The exit layers an early-exit build tries when exit_layer is "measured" (those below the target's layer count).
DEFAULT_EXIT_SWEEP = (4, 6, 8, 10, 12)


@dataclass(frozen=True)
class EarlyExitSpec(Section):
    """Self-speculation: the draft is the target's first `exit_layer` layers, then the target's own final norm and
    its head's rows of the `draft_vocab` most frequent tokens (0: the whole head; a full head costs a fifth of a
    SmolLM2 step per drafted token). The draft's cache entries are the target's for those layers, and the verify
    forward resumes at `exit_layer` (speculative/early_exit.py). exit_layer "measured": `specdeploy build` decodes
    calibration prompts at each layer of `sweep` and keeps the one with the best realized speedup. adapter: the
    folder `specdeploy train-exit-adapter` writes (relative to the YAML; speculative/exit_adapter.py), a small
    position-wise block the draft's states pass through before the final norm; it was trained at one exit layer,
    so exit_layer must then be that layer, not "measured" (the build checks it against the adapter's config.json)."""

    exit_layer: int | Literal["measured"] = "measured"
    sweep: tuple[int, ...] = DEFAULT_EXIT_SWEEP
    draft_vocab: int = 4096
    adapter: str = ""

    def check(self) -> None:
        if self.exit_layer != "measured" and not (type(self.exit_layer) is int and self.exit_layer >= 1):
            raise Problem("exit_layer", f"must be ≥ 1 or 'measured', got {quoted(self.exit_layer)}")
        if self.adapter and self.exit_layer == "measured":
            raise Problem("exit_layer", "an adapter was trained at one exit layer: set exit_layer to that layer (its "
                                        "config.json's exit_layer), not 'measured'")
        if not self.sweep or any(type(layer) is not int or layer < 1 for layer in self.sweep):
            raise Problem("sweep", f"must be one or more layer counts ≥ 1, got {quoted(list(self.sweep))}")
        if self.draft_vocab < 0:
            raise Problem("draft_vocab", f"must be ≥ 0 (0: the whole head), got {self.draft_vocab}")


@dataclass(frozen=True)
class LookaheadSpec(Section):
    """Lookahead decoding with TensorRT-LLM's parameters: a window of `window` (W) columns guessed ahead over
    ngram - 1 levels in the target's own verify forward (Jacobi iterations), the n-grams of `ngram` (N) tokens
    their trajectories yield kept in a pool keyed by their first token, and up to `verification_set` (G) of the
    pool's n-grams that start with the pending token verified in the same forward (speculative/lookahead.py)."""

    window: int = 4
    ngram: int = 3
    verification_set: int = 4

    def check(self) -> None:
        for key in ("window", "verification_set"):
            if getattr(self, key) < 1:
                raise Problem(key, f"must be ≥ 1, got {getattr(self, key)}")
        if self.ngram < 2:
            raise Problem("ngram", f"must be ≥ 2 (an n-gram is a key token and what follows it), got {self.ngram}")

    @property
    def nodes(self) -> int:
        """Tokens one verify forward carries besides the pending one, at most: the window's (N - 2) + (W - 1)(N - 1)
        guesses (row 0's first level is the pending token) and G candidates of N - 1 tokens. TensorRT-LLM's
        max_draft_len for (W, N, G), by its own formula (LookaheadDecodingConfig::calculateSpeculativeResourceTuple,
        docs/lookahead.md)."""
        return (self.ngram - 2) + (self.window - 1 + self.verification_set) * (self.ngram - 1)


@dataclass(frozen=True)
class SpeculationSpec(Section):
    method: Method = "none"
    num_draft_tokens: int = 4
    acceptance: Acceptance = "exact"
    schedule: Schedule = "constant"
    draft: DraftSpec | None = None
    ngram: NgramSpec = field(default_factory=NgramSpec)
    medusa: MedusaSpec = field(default_factory=MedusaSpec)
    eagle: EagleSpec = field(default_factory=EagleSpec)
    early_exit: EarlyExitSpec = field(default_factory=EarlyExitSpec)
    lookahead: LookaheadSpec = field(default_factory=LookaheadSpec)

    def check(self) -> None:
        if self.method not in METHODS:  # a spec built in code: a file's value is checked against Method already
            raise Problem("method", f"must be one of {', '.join(METHODS)}, got {quoted(self.method)}")
        if self.num_draft_tokens <= 0:
            raise Problem("num_draft_tokens", f"must be ≥ 1, got {self.num_draft_tokens}")
        if self.uses_draft_model and self.draft is None:
            raise Problem("draft", f"required when method is {self.method!r}")
        if not self.uses_draft_model and self.draft is not None:
            raise Problem("draft", f"only allowed when method is 'draft_target', not {self.method!r}")
        if self.acceptance == "typical" and not self.uses_heads:  # Medusa's rule for accepting its tree's nodes
            raise Problem("acceptance", f"'typical' (lossy) is only for method 'medusa', not {self.method!r}")
        if self.uses_heads:
            if not self.medusa.heads:
                raise Problem("medusa.heads", "required when method is 'medusa' (train them with "
                                              "specdeploy train-medusa)")
            if self.num_draft_tokens > self.medusa.num_heads:
                raise Problem("num_draft_tokens", f"for medusa the tree depth cap, at most medusa.num_heads "
                                                  f"({self.medusa.num_heads}), got {self.num_draft_tokens}")
        if self.uses_features and not self.eagle.head:
            raise Problem("eagle.head", "required when method is 'eagle' (train one with specdeploy train-eagle)")

    # The questions the build, the servers and the sizing ask of the method (its row in METHODS), never its name.

    @property
    def speculates(self) -> bool:
        """Anything is proposed at all (method none decodes one token per target step)."""
        return self.method != "none"

    @property
    def uses_draft_model(self) -> bool:
        """A separate draft model proposes (the `draft` section): its engine is built, converted, loaded, served
        and sized beside the target's."""
        return METHODS[self.method].draft_model

    @property
    def uses_heads(self) -> bool:
        """Heads on the target's hidden state propose (the `medusa` section): trained apart, written and converted
        with the target, sized with it; on TensorRT-LLM the target engine drafts and verifies by itself."""
        return METHODS[self.method].heads

    @property
    def uses_features(self) -> bool:
        """A one-layer draft fed by the target's hidden states proposes (the `eagle` section): trained apart, built
        into the engine beside the target, sized with it; the target hands it three layers' hidden states."""
        return METHODS[self.method].features

    @property
    def drafts_with_own_layers(self) -> bool:
        """The target's own first layers propose (the `early_exit` section): nothing is built beside the target but
        an optional adapter; the draft writes the target's cache for those layers and the verify resumes after
        them."""
        return METHODS[self.method].own_layers

    @property
    def uses_exit_adapter(self) -> bool:
        """The early exit's draft passes its states through an adapter (early_exit.adapter): trained apart, copied
        into the engine beside the target."""
        return self.drafts_with_own_layers and bool(self.early_exit.adapter)

    @property
    def drafts_by_lookahead(self) -> bool:
        """The target guesses ahead in its own verify forward and verifies n-grams pooled from those guesses (the
        `lookahead` section): nothing is built beside the target."""
        return METHODS[self.method].lookahead

    @property
    def drafts_from_context(self) -> bool:
        """Proposals are looked up in the prompt and output so far (the `ngram` section): no model proposes."""
        return METHODS[self.method].from_context

    @property
    def drafts_outside_target(self) -> bool:
        """Proposals come from outside the target (a draft model or the text) as a chain of up to gamma tokens
        that one target call verifies: on TensorRT-LLM, a draft_tokens_external engine fed by our orchestration."""
        return self.uses_draft_model or self.drafts_from_context

    @property
    def drafts_tree(self) -> bool:
        """Proposals form a token tree verified in one step (medusa.choices, or eagle's tree grown each step);
        its size is set by the tree, so there is no chain length to sweep."""
        return METHODS[self.method].tree


@dataclass(frozen=True)
class SamplingSpec(Section):
    """Defaults for requests that do not set them. temperature 0 means greedy; top_k 0 means off."""

    temperature: float = _NEUTRAL.temperature
    top_k: int = _NEUTRAL.top_k
    top_p: float = _NEUTRAL.top_p
    repetition_penalty: float = _NEUTRAL.repetition_penalty
    max_tokens: int = 128

    def check(self) -> None:
        for key, problem in sampling_problems(self.temperature, self.top_k, self.top_p, self.repetition_penalty):
            raise Problem(key, problem)
        if self.max_tokens <= 0:
            raise Problem("max_tokens", f"must be ≥ 1, got {self.max_tokens}")

    def params(self, temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
               repetition_penalty: float | None = None, seed: int | None = None) -> SamplingParams:
        """A request's SamplingParams: the given values, this section's for those left None."""
        return SamplingParams(temperature=self.temperature if temperature is None else temperature,
                              top_k=self.top_k if top_k is None else top_k,
                              top_p=self.top_p if top_p is None else top_p,
                              repetition_penalty=(self.repetition_penalty if repetition_penalty is None
                                                  else repetition_penalty),
                              seed=seed)


@dataclass(frozen=True)
class LimitsSpec(Section):
    max_batch_size: int = 8
    max_input_length: int = 1024
    max_sequence_length: int = 2048
    max_draft_tokens: int = 16

    def check(self) -> None:
        for key in ("max_batch_size", "max_input_length", "max_sequence_length", "max_draft_tokens"):
            if getattr(self, key) <= 0:
                raise Problem(key, f"must be ≥ 1, got {getattr(self, key)}")
        if self.max_input_length >= self.max_sequence_length:
            raise Problem("max_input_length",
                          f"must be below max_sequence_length ({self.max_sequence_length}), "
                          f"got {self.max_input_length}")


@dataclass(frozen=True)
class PolicySpec(Section):
    """Speculation by batch size B: the request's gamma while B ≤ full_up_to, then reduced linearly down to 1 at
    off_above, and no drafting at all when B > off_above."""

    # Drafting pays at a few streams and stops paying once the batch's GEMM is compute-bound (measured over gRPC:
    # docs/benchmarks.md, "Figures behind the code").
    full_up_to: int = 2
    off_above: int = 4
    # The most tokens any step drafts, whatever a request asks (None: no cap; 0: none, plain decode). "measured":
    # the gamma whose realized speedup was best on this machine, which `specdeploy build` measures into the engine
    # (bench/gamma_cap.py): a verify's cost by width, and an MoE's expert union, depend on the CPU or GPU.
    gamma_cap: int | Literal["measured"] | None = None

    def check(self) -> None:
        if self.full_up_to < 0:
            raise Problem("full_up_to", f"must be ≥ 0, got {self.full_up_to}")
        if self.off_above < self.full_up_to:
            raise Problem("off_above", f"must be ≥ full_up_to ({self.full_up_to}), got {self.off_above}")
        if self.gamma_cap is not None and self.gamma_cap != "measured" and not (
                type(self.gamma_cap) is int and self.gamma_cap >= 0):
            raise Problem("gamma_cap", f"must be ≥ 0 (0: no drafting), 'measured' or null for no cap, got "
                                       f"{quoted(self.gamma_cap)}")

    def gamma(self, gamma: int, batch_size: int) -> int:
        """The proposal cap for a request whose own gamma is `gamma` in a batch of `batch_size` sequences."""
        if batch_size > self.off_above:
            return 0
        if batch_size <= self.full_up_to:
            return gamma
        remaining = (self.off_above - batch_size + 1) / (self.off_above - self.full_up_to + 1)
        return max(1, round(gamma * remaining))


@dataclass(frozen=True)
class ServingSpec(Section):
    """How the Triton `speculative` model schedules: the speculation policy and the KV budget in tokens (None:
    limits.max_batch_size × limits.max_sequence_length, see PipelineSpec.kv_capacity_tokens). request_kinds: the
    values a request's `request_kind` input may take, each a label of the acceptance counters so that acceptance
    shows per kind of traffic; at most MAX_REQUEST_KINDS short labels, so the series stay few (requests without a
    kind count as UNSPECIFIED_KIND). determinism: "batch_invariant" computes each request's positions as a lone
    plain decode step would (models/row_invariance.py), so its greedy text depends neither on the batch nor on
    speculation; "batch_dependent" runs each step's rows through the kernels together, which is faster."""

    policy: PolicySpec = field(default_factory=PolicySpec)
    kv_capacity_tokens: int | None = None
    request_kinds: tuple[str, ...] = ()
    # Off by default: it costs throughput at full batches, more while speculating (docs/serving.md, "What a seed
    # guarantees").
    determinism: Determinism = "batch_dependent"

    def check(self) -> None:
        if self.kv_capacity_tokens is not None and self.kv_capacity_tokens <= 0:
            raise Problem("kv_capacity_tokens", f"must be ≥ 1, got {self.kv_capacity_tokens}")
        if len(self.request_kinds) > MAX_REQUEST_KINDS:
            raise Problem("request_kinds", f"at most {MAX_REQUEST_KINDS} kinds (each is a Prometheus label value), "
                                           f"got {len(self.request_kinds)}")
        for kind in self.request_kinds:
            problem = request_kind_problem(kind)
            if problem:
                raise Problem("request_kinds", problem)
        if len(set(self.request_kinds)) != len(self.request_kinds):
            raise Problem("request_kinds", f"each kind once, got {list(self.request_kinds)}")


@dataclass(frozen=True)
class TrtllmSpec(Section):
    """TensorRT-LLM settings (backend.kind: trtllm). line: `engine` builds TensorRT engines with TensorRT-LLM 1.2.x
    (trtllm-build), `llm_api` serves through the LLM API's PyTorch backend of newer releases. server: Triton (its
    tensorrtllm backend, or its llmapi model on the llm_api line) or trtllm-serve. moe_tp_size × moe_ep_size must
    equal tp_size (unset: TensorRT-LLM's completion, tp × 1). Batch, input and sequence limits come from `limits`;
    the draft's weight-only int4 or int8 from speculation.draft.derive. medusa_converter: TensorRT-LLM's
    examples/medusa/convert_checkpoint.py, which is not in its wheel; the default is where the pinned Triton image
    keeps it (tensorrtllm_backend's Dockerfile: WORKDIR /app, the repository's examples copied to examples)."""

    line: Literal["engine", "llm_api"] = "engine"
    server: Literal["triton", "trtllm_serve"] = "triton"
    dtype: Literal["float16", "bfloat16"] = "bfloat16"
    tp_size: int = 1
    pp_size: int = 1
    moe_tp_size: int | None = None
    moe_ep_size: int | None = None
    max_num_tokens: int = 8192
    kv_cache_free_gpu_mem_fraction: float = 0.9
    enable_kv_cache_reuse: bool = True
    medusa_converter: str = "/app/examples/medusa/convert_checkpoint.py"

    def check(self) -> None:
        for key in ("tp_size", "pp_size", "max_num_tokens"):
            if getattr(self, key) < 1:
                raise Problem(key, f"must be ≥ 1, got {getattr(self, key)}")
        for key in ("moe_tp_size", "moe_ep_size"):
            value = getattr(self, key)
            if value is not None and (value < 1 or self.tp_size % value):
                raise Problem(key, f"must divide tp_size ({self.tp_size}), got {value}")
        if self.moe_tp_size is not None and self.moe_ep_size is not None \
                and self.moe_tp_size * self.moe_ep_size != self.tp_size:
            raise Problem("moe_ep_size", f"moe_tp_size × moe_ep_size must equal tp_size ({self.tp_size}), got "
                                         f"{self.moe_tp_size} × {self.moe_ep_size}")
        if not 0 < self.kv_cache_free_gpu_mem_fraction < 1:  # the executor's KvCacheConfig refuses 0 and 1
            raise Problem("kv_cache_free_gpu_mem_fraction", f"must be in (0, 1), got "
                                                            f"{self.kv_cache_free_gpu_mem_fraction}")


@dataclass(frozen=True)
class TorchSpec(Section):
    """Torch backend settings (backend.kind: torch). device: cuda runs build measurements, generate, bench and serve
    on an NVIDIA GPU (Triton gives the engine's model KIND_GPU instances); the engine files are the same on both, so
    changing it rebuilds nothing."""

    device: Device = "cpu"
    # decode and verify steps through torch.compile (models/compiled.py): compiled at build into the engine's cache,
    # loaded with the engine; CPU only
    compile: bool = False
    # each stepped model's forward as an ahead-of-time compiled program (runtime/step_programs.py): measured (built
    # and kept where faster than eager on this machine), compiled (kept whatever the timing), eager (none); CPU only
    steps: StepsMode = "measured"


@dataclass(frozen=True)
class BackendSpec(Section):
    """Which engine the build produces and the Triton repository serves; each kind brings its own settings."""

    kind: BackendKind = "torch"
    trtllm: TrtllmSpec | None = None  # kind trtllm only; None there: every default
    torch: TorchSpec | None = None  # kind torch only; None there: every default

    def check(self) -> None:
        if self.kind != "trtllm" and self.trtllm is not None:
            raise Problem("trtllm", f"only with kind: trtllm (kind is {self.kind!r})")
        if self.kind != "torch" and self.torch is not None:
            raise Problem("torch", f"only with kind: torch (kind is {self.kind!r}; TensorRT-LLM always runs on "
                                   f"GPUs)")

    @property
    def device(self) -> Device:
        """Where the torch backend's engine runs."""
        return self.torch.device if self.torch else "cpu"

    def with_device(self, device: Device) -> BackendSpec:
        """The same backend run on `device` (the CLI's --device); only the torch backend has a choice."""
        if self.kind != "torch":
            raise PipelineError(f"--device is for the torch backend (this pipeline's backend.kind is {self.kind!r})")
        return dataclasses.replace(self, torch=dataclasses.replace(self.torch or TorchSpec(), device=device))

    @property
    def steps(self) -> StepsMode:
        """What the build does about compiled step programs (backend.torch.steps)."""
        return (self.torch or TorchSpec()).steps

    @property
    def compiles(self) -> bool:
        """Whether the torch engine runs compiled steps (backend.torch.compile)."""
        return self.torch is not None and self.torch.compile

    @property
    def settings(self) -> TrtllmSpec:
        """The TensorRT-LLM settings (defaults when the section is left out)."""
        return self.trtllm or TrtllmSpec()


@dataclass(frozen=True)
class PipelineSpec(Section):
    name: str
    target: TargetSpec
    speculation: SpeculationSpec = field(default_factory=SpeculationSpec)
    sampling: SamplingSpec = field(default_factory=SamplingSpec)
    limits: LimitsSpec = field(default_factory=LimitsSpec)
    serving: ServingSpec = field(default_factory=ServingSpec)
    backend: BackendSpec = field(default_factory=BackendSpec)
    source_file: Path | None = field(default=None, compare=False, metadata=NOT_IN_FILE)

    def check(self) -> None:
        if not self.name or not all(ch.isalnum() or ch in "-_." for ch in self.name) or self.name.startswith("."):
            # The name is a directory under the engines root: one path component, never '.', '..' or hidden.
            raise Problem("name", f"must be letters, digits, '-', '_' or '.', not starting with '.', got "
                                  f"{quoted(self.name)}")
        gamma, limit = self.speculation.num_draft_tokens, self.limits.max_draft_tokens
        if gamma > limit:
            raise Problem("speculation.num_draft_tokens", f"{gamma} is above limits.max_draft_tokens ({limit})")
        draft = self.speculation.draft
        if draft is not None and draft.derive == "int4_dense" and self.target.moe is None:
            raise Problem("speculation.draft.derive", "int4_dense quantizes the dense model an MoE target is derived "
                                                      "from, and this target has no target.moe: use int4")
        if draft is not None and not draft_is_smaller(draft, self.target):
            raise Problem("speculation.draft.derive", f"{draft.derive} from a target already stored as "
                                                      f"{self.target.weight_only} would be no cheaper than the "
                                                      f"target: use ngram, or a smaller draft checkpoint "
                                                      f"(derive: none)")
        if self.backend.compiles and self.serving.determinism == "batch_invariant":
            raise Problem("serving.determinism", "batch_invariant attends row by row, which compiled steps do not "
                                                 "(set batch_dependent with backend.torch.compile)")
        if self.backend.compiles and self.speculation.drafts_with_own_layers:
            raise Problem("backend.torch.compile", "compiled steps run the whole target at each forward; an early "
                                                   "exit's draft and verify run parts of it, eagerly (leave compile "
                                                   "off for method early_exit)")
        if self.backend.compiles and self.speculation.drafts_tree:
            raise Problem("backend.torch.compile", f"compiled steps run chains of drafts; a token tree's masked "
                                                   f"verify runs eagerly (leave compile off for method "
                                                   f"{self.speculation.method})")
        if self.backend.steps == "compiled":
            self.check_compiled_steps()
        if self.backend.kind == "trtllm":
            self.check_trtllm()
        if self.speculation.uses_features and self.speculation.eagle.max_nodes > limit:
            raise Problem("speculation.eagle.max_nodes", f"{self.speculation.eagle.max_nodes} nodes are above "
                                                         f"limits.max_draft_tokens ({limit})")
        if self.speculation.drafts_by_lookahead and self.speculation.lookahead.nodes > limit:
            raise Problem("speculation.lookahead", f"(N - 2) + (W - 1 + G)(N - 1) = "
                                                   f"{self.speculation.lookahead.nodes} tokens per verify are above "
                                                   f"limits.max_draft_tokens ({limit})")
        nodes = len(self.speculation.medusa.choices)
        if self.speculation.uses_heads and nodes > limit:
            # a tree's nodes take cache slots past the committed prefix, as many as a chain's drafted tokens
            raise Problem("speculation.medusa.choices", f"{nodes} nodes are above limits.max_draft_tokens ({limit})")

    def check_compiled_steps(self) -> None:
        """backend.torch.steps: compiled asks for what `measured` leaves eager, quietly, where a program cannot run."""
        key = "backend.torch.steps"
        if self.backend.compiles:
            raise Problem(key, "compiled step programs and backend.torch.compile are two ways to compile the same "
                               "steps: choose one")
        if self.serving.determinism == "batch_invariant":
            raise Problem(key, "a step program attends to every row at once, and serving.determinism "
                               "batch_invariant row by row (set batch_dependent, or steps: eager)")
        if self.backend.device != "cpu":
            raise Problem(key, f"step programs are built and measured for the CPU only, and the engine runs on "
                               f"{self.backend.device} (use steps: measured or eager)")

    def check_trtllm(self) -> None:
        """The combinations TensorRT-LLM cannot serve (facts in docs/tensorrt-llm.md). The checks that need the
        model's head and expert counts run at build (build/trtllm/plan.check_model_fits)."""
        settings, speculation, method = self.backend.settings, self.speculation, self.speculation.method
        if speculation.drafts_with_own_layers:
            raise Problem("speculation.method", "early_exit has no TensorRT-LLM path (neither trtllm-build nor the "
                                                "LLM API drafts with a model's own early layers): use backend.kind: "
                                                "torch, or lookahead for speculation without a draft on TensorRT-LLM")
        if speculation.uses_heads and self.target.moe is not None:
            raise Problem("speculation.method", "medusa on an MoE target has no TensorRT-LLM recipe (its Medusa "
                                                "converter has no expert mapping); use draft_target or ngram")
        if speculation.uses_heads and settings.line == "llm_api":
            raise Problem("backend.trtllm.line", "medusa runs on TensorRT engines only: use line: engine (the "
                                                 "LLM API's PyTorch backend has no Medusa)")
        if speculation.uses_features and settings.line == "engine":
            raise Problem("backend.trtllm.line", f"{method} heads are EAGLE-3, which runs on line: llm_api only: "
                                                 f"the engine line's EAGLE (examples/eagle/convert_checkpoint.py, "
                                                 f"trtllm-build --speculative_decoding_mode eagle) reads EAGLE-1 "
                                                 f"drafts (one fc over the embedding and the last hidden state), not "
                                                 f"three captured layers and a draft vocabulary")
        if speculation.uses_features and speculation.eagle.top_k != 1:
            # line llm_api: EagleDecodingConfig's draft trees (eagle_choices, use_dynamic_tree) are flagged as under
            # development in the 1.2 line, so the plan asks for its linear chain (docs/tensorrt-llm.md)
            raise Problem("speculation.eagle.top_k", f"TensorRT-LLM's PyTorch backend drafts EAGLE-3 as one chain "
                                                     f"of num_draft_tokens tokens: set top_k: 1 (a chain) so the "
                                                     f"torch and trtllm flavours draft alike, got "
                                                     f"{speculation.eagle.top_k}")
        if speculation.drafts_by_lookahead:
            self.check_trtllm_lookahead()
        if settings.line == "engine" and settings.server == "trtllm_serve" and speculation.drafts_outside_target:
            raise Problem("backend.trtllm.server", f"{method} on the engine line runs through Triton (our "
                                                   f"orchestration model feeds draft tokens to the engine); the "
                                                   f"LLM API serves {method} only on line: llm_api")
        if settings.line == "engine" and speculation.drafts_outside_target and not settings.enable_kv_cache_reuse:
            raise Problem("backend.trtllm.enable_kv_cache_reuse", f"{method} verifies drafts on a "
                                                                  f"draft_tokens_external target engine, which "
                                                                  f"TensorRT-LLM refuses to load without KV cache "
                                                                  f"block reuse: set it true")
        if settings.line == "llm_api" and self.target.weight_only is not None:
            raise Problem("target.weight_only", "needs the engine line (TensorRT-LLM quantizes it at conversion); "
                                                "on line: llm_api give a quantized checkpoint instead")
        draft = speculation.draft
        if settings.line == "llm_api" and speculation.uses_draft_model and draft.derive != "none":
            raise Problem("speculation.draft.derive", f"{draft.derive} needs the engine line (TensorRT-LLM "
                                                      f"quantizes it at conversion); on line: llm_api give the "
                                                      f"draft a checkpoint (derive: none)")

    def check_trtllm_lookahead(self) -> None:
        """Lookahead decoding on TensorRT-LLM (docs/tensorrt-llm.md, "Lookahead decoding"): TensorRT engines only,
        served by Triton's tensorrtllm backend, and greedy only, so the pipeline's own sampling defaults must be
        greedy and unpenalised (each request is checked again when it arrives: serve/trtllm/orchestration.py)."""
        settings, sampling = self.backend.settings, self.sampling
        if settings.line == "llm_api":
            # llm_args.LookaheadDecodingConfig.supports_backend: not pytorch, not _autodeploy
            raise Problem("backend.trtllm.line", "lookahead runs on line: engine only (trtllm-build "
                                                 "--speculative_decoding_mode lookahead_decoding); the LLM API's "
                                                 "PyTorch backend, which the llm_api line serves, refuses it: "
                                                 "\"Speculation type Lookahead does not support backend pytorch\"")
        if settings.server == "trtllm_serve":
            raise Problem("backend.trtllm.server", "lookahead's engine is served by Triton's tensorrtllm backend "
                                                   "(decoding_mode lookahead and its three lookahead_* "
                                                   "parameters); trtllm-serve takes the LLM API's options, whose "
                                                   "PyTorch backend refuses lookahead: use server: triton")
        if not sampling.params().greedy:
            raise Problem("sampling.temperature", f"TensorRT-LLM's lookahead decoding is greedy only (it takes the "
                                                  f"top token at every position and ignores temperature, top_k and "
                                                  f"top_p), so requests at this default would be refused: set 0, "
                                                  f"got {sampling.temperature}")
        if sampling.repetition_penalty != 1:
            raise Problem("sampling.repetition_penalty", f"TensorRT-LLM's lookahead decoding applies no penalties, "
                                                         f"so requests at this default would be refused: set 1, got "
                                                         f"{sampling.repetition_penalty}")

    @property
    def kv_capacity_tokens(self) -> int:
        """The KV budget shared by a server's active sequences, in tokens."""
        limits = self.limits
        return self.serving.kv_capacity_tokens or limits.max_batch_size * limits.max_sequence_length

    def resolve(self, path: str) -> Path:
        """A checkpoint path, relative to the pipeline file's directory when not absolute."""
        candidate = Path(path).expanduser()
        if candidate.is_absolute() or self.source_file is None:
            return candidate
        return (self.source_file.parent / candidate).resolve()

    def with_gamma_cap(self, cap: int | None) -> PipelineSpec:
        """The same spec with serving.policy.gamma_cap set to `cap`."""
        policy = dataclasses.replace(self.serving.policy, gamma_cap=cap)
        return dataclasses.replace(self, serving=dataclasses.replace(self.serving, policy=policy))

    def with_exit_layer(self, layer: int) -> PipelineSpec:
        """The same spec with speculation.early_exit.exit_layer set to `layer`."""
        early_exit = dataclasses.replace(self.speculation.early_exit, exit_layer=layer)
        return dataclasses.replace(self, speculation=dataclasses.replace(self.speculation, early_exit=early_exit))

    def resolved(self) -> PipelineSpec:
        """The same spec with file checkpoints as absolute paths, so it means the same wherever it is saved."""

        def absolute(checkpoint: CheckpointSpec | None) -> CheckpointSpec | None:
            if checkpoint is None or checkpoint.source == "package":
                return checkpoint
            return dataclasses.replace(checkpoint, path=str(self.resolve(checkpoint.path)))

        speculation = self.speculation
        if speculation.draft is not None:
            draft = dataclasses.replace(speculation.draft, checkpoint=absolute(speculation.draft.checkpoint))
            speculation = dataclasses.replace(speculation, draft=draft)
        if speculation.medusa.heads:
            medusa = dataclasses.replace(speculation.medusa, heads=str(self.resolve(speculation.medusa.heads)))
            speculation = dataclasses.replace(speculation, medusa=medusa)
        if speculation.eagle.head:
            eagle = dataclasses.replace(speculation.eagle, head=str(self.resolve(speculation.eagle.head)))
            speculation = dataclasses.replace(speculation, eagle=eagle)
        if speculation.early_exit.adapter:
            early_exit = dataclasses.replace(speculation.early_exit,
                                             adapter=str(self.resolve(speculation.early_exit.adapter)))
            speculation = dataclasses.replace(speculation, early_exit=early_exit)
        target = dataclasses.replace(self.target, checkpoint=absolute(self.target.checkpoint))
        return dataclasses.replace(self, target=target, speculation=speculation)

    def to_dict(self) -> dict:
        """Plain data, as JSON holds it (lists, not tuples), that parse_pipeline turns back into an equal spec."""
        return plain_data(self)


def load_pipeline(path: str | Path) -> PipelineSpec:
    """A pipeline YAML file (JSON, which YAML reads too, for the copy a build saves in the engine directory)."""
    return parse_pipeline(read_yaml(path, "pipeline"), source=Path(path))


def parse_pipeline(data: object, source: Path | None = None) -> PipelineSpec:
    """The PipelineSpec of plain data (a file's, when `source` names it: messages name it, relative paths resolve
    against its folder)."""
    where = str(source) if source else "<pipeline>"
    spec = build(PipelineSpec, data, where)
    return dataclasses.replace(spec, source_file=source.resolve() if source else None)
