"""The `specdeploy` command: one thin command per verb over the library."""

from __future__ import annotations

import json
from pathlib import Path

import click

from specdeploy.errors import SpecdeployError

ENGINES_HELP = "Directory holding engines/<name>/ (default: ./engines, or $SPECDEPLOY_ENGINES)."


def engines_option(function):
    return click.option("--engines-dir", type=click.Path(file_okay=False, path_type=Path),
                        envvar="SPECDEPLOY_ENGINES", default=Path("engines"), show_default=True,
                        help=ENGINES_HELP)(function)


def load_engine(pipeline_path: str, engines_dir: Path, quiet: bool = False):
    """Build the pipeline's engine if it is missing or stale, then load it."""
    from specdeploy.builders.torch import build
    from specdeploy.engine import Engine
    from specdeploy.pipeline import load_pipeline

    pipeline = load_pipeline(pipeline_path)
    return pipeline, Engine(build(pipeline, engines_dir, quiet=quiet))


class UserError(click.ClickException):
    """A SpecdeployError shown as one line, exit status 2, no traceback."""

    exit_code = 2

    def show(self, file=None) -> None:
        click.echo(f"error: {self.message}", err=True)


class SpecdeployGroup(click.Group):
    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except SpecdeployError as exc:
            raise UserError(str(exc)) from None


@click.group(cls=SpecdeployGroup)
@click.version_option(package_name="specdeploy")
def cli() -> None:
    """Build, serve and measure speculative-decoding LLM engines."""


@cli.command()
@click.argument("pipeline_path", metavar="PIPELINE.yaml")
@engines_option
@click.option("--force", is_flag=True, help="Rebuild even when the inputs are unchanged.")
def build(pipeline_path: str, engines_dir: Path, force: bool) -> None:
    """Build the pipeline's target (and draft) engines."""
    from specdeploy.builders.torch import build_if_needed
    from specdeploy.pipeline import load_pipeline

    directory, built = build_if_needed(load_pipeline(pipeline_path), engines_dir, force=force)
    click.echo(f"built {directory}" if built else f"{directory}: up to date, nothing to build")


@cli.command()
@click.argument("arguments", nargs=-1, required=True, metavar="[PIPELINE.yaml] PROMPT")
@click.option("--url", default=None, help="Generate through a running server's gRPC endpoint (HOST:PORT) instead "
              "of in-process; then PIPELINE.yaml is not given.")
