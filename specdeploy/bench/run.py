"""In-process benchmark: every prompt with and without speculation, same process, same engine, side by side.

Speeds are decode-phase tokens/s (prefill is identical in both modes and speculation does not touch it). The
report also measures, in the same run, the memory bandwidth of a weight-streaming mat-vec (the ceiling on plain
decode) and transformers' `generate` on the same weights, dtype and threads.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import track
from rich.table import Table

from specdeploy.bench.moe_curve import dense_source, expert_union_curve, predicted_speedups, timed_forward
from specdeploy.bench.peers import common_prefix, hf_model, llama_cpp_peers, transformers_peers
from specdeploy.decoding.stats import RequestStats, decode_rate
from specdeploy.errors import SpecdeployError
from specdeploy.models import machine
from specdeploy.models.device_transfer import finish
from specdeploy.models.moe import SparseMoE
from specdeploy.runtime.engine import Engine
from specdeploy.spec.request import GenerationRequest


@dataclass
class PromptRun:
    kind: str
    plain: RequestStats
    speculative: RequestStats
    plain_tokens: list[int]
    speculative_tokens: list[int]


def load_prompts(path: str | Path | None = None) -> list[dict]:
    """JSON Lines of {"prompt": ..., "kind": optional}; the shipped mixed set when path is None."""
    text = (Path(path).read_text() if path else
            resources.files("specdeploy").joinpath("data/prompts.jsonl").read_text())
    prompts = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SpecdeployError(f"{path}:{number}: not valid JSON: {exc}") from None
        if not isinstance(item, dict) or not isinstance(item.get("prompt"), str) or not item["prompt"].strip():
            raise SpecdeployError(f"{path}:{number}: expected an object with a non-empty string 'prompt'")
        prompts.append({"prompt": item["prompt"], "kind": str(item.get("kind", "other"))})
    if not prompts:
        raise SpecdeployError(f"{path}: no prompts")
    return prompts


def measure_bandwidth(dtype: torch.dtype, device: torch.device | str = "cpu", megabytes: int = 256,
                      repeats: int = 10) -> float:
    """Bytes/s streamed by a mat-vec over a matrix far larger than the caches (what plain decode does)."""
    columns = 1024
    rows = megabytes * 2**20 // (columns * torch.finfo(dtype).bits // 8)
    matrix = torch.randn(rows, columns, device=device).to(dtype)
    vector = torch.randn(1, columns, device=device).to(dtype)
    torch.nn.functional.linear(vector, matrix)
    finish(device)
    started = time.perf_counter()
    for _ in range(repeats):
        torch.nn.functional.linear(vector, matrix)
    finish(device)
    elapsed = (time.perf_counter() - started) / repeats
    return matrix.numel() * matrix.element_size() / elapsed


def weight_bytes_per_token(engine: Engine) -> int:
    """Bytes of weight matrices one plain decode step reads (every projection and the vocabulary head)."""
    total = 0
    for module in engine.target.modules():
        for name, tensor in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
            if tensor.dim() == 2 and name in ("weight", "packed"):
                total += tensor.numel() * tensor.element_size()
        if isinstance(module, SparseMoE):  # a token reads only the experts it is routed to
            total -= (module.num_experts - module.experts_per_token) * module.expert_bytes
    return total


def transformers_decode_tokens_per_s(engine: Engine, prompt_ids: list[int], max_tokens: int) -> float:
    """transformers' greedy `generate` on the same weights, dtype and threads, decode phase only:
    (N - 1) / (time(N tokens) - time(1 token))."""
    model = hf_model(engine.dir / "target", engine.target.dtype, engine.device)
    ids = torch.tensor([prompt_ids], device=engine.device)

    def timed(n: int) -> float:
        started = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0)
        finish(engine.device)
        return time.perf_counter() - started

    timed(4)  # warm-up
    return (max_tokens - 1) / max(timed(max_tokens) - timed(1), 1e-9)


def top_two_gap(engine: Engine, tokens: list[int]) -> float:
    """Gap between the target's two largest logits for the token after `tokens` (fresh prefill)."""
    cache = engine.target.new_cache(1, len(tokens) + 1)
    hidden = engine.target(torch.tensor([tokens], device=engine.device),
                           torch.arange(len(tokens), device=engine.device)[None], cache)
    top = engine.target.logits(hidden[0, -1]).topk(2).values
    return float(top[0] - top[1])


def near_tie_tolerance(dtype: str) -> float:
    """Largest top-two logit gap that reduced-precision reordering of the same sums can flip."""
    return 0.0 if dtype == "float32" else 0.25


