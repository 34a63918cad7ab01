"""The `specdeploy` command: one thin command per verb over the library (specdeploy.workflows; bench, serve and
deploy for their own verbs).

Options that a pipeline also sets default to "the pipeline's value" (None here), and the others read their defaults
from the dataclass the command fills (BenchOptions, OverlayOptions, the training options), so every default has one
home. Those dataclasses live in modules that import nothing heavy: `specdeploy --help` loads no torch. The train-*
commands are cli_training.py's.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import click

from specdeploy.bench.options import BenchOptions
from specdeploy.cli_options import engines_option, integers, numbers
from specdeploy.cli_training import TRAINING_COMMANDS
from specdeploy.deploy.overlay_options import OverlayOptions
from specdeploy.errors import SpecdeployError

if TYPE_CHECKING:
    from specdeploy.workflows import GenerationReport

def device_option(function):
    return click.option("--device", type=click.Choice(["cpu", "cuda"]), default=None,
                        help="Run the torch engine here (default: the pipeline's backend.torch.device, else cpu); "
                             "the engine records it, and a repository packaged for cuda gets KIND_GPU.")(function)


def sampling_options(function):
    """The request fields a pipeline's sampling section defaults."""
    for option in reversed([
        click.option("--max-tokens", type=int, default=None, help="Tokens to generate (default: the pipeline's)."),
        click.option("--temperature", type=float, default=None, help="0 is greedy (default: the pipeline's)."),
        click.option("--top-k", type=int, default=None, help="0 turns top-k off (default: the pipeline's)."),
        click.option("--top-p", type=float, default=None, help="In (0, 1] (default: the pipeline's)."),
        click.option("--repetition-penalty", type=float, default=None, help="1 turns it off (default: the "
                     "pipeline's)."),
        click.option("--seed", type=int, default=None, help="Seed for sampling at temperature > 0."),
    ]):
        function = option(function)
    return function


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


for command in TRAINING_COMMANDS:
    cli.add_command(command)


@cli.command()
@click.argument("pipeline_path", metavar="PIPELINE.yaml")
@engines_option
@click.option("--force", is_flag=True, help="Rebuild even when the inputs are unchanged.")
@click.option("--dry-run", is_flag=True, help="backend trtllm: print every conversion and engine build with its "
              "arguments and paths, and run nothing (needs no TensorRT-LLM).")
@device_option
def build(pipeline_path: str, engines_dir: Path, force: bool, dry_run: bool, device: str | None) -> None:
    """Build the pipeline's target (and draft) engines."""
    from specdeploy.workflows import build_engine, build_plan, load_spec

    pipeline = load_spec(pipeline_path, device)
    if dry_run:
        plan = build_plan(pipeline, engines_dir)
        if plan is None:
            raise click.UsageError("--dry-run prints the plan of a trtllm pipeline; a torch build runs in-process")
        click.echo(plan)
        return
    directory, built = build_engine(pipeline, engines_dir, force=force)
    click.echo(f"built {directory}" if built else f"{directory}: up to date, nothing to build")


@cli.command()
@click.argument("pipeline_path", metavar="PIPELINE.yaml")
@engines_option
def tune(pipeline_path: str, engines_dir: Path) -> None:
    """Measure again on this machine what the pipeline's built torch engine measures at build: its step programs
    against eager, an early exit's layer and the gamma cap (each where the pipeline asks for it)."""
    from specdeploy.workflows import load_spec, retune_engine

    for said in retune_engine(load_spec(pipeline_path), engines_dir):
        click.echo(said)


def write_json(path: Path | None, report: dict) -> None:
    """A command's report as JSON at `path`, when the user asked for one."""
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2))
        click.echo(f"wrote {path}")


def echo_text(text: str) -> None:
    if text:
        click.echo(text, nl=False)


@cli.command()
@click.argument("arguments", nargs=-1, required=True, metavar="[PIPELINE.yaml] PROMPT")
@click.option("--url", default=None, help="Generate through a running server's gRPC endpoint (HOST:PORT) instead "
              "of in-process; then PIPELINE.yaml is not given.")
