"""How much a weight-only quantized target (target.weight_only) loses against the bf16 target, on held-out text
(model_quality.py): greedy agreement, KL divergence from the bf16 model's next-token distribution, perplexity. The
rows are the stored forms a pipeline can choose — fp32 (the checkpoint's values unrounded), int8 rows, int4 groups
with an int8 head (what target.weight_only: int4 stores) and int4 with the rescored int4 head a derived draft uses —
each run through the engine's own model and kernels."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal, NamedTuple

import torch
from rich.console import Console
from rich.progress import track
from rich.table import Table

from specdeploy.bench.model_quality import compare, held_out_sequences, perplexity, teacher_forced_logits
from specdeploy.build.checkpoints import load_checkpoint
from specdeploy.build.torch_engine import quantized_state
from specdeploy.errors import SpecdeployError
from specdeploy.models.llama import LlamaModel
from specdeploy.spec.pipeline import PipelineSpec


class Form(NamedTuple):
    precision: Literal["int4", "int8"] | None  # None: the checkpoint's values as they are
    rescored_head: bool  # the derived draft's head: int4 read, its top logits rescored at int8
    dtype: torch.dtype  # what the model runs in


FORMS = {
    "float32": Form(None, False, torch.float32),
    "int8": Form("int8", False, torch.bfloat16),
    "int4": Form("int4", False, torch.bfloat16),
    "int4, rescored int4 head (a derived draft)": Form("int4", True, torch.bfloat16),
}


@dataclass
class FormQuality:
    """One stored form against the bf16 target."""

    form: str  # a FORMS key
    greedy_agreement: float  # the fraction of positions where both pick the same next token
    kl_from_dense: float  # from the bf16 target, per position
    perplexity: float


@dataclass
class QuantQuality:
    """What `quant-quality` measured; its JSON (`--json`) is this object's fields, the forms a list of objects."""

    model: str  # the target's checkpoint path
    held_out_tokens: int
    bfloat16_perplexity: float
    by_form: list[FormQuality]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> QuantQuality:
        return cls(**{**data, "by_form": [FormQuality(**row) for row in data["by_form"]]})


def stored_state(state: dict[str, torch.Tensor], form: Form) -> dict[str, torch.Tensor]:
    if form.precision is None:
        return state
    return quantized_state(state, form.precision, form.rescored_head)


def quant_quality(pipeline: PipelineSpec, quiet: bool = False) -> QuantQuality:
    """The bf16 target's perplexity and each stored form's quality against it (see the module docstring)."""
    if pipeline.target.moe is not None:
        raise SpecdeployError(f"{pipeline.name}: quant-quality scores a dense target; for a derived MoE use "
                              f"moe-quality")
    dense = load_checkpoint(pipeline.target.checkpoint, pipeline)
    sequences = held_out_sequences(dense.tokenizer)

    def score(state: dict[str, torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
        model = LlamaModel(dense.config, state, dtype).eval()
        return [teacher_forced_logits(model, s) for s in sequences]

    reference = score(dense.state, torch.bfloat16)
    rows = []
    for name, form in track(FORMS.items(), description="quantizing and scoring", disable=quiet):
        logits = score(stored_state(dense.state, form), form.dtype)
        rows.append(FormQuality(form=name, **compare(reference, logits), perplexity=perplexity(logits, sequences)))
    return QuantQuality(model=str(pipeline.target.checkpoint.path), held_out_tokens=sum(len(s) for s in sequences),
                        bfloat16_perplexity=perplexity(reference, sequences), by_form=rows)


def print_quant_quality(report: QuantQuality, console: Console | None = None) -> None:
    table = Table(title=f"stored forms of {report.model} against bf16 ({report.held_out_tokens} held-out tokens, "
                        f"bf16 perplexity {report.bfloat16_perplexity:.2f})")
    for column in ("stored as", "greedy agreement", "KL from bf16", "perplexity"):
        table.add_column(column, justify="right")
    for row in report.by_form:
        table.add_row(row.form, f"{row.greedy_agreement:.3f}", f"{row.kl_from_dense:.4f}", f"{row.perplexity:.2f}")
    (console or Console()).print(table)
