"""BenchReport: what one in-process bench measured for one pipeline, typed, and its JSON form.

The JSON (`bench --json`, DIR/reports.json of `bench --report`) is one flat object per pipeline whose keys are the
field names below, with the nested parts (machine, by_kind, moe, medusa, peers) as objects: the same keys earlier
reports were written with, so they load. Optional parts that were not measured are left out of the JSON.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from specdeploy.errors import SpecdeployError


def known_fields(cls, data: dict) -> dict:
    """The entries of `data` that are fields of the dataclass `cls` (a newer file may carry more)."""
    names = {f.name for f in fields(cls)}
    return {key: value for key, value in data.items() if key in names}


def without_none(data: dict) -> dict:
    return {key: value for key, value in data.items() if value is not None}


@dataclass
class Machine:
    """The machine the bench ran on (models.machine.describe)."""
    cpu: str
    threads: int
    bf16_matmul: str  # "oneDNN" or the generic kernel, whose time grows with the rows
    matmul_flags: list[str] = field(default_factory=list)
    cores: int | None = None
    torch: str | None = None
    weight_only_kernels: str | None = None  # the int4/int8 kernels' code path (None in a report that predates it)
    cpu_threads: dict | None = None  # how `threads` was chosen (models/cpu_threads.py; None: a report before it)

    @classmethod
    def from_json(cls, data: dict) -> Machine:
        return cls(**known_fields(cls, data))


@dataclass
class Setup:
    """What was run: the pipeline, its speculation and the request."""
    pipeline: str
    method: str
    num_draft_tokens: int  # the pipeline's gamma
    gamma_cap: int | str | None  # serving.policy.gamma_cap
    schedule: str  # speculation.schedule: constant or an adaptive one
    dtype: str
    temperature: float
    max_tokens: int
    prompts: int
    threads: int
    machine: Machine
    steps: dict[str, str] = field(default_factory=dict)  # stepped model → "compiled" or "eager: <why>"


@dataclass
class KindSpeeds:
    """One prompt kind's decode speeds, and its tokens a speculative step (None in reports from before it)."""
    speedup: float
    prompts: int
    plain_tokens_per_s: float
    speculative_tokens_per_s: float
    mean_accepted_length: float | None = None


@dataclass
class Summary:
    """Speeds, acceptance and costs over every prompt. Costs are in plain decode steps."""
    baseline_tokens_per_s: float  # plain decode
    speculative_tokens_per_s: float
    speedup: float
    acceptance_rate: float  # alpha: accepted / drafted
    mean_accepted_length: float  # tokens emitted per step
    draft_cost_ratio: float  # c: per draft forward (a draft model) or per drafted token (draft-free)
    verify_cost_ratio: float  # v: one verify forward
    predicted_speedup: float  # the seed's formula; an MoE's union curve or a Medusa tree's own where they apply
    mean_draft_tokens_per_step: float
    proposal_cost_per_step: float  # everything the proposer spent in a step
    per_position_acceptance: list[float]  # [i]: of the steps drafting position i + 1, the fraction accepting it
    by_kind: dict[str, KindSpeeds]

    @classmethod
    def from_json(cls, data: dict) -> Summary:
        by_kind = {kind: KindSpeeds(**row) for kind, row in data["by_kind"].items()}
        return cls(**{**known_fields(cls, data), "by_kind": by_kind})


@dataclass
class GreedyCheck:
    """At temperature 0 speculation must emit plain decode's tokens: how many prompts did, how many parted at a
    near tie of the target's top two logits (reduced-precision reordering), how many did not."""
    greedy_match: bool  # no prompt mismatched
    greedy_exact_prompts: int
    greedy_near_tie_prompts: int
    greedy_mismatch_prompts: int
    # each prompt that parted: its index, the token it parted at, the top-two gap there, the tolerance at those
    # logits and the verdict (bench/greedy_check.py; empty in a report before it)
    greedy_divergences: list[dict] = field(default_factory=list)


@dataclass
class Ceiling:
    """The memory-bandwidth ceiling on plain decode: a weight-streaming mat-vec's bandwidth over the weight bytes
    one token reads."""
    bandwidth_gb_per_s: float
    weight_bytes_per_token: int
    bandwidth_ceiling_tokens_per_s: float
    fraction_of_ceiling: float  # plain decode's share of it


@dataclass
class TransformersBaseline:
    """transformers' greedy `generate` on the same weights, dtype and threads (decode phase)."""
    transformers_tokens_per_s: float
    plain_vs_transformers: float