@click.option("--stream/--no-stream", default=True, show_default=True, help="With --url: stream the text.")
@engines_option
@sampling_options
@click.option("--num-draft-tokens", type=int, default=None, help="Override gamma for this request.")
@click.option("--no-speculation", is_flag=True, help="Plain decode (same as --num-draft-tokens 0).")
@click.option("--end-id", type=int, default=None, help="End on this token instead of the end-of-sequence tokens "
              "(-1: none, generate --max-tokens).")
@click.option("--request-kind", default=None, help="The request's kind of traffic (one of the pipeline's "
              "serving.request_kinds): labels its acceptance in the server's metrics.")
@click.option("--stop", "stop_strings", multiple=True, help="Stop where this text appears in the output (kept in "
              "it; repeat for several).")
@click.option("--compare", is_flag=True, help="Also run plain decode on the same prompt and report the speedup.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with the text and statistics.")
@device_option
def generate(arguments: tuple[str, ...], url: str | None, stream: bool, engines_dir: Path, max_tokens: int | None,
             temperature: float | None, top_k: int | None, top_p: float | None,
             repetition_penalty: float | None, seed: int | None, num_draft_tokens: int | None,
             no_speculation: bool, end_id: int | None, request_kind: str | None, stop_strings: tuple[str, ...],
             compare: bool, as_json: bool, device: str | None) -> None:
    """Generate in-process (PIPELINE.yaml PROMPT) or over gRPC (--url HOST:PORT PROMPT), streaming the text."""
    from specdeploy.workflows import RequestOptions, generate_in_process, generate_over_grpc, load_engine

    options = RequestOptions(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                             repetition_penalty=repetition_penalty, seed=seed,
                             num_draft_tokens=0 if no_speculation else num_draft_tokens, end_id=end_id,
                             kind=request_kind, stop_strings=stop_strings or None)
    show = (lambda _: None) if as_json else echo_text
    if url is not None:
        if len(arguments) != 1:
            raise click.UsageError("with --url give only the PROMPT")
        report = generate_over_grpc(url, arguments[0], options, stream, compare, show)
    else:
        if len(arguments) != 2:
            raise click.UsageError("give PIPELINE.yaml and PROMPT (or --url HOST:PORT and PROMPT)")
        engine = load_engine(arguments[0], engines_dir, quiet=as_json, device=device)
        report = generate_in_process(engine, arguments[1], options, compare, show)
    if as_json:
        click.echo(json.dumps(report.to_json()))
    else:
        print_generation(report)


def print_generation(report: GenerationReport) -> None:
    if report.seconds is None:  # in-process: the decode phase's rate
        click.echo(f"\n[{report.label}] {report.generated_tokens} tokens at {report.tokens_per_s:.1f} tokens/s; "
                   f"acceptance {report.acceptance_rate:.2f}, mean accepted length "
                   f"{report.mean_accepted_length:.2f} tokens/step")
        plain = "plain decode {:.1f} tokens/s on the same prompt: speedup {:.2f}x"
    else:
        click.echo(f"\n[{report.label}] {report.generated_tokens} tokens in {report.seconds:.2f} s "
                   f"({report.tokens_per_s:.1f} tokens/s end to end); acceptance {report.acceptance_rate:.2f}, "
                   f"mean accepted length {report.mean_accepted_length:.2f}")
        plain = "plain decode over the same server: {:.1f} tokens/s: speedup {:.2f}x"
    if report.plain_tokens_per_s is not None:
        click.echo(plain.format(report.plain_tokens_per_s, report.speedup))


@cli.command()
@click.argument("pipeline_paths", metavar="[PIPELINE.yaml]...", nargs=-1)
@engines_option
@click.option("--url", default=None, help="Benchmark a running server with concurrent streams: HOST:PORT over "
              "Triton gRPC, http://HOST:PORT/v1 over the OpenAI API (chat completions).")
@click.option("--plain-url", default=None, metavar="HOST:PORT",
              help="With --url: measure plain decoding on this server (the same target served without "
                   "speculation) instead of with num_draft_tokens 0 on --url; needed where --url's engine "
                   "speculates on every request (TensorRT-LLM Medusa or lookahead), which refuses 0.")
