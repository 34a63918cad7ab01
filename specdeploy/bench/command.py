"""`specdeploy bench`: the in-process bench of one or more pipelines, or a running server's load test, with what
each option asks for (printing, --json, --report DIR, --measure-gamma-cap). The CLI parses the options into
BenchOptions (bench/options.py) and calls `bench`."""

from __future__ import annotations

import json
from collections.abc import Callable

from specdeploy.bench.options import BenchOptions, check_options
from specdeploy.bench.results import BenchReport, Cost
from specdeploy.errors import SpecdeployError
from specdeploy.runtime.engine import Engine
from specdeploy.spec.engine_paths import engine_pipeline
from specdeploy.spec.pipeline import load_pipeline
from specdeploy.spec.prompt_sets import load_prompts


def bench(options: BenchOptions, load_engine: Callable[[str, int | None], Engine]) -> None:
    """Run what the options ask for, print it and write what they name. load_engine(path, max_sequence_length): a
    pipeline file's engine, built if needed, with room for sequences that long (None: its limits)."""
    prompts = load_prompts(options.prompts_path)
    check_options(options)
    room = None
    if options.contexts:
        from specdeploy.bench.context_sweep import sequence_room

        answer = options.max_tokens or load_pipeline(options.pipeline_paths[0]).sampling.max_tokens
        room = sequence_room(options.contexts, answer)
    engines = [load_engine(path, room) for path in options.pipeline_paths]
    if options.contexts:
        written = context_sweep(options, engines[0], prompts)
    elif options.url is None:
        written = in_process(options, engines, prompts)
    else:
        written = against_server(options, engines[0] if engines else None, [p["prompt"] for p in prompts])
    if options.json_out:
        options.json_out.parent.mkdir(parents=True, exist_ok=True)
        options.json_out.write_text(json.dumps(written, indent=2))
        print(f"wrote {options.json_out}")


def in_process(options: BenchOptions, engines: list[Engine], prompts: list[dict]) -> dict:
    """The bench of every pipeline in one run; returns the JSON to write (one report, or several compared)."""
    from specdeploy.bench.peers import peer_ratios
    from specdeploy.bench.printing import print_report
    from specdeploy.bench.run import run_benches

    most = min(engine.pipeline.limits.max_draft_tokens for engine in engines)
    if any(not 1 <= gamma <= most for gamma in options.gammas):
        raise SpecdeployError(f"--gammas: every gamma must be in 1..{most} (limits.max_draft_tokens), got "
                              f"{','.join(map(str, options.gammas))}")
    gammas = options.gammas
    if options.measure_gamma_cap:  # every engine at its full gamma, and at each smaller gamma the cap may take
        from specdeploy.tune import gamma_cap

        for engine in engines:
            gamma_cap.lift_gamma_cap(engine)
        swept = {g for engine in engines for g in gamma_cap.sweep_gammas(engine.num_draft_tokens)}
        gammas = tuple(sorted(swept.union(gammas)))
    reports = run_benches(engines, prompts, options.max_tokens, options.temperature, options.seed,
                          with_transformers=options.with_transformers, with_peers=options.peers, gammas=gammas)
    if options.price_per_hour is not None:
        for report in reports:
            report.cost = Cost.at(options.price_per_hour, report.summary.baseline_tokens_per_s,
                                  report.summary.speculative_tokens_per_s)
    for report in reports:
        print_report(report)
        for name, ratio in peer_ratios(report).items():
            print(f"{report.setup.pipeline}: ours plain {ratio.ours_plain:.2f}x, speculative "
                  f"{ratio.ours_speculative:.2f}x the tokens/s of {name}")
    if options.measure_gamma_cap:
        for engine, report in zip(engines, reports):
            policy = measured_policy(report)
            print(gamma_cap.write_gamma_cap(engine.dir, policy))
            report.setup.gamma_cap = engine_pipeline(engine.dir).serving.policy.gamma_cap  # served from now on
    if options.report_dir is not None:
        from specdeploy.bench.markdown import write_report

        print(f"wrote {write_report(reports, options.report_dir, list(options.pipeline_paths))}")
    if len(reports) == 1:
        return reports[0].to_json()
    return compared(reports)


def context_sweep(options: BenchOptions, engine: Engine, prompts: list[dict]) -> dict:
    from specdeploy.bench.context_markdown import write_context_report
    from specdeploy.bench.context_printing import print_context_sweep
    from specdeploy.bench.context_sweep import run_context_sweep

    sweep = run_context_sweep(engine, prompts, options.contexts, options.max_tokens, options.temperature,
                              options.seed)
    print_context_sweep(sweep)
    if options.report_dir is not None:
        print(f"wrote {write_context_report(sweep, options.report_dir)}")
    return sweep.to_json()


def compared(reports: list[BenchReport]) -> dict:
    from specdeploy.bench.comparison import compare, print_comparison

    comparison = compare(reports)
    print_comparison(comparison)
    return {"comparison": comparison, "reports": [report.to_json() for report in reports]}


def against_server(options: BenchOptions, engine: Engine | None, texts: list[str]) -> dict:
    """--url: the long stream, the stress test or the concurrency levels (beside the engine in-process when a
    pipeline is given); returns the JSON to write."""
    from specdeploy.bench import server_runs
    from specdeploy.bench.server_printing import print_long_stream, print_server_bench

    if options.long_stream is not None:
        report = server_runs.run_long_stream(options.url, engine, texts[0], options.long_stream,
                                             options.requests_per_level or 3)
        print_long_stream(report)
        return report
    if options.stress is not None:
        report = server_runs.run_stress(options.url, texts, options.stress, max(options.concurrency),
                                        options.max_tokens, options.cancel_fraction, options.seed,
                                        options.metrics_url)
        print(json.dumps(report, indent=2))
        return report
    in_process_rate = (None if engine is None else
                       server_runs.in_process_tokens_per_s(engine, texts, options.max_tokens))
    measured = server_runs.run_server_bench(options.url, texts, list(options.concurrency), options.max_tokens,
                                          options.requests_per_level, in_process_rate, options.price_per_hour,
                                          options.plain_url)
    print_server_bench(measured)
    if options.report_dir is not None:
        from specdeploy.bench.server_markdown import write_server_report

        served = None if engine is None else engine.pipeline
        print(f"wrote {write_server_report(measured, options.report_dir, served)}")
    return measured.to_json()


def measured_policy(report: BenchReport) -> dict:
    """The gamma cap picked from the report's realized speedups (tune/gamma_cap.py), with what else the bench saw:
    acceptance by position, the draft and verify costs, an MoE's union-curve prediction, and the seconds it took."""
    from specdeploy.tune.gamma_cap import gamma_cap_record

    full, summary = report.setup.num_draft_tokens, report.summary
    policy = gamma_cap_record({**(report.gamma_sweep or {}), full: summary.speedup}, full)
    policy |= {"per_position_acceptance": summary.per_position_acceptance,
               "draft_cost_ratio": summary.draft_cost_ratio, "verify_costs": report.verify_costs,
               "prompts": report.setup.prompts, "max_tokens": report.setup.max_tokens,
               "seconds": round(sum(report.phase_seconds.values()), 1)}
    if report.moe is not None:  # the MoE's union-curve prediction, beside what was realized
        policy["moe_predicted_speedup_by_gamma"] = report.moe.predicted_speedup_by_gamma
    return policy