@click.option("--stream/--no-stream", default=True, show_default=True, help="With --url: stream the text.")
@engines_option
@click.option("--max-tokens", type=int, default=None, help="Tokens to generate (default: the pipeline's).")
@click.option("--temperature", type=float, default=None, help="0 is greedy (default: the pipeline's).")
@click.option("--top-k", type=int, default=None, help="0 turns top-k off (default: the pipeline's).")
@click.option("--top-p", type=float, default=None, help="In (0, 1] (default: the pipeline's).")
@click.option("--repetition-penalty", type=float, default=None, help="1 turns it off (default: the pipeline's).")
@click.option("--seed", type=int, default=None, help="Seed for sampling at temperature > 0.")
@click.option("--num-draft-tokens", type=int, default=None, help="Override gamma for this request.")
@click.option("--no-speculation", is_flag=True, help="Plain decode (same as --num-draft-tokens 0).")
@click.option("--compare", is_flag=True, help="Also run plain decode on the same prompt and report the speedup.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with the text and statistics.")
def generate(arguments: tuple[str, ...], url: str | None, stream: bool, engines_dir: Path, max_tokens: int | None,
             temperature: float | None, top_k: int | None, top_p: float | None,
             repetition_penalty: float | None, seed: int | None, num_draft_tokens: int | None,
             no_speculation: bool, compare: bool, as_json: bool) -> None:
    """Generate in-process (PIPELINE.yaml PROMPT) or over gRPC (--url HOST:PORT PROMPT), streaming the text."""
    gamma = 0 if no_speculation else num_draft_tokens
    if url is not None:
        if len(arguments) != 1:
            raise click.UsageError("with --url give only the PROMPT")
        remote_generate(url, arguments[0], stream, max_tokens, gamma, compare, as_json,
                        temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=repetition_penalty,
                        random_seed=seed)
        return
    if len(arguments) != 2:
        raise click.UsageError("give PIPELINE.yaml and PROMPT (or --url HOST:PORT and PROMPT)")
    pipeline_path, prompt = arguments
    from specdeploy.detokenize import IncrementalDetokenizer
    from specdeploy.sampling import SamplingParams

    pipeline, engine = load_engine(pipeline_path, engines_dir, quiet=as_json)
    defaults = pipeline.sampling
    params = SamplingParams(
        temperature=defaults.temperature if temperature is None else temperature,
        top_k=defaults.top_k if top_k is None else top_k,
        top_p=defaults.top_p if top_p is None else top_p,
        repetition_penalty=defaults.repetition_penalty if repetition_penalty is None else repetition_penalty,
        seed=seed)
    prompt_ids = engine.encode_prompt(prompt)
    max_tokens = defaults.max_tokens if max_tokens is None else max_tokens
    if compare:  # warm up both paths, so neither timed run pays first-call costs
        for warm_gamma in (0, gamma):
            engine.generate(prompt_ids, params, 4, warm_gamma).run()
    generation = engine.generate(prompt_ids, params, max_tokens, gamma)
    detokenizer = IncrementalDetokenizer(engine.tokenizer, engine.eos_ids)
    for emitted in generation:
        text = detokenizer.add(emitted)
        if text and not as_json:
            click.echo(text, nl=False)
    tail = detokenizer.flush()
    stats = generation.stats
    result = {"text": detokenizer.emitted, "tokens": generation.tokens, "method": engine.method,
              "num_draft_tokens": engine.num_draft_tokens if gamma is None else gamma, **stats.to_dict()}
    if compare:
        plain = engine.generate(prompt_ids, params, max_tokens, 0)
        plain.run()
        result.update(plain_tokens_per_s=plain.stats.decode_tokens_per_s,
                      speedup=stats.decode_tokens_per_s / plain.stats.decode_tokens_per_s)
    if as_json:
        click.echo(json.dumps(result))
        return
    click.echo(tail)
    click.echo(f"\n[{engine.method}, gamma {result['num_draft_tokens']}] {stats.generated_tokens} tokens at "
               f"{stats.decode_tokens_per_s:.1f} tokens/s; acceptance {stats.acceptance_rate:.2f}, "
               f"mean accepted length {stats.mean_accepted_length:.2f} tokens/step")
    if compare:
        click.echo(f"plain decode {result['plain_tokens_per_s']:.1f} tokens/s on the same prompt: "
                   f"speedup {result['speedup']:.2f}x")


