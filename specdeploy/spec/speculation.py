"""The speculation section of a pipeline: each method's descriptor (METHODS), its settings section, and
SpeculationSpec.

A method's descriptor answers what the stages ask of it as data: the settings section it reads, the shape of its
proposals, the trained parts it brings beside the target, how many nodes one verify carries, and how TensorRT-LLM
runs it. The build, the servers, the sizing and the bench loop over those answers; none of them names a method
(tests/spec/test_method_predicates.py). docs/architecture.md, "Adding a speculation method", lists the files a new
method touches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from specdeploy.spec.checkpoint import CheckpointSpec, DType
from specdeploy.spec.strict_yaml import Problem, Section, quoted
from specdeploy.spec.token_tree import TokenTree

Method = Literal["draft_target", "ngram", "medusa", "eagle", "early_exit", "lookahead", "none"]
# exact: every emitted token is distributed as the target's. typical: Medusa's typical acceptance, LOSSY (it accepts
# more and changes the distribution); only for a method whose descriptor allows it, and never the default.
Acceptance = Literal["exact", "typical"]
Schedule = Literal["constant", "heuristic"]  # proposal length per step: always gamma, or adaptive up to gamma
Shape = Literal["chain", "tree"]  # a chain of up to gamma tokens, or the nodes of a token tree verified at once
TrtllmLineName = Literal["engine", "llm_api"]


@dataclass(frozen=True)
class TrainedPart:
    """A trained artefact a method reads beside the target: the key of its section that names where it is
    (relative to the YAML), the specdeploy verb that trains one, and the engine folder the build writes it to.
    layout: one safetensors file, or a folder holding config.json and safetensors."""

    key: str
    what: str
    command: str
    folder: str
    layout: Literal["file", "folder"]
    required: bool = True


@dataclass(frozen=True)
class TrainedSource:
    """A trained part as one pipeline names it: the part, its full key ('speculation.medusa.heads') and the path
    as written in the file."""

    part: TrainedPart
    key: str
    path: str


@dataclass(frozen=True)
class TrtllmRecipe:
    """How TensorRT-LLM runs a method (docs/tensorrt-llm.md). lines: where it has a recipe (engine: trtllm-build
    engines served by Triton's tensorrtllm backend; llm_api: the LLM API's PyTorch backend); `refusal` says why
    another line has none (the method, when none has). engine_mode: the target engine's
    --speculative_decoding_mode on line engine (None: plain); decoding_type: speculative_config's decoding_type on
    line llm_api (None: plain). servers: the servers that may serve it, with `server_refusal` for the rest.
    greedy_only: upstream decodes it greedily whatever a request samples. moe_refusal: why an MoE target has no
    recipe (empty: it has one). converts_heads: the target is converted together with the method's trained heads by
    TensorRT-LLM's own converter for them (examples/medusa/convert_checkpoint.py), which loads the whole model."""

    lines: tuple[TrtllmLineName, ...] = ("engine", "llm_api")
    refusal: str = ""
    engine_mode: str | None = None
    decoding_type: str | None = None
    servers: tuple[str, ...] = ("triton", "trtllm_serve")
    server_refusal: str = ""
    greedy_only: bool = False
    moe_refusal: str = ""
    converts_heads: bool = False

    @property
    def orchestrated(self) -> bool:
        """On line engine, the drafts come from outside the target engine: our orchestration model feeds them."""
        return self.engine_mode == DRAFTS_FROM_OUTSIDE

    @property
    def engine_speculates(self) -> bool:
        """On line engine, the target engine drafts and verifies by itself (its mode is neither plain nor fed)."""
        return self.engine_mode not in (None, DRAFTS_FROM_OUTSIDE)


DRAFTS_FROM_OUTSIDE = "draft_tokens_external"  # trtllm-build's mode for drafts fed to the target engine


@dataclass(frozen=True)
class MethodTraits:
    """One speculation method, in the terms the stages ask about.

    section: its settings' key in SpeculationSpec (None: it has none). shape: a chain or a tree. outside_target: a
    chain proposed outside the target (a draft model, the text), which the target verifies in one call: the gamma
    cap is measured for it, and TensorRT-LLM feeds it to a draft_tokens_external engine. draft_model: a separate
    draft model proposes (the `draft` section; built, served and sized beside the target). trained: what it brings
    beside the target that `specdeploy train-*` makes. typical: Medusa's lossy typical acceptance may be asked for.
    reuses_target_layers: the draft runs the target's own first layers, and the verify resumes after them, so a
    whole-target compiled step cannot run it."""

    section: str | None = None
    shape: Shape = "chain"
    outside_target: bool = False
    draft_model: bool = False
    trained: tuple[TrainedPart, ...] = ()
    typical: bool = False
    reuses_target_layers: bool = False
    trtllm: TrtllmRecipe = TrtllmRecipe()


