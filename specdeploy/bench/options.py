"""What `specdeploy bench` takes, with its defaults, and the combinations that cannot run. The CLI's options read
their defaults from BenchOptions, so each has one home; only dataclasses are imported, so the CLI loads this
without the engine."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specdeploy.errors import SpecdeployError


@dataclass(frozen=True)
class BenchOptions:
    pipeline_paths: tuple[str, ...] = ()
    url: str | None = None  # HOST:PORT of a running server
    plain_url: str | None = None  # with url: a twin without speculation, the plain baseline's server
    concurrency: tuple[int, ...] = (1, 2, 4, 8, 16)  # with url
    requests_per_level: int | None = None  # with url; with long_stream: generations per mode and place
    stress: int | None = None  # with url: this many requests, some cancelled
    cancel_fraction: float = 0.2
    metrics_url: str | None = None  # with stress
    long_stream: int | None = None  # with url: one streamed generation of this many tokens
    prompts_path: str | None = None  # default: the shipped mixed set
    max_tokens: int | None = None  # default: the pipeline's
    temperature: float | None = None  # in-process; default: the pipeline's
    seed: int = 0  # in-process
    json_out: Path | None = None
    with_transformers: bool = True
    gammas: tuple[int, ...] = ()  # in-process: also decode every prompt at these gammas
    peers: bool = False  # in-process
    report_dir: Path | None = None
    measure_gamma_cap: bool = False  # in-process: any speculating pipeline (a tree's depth cap)
    price_per_hour: float | None = None  # USD: dollars per million output tokens beside each rate
    contexts: tuple[int, ...] = ()  # in-process: pad every prompt to each of these lengths (bench/context_sweep.py)


def check_options(options: BenchOptions) -> None:
    """Refuse option combinations that cannot run, before anything is built or measured."""
    in_process = options.url is None
    if not in_process and options.measure_gamma_cap:
        raise SpecdeployError("--measure-gamma-cap measures in-process: give PIPELINE.yaml without --url")
    if not in_process and options.peers:
        raise SpecdeployError("--peers measures in-process: give PIPELINE.yaml without --url")
    if options.report_dir is not None and (options.stress is not None or options.long_stream is not None):
        raise SpecdeployError("--report plots the in-process bench or the concurrency levels of --url, not "
                              "--stress or --long-stream")
    if options.plain_url is not None and (in_process or options.stress is not None
                                          or options.long_stream is not None):
        raise SpecdeployError("--plain-url is the plain baseline of --url's concurrency levels: give --url, without "
                              "--stress or --long-stream")
    if not in_process and len(options.pipeline_paths) > 1:
        raise SpecdeployError("--url compares a server with one pipeline in-process: give one PIPELINE.yaml")
    if in_process and not options.pipeline_paths:
        raise SpecdeployError("give PIPELINE.yaml (in-process) or --url HOST:PORT (a running server)")
    if options.contexts and (not in_process or len(options.pipeline_paths) != 1):
        raise SpecdeployError("--context measures one pipeline in-process: give one PIPELINE.yaml without --url")
    if options.contexts and (options.gammas or options.peers or options.measure_gamma_cap):
        raise SpecdeployError("--context runs its own sweep: leave out --gammas, --peers and --measure-gamma-cap")
    if options.long_stream is not None and not options.pipeline_paths:
        raise SpecdeployError("--long-stream compares with the pipeline in-process: give PIPELINE.yaml")
    if options.report_dir is not None:
        from specdeploy.bench.plots import pyplot

        pyplot()  # before measuring: a missing matplotlib is an error now, not after minutes of benchmarking