@dataclass
class MoeCurve:
    """An MoE target's verify cost by verification length n = 1 .. (bench/moe_curve.py)."""
    verification_length: list[int]
    num_experts: int
    experts_per_token: int
    distinct_experts_per_layer: list[float]
    expert_bytes_read: list[float]
    verify_cost: list[float]  # [n - 1]: a forward over n tokens, in plain decode steps
    dense_verify_cost: list[float] | None = None  # the dense model it was derived from, same windows
    plain_step_speed_vs_dense: float | None = None  # above 1: the MoE's plain step is faster
    predicted_speedup_by_gamma: list[float] | None = None  # [gamma - 1]
    best_gamma: int | None = None

    @classmethod
    def from_json(cls, data: dict) -> MoeCurve:
        return cls(**known_fields(cls, data))


@dataclass
class MedusaTree:
    """The served tree, its predicted speedup and the tree the builder would pick here (bench/medusa_tree.py)."""
    tree: list[list[int]]
    tree_size: int
    head_cost_ratio: float
    head_top1_here: list[float]
    realized_accepted_per_step: float
    expected_accepted_per_step: float
    predicted_speedup: float
    verify_costs: list[float]
    suggested_tree: list[list[int]]
    suggested_expected_accepted: float
    suggested_predicted_speedup: float
    expected_accepted_per_step_held_out: float | None = None  # from train-medusa's held-out answers

    @classmethod
    def from_json(cls, data: dict) -> MedusaTree:
        return cls(**known_fields(cls, data))


@dataclass
class EagleTree:
    """The served tree budget, what smaller budgets would have accepted, and the budget the measured verify costs
    make best here (bench/eagle_tree.py)."""
    depth: int
    top_k: int
    max_nodes: int
    draft_cost_ratio: float  # the head's drafting per step, in plain steps
    verify_cost_ratio: float  # a target forward over max_nodes + 1 positions, in plain steps
    realized_accepted_per_step: float
    accepted_by_budget: list[float]  # [n - 1]: mean accepted tokens per step had the tree kept its n best nodes
    predicted_speedup: float  # from the served budget's accepted tokens and the measured costs
    verify_costs: list[float]
    suggested_max_nodes: int
    suggested_predicted_speedup: float
    held_out_chain_acceptance: list[float] | None = None  # train-eagle's P(depths 1..d all right), a chain's
    held_out_predicted_speedup: float | None = None

    @classmethod
    def from_json(cls, data: dict) -> EagleTree:
        return cls(**known_fields(cls, data))


@dataclass
class Peer:
    """Another implementation measured on the same weights and prompts (bench/peers.py), or why it was skipped."""
    tokens_per_s: float | None = None
    what: str | None = None
    common_prefix_tokens: float | None = None  # llama.cpp: leading tokens its greedy output shares with ours
    by_kind: dict[str, float] | None = None  # llama.cpp: tokens/s per prompt kind
    skipped: str | None = None

    @classmethod
    def from_json(cls, data: dict) -> Peer:
        return cls(**known_fields(cls, data))


@dataclass
class Footprint:
    """What the engine costs beside its decode rate (bench/footprint.py)."""

    engine_bytes: int  # every file in the engine directory
    load_seconds: float  # a fresh process: constructing the Engine (weights read, compiled steps loaded)
    first_token_seconds: float  # its first request: prompt to first token (prefill and the first step)
    first_request_seconds: float  # its first request, whole
    peak_rss_bytes: int  # that process's peak resident memory, after the request
    build_seconds: float | None = None  # the build manifest's (None: an engine built before builds recorded it)
    compile_seconds: float | None = None  # compiling the step programs after the build
    gamma_cap_seconds: float | None = None  # serving.policy.gamma_cap: measured, measured after the build
    llama_cpp_peak_rss_bytes: int | None = None  # llama.cpp's fresh process on the same GGUF and request
    llama_cpp_skipped: str | None = None  # why llama.cpp's was not measured

    @classmethod
    def from_json(cls, data: dict) -> Footprint:
        return cls(**known_fields(cls, data))

    @property
    def rss_vs_llama_cpp(self) -> float | None:
        if not self.llama_cpp_peak_rss_bytes:
            return None
        return self.peak_rss_bytes / self.llama_cpp_peak_rss_bytes


@dataclass
class Cost:
    """Dollars per million output tokens on a machine rented at `price_per_hour` (bench --price-per-hour), at the
    run's plain and speculative decode rates: the hourly price over the tokens an hour decodes."""

    price_per_hour: float
    plain_usd_per_million_tokens: float | None  # None: no tokens were decoded
    speculative_usd_per_million_tokens: float | None

    @classmethod
    def at(cls, price_per_hour: float, plain_tokens_per_s: float, speculative_tokens_per_s: float) -> Cost:
        return cls(price_per_hour, usd_per_million_tokens(price_per_hour, plain_tokens_per_s),
                   usd_per_million_tokens(price_per_hour, speculative_tokens_per_s))

    @classmethod
    def from_json(cls, data: dict) -> Cost:
        return cls(**known_fields(cls, data))


