"""How much a derived MoE (target.moe) loses against its dense source, for each number of experts per token (and,
for an upcycled MoE, each expert noise):
teacher-forced over held-out text (text_corpus.py's held-out half, never used for calibration), the fraction of
positions where both pick the same next token, the mean KL divergence from the dense model's next-token
distribution, and each model's perplexity on the text."""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass
from typing import Any

from rich.console import Console
from rich.progress import track
from rich.table import Table

from specdeploy.bench.model_quality import compare, held_out_sequences, perplexity, teacher_forced_logits
from specdeploy.build.checkpoints import load_checkpoint
from specdeploy.build.moe_derive import calibration_sequences, derive_moe
from specdeploy.errors import PipelineError, SpecdeployError
from specdeploy.models.llama import LlamaModel
from specdeploy.models.moe import MixtralModel
from specdeploy.spec.pipeline import PipelineSpec


@dataclass
class VariantQuality:
    """One derived variant against the dense model."""

    experts_per_token: int
    expert_noise: float
    greedy_agreement: float  # the fraction of positions where both pick the same next token
    kl_from_dense: float  # per position
    perplexity: float


@dataclass
class MoeQuality:
    """What `moe-quality` measured; its JSON (`--json`) is this object's fields, the variants a list of objects."""

    method: str  # target.moe.method
    experts: int
    held_out_tokens: int
    dense_perplexity: float
    by_experts_per_token: list[VariantQuality]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> MoeQuality:
        return cls(**{**data, "by_experts_per_token": [VariantQuality(**row) for row in data["by_experts_per_token"]]})


def moe_quality(pipeline: PipelineSpec, experts_per_token: list[int], expert_noises: list[float] | None = None,
                quiet: bool = False) -> MoeQuality:
    """The dense model's perplexity and, per k and expert noise (default: the pipeline's), the derived MoE's quality
    against it (see the module docstring)."""
    spec = pipeline.target.moe
    if spec is None:
        raise SpecdeployError(f"{pipeline.name}: the target has no moe section to derive an MoE with")
    bad = [k for k in experts_per_token if not 1 <= k <= spec.experts]
    if bad:
        raise SpecdeployError(f"experts per token must be in [1, {spec.experts}], got {bad}")
    try:  # each variant checked as the pipeline's own section would be
        variants = [dataclasses.replace(spec, experts_per_token=k, expert_noise=noise)
                    for noise in (expert_noises or [spec.expert_noise]) for k in experts_per_token]
    except PipelineError as exc:
        raise SpecdeployError(f"{pipeline.name}: target.moe.{exc}") from None
    dense = load_checkpoint(pipeline.target.checkpoint, pipeline)
    sequences = held_out_sequences(dense.tokenizer)
    reference = [teacher_forced_logits(LlamaModel(dense.config, dense.state), s) for s in sequences]
    calibration = calibration_sequences(dense.tokenizer, spec.calibration_tokens)
    rows = []
    for variant in track(variants, description="deriving and scoring", disable=quiet):
        config, state = derive_moe(dense.config, dense.state, calibration, variant)
        model = MixtralModel(config, state)
        logits = [teacher_forced_logits(model, s) for s in sequences]
        rows.append(VariantQuality(experts_per_token=variant.experts_per_token, expert_noise=variant.expert_noise,
                                   **compare(reference, logits), perplexity=perplexity(logits, sequences)))
    return MoeQuality(method=spec.method, experts=spec.experts, held_out_tokens=sum(len(s) for s in sequences),
                      dense_perplexity=perplexity(reference, sequences), by_experts_per_token=rows)


def print_moe_quality(report: MoeQuality, console: Console | None = None) -> None:
    table = Table(title=f"derived MoE ({report.method}) against the dense model ({report.experts} experts, "
                        f"{report.held_out_tokens} held-out tokens, dense perplexity {report.dense_perplexity:.1f})")
    noisy = report.method == "upcycle"  # the only method with expert noise
    for column in ("experts per token",) + ("expert noise",) * noisy + ("greedy agreement", "KL from dense",
                                                                        "perplexity"):
        table.add_column(column, justify="right")
    for row in report.by_experts_per_token:
        noise = (f"{row.expert_noise:g}",) * noisy
        table.add_row(str(row.experts_per_token), *noise, f"{row.greedy_agreement:.3f}", f"{row.kl_from_dense:.3f}",
                      f"{row.perplexity:.1f}")
    (console or Console()).print(table)