def remote_generate(url: str, prompt: str, stream: bool, max_tokens: int | None, gamma: int | None, compare: bool,
                    as_json: bool, **sampling) -> None:
    """`generate --url`: one request through the ensemble, optionally followed by the same one without
    speculation for a side-by-side speed."""
    import time

    from specdeploy.triton.client import generate as grpc_generate

    max_tokens = 128 if max_tokens is None else max_tokens

    def run(draft_tokens: int | None, show: bool) -> tuple[str, dict, float]:
        started, text, statistics = time.perf_counter(), "", {}
        for chunk in grpc_generate(url, prompt, max_tokens, stream=stream, num_draft_tokens=draft_tokens,
                                   **sampling):
            text += chunk.text
            statistics = chunk.statistics or statistics
            if show and chunk.text:
                click.echo(chunk.text, nl=False)
        return text, statistics, time.perf_counter() - started

    text, statistics, seconds = run(gamma, not as_json)
    result = {"text": text, **statistics, "seconds": seconds,
              "tokens_per_s": statistics.get("generated_tokens", 0) / seconds}
    steps = statistics.get("verification_steps", 0)
    result["mean_accepted_length"] = (statistics.get("generated_tokens", 1) - 1) / steps if steps else 0.0
    if compare:
        _, plain, plain_seconds = run(0, False)
        result.update(plain_tokens_per_s=plain.get("generated_tokens", 0) / plain_seconds)
        result["speedup"] = result["tokens_per_s"] / result["plain_tokens_per_s"]
    if as_json:
        click.echo(json.dumps(result))
        return
    click.echo(f"\n[{url}] {result.get('generated_tokens', 0)} tokens in {seconds:.2f} s "
               f"({result['tokens_per_s']:.1f} tokens/s end to end); acceptance "
               f"{result.get('acceptance_rate', 0):.2f}, mean accepted length {result['mean_accepted_length']:.2f}")
    if compare:
        click.echo(f"plain decode over the same server: {result['plain_tokens_per_s']:.1f} tokens/s: speedup "
                   f"{result['speedup']:.2f}x")


@cli.command()
@click.argument("pipeline_path", metavar="PIPELINE.yaml", required=False)
@engines_option
@click.option("--url", default=None, help="Benchmark a running server (HOST:PORT) with concurrent gRPC streams.")
@click.option("--concurrency", default="1,2,4,8,16", show_default=True, help="With --url: concurrency levels.")
@click.option("--requests", "requests_per_level", type=int, default=None,
              help="With --url: requests per level and mode (default: 2 x concurrency, at least 4).")
@click.option("--stress", type=int, default=None, metavar="N",
              help="With --url: N requests at the highest --concurrency, some cancelled at random (--cancel-"
                   "fraction); counts lost and corrupted responses.")
@click.option("--cancel-fraction", type=click.FloatRange(0, 1), default=0.2, show_default=True)
@click.option("--prompts", "prompts_path", type=click.Path(dir_okay=False, exists=True), default=None,
              help="JSON Lines, one {\"prompt\": ...} per line (default: the shipped mixed set).")
@click.option("--max-tokens", type=int, default=128, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write the report as JSON to this file.")
@click.option("--no-transformers", is_flag=True, help="Skip the transformers `generate` baseline.")
def bench(pipeline_path: str | None, engines_dir: Path, url: str | None, concurrency: str,
          requests_per_level: int | None, stress: int | None, cancel_fraction: float, prompts_path: str | None,
          max_tokens: int, temperature: float, seed: int, json_out: Path | None, no_transformers: bool) -> None:
    """Each prompt with and without speculation, side by side: speedup, acceptance, costs, prediction.
    With --url: aggregate tokens/s of a server per concurrency level, speculative and plain."""
    from specdeploy.bench import load_prompts, print_report, run_bench

    prompts = load_prompts(prompts_path)
    if url is not None:
        from specdeploy.triton.load_report import print_server_report, run_server_bench

        try:
            levels = [int(level) for level in concurrency.split(",")]
        except ValueError:
            raise click.BadParameter(f"expected comma-separated integers, got {concurrency!r}",
                                     param_hint="--concurrency") from None
        texts = [p["prompt"] for p in prompts]
        if stress is not None:
            from specdeploy.triton.load_report import run_stress

            report = run_stress(url, texts, stress, max(levels), max_tokens, cancel_fraction, seed)
            click.echo(json.dumps(report, indent=2))
        else:
            in_process = None
            if pipeline_path is not None:  # the same pipeline in this process, one stream, for the gRPC overhead
                from specdeploy.triton.load_report import in_process_tokens_per_s

                _, engine = load_engine(pipeline_path, engines_dir)
                in_process = in_process_tokens_per_s(engine, texts, max_tokens)
            report = run_server_bench(url, texts, levels, max_tokens, requests_per_level, in_process)
            print_server_report(report)
    else:
        if pipeline_path is None:
            raise click.UsageError("give PIPELINE.yaml (in-process) or --url HOST:PORT (a running server)")
        _, engine = load_engine(pipeline_path, engines_dir)
        report = run_bench(engine, prompts, max_tokens, temperature, seed, with_transformers=not no_transformers)
        print_report(report)
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(report, indent=2))
        click.echo(f"wrote {json_out}")