@click.option("--concurrency", default=",".join(map(str, BenchOptions.concurrency)), show_default=True,
              help="With --url: concurrency levels.")
@click.option("--requests", "requests_per_level", type=int, default=None,
              help="With --url: requests per level and mode (default: 2 x concurrency, at least 4); with "
                   "--long-stream: generations per mode and place (default 3).")
@click.option("--stress", type=int, default=None, metavar="N",
              help="With --url: N requests at the highest --concurrency, some cancelled at random (--cancel-"
                   "fraction); counts lost and corrupted responses.")
@click.option("--cancel-fraction", type=click.FloatRange(0, 1), default=BenchOptions.cancel_fraction, show_default=True)
@click.option("--metrics-url", default=None, help="With --stress: the server's metrics endpoint, to report how many "
              "requests it counted as cancelled and how soon it was idle.")
@click.option("--long-stream", type=int, default=None, metavar="N",
              help="With --url: one streamed generation of N tokens (end of sequence ignored), its tokens/s in the "
                   "first quarter and the last fifth, against the same generation in-process (needs PIPELINE.yaml).")
@click.option("--prompts", "prompts_path", type=click.Path(dir_okay=False, exists=True), default=None,
              help="JSON Lines, one {\"prompt\": ...} per line (default: the shipped mixed set).")
@click.option("--max-tokens", type=int, default=None, help="Tokens per request (default: the pipeline's).")
@click.option("--temperature", type=float, default=None, help="In-process: 0 is greedy (default: the pipeline's).")
@click.option("--seed", type=int, default=BenchOptions.seed, show_default=True, help="In-process: the sampling seed.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write the report as JSON to this file.")
@click.option("--no-transformers", is_flag=True, help="Skip the transformers `generate` baseline.")
@click.option("--gammas", default=None, metavar="G1,G2,...", help="In-process: also decode every prompt at these "
              "gammas (the report's speedup plot shows each).")
@click.option("--peers", is_flag=True, help="In-process: also measure transformers `generate` plain, with prompt "
              "lookup and with the draft as assistant_model, on the same weights and prompts (greedy).")
@click.option("--report", "report_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Also write DIR/report.md with PNG plots, in-process or of --url's concurrency levels (needs the "
                   "report extra: matplotlib).")
@click.option("--measure-gamma-cap", is_flag=True,
              help="Bench at the pipeline's full gamma (whatever its cap) and at smaller gammas (a tree's depth "
                   "cap: Medusa, EAGLE, lookahead), and write the gamma with the best realized speedup into the "
                   "engine, where serving.policy.gamma_cap: measured serves with it (build measures it on "
                   "calibration prompts).")
@click.option("--price-per-hour", type=click.FloatRange(min=0, min_open=True), default=None, metavar="USD",
              help="The machine's price per hour: adds dollars per million output tokens, plain and speculative "
                   "(in-process, and per concurrency level with --url).")
@click.option("--context", "contexts", default=None, metavar="L1,L2,...",
              help="In-process: pad every prompt with held-out text to about these many tokens and measure the "
                   "speedup at each context length against the bytes model's prediction (one pipeline).")
@device_option
def bench(pipeline_paths: tuple[str, ...], engines_dir: Path, url: str | None, plain_url: str | None,
          concurrency: str,
          requests_per_level: int | None, stress: int | None, cancel_fraction: float, metrics_url: str | None,
          long_stream: int | None,
          prompts_path: str | None, max_tokens: int | None, temperature: float | None, seed: int,
          json_out: Path | None, no_transformers: bool, measure_gamma_cap: bool, report_dir: Path | None,
          gammas: str | None, peers: bool, price_per_hour: float | None, contexts: str | None,
          device: str | None) -> None:
    """Each prompt with and without speculation, side by side: speedup, acceptance, costs, prediction. Several
    pipelines: measured in one run, prompt by prompt, then compared (which speculation wins, by prompt kind).
    With --url: aggregate tokens/s of a server per concurrency level, speculative and plain."""
    from specdeploy.bench.command import bench as run_bench_command
    from specdeploy.workflows import load_engine

    options = BenchOptions(
        pipeline_paths=pipeline_paths, url=url, plain_url=plain_url,
        concurrency=tuple(integers(concurrency, "--concurrency")),
        requests_per_level=requests_per_level, stress=stress, cancel_fraction=cancel_fraction,
        metrics_url=metrics_url, long_stream=long_stream, prompts_path=prompts_path, max_tokens=max_tokens,
        temperature=temperature, seed=seed, json_out=json_out, with_transformers=not no_transformers,
        gammas=tuple(integers(gammas, "--gammas")) if gammas else (), peers=peers, report_dir=report_dir,
        measure_gamma_cap=measure_gamma_cap, price_per_hour=price_per_hour,
        contexts=tuple(integers(contexts, "--context")) if contexts else ())
    run_bench_command(options, lambda path, room: load_engine(path, engines_dir, device=device,
                                                              max_sequence_length=room))