MEDUSA_HEADS = TrainedPart("heads", "Medusa heads", "train-medusa", "medusa", "file")
EAGLE_HEAD = TrainedPart("head", "EAGLE-3 head", "train-eagle", "eagle", "folder")
EXIT_ADAPTER = TrainedPart("adapter", "exit adapter", "train-exit-adapter", "exit_adapter", "folder", required=False)

METHODS: dict[str, MethodTraits] = {
    "none": MethodTraits(),  # plain decoding: nothing is proposed
    "draft_target": MethodTraits(
        section="draft", outside_target=True, draft_model=True,
        trtllm=TrtllmRecipe(engine_mode=DRAFTS_FROM_OUTSIDE, decoding_type="DraftTarget")),
    "ngram": MethodTraits(
        section="ngram", outside_target=True,
        trtllm=TrtllmRecipe(engine_mode=DRAFTS_FROM_OUTSIDE, decoding_type="NGram")),
    "medusa": MethodTraits(
        section="medusa", shape="tree", trained=(MEDUSA_HEADS,), typical=True,
        trtllm=TrtllmRecipe(
            lines=("engine",), engine_mode="medusa",
            refusal="medusa runs on TensorRT engines only: use line: engine (the LLM API's PyTorch backend has no "
                    "Medusa)",
            converts_heads=True,
            moe_refusal="medusa on an MoE target has no TensorRT-LLM recipe (its Medusa converter has no expert "
                        "mapping); use draft_target or ngram")),
    "eagle": MethodTraits(
        section="eagle", shape="tree", trained=(EAGLE_HEAD,),
        trtllm=TrtllmRecipe(
            lines=("llm_api",), decoding_type="Eagle",
            refusal="eagle heads are EAGLE-3, which runs on line: llm_api only: the engine line's EAGLE "
                    "(examples/eagle/convert_checkpoint.py, trtllm-build --speculative_decoding_mode eagle) reads "
                    "EAGLE-1 drafts (one fc over the embedding and the last hidden state), not three captured "
                    "layers and a draft vocabulary")),
    "early_exit": MethodTraits(
        section="early_exit", trained=(EXIT_ADAPTER,), reuses_target_layers=True,
        trtllm=TrtllmRecipe(
            lines=(), refusal="early_exit has no TensorRT-LLM path (neither trtllm-build nor the LLM API drafts "
                              "with a model's own early layers): use backend.kind: torch, or lookahead for "
                              "speculation without a draft on TensorRT-LLM")),
    "lookahead": MethodTraits(
        section="lookahead", shape="tree",
        trtllm=TrtllmRecipe(
            # llm_args.LookaheadDecodingConfig.supports_backend: not pytorch, not _autodeploy
            lines=("engine",), engine_mode="lookahead_decoding", greedy_only=True,
            refusal="lookahead runs on line: engine only (trtllm-build --speculative_decoding_mode "
                    "lookahead_decoding); the LLM API's PyTorch backend, which the llm_api line serves, refuses "
                    "it: \"Speculation type Lookahead does not support backend pytorch\"",
            servers=("triton",),
            server_refusal="lookahead's engine is served by Triton's tensorrtllm backend (decoding_mode lookahead "
                           "and its three lookahead_* parameters); trtllm-serve takes the LLM API's options, whose "
                           "PyTorch backend refuses lookahead: use server: triton")),
}


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
    of top-k indices, [0] = the first head's best token, [0, 1] = the second head's second best below it).
    draft_vocab: the heads propose from the target head's rows of the `draft_vocab` tokens most frequent in the
    shipped text corpus (speculative/draft_vocabulary.py; 0: the whole head, as TensorRT-LLM's Medusa does, whose
    engines always read it whole). Over an int4 target the whole head costs the heads a third of a decode step."""

    heads: str = ""
    num_heads: int = 4
    num_layers: int = 1
    choices: tuple[tuple[int, ...], ...] = DEFAULT_MEDUSA_CHOICES
    draft_vocab: int = 0

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
        if self.draft_vocab < 0:
            raise Problem("draft_vocab", f"must be ≥ 0 (0: the whole head), got {self.draft_vocab}")

    def check_depth(self, num_draft_tokens: int) -> None:
        """num_draft_tokens caps the tree's depth, and there is a head per level."""
        if num_draft_tokens > self.num_heads:
            raise Problem("num_draft_tokens", f"for medusa the tree depth cap, at most medusa.num_heads "
                                              f"({self.num_heads}), got {num_draft_tokens}")

    def verify_nodes(self, num_draft_tokens: int) -> tuple[int, str, str]:
        """A tree's nodes take cache slots past the committed prefix, as many as a chain's drafted tokens."""
        return len(self.choices), "choices", f"{len(self.choices)} nodes"

    def check_trtllm(self) -> None:
        # TensorRT-LLM's Medusa gives every head an LM head over the whole vocabulary, loaded from the heads
        # file's `{h}.{num_layers}.weight` (tensorrt_llm/models/medusa/weight.py @ 27712aa7, load_medusa_hf)
        if self.draft_vocab:
            raise Problem("draft_vocab", f"TensorRT-LLM's Medusa reads every head's whole vocabulary projection: set "
                                         f"draft_vocab: 0 on backend trtllm, got {self.draft_vocab}")

    @property
    def max_accepted(self) -> int:
        """The most drafted tokens one step accepts: the tree's depth."""
        return max(len(path) for path in self.choices)

    def trained_parameters(self, model) -> int:
        """The heads' parameters at the target's dimensions (`model`: its ModelConfig): per head, its residual
        blocks and a vocabulary projection."""
        return self.num_heads * (self.num_layers * model.hidden_size ** 2 + model.hidden_size * model.vocab_size)


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

    def verify_nodes(self, num_draft_tokens: int) -> tuple[int, str, str]:
        return self.max_nodes, "max_nodes", f"{self.max_nodes} nodes"

    def check_trtllm(self) -> None:
        # line llm_api: EagleDecodingConfig's draft trees (eagle_choices, use_dynamic_tree) are flagged as under
        # development in the 1.2 line, so the plan asks for its linear chain (docs/tensorrt-llm.md)
        if self.top_k != 1:
            raise Problem("top_k", f"TensorRT-LLM's PyTorch backend drafts EAGLE-3 as one chain of num_draft_tokens "
                                   f"tokens: set top_k: 1 (a chain) so the torch and trtllm flavours draft alike, got "
                                   f"{self.top_k}")

    def trained_parameters(self, model) -> int:
        """The layout's count at the target's dimensions (speculative/eagle_head.py: fc over three layers, one
        decoder layer whose attention reads 2 × hidden, a vocabulary head; the draft vocabulary taken as the whole
        one, an upper bound)."""
        h, q, kv = model.hidden_size, model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
        return 3 * h * h + 2 * h * (q + 2 * kv) + q * h + 3 * h * model.intermediate_size + model.vocab_size * h


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

    def verify_nodes(self, num_draft_tokens: int) -> tuple[int, str, str]:
        return self.nodes, "", f"(N - 2) + (W - 1 + G)(N - 1) = {self.nodes} tokens per verify"

    @property
    def max_accepted(self) -> int:
        """The most drafted tokens one step accepts: an n-gram's N - 1."""
        return self.ngram - 1


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
        traits = self.traits
        if traits.draft_model and self.draft is None:
            raise Problem("draft", f"required when method is {self.method!r}")
        if not traits.draft_model and self.draft is not None:
            raise Problem("draft", f"only allowed when method is 'draft_target', not {self.method!r}")
        if self.acceptance == "typical" and not traits.typical:  # Medusa's rule for accepting its tree's nodes
            raise Problem("acceptance", f"'typical' (lossy) is only for method 'medusa', not {self.method!r}")
        for part in traits.trained:
            if part.required and not getattr(self.settings, part.key):
                raise Problem(f"{traits.section}.{part.key}", f"required when method is {self.method!r} (train "
                                                              f"one with specdeploy {part.command})")
        check_depth = getattr(self.settings, "check_depth", None)
        if check_depth is not None:
            check_depth(self.num_draft_tokens)

    # The questions the build, the servers and the sizing ask of the method: its descriptor's answers, never its name.

    @property
    def traits(self) -> MethodTraits:
        """The method's descriptor (METHODS)."""
        return METHODS[self.method]

    @property
    def settings(self) -> Section | None:
        """The method's own settings section (None for a method without one)."""
        section = self.traits.section
        return None if section is None else getattr(self, section)

    @property
    def speculates(self) -> bool:
        """Anything is proposed at all (method none decodes one token per target step)."""
        return self.method != "none"

    @property
    def drafts_outside_target(self) -> bool:
        """Proposals come from outside the target (a draft model or the text) as a chain of up to gamma tokens
        that one target call verifies."""
        return self.traits.outside_target

    @property
    def drafts_tree(self) -> bool:
        """Proposals form a token tree verified in one step; its size is set by the tree, so there is no chain
        length to sweep."""
        return self.traits.shape == "tree"

    @property
    def trained_sources(self) -> list[TrainedSource]:
        """The trained parts this pipeline names (an optional one only where it is set), with their keys."""
        traits = self.traits
        return [TrainedSource(part, f"speculation.{traits.section}.{part.key}", getattr(self.settings, part.key))
                for part in traits.trained if getattr(self.settings, part.key)]

    def verify_nodes(self) -> tuple[int, str, str]:
        """The most draft tokens one verify carries, the settings key that sets it (under the method's section;
        '' for the section itself) and the count in words: a chain's num_draft_tokens, a tree's nodes."""
        counted = getattr(self.settings, "verify_nodes", None)
        if counted is None:
            return self.num_draft_tokens, "", f"{self.num_draft_tokens} draft tokens"
        return counted(self.num_draft_tokens)