def compare_greedy(engine: Engine, prompt_ids: list[int], plain: list[int], speculative: list[int]) -> str:
    """'match', 'near_tie' (first divergence at a near-tie of the target's top two tokens) or 'mismatch'."""
    if plain == speculative:
        return "match"
    common = common_prefix(plain, speculative)
    if common >= min(len(plain), len(speculative)):
        return "mismatch"  # one stopped early: a length difference is never a tie
    gap = top_two_gap(engine, prompt_ids + plain[:common])
    return "near_tie" if gap <= near_tie_tolerance(engine.dtype) else "mismatch"


def run_bench(engine: Engine, prompts: list[dict], max_tokens: int | None, temperature: float | None, seed: int,
              with_transformers: bool, quiet: bool = False) -> dict:
    """max_tokens, temperature: None for the pipeline's. The seed is the same for every prompt and mode."""
    return run_benches([engine], prompts, max_tokens, temperature, seed, with_transformers, quiet)[0]


def run_benches(engines: list[Engine], prompts: list[dict], max_tokens: int | None, temperature: float | None,
                seed: int, with_transformers: bool, quiet: bool = False, with_peers: bool = False,
                gammas: tuple[int, ...] = ()) -> list[dict]:
    """One report per engine, measured in one run: for each prompt in turn every engine decodes it plain and with
    its speculation, so the machine's load drifts over all of them alike. transformers is measured once (first
    engine); with_peers: each engine's peers (bench/peers.py) on the same prompts, greedy, after its own runs;
    gammas: each prompt also decoded at these gammas (report["gamma_sweep"]: gamma → speedup; not for Medusa, whose
    tree sets its own width)."""
    requests = [GenerationRequest.with_defaults(e.pipeline, [], max_tokens, temperature, seed=seed) for e in engines]
    encoded = [[e.encode_prompt(p["prompt"]) for p in prompts] for e in engines]
    for engine, request, ids in zip(engines, requests, encoded):
        engine.generate(ids[0], request.sampling, 8).run()  # warm-up: first calls allocate and page in weights
    runs: list[list[PromptRun]] = [[] for _ in engines]
    sweeps: list[dict[int, list[RequestStats]]] = [{} for _ in engines]  # per engine: gamma → its runs' stats
    spent = [PhaseSeconds() for _ in engines]
    for index, item in enumerate(track(prompts, description="bench", disable=quiet)):
        for engine, request, ids, done, sweep, clock in zip(engines, requests, encoded, runs, sweeps, spent):
            with clock("plain_and_speculative"):
                plain = engine.generate(ids[index], request.sampling, request.max_tokens,
                                        num_draft_tokens=0)
                plain_tokens = plain.run()
                speculative = engine.generate(ids[index], request.sampling, request.max_tokens)
                speculative_tokens = speculative.run()
            done.append(PromptRun(item["kind"], plain.stats, speculative.stats, plain_tokens,
                                  speculative_tokens))
            if engine.method != "medusa":
                for gamma in gammas:
                    with clock("gamma_sweep"):
                        swept = engine.generate(ids[index], request.sampling, request.max_tokens,
                                                num_draft_tokens=gamma)
                        swept.run()
                    sweep.setdefault(gamma, []).append(swept.stats)
    reports = []
    for number, (engine, request, ids, done, clock) in enumerate(zip(engines, requests, encoded, runs, spent)):
        with clock("analysis"):
            reports.append(finish_report(engine, done, ids, request, with_transformers and number == 0))
    for report, sweep in zip(reports, sweeps):
        if sweep:
            report["gamma_sweep"] = {str(gamma): decode_rate(stats) / report["baseline_tokens_per_s"]
                                     for gamma, stats in sorted(sweep.items())}
    if with_peers:
        for engine, request, ids, report, done, clock in zip(engines, requests, encoded, reports, runs, spent):
            with clock("peers"):
                report["peers"] = {**transformers_peers(engine, ids, request.max_tokens),
                                   **llama_cpp_peers(engine, ids, request.max_tokens, [r.plain_tokens for r in done])}
    for report, clock in zip(reports, spent):
        report["phase_seconds"] = clock.seconds
    return reports