def usd_per_million_tokens(price_per_hour: float, tokens_per_s: float) -> float | None:
    """price_per_hour (USD) / (tokens_per_s x 3600) x 1e6; None at no tokens/s."""
    return price_per_hour / (tokens_per_s * 3600) * 1e6 if tokens_per_s > 0 else None


def dollars(value: float | None) -> str:
    return "–" if value is None else f"${value:.2f}"


@dataclass
class BenchReport:
    setup: Setup
    summary: Summary
    ceiling: Ceiling
    greedy: GreedyCheck | None = None  # None when sampling (no check)
    verify_costs: list[float] | None = None  # [n]: a forward over n + 1 positions, in plain steps (dense chains)
    transformers: TransformersBaseline | None = None
    moe: MoeCurve | None = None
    medusa: MedusaTree | None = None
    eagle: EagleTree | None = None
    gamma_sweep: dict[int, float] | None = None  # gamma → measured speedup
    peers: dict[str, Peer] | None = None
    footprint: Footprint | None = None
    cost: Cost | None = None
    phase_seconds: dict[str, float] = field(default_factory=dict)  # where the bench's time went

    @property
    def label(self) -> str:
        return f"{self.setup.pipeline} ({self.setup.method})"

    def to_json(self) -> dict[str, Any]:
        """The flat JSON object (see the module docstring)."""
        data: dict[str, Any] = asdict(self.summary)
        data["by_kind"] = {kind: without_none(speeds) for kind, speeds in data["by_kind"].items()}
        data.update(asdict(self.greedy) if self.greedy else {"greedy_match": None})
        if not data.get("greedy_divergences", True):  # no prompt parted: written as reports before it were
            del data["greedy_divergences"]
        data.update(asdict(self.ceiling))
        if self.verify_costs is not None:
            data["verify_costs"] = self.verify_costs
        if self.transformers is not None:
            data.update(asdict(self.transformers))
        if self.moe is not None:
            data["moe"] = without_none(asdict(self.moe))
        if self.medusa is not None:
            data["medusa"] = without_none(asdict(self.medusa))
        if self.eagle is not None:
            data["eagle"] = without_none(asdict(self.eagle))
        data.update(asdict(self.setup))
        data["machine"] = without_none(data["machine"])
        if not data["steps"]:  # a report from before step programs has none
            del data["steps"]
        if self.gamma_sweep:
            data["gamma_sweep"] = {str(gamma): value for gamma, value in self.gamma_sweep.items()}
        if self.peers is not None:
            data["peers"] = {name: without_none(asdict(peer)) for name, peer in self.peers.items()}
        if self.footprint is not None:
            data["footprint"] = without_none(asdict(self.footprint))
        if self.cost is not None:
            data["cost"] = asdict(self.cost)
        data["phase_seconds"] = self.phase_seconds
        return data

    @classmethod
    def from_json(cls, data: dict) -> BenchReport:
        try:
            setup = Setup(**{**known_fields(Setup, data), "machine": Machine.from_json(data["machine"])})
            greedy = GreedyCheck(**known_fields(GreedyCheck, data)) if data.get("greedy_match") is not None else None
            transformers = (TransformersBaseline(**known_fields(TransformersBaseline, data))
                            if data.get("transformers_tokens_per_s") is not None else None)
            return cls(setup=setup, summary=Summary.from_json(data), ceiling=Ceiling(**known_fields(Ceiling, data)),
                       greedy=greedy, verify_costs=data.get("verify_costs"), transformers=transformers,
                       moe=MoeCurve.from_json(data["moe"]) if data.get("moe") else None,
                       medusa=MedusaTree.from_json(data["medusa"]) if data.get("medusa") else None,
                       eagle=EagleTree.from_json(data["eagle"]) if data.get("eagle") else None,
                       gamma_sweep={int(g): v for g, v in data["gamma_sweep"].items()} if "gamma_sweep" in data
                       else None,
                       peers={name: Peer.from_json(peer) for name, peer in data["peers"].items()} if "peers" in data
                       else None,
                       footprint=Footprint.from_json(data["footprint"]) if "footprint" in data else None,
                       cost=Cost.from_json(data["cost"]) if "cost" in data else None,
                       phase_seconds=data.get("phase_seconds", {}))
        except (KeyError, TypeError) as error:
            raise SpecdeployError(f"not a bench report ({type(error).__name__}: {error})") from None