@cli.command("export-hf")
@click.argument("pipeline_path", metavar="PIPELINE.yaml")
@engines_option
@click.option("--component", type=click.Choice(["target", "draft"]), default="target", show_default=True)
@click.option("--output", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="The Hugging Face checkpoint directory to write.")
@click.option("--dtype", type=click.Choice(["bfloat16", "float32"]), default="bfloat16", show_default=True)
def export_hf(pipeline_path: str, engines_dir: Path, component: str, output: Path, dtype: str) -> None:
    """Write an engine component as a Hugging Face checkpoint (LlamaForCausalLM, or a per-expert
    MixtralForCausalLM for an MoE target): what TensorRT-LLM's converters read."""
    from specdeploy.workflows import export_component

    click.echo(f"wrote {export_component(pipeline_path, engines_dir, component, output, dtype)}")


@cli.command("quant-quality")
@click.argument("pipeline_path", metavar="PIPELINE.yaml")
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write the report as JSON.")
def quant_quality(pipeline_path: str, json_out: Path | None) -> None:
    """Score the pipeline's target stored weight-only quantized (int8 rows, int4 groups; target.weight_only) against
    the bf16 target on held-out text: greedy agreement, KL divergence, perplexity."""
    from specdeploy.bench.quant_quality import print_quant_quality
    from specdeploy.bench.quant_quality import quant_quality as measure
    from specdeploy.spec.pipeline import load_pipeline

    report = measure(load_pipeline(pipeline_path))
    print_quant_quality(report)
    write_json(json_out, report.to_json())


@cli.command("moe-quality")
@click.argument("pipeline_path", metavar="PIPELINE.yaml")
@click.option("--experts-per-token", "ks", default=None, help="Comma-separated k to derive and score "
              "(default: 1 to the pipeline's target.moe.experts).")
@click.option("--expert-noise", "noises", default=None, help="Comma-separated target.moe.expert_noise values to "
              "derive each k with (upcycle only; default: the pipeline's).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write the report as JSON.")
def moe_quality(pipeline_path: str, ks: str | None, noises: str | None, json_out: Path | None) -> None:
    """Derive the pipeline's MoE target (target.moe) for each number of experts per token (and expert noise) and
    score it against the dense model on held-out text: greedy agreement, KL divergence, perplexity."""
    from specdeploy.bench.moe_quality import moe_quality as measure
    from specdeploy.bench.moe_quality import print_moe_quality
    from specdeploy.spec.pipeline import load_pipeline

    pipeline = load_pipeline(pipeline_path)
    chosen = None if ks is None else integers(ks, "--experts-per-token")
    if chosen is None:
        chosen = list(range(1, (pipeline.target.moe.experts if pipeline.target.moe else 0) + 1))
    report = measure(pipeline, chosen, None if noises is None else numbers(noises, "--expert-noise"))
    print_moe_quality(report)
    write_json(json_out, report.to_json())


