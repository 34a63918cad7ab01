"""PipelineSpec: the one validated configuration, loaded from a pipeline YAML (or the JSON a build saves).

Every section is a frozen dataclass validated when it is constructed, so a spec built in code is checked exactly
like one loaded from a file; spec/strict_yaml.py reads the file and walks its data against the sections' type
hints, so unknown keys, wrong types and values outside a Literal are errors naming the file, the key path, the bad
value and what is allowed. Defaults are defined here and nowhere else; this module imports neither torch nor the
runtime. The speculation section is spec/speculation.py, the backend section spec/backend.py.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from specdeploy.spec.backend import BackendSpec, check_backend
from specdeploy.spec.checkpoint import CheckpointSpec, DType
from specdeploy.spec.sampling_params import SamplingParams, sampling_problems
from specdeploy.spec.speculation import DraftSpec, SpeculationSpec
from specdeploy.spec.strict_yaml import NOT_IN_FILE, Problem, Section, build, plain_data, quoted, read_yaml

# batch_invariant: each row computed as it would be alone (a chain's positions as lone plain decode steps);
# batch_dependent: each step's rows through the kernels together (ServingSpec.determinism)
Determinism = Literal["batch_invariant", "batch_dependent"]

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



WEIGHT_BITS = {None: 16, "int8": 8, "int4": 4}


def draft_is_smaller(draft: DraftSpec, target: TargetSpec) -> bool:
    """Whether a derived draft stores fewer bits per projection weight than the target it is derived from (a
    checkpoint draft, or one derived from an MoE's dense source, is another model and always qualifies)."""
    if draft.derive in ("none", "int4_dense"):
        return True
    return WEIGHT_BITS[draft.weight_only] < WEIGHT_BITS[target.weight_only]


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
    # (tune/gamma_cap.py): a verify's cost by width, and an MoE's expert union, depend on the CPU or GPU.
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
    kind count as UNSPECIFIED_KIND). determinism: "batch_invariant" computes each row as it would be alone
    (models/row_invariance.py), so the batch changes a request's text only through the gamma the policy gives it,
    and a chain method's verify computes each position as a plain decode step would, so its greedy text depends on
    neither (a tree method's can part from plain at near ties); "batch_dependent" runs each step's rows through the
    kernels together, which is faster. What each keeps: docs/serving.md, "What a seed guarantees"."""

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
        check_backend(self)
        nodes, key, counted = self.speculation.verify_nodes()
        if nodes > limit:
            section = self.speculation.traits.section
            raise Problem(".".join(part for part in ("speculation", section, key) if part),
                          f"{counted} are above limits.max_draft_tokens ({limit})")

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
        for source in speculation.trained_sources:
            settings = dataclasses.replace(speculation.settings, **{source.part.key: str(self.resolve(source.path))})
            speculation = dataclasses.replace(speculation, **{speculation.traits.section: settings})
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