class PhaseSeconds:
    """Wall seconds a bench spent per phase (`with clock("peers"): ...`), so a report says where its time went.
    "analysis" is finish_report: the greedy check, the bandwidth and verify-cost measurements, an MoE's union curve
    or Medusa's tree, and transformers' one-prompt baseline when it is on."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - started


def finish_report(engine: Engine, runs: list[PromptRun], encoded: list[list[int]], request: GenerationRequest,
                  with_transformers: bool) -> dict:
    """The report of one engine's runs: speeds, costs, prediction, greedy check, bandwidth ceiling."""
    params, max_tokens = request.sampling, request.max_tokens
    report = summarize(engine, runs)
    if params.greedy:
        verdicts = [compare_greedy(engine, ids, r.plain_tokens, r.speculative_tokens)
                    for ids, r in zip(encoded, runs)]
        report["greedy_match"] = all(v != "mismatch" for v in verdicts)
        report["greedy_exact_prompts"] = verdicts.count("match")
        report["greedy_near_tie_prompts"] = verdicts.count("near_tie")
        report["greedy_mismatch_prompts"] = verdicts.count("mismatch")
    else:
        report["greedy_match"] = None
    bandwidth = measure_bandwidth(engine.target.dtype, engine.device)
    bytes_per_token = weight_bytes_per_token(engine)
    ceiling = bandwidth / bytes_per_token
    report.update(bandwidth_gb_per_s=bandwidth / 1e9, weight_bytes_per_token=bytes_per_token,
                  bandwidth_ceiling_tokens_per_s=ceiling,
                  fraction_of_ceiling=report["baseline_tokens_per_s"] / ceiling)
    if engine.method in ("draft_target", "ngram") and engine.target.config.architecture == "llama":
        # v grows with the verified width where matmuls are not bandwidth bound: the report's predicted lines
        # take its shape from here (an MoE measures its own union curve, Medusa its tree's widths)
        widest = min(engine.pipeline.limits.max_draft_tokens, 2 * max(engine.num_draft_tokens, 1))
        report["verify_costs"] = measure_verify_costs(engine, encoded[0], widest)
    if with_transformers:
        hf = transformers_decode_tokens_per_s(engine, encoded[0], min(max_tokens, 64))
        report.update(transformers_tokens_per_s=hf, plain_vs_transformers=report["baseline_tokens_per_s"] / hf)
    if engine.target.config.architecture == "mixtral":
        answers = [(ids + r.plain_tokens, len(ids)) for ids, r in zip(encoded, runs)]
        report["moe"] = curve = expert_union_curve(engine, answers, engine.num_draft_tokens + 1,
                                                   dense=dense_source(engine))
        if curve and report["per_position_acceptance"]:
            # the linear formula assumes a dense model's verify cost and independent acceptance: on an MoE the
            # prediction comes from the union curve and the measured acceptance by position
            served = request.gamma(engine.pipeline)  # the pipeline's gamma within its gamma_cap
            # positions past the served gamma were never drafted: their acceptance is unknown, not zero
            by_gamma = predicted_speedups(report["per_position_acceptance"][:served], report["draft_cost_ratio"],
                                          curve["verify_cost"])
            curve["predicted_speedup_by_gamma"] = by_gamma
            curve["best_gamma"] = 1 + max(range(len(by_gamma)), key=by_gamma.__getitem__)
            report["predicted_speedup"] = by_gamma[-1]
    if engine.method == "medusa":
        report["medusa"] = medusa_report(engine, runs, report, encoded)
        # the linear rule's formula does not describe a tree: the tree's own prediction replaces it
        report["predicted_speedup"] = report["medusa"]["predicted_speedup"]
    report.update(pipeline=engine.pipeline.name, method=engine.method, num_draft_tokens=engine.num_draft_tokens,
                  gamma_cap=engine.pipeline.serving.policy.gamma_cap,
                  schedule=engine.pipeline.speculation.schedule, dtype=engine.dtype,
                  temperature=params.temperature, max_tokens=max_tokens, prompts=len(runs),
                  threads=torch.get_num_threads(), machine=machine.describe())
    return report


def why_it_loses(report: dict) -> str | None:
    """A sentence saying where the time went when speculation ran slower than plain decode (None when it did
    not), naming the CPU's generic bf16 matmul when that is the cause of a costly verify."""
    if report["speedup"] >= 1:
        return None
    text = (f"Speculation ran at {report['speedup']:.2f}x plain decode here: a step cost "
            f"{report['proposal_cost_per_step']:.2f} plain steps to propose and {report['verify_cost_ratio']:.2f} to "
            f"verify, for {report['mean_accepted_length']:.2f} tokens.")
    if report["dtype"] == "bfloat16" and not report["machine"]["bf16_matmul"].startswith("oneDNN"):
        text += (" This CPU has no oneDNN bf16 matmul (it needs AVX-512 or AMX), so a bf16 matmul's time grows with "
                 "its rows and verifying n tokens costs nearly n plain steps: serve this pipeline without "
                 "speculation here, or on a CPU with AVX-512 or AMX.")
    return text