@cli.command()
@click.argument("pipeline_path", metavar="PIPELINE.yaml")
@engines_option
@click.option("--output", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Model repository directory (default: $SPECDEPLOY_REPOSITORIES/<name>, else "
                   "model_repository/<name>).")
@click.option("--served-at", type=click.Path(path_type=Path), default=None,
              help="trtllm: where the repository will be mounted on the server, as the tensorrtllm models' engine "
                   "paths must name it (default: the --output directory).")
@click.option("--trtllm-source", type=click.Path(file_okay=False, exists=True, path_type=Path), default=None,
              help="trtllm llm_api line: a NVIDIA/TensorRT-LLM checkout at the served release's tag, whose "
                   "Triton LLM-API model code the repository takes (inside the pinned image: /app).")
@click.option("--force", is_flag=True, help="Write the repository even when it was packaged from the same inputs.")
@device_option
def package(pipeline_path: str, engines_dir: Path, output: Path | None, served_at: Path | None,
            trtllm_source: Path | None, force: bool, device: str | None) -> None:
    """Write a Triton model repository: the ensemble preprocessing → speculative, and for a trtllm pipeline the
    tensorrtllm backend's tensorrt_llm (and tensorrt_llm_draft) models that speculative orchestrates (on the
    llm_api line: Triton's LLM-API model with its model.yaml)."""
    from specdeploy.workflows import package as package_pipeline

    if served_at is not None and not served_at.is_absolute():
        raise click.BadParameter("must be an absolute path (the backend reads engine paths as they are)",
                                 param_hint="--served-at")
    directory, written = package_pipeline(pipeline_path, engines_dir, output, served_at, trtllm_source, force,
                                          device)
    click.echo(f"wrote {directory}" if written else f"{directory}: up to date, nothing to package")


@cli.command()
@click.argument("pipeline_path", metavar="PIPELINE.yaml", required=False)
@engines_option
@click.option("--model-repository", type=click.Path(file_okay=False, exists=True, path_type=Path), default=None,
              help="Serve this repository instead of packaging PIPELINE.yaml.")
@click.option("--grpc-port", type=int, default=8001, show_default=True)
@click.option("--http-port", type=int, default=8000, show_default=True)
@click.option("--metrics-port", type=int, default=8002, show_default=True)
@click.option("--openai-port", type=int, default=9000, show_default=True,
              help="The OpenAI-compatible endpoints (/v1/chat/completions, …) beside tritonserver; 0: none.")
@click.option("--openai-max-requests", type=click.IntRange(min=0), default=128, show_default=True,
              help="Requests the OpenAI endpoints run at once; more get 429 (0: no limit).")
@click.option("--address", default="127.0.0.1", show_default=True, help="Interface to bind (0.0.0.0: all).")
@click.option("--drain-timeout", type=click.FloatRange(min=0), default=None,
              help="Seconds running requests get to finish after SIGTERM or Ctrl-C (default: 30).")
@device_option
def serve(pipeline_path: str | None, engines_dir: Path, model_repository: Path | None, grpc_port: int,
          http_port: int, metrics_port: int, openai_port: int, openai_max_requests: int, address: str,
          drain_timeout: float | None, device: str | None) -> None:
    """Run tritonserver on the pipeline's model repository, and the OpenAI-compatible endpoints beside it, until
    SIGTERM or Ctrl-C, then drain both and exit; exit non-zero when the model's scheduler failed (so that a
    supervisor restarts the server)."""
    import signal

    from specdeploy.serve.openai_api.front import OpenAIFront
    from specdeploy.serve.tritonserver import DRAIN_TIMEOUT, TritonServer
    from specdeploy.workflows import package as package_pipeline

    if model_repository is None:
        if pipeline_path is None:
            raise click.UsageError("give PIPELINE.yaml or --model-repository")
        model_repository = package_pipeline(pipeline_path, engines_dir, device=device).directory
    elif device is not None:
        raise click.UsageError("--device applies when packaging PIPELINE.yaml; a given --model-repository runs "
                               "where it was packaged for")
    timeout = DRAIN_TIMEOUT if drain_timeout is None else drain_timeout
    server = TritonServer(model_repository, grpc_port, http_port, metrics_port, address, drain_timeout=timeout)
    front = None

    def drain(*_) -> None:
        if front is not None:
            front.drain()
        server.drain()

    # The handlers only start the drain (a second signal kills): the main thread is the one waiting on the server.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, drain)
    server.start()
    if openai_port and not server.draining:
        try:
            front = OpenAIFront(model_repository, server.grpc_url, openai_port, address, timeout,
                                openai_max_requests).start()
        except SpecdeployError:
            if not server.draining:
                raise
            # a SIGTERM to the process group while the front started (a pod stopped early): it stopped the front
            # too, and the drain goes on without it
    click.echo(f"tritonserver ready: gRPC {server.grpc_url}, metrics {server.metrics_url}"
               + (f", OpenAI API {front.url}" if front else "") + "; SIGTERM or Ctrl-C drains and stops it", err=True)
    if not os.environ.get("SPECDEPLOY_ADMIN_KEY"):
        click.echo(f"admin endpoints (logging, shared memory, model repository, trace) need the header "
                   f"specdeploy-admin-key: {server.admin_key} (set SPECDEPLOY_ADMIN_KEY to choose it)", err=True)
    status = server.process.wait()
    failure = server.failure()  # the model's scheduler failed and had tritonserver stop: exit non-zero to be restarted
    if front is not None:
        front.stop()
    server.cleanup()
    click.echo(f"tritonserver exited with status {status}", err=True)
    if failure is not None:
        click.echo(f"the speculative model failed: {failure}", err=True)
        raise SystemExit(status or 1)
    raise SystemExit(status)


@cli.command()
@click.argument("pipeline_path", metavar="PIPELINE.yaml")
@click.argument("prompt")
@engines_option
@click.option("--max-tokens", type=int, default=None, help="Tokens to generate (default: the pipeline's).")
@device_option
def demo(pipeline_path: str, prompt: str, engines_dir: Path, max_tokens: int | None, device: str | None) -> None:
    """The main job end to end: build, package, serve on free local ports, stream a generation over gRPC with the
    acceptance statistics and a plain-vs-speculative comparison, show the OpenAI endpoint answering the same, then
    stop the server."""
    from specdeploy.runtime.step_programs import eager_first_run
    from specdeploy.serve.openai_api.front import OpenAIFront, served_name
    from specdeploy.serve.tritonserver import TritonServer
    from specdeploy.spec.engine_paths import engine_path
    from specdeploy.workflows import RequestOptions, generate_over_grpc, load_spec, openai_curl
    from specdeploy.workflows import package as package_pipeline

    pipeline = load_spec(pipeline_path, device)
    deferred = eager_first_run(pipeline, engine_path(engines_dir, pipeline))
    if deferred:
        click.echo(deferred)
    repository = package_pipeline(pipeline_path, engines_dir, device=device).directory
    click.echo(f"model repository: {repository}; starting tritonserver ...")
    with TritonServer(repository, log_file=repository.with_name(repository.name + ".tritonserver.log")) as server:
        click.echo(f"tritonserver ready on {server.grpc_url} (log: {server.log_file})\n")
        report = generate_over_grpc(server.grpc_url, prompt, RequestOptions(max_tokens=max_tokens), True, True,
                                    echo_text)
        print_generation(report)
        with OpenAIFront(repository, server.grpc_url) as front:
            command, answer = openai_curl(front.url, served_name(repository), prompt, max_tokens or 32)
            click.echo(f"\nthe same server over the OpenAI API (specdeploy serve runs it on port 9000):\n  {command}")
            click.echo(f"→ {answer}")
    click.echo("tritonserver stopped")


@cli.command()
@click.argument("pipeline_path", metavar="PIPELINE.yaml")
@click.option("--output", type=click.Path(file_okay=False, path_type=Path), default=Path("k8s"), show_default=True,
              help="Writes OUTPUT/base, OUTPUT/monitoring and OUTPUT/overlays/NAME.")
@click.option("--name", default=None, help="The overlay's folder name (default: the pipeline's name).")
@click.option("--image", default=None, help="Image repository:tag or repository@sha256:digest (pin a digest in "
              "production). Required for trtllm, naming the registry the GPU nodes pull from; default for torch: "
              "specdeploy-cpu at this version, loaded into a local cluster.")
@click.option("--namespace", default=OverlayOptions.namespace, show_default=True)
@click.option("--weights-gib", type=click.FloatRange(min=0, min_open=True), default=None,
              help="The model's weights in GiB (default: estimated from the target's configuration; required when "
                   "its checkpoint is not readable here).")
@click.option("--gpus-per-node", type=click.IntRange(min=1), default=OverlayOptions.gpus_per_node, show_default=True,
              help="trtllm: more ranks than this span nodes (a LeaderWorkerSet).")
@click.option("--longest-generation", type=click.IntRange(min=1), default=OverlayOptions.longest_generation_s,
              show_default=True,
              help="Seconds the longest generation takes: the drain on shutdown (the grace period adds to it).")
@click.option("--draft-cost-ratio", type=click.FloatRange(min=0), default=None,
              help="c, for the acceptance alert's break-even (default: 0.1 with a draft model, else 0).")
@click.option("--verify-cost-ratio", type=click.FloatRange(min=0), default=OverlayOptions.verify_cost_ratio,
              show_default=True,
              help="v, for the acceptance alert's break-even (gamma × c + v).")
@click.option("--gpu-product", default=None,
              help="trtllm (required): the nvidia.com/gpu.product label of the GPU nodes; the build Job and the "
                   "servers are pinned to it, since an engine runs only on the GPU type it was built on.")
@click.option("--storage-class", default=None, help="The data volume's storage class (default: the cluster's; "
              "required for ReadWriteMany, which few default classes provide).")
@click.option("--volume-read-gibps", type=click.FloatRange(min=0, min_open=True),
              default=OverlayOptions.volume_read_gibps, show_default=True,
              help="trtllm: GiB/s the data volume reads at; GPU servers' startup probes allow the engines' bytes at "
                   "this rate (x1.5, at least 30 min). An EBS gp3 volume's baseline is 0.12.")
@click.option("--access-mode", type=click.Choice(["ReadWriteOnce", "ReadWriteMany"]), default=None,
              help="The data volume's access mode (default: ReadWriteOnce where one node serves, ReadWriteMany, "
                   "required, where a group spans nodes).")
@click.option("--monitoring/--no-monitoring", default=OverlayOptions.monitoring, show_default=True,
              help="The PodMonitor, PrometheusRule and HPA (they need prometheus-operator's CRDs and the adapter).")
@click.option("--prometheus-release", default=OverlayOptions.prometheus_release, show_default=True,
              help="kube-prometheus-stack's Helm release: it selects PodMonitors and rules by their release label.")
@click.option("--prometheus-namespace", default=OverlayOptions.prometheus_namespace, show_default=True,
              help="Where that Prometheus runs (the adapter's URL).")
def k8s(pipeline_path: str, output: Path, name: str | None, image: str | None, namespace: str,
        weights_gib: float | None, gpus_per_node: int, longest_generation: int, draft_cost_ratio: float | None,
        verify_cost_ratio: float, gpu_product: str | None, storage_class: str | None, volume_read_gibps: float,
        access_mode: str | None,
        monitoring: bool, prometheus_release: str, prometheus_namespace: str) -> None:
    """Write a kustomize overlay for the pipeline (and the shared base): the pipeline ConfigMap, the engine-build
    Job, the Triton Deployment (a LeaderWorkerSet across nodes), Service, PDB, NetworkPolicy, HPA, PodMonitor and
    PrometheusRule, sized from the model."""
    from specdeploy.deploy.k8s import checked_overlay, write_checked

    options = OverlayOptions(name=name, image=image, namespace=namespace, weights_gib=weights_gib,
                             gpus_per_node=gpus_per_node, longest_generation_s=longest_generation,
                             draft_cost_ratio=draft_cost_ratio, verify_cost_ratio=verify_cost_ratio,
                             gpu_product=gpu_product, storage_class=storage_class,
                             volume_read_gibps=volume_read_gibps, access_mode=access_mode,
                             monitoring=monitoring, prometheus_release=prometheus_release,
                             prometheus_namespace=prometheus_namespace)
    checked = checked_overlay(Path(pipeline_path), options)
    overlay = write_checked(checked, output)
    click.echo(f"wrote {overlay}: kubectl apply -k {overlay}")
    for note in checked.notes:
        click.echo(f"note: {note}", err=True)


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