@cli.command()
@click.argument("pipeline_path", metavar="PIPELINE.yaml")
@engines_option
@click.option("--output", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Model repository directory (default: model_repository/<name>).")
def package(pipeline_path: str, engines_dir: Path, output: Path | None) -> None:
    """Write a Triton model repository (ensemble: preprocessing → speculative → postprocessing)."""
    click.echo(f"wrote {package_pipeline(pipeline_path, engines_dir, output)}")


def package_pipeline(pipeline_path: str, engines_dir: Path, output: Path | None) -> Path:
    """Build the pipeline's engine if needed and write its model repository (default model_repository/<name>)."""
    from specdeploy.builders.torch import build_if_needed
    from specdeploy.pipeline import load_pipeline
    from specdeploy.triton.repository import write_repository

    pipeline = load_pipeline(pipeline_path)
    engine_dir, _ = build_if_needed(pipeline, engines_dir)
    return write_repository(pipeline, engine_dir, output or Path("model_repository") / pipeline.name)


@cli.command()
@click.argument("pipeline_path", metavar="PIPELINE.yaml", required=False)
@engines_option
@click.option("--model-repository", type=click.Path(file_okay=False, exists=True, path_type=Path), default=None,
              help="Serve this repository instead of packaging PIPELINE.yaml.")
@click.option("--grpc-port", type=int, default=8001, show_default=True)
@click.option("--http-port", type=int, default=8000, show_default=True)
@click.option("--metrics-port", type=int, default=8002, show_default=True)
@click.option("--address", default="127.0.0.1", show_default=True, help="Interface to bind (0.0.0.0: all).")
def serve(pipeline_path: str | None, engines_dir: Path, model_repository: Path | None, grpc_port: int,
          http_port: int, metrics_port: int, address: str) -> None:
    """Run tritonserver on the pipeline's model repository until interrupted."""
    import signal

    from specdeploy.triton.server import TritonServer

    if model_repository is None:
        if pipeline_path is None:
            raise click.UsageError("give PIPELINE.yaml or --model-repository")
        model_repository = package_pipeline(pipeline_path, engines_dir, None)
    server = TritonServer(model_repository, grpc_port, http_port, metrics_port, address)
    server.start()
    click.echo(f"tritonserver ready: gRPC {server.grpc_url}, metrics {server.metrics_url} (Ctrl-C stops it)")
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: server.stop())
    server.process.wait()
    server.stop()


@cli.command()
@click.argument("pipeline_path", metavar="PIPELINE.yaml")
@click.argument("prompt")
@engines_option
@click.option("--max-tokens", type=int, default=160, show_default=True)
def demo(pipeline_path: str, prompt: str, engines_dir: Path, max_tokens: int) -> None:
    """The main job end to end: build, package, serve on free local ports, stream a generation over gRPC with the
    acceptance statistics and a plain-vs-speculative comparison, then stop the server."""
    from specdeploy.triton.server import TritonServer

    repository = package_pipeline(pipeline_path, engines_dir, None)
    click.echo(f"model repository: {repository}; starting tritonserver ...")
    with TritonServer(repository, log_file=repository.with_name(repository.name + ".tritonserver.log")) as server:
        click.echo(f"tritonserver ready on {server.grpc_url} (log: {server.log_file})\n")
        remote_generate(server.grpc_url, prompt, True, max_tokens, None, True, False)
    click.echo("tritonserver stopped")


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