def plain_step_seconds(plain: list[RequestStats]) -> float:
    """The mean time of one plain decode step: the unit of draft, head and verify costs."""
    return sum(s.verify_seconds for s in plain) / max(sum(s.steps for s in plain), 1)


def summarize(engine: Engine, runs: list[PromptRun]) -> dict:
    plain = [r.plain for r in runs]
    spec = [r.speculative for r in runs]
    baseline, speculative = decode_rate(plain), decode_rate(spec)
    drafted, accepted = sum(s.drafted for s in spec), sum(s.accepted for s in spec)
    steps = sum(s.steps for s in spec)
    emitted = sum(s.decode_tokens for s in spec)
    plain_step = plain_step_seconds(plain)
    # c per draft forward for a draft model; per drafted token for a draft-free proposer (no forwards).
    draft_units = sum(s.draft_forwards for s in spec) or drafted
    draft_cost = sum(s.draft_seconds for s in spec) / max(draft_units, 1) / plain_step
    verify_cost = sum(s.verify_seconds for s in spec) / max(steps, 1) / plain_step
    alpha = accepted / drafted if drafted else 0.0
    gamma = engine.num_draft_tokens
    speculative_steps = sum(s.speculative_steps for s in spec)
    mean_drafted = drafted / speculative_steps if speculative_steps else 0.0
    # Under the heuristic schedule gamma varies per step: the formula gets the mean proposal length instead.
    formula_gamma = gamma if engine.pipeline.speculation.schedule == "constant" else mean_drafted
    per_position = [0] * gamma, [0] * gamma
    for s in spec:
        for i, (d, a) in enumerate(zip(s.drafted_per_position, s.accepted_per_position)):
            per_position[0][i] += d
            per_position[1][i] += a
    report = {
        "baseline_tokens_per_s": baseline,
        "speculative_tokens_per_s": speculative,
        "speedup": speculative / baseline if baseline else 0.0,
        "acceptance_rate": alpha,
        "mean_accepted_length": emitted / steps if steps else 0.0,
        "draft_cost_ratio": draft_cost,
        "verify_cost_ratio": verify_cost,
        "predicted_speedup": predicted_speedup(alpha, formula_gamma, draft_cost, verify_cost),
        "mean_draft_tokens_per_step": mean_drafted,
        "proposal_cost_per_step": (sum(s.draft_seconds for s in spec) / max(speculative_steps, 1) / plain_step),
        # a position no step drafted (past a gamma cap) has no acceptance to report, rather than 0
        "per_position_acceptance": [a / d for d, a in zip(*per_position) if d],
        "by_kind": {},
    }
    for kind in sorted({r.kind for r in runs}):
        chosen = [r for r in runs if r.kind == kind]
        base, rate = decode_rate([r.plain for r in chosen]), decode_rate([r.speculative for r in chosen])
        if base and rate:  # a kind whose answers ended at once decoded nothing: there is no speed to compare
            report["by_kind"][kind] = {"speedup": rate / base, "prompts": len(chosen), "plain_tokens_per_s": base,
                                       "speculative_tokens_per_s": rate}
    return report


def measure_verify_costs(engine: Engine, prompt_ids: list[int], max_nodes: int, repeats: int = 5) -> list[float]:
    """[n]: the time of one target forward over n + 1 positions after the prompt, in plain decode steps (n = 0),
    medians of `repeats`."""
    cache = engine.target.new_cache(1, len(prompt_ids) + max_nodes + 2)
    tokens = torch.tensor([prompt_ids], device=engine.device)
    with torch.inference_mode():
        engine.target(tokens, torch.arange(len(prompt_ids), device=engine.device)[None], cache)
        times = [timed_forward(engine.target, cache, tokens[:, -1:].expand(1, width), len(prompt_ids) - 1, repeats)
                 for width in range(1, max_nodes + 2)]
    return [t / times[0] for t in times]


