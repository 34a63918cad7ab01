"""A bench report on the terminal: one table of every figure, and sentences saying what limits speculation where it
gave less than SPEEDUP_TARGET x plain decode on open-ended prompts."""

from __future__ import annotations

from dataclasses import asdict

from rich.console import Console
from rich.table import Table

from specdeploy.bench.results import BenchReport
from specdeploy.spec.prompt_sets import OPEN_ENDED

# What a shipped speculative pipeline should give over its own plain decode on open-ended prompts (issue 60): below
# it, the report says what limits it.
SPEEDUP_TARGET = 1.2


def why_below_target(report: BenchReport) -> str | None:
    """Sentences saying what limits speculation where it ran below SPEEDUP_TARGET x plain decode on open-ended
    prompts (on every prompt, where the run had none); None where it did not. From the speedup algebra: a step
    costs p plain steps to propose and v to verify for L tokens (L of the open-ended prompts where known; p and v
    over every prompt), so the speedup is L / (p + v). The limit named is the one whose removal alone would reach
    the target: the verify's growth over a plain step (v → 1, a bandwidth-bound verify), else the proposal (p → 0),
    else acceptance (neither alone would: L is too small). Names the CPU's generic bf16 matmul when that is the
    cause of a costly verify."""
    summary = report.summary
    open_ended = summary.by_kind.get(OPEN_ENDED)
    speedup = summary.speedup if open_ended is None else open_ended.speedup
    if speedup >= SPEEDUP_TARGET:
        return None
    where = "" if open_ended is None else f" ({open_ended.speedup:.2f}x on open-ended prompts)"
    propose, verify = summary.proposal_cost_per_step, summary.verify_cost_ratio
    tokens, which = summary.mean_accepted_length, "every prompt"
    if open_ended is not None and open_ended.mean_accepted_length is not None:
        tokens, which = open_ended.mean_accepted_length, "the open-ended prompts"
    text = (f"Speculation ran at {summary.speedup:.2f}x plain decode here{where}, below {SPEEDUP_TARGET}x: a step "
            f"cost {propose:.2f} plain steps to propose and {verify:.2f} to verify, for {tokens:.2f} tokens on "
            f"{which}. {SPEEDUP_TARGET}x at these costs needs {SPEEDUP_TARGET * (propose + verify):.2f} tokens a "
            f"step, or at these tokens a step of at most {tokens / SPEEDUP_TARGET:.2f} plain steps.")
    if tokens / (propose + 1) >= SPEEDUP_TARGET:
        text += (f" The verify limits it: {summary.mean_draft_tokens_per_step + 1:.1f} positions cost {verify:.2f} "
                 f"plain steps, where a bandwidth-bound verify costs about one, so the target's kernels are "
                 f"compute-bound at that width.")
    elif tokens / verify >= SPEEDUP_TARGET:
        text += f" The proposal limits it: {propose:.2f} plain steps a step."
    else:
        text += (f" Acceptance limits it: neither a free proposal ({tokens / verify:.2f}x) nor a verify as cheap as "
                 f"a plain step ({tokens / (propose + 1):.2f}x) alone would reach {SPEEDUP_TARGET}x.")
    if report.setup.dtype == "bfloat16" and not report.setup.machine.bf16_matmul.startswith("oneDNN"):
        text += (" This CPU has no oneDNN bf16 matmul (it needs AVX-512 or AMX), so a bf16 matmul's time grows with "
                 "its rows and verifying n tokens costs nearly n plain steps: serve this pipeline without "
                 "speculation here, or on a CPU with AVX-512 or AMX.")
    return text


def phases_text(seconds: dict[str, float]) -> str:
    """{"gamma_sweep": 22.3, ...} → "gamma sweep 22, ..." (whole seconds)."""
    return ", ".join(f"{phase.replace('_', ' ')} {value:.0f}" for phase, value in seconds.items())


def cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    if isinstance(value, list):
        return " ".join(f"{v:.2f}" for v in value)
    return str(value)


def section_cell(value) -> str:
    """A Medusa or MoE figure: byte counts in 3 significant digits."""
    if isinstance(value, float):
        return f"{value:.3f}"
    if isinstance(value, list) and value and isinstance(value[0], float):
        return " ".join(f"{v:.3g}" if v >= 1e4 else f"{v:.2f}" for v in value)
    return str(value)


def divergences_text(divergences: list[dict]) -> str:
    """Where each prompt parted from plain decode: '#3 at token 17: gap 0.375 ≤ 0.5 near_tie'."""
    def one(entry: dict) -> str:
        if "gap" not in entry:
            return f"#{entry['prompt']} at token {entry['token']}: {entry.get('why', entry['verdict'])}"
        sign = "≤" if entry["gap"] <= entry["tolerance"] else ">"
        return (f"#{entry['prompt']} at token {entry['token']}: gap {entry['gap']:.4g} {sign} "
                f"{entry['tolerance']:.3g} {entry['verdict']}")
    return "; ".join(one(entry) for entry in divergences)


def figure_rows(report: BenchReport) -> list[tuple[str, str]]:
    """(name, value) of every measured figure, named as in the JSON."""
    summary = asdict(report.summary)
    del summary["by_kind"]
    greedy = asdict(report.greedy) if report.greedy else {}
    if greedy:
        greedy["greedy_divergences"] = divergences_text(greedy["greedy_divergences"]) or None
    parts = [summary, greedy, asdict(report.ceiling),
             {"verify_costs": report.verify_costs}, asdict(report.transformers) if report.transformers else {},
             {"max_tokens": report.setup.max_tokens, "threads": report.setup.threads},
             {"gamma_sweep": report.gamma_sweep}]
    rows = [(name, cell(value)) for part in parts for name, value in part.items() if value is not None]
    rows += [(f"speedup ({kind})", f"{row.speedup:.3f} ({row.prompts} prompts)")
             for kind, row in report.summary.by_kind.items()]
    if report.footprint is not None:
        rows += [(f"footprint: {name}", cell(value)) for name, value in asdict(report.footprint).items()
                 if value is not None]
    if report.cost is not None:
        rows += [(f"cost: {name}", cell(value)) for name, value in asdict(report.cost).items() if value is not None]
    for section, part in (("medusa", report.medusa), ("eagle", report.eagle), ("moe", report.moe)):
        if part is not None:
            rows += [(f"{section}: {name}", section_cell(value)) for name, value in asdict(part).items()
                     if value is not None]
    return rows


def print_report(report: BenchReport, console: Console | None = None) -> None:
    console = console or Console()
    setup = report.setup
    capped = "" if setup.gamma_cap is None else f" capped at {setup.gamma_cap}"
    table = Table(title=f"specdeploy bench — {setup.pipeline}: {setup.method}, gamma={setup.num_draft_tokens}"
                        f"{capped} ({setup.schedule}), {setup.dtype}, T={setup.temperature}, {setup.prompts} prompts")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for name, value in figure_rows(report):
        table.add_row(name, value)
    for component, how in setup.steps.items():  # compiled step programs, or why a model ran eagerly
        table.add_row(f"{component} steps", how)
    if report.phase_seconds:
        table.add_row("time spent (s)", phases_text(report.phase_seconds))
    machine = setup.machine
    table.add_row("machine", f"{machine.cpu}, {machine.threads} threads, "
                             f"{' '.join(machine.matmul_flags) or 'no listed flags'}; "
                             f"bf16 matmul: {machine.bf16_matmul}"
                             + (f"; int4/int8 weight-only: {machine.weight_only_kernels}"
                                if machine.weight_only_kernels else ""))
    console.print(table)
    verdict = why_below_target(report)
    if verdict:
        console.print(f"[yellow]{verdict}[/yellow]")