def medusa_report(engine: Engine, runs: list[PromptRun], report: dict, encoded: list[list[int]]) -> dict:
    """The tree served and its predicted speedup: the expected accepted tokens per step from the heads' accuracy
    by rank, measured here on the plain greedy answers to these prompts (and, for comparison, from the held-out
    answers train-medusa reported, which the build copies into the engine), over the head and verify costs of
    this run; and the tree the builder picks from the same accuracies and verify costs measured on this machine."""
    from specdeploy.models.registry import load_projection
    from specdeploy.speculative.medusa import ACCURACY_FILE
    from specdeploy.speculative.medusa_accuracy import accuracies, hidden_features
    from specdeploy.speculative.tree_builder import build_tree, expected_accepted

    proposer = engine.proposer
    tree, paths = proposer.tree, list(proposer.tree.paths)
    head_cost = report["proposal_cost_per_step"]  # the heads are Medusa's proposal
    sequences = [(ids + r.plain_tokens, len(ids) - 1) for ids, r in zip(encoded, runs)]
    data = hidden_features(engine.target, sequences, proposer.heads.num_heads)
    heads_here = accuracies(proposer.heads, data, load_projection(engine.dir / "target"))
    by_rank = [head["by_rank"] for head in heads_here]
    expected = expected_accepted(paths, by_rank)
    costs = measure_verify_costs(engine, encoded[0], engine.pipeline.limits.max_draft_tokens)
    best = build_tree(by_rank, costs, head_cost)
    result = {"tree": [list(p) for p in paths], "tree_size": tree.size, "head_cost_ratio": head_cost,
              "head_top1_here": [head["top1"] for head in heads_here],
              "realized_accepted_per_step": report["mean_accepted_length"] - 1,
              "expected_accepted_per_step": expected,
              "predicted_speedup": (1 + expected) / (head_cost + report["verify_cost_ratio"]),
              "verify_costs": costs, "suggested_tree": best.choices,
              "suggested_expected_accepted": best.expected_accepted,
              "suggested_predicted_speedup": best.predicted_speedup}
    held_out = engine.dir / "medusa" / ACCURACY_FILE
    if held_out.is_file():
        trained = [head["by_rank"] for head in json.loads(held_out.read_text())["held_out_accuracy"]]
        result["expected_accepted_per_step_held_out"] = expected_accepted(paths, trained)
    return result


def predicted_speedup(alpha: float, gamma: float, draft_cost: float, verify_cost: float) -> float:
    """Seed formula: (1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + v))."""
    tokens_per_step = gamma + 1 if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)
    return tokens_per_step / (gamma * draft_cost + verify_cost)


def phases_text(seconds: dict[str, float]) -> str:
    """{"gamma_sweep": 22.3, ...} → "gamma sweep 22, ..." (whole seconds)."""
    return ", ".join(f"{phase.replace('_', ' ')} {value:.0f}" for phase, value in seconds.items())


def print_report(report: dict, console: Console | None = None) -> None:
    console = console or Console()
    capped = "" if report.get("gamma_cap") is None else f" capped at {report['gamma_cap']}"
    table = Table(title=f"specdeploy bench — {report['pipeline']}: {report['method']}, "
                        f"gamma={report['num_draft_tokens']}{capped} ({report['schedule']}), "
                        f"{report['dtype']}, T={report['temperature']}, {report['prompts']} prompts")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in report.items():
        if key in ("by_kind", "pipeline", "method", "num_draft_tokens", "gamma_cap", "schedule", "dtype", "temperature",
                   "prompts", "medusa", "moe", "machine", "peers", "phase_seconds"):
            continue
        if isinstance(value, float):
            value = f"{value:.3f}"
        elif isinstance(value, list):
            value = " ".join(f"{v:.2f}" for v in value)
        table.add_row(key, str(value))
    for kind, row in report["by_kind"].items():
        table.add_row(f"speedup ({kind})", f"{row['speedup']:.3f} ({row['prompts']} prompts)")
    for section in ("medusa", "moe"):
        for key, value in report.get(section, {}).items():
            if isinstance(value, float):
                value = f"{value:.3f}"
            elif isinstance(value, list) and value and isinstance(value[0], float):
                value = " ".join(f"{v:.3g}" if v >= 1e4 else f"{v:.2f}" for v in value)
            table.add_row(f"{section}: {key}", str(value))
    if report.get("phase_seconds"):
        table.add_row("time spent (s)", phases_text(report["phase_seconds"]))
    machine_row = report["machine"]
    table.add_row("machine", f"{machine_row['cpu']}, {machine_row['threads']} threads, "
                             f"{' '.join(machine_row['matmul_flags']) or 'no listed flags'}; "
                             f"bf16 matmul: {machine_row['bf16_matmul']}")
    console.print(table)
    verdict = why_it_loses(report)
    if verdict:
        console.print(f"[yellow]{verdict}[/yellow]")
