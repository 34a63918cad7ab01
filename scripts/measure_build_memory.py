"""Peak memory of builds, measured: each build runs in a fresh process that reports its own peak RSS (VmHWM), so
the constants of specdeploy/deploy/build_memory.py come from figures. The figures they come from, with the machine
and the run history, are kept in docs/benchmarks.md ("Build memory"): update that section with the constants.

  .venv/bin/python scripts/measure_build_memory.py [--json OUT.json] [--only SUBSTRING] [--work DIR]
      every case (or those whose name contains SUBSTRING), a table, the fitted lines; OUT.json gets the figures
  .venv/bin/python scripts/measure_build_memory.py worker KIND PIPELINE.yaml ENGINES_DIR
      one build in this process, its peak printed as JSON on the last line. KIND: torch (the torch backend), trtllm
      (the trtllm backend; TensorRT-LLM's tools must be on PATH, e.g. the test double), export (the target exported
      whole the way a GGUF or packaged source is, through the trtllm builder's Sources and export_model), imports
      (nothing built: the runtime alone)

Cases:
- the shipped CPU pipelines (pipelines/smollm2-*.yaml), torch builds: their GGUF source is dequantized whole; and
  the draft-target and MoE ones on the trtllm backend, whose target export loads that GGUF whole (and derives the
  MoE from it);
- a random Llama written as a Hugging Face checkpoint (bf16 safetensors, a character tokenizer padded to a vocabulary
  of 16 x the hidden size; no downloads) at two sizes of 16 layers, about 60 and 460 MB: a torch build; on the
  trtllm backend through the test double of TensorRT-LLM (tests/trtllm_double/), a draft-target build (read in
  place), a Medusa build (the target's projection read alone) and an MoE derived from it layer by layer; and the
  whole-model export a GGUF source takes.
The peak is the worker's own (VmHWM): the double's converter and trtllm-build run as its children and are not
counted (their figures would be the double's, not TensorRT-LLM's, which build_memory.py estimates from upstream's
code; and a child's ru_maxrss includes the parent's pages it was forked with).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from specdeploy.build import gguf_store

REPO = Path(__file__).resolve().parents[1]
DOUBLE = REPO / "tests" / "trtllm_double"
GIB = 1 << 30
LAYERS = 16  # build_memory.FEWEST_LAYERS: the synthetic models are as shallow as a Llama-family model gets
# name → Llama dimensions; about 60 MB and 460 MB of bf16 weights
SIZES = {"llama-60m": dict(hidden_size=384, intermediate_size=1152, num_attention_heads=6, num_key_value_heads=2),
         "llama-460m": dict(hidden_size=1024, intermediate_size=3072, num_attention_heads=8, num_key_value_heads=2)}
SHIPPED = ["smollm2-draft-target", "smollm2-ngram", "smollm2-medusa", "smollm2-moe-draft-target"]
LIMITS = {"max_batch_size": 8, "max_input_length": 256, "max_sequence_length": 512, "max_draft_tokens": 8}


def peak_gib() -> float:
    """This process's peak resident memory so far (VmHWM, Linux, in kB), in GiB."""
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(status["VmHWM"].split()[0]) / (1 << 20)


def worker(kind: str, pipeline_path: Path, engines: Path) -> None:
    """One build in this fresh process, then its peak as JSON."""
    from specdeploy.spec.pipeline import load_pipeline

    if kind != "imports":
        pipeline = load_pipeline(pipeline_path)
    if kind == "torch":
        from specdeploy.build.torch_engine import build

        build(pipeline, engines, quiet=True)
    elif kind == "trtllm":
        from specdeploy.build.trtllm import engine_build as trtllm

        trtllm.missing_requirements = lambda pipeline: []  # the double stands in for TensorRT-LLM and a GPU
        trtllm.build(pipeline, engines, quiet=True)
    elif kind == "export":
        from specdeploy.build.trtllm import engine_build as trtllm

        output = engines / "export"
        step = trtllm.Step("export the target whole", output, action="export target")
        trtllm.run_action(step, pipeline, engines, output, trtllm.Sources(pipeline))
    else:
        import specdeploy.build.torch_engine  # noqa: F401
        import specdeploy.build.trtllm.engine_build  # noqa: F401
    print(json.dumps({"peak_gib": peak_gib()}))


def double_env(bin_dir: Path) -> dict[str, str]:
    """The environment of a trtllm build through the double: trtllm-build and python3 on PATH, the tensorrt_llm
    package on PYTHONPATH (as tests/build/trtllm/test_trtllm_build.py's `double` fixture)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name, target in (("trtllm-build", f"{sys.executable} {DOUBLE / 'trtllm_build.py'}"),
                         ("python3", sys.executable)):
        (bin_dir / name).write_text(f'#!/bin/sh\nexec {target} "$@"\n')
        (bin_dir / name).chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(DOUBLE)}


def measure(kind: str, pipeline: Path, engines: Path, env: dict[str, str] | None = None,
            timeout: float = 1800) -> dict[str, float]:
    """Run one build in a fresh worker process: its peak RSS (GiB) and the seconds it took."""
    start = time.monotonic()
    result = subprocess.run([sys.executable, __file__, "worker", kind, str(pipeline), str(engines)],
                            capture_output=True, text=True, timeout=timeout,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {}),
                                 # a store of its own: every measured build converts its GGUF, the first build's peak
                                 gguf_store.STORE_VARIABLE: str(engines / gguf_store.STORE_FOLDER)})
    if result.returncode != 0:
        raise RuntimeError(f"{kind} build of {pipeline} failed:\n{result.stderr[-3000:]}")
    return {**json.loads(result.stdout.strip().splitlines()[-1]), "seconds": time.monotonic() - start}


def synthetic_checkpoint(directory: Path, seed: int = 0, **dimensions) -> Path:
    """A random Llama as a Hugging Face directory in bf16 with a character tokenizer (tests/helpers/tiny_models.py)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(REPO / "tests"))
    from helpers.tiny_models import char_tokenizer

    torch.manual_seed(seed)
    # a vocabulary 16 x the hidden size, as Llama 3 8B's is 31 x and Llama 2's 8 x (the Medusa export holds it)
    config = LlamaConfig(vocab_size=16 * dimensions["hidden_size"], num_hidden_layers=LAYERS,
                         max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                         **dimensions)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)
    char_tokenizer(config.vocab_size).save_pretrained(directory)
    return directory


def synthetic_pipeline(path: Path, checkpoint: Path, variant: str) -> Path:
    """A pipeline on the synthetic checkpoint. variant: torch (int4 draft), trtllm (draft-target, int4 draft),
    medusa (heads written beside it), moe (derived, 8 experts of 2, int4 dense draft)."""
    spec = {"name": path.stem, "target": {"checkpoint": {"source": "hf_dir", "path": str(checkpoint)},
                                          "dtype": "bfloat16"},
            "speculation": {"method": "draft_target", "num_draft_tokens": 4, "draft": {"derive": "int4"}},
            "limits": LIMITS, "backend": {"kind": "trtllm", "trtllm": {}}}
    if variant == "torch":
        spec["backend"] = {"kind": "torch"}
    elif variant == "medusa":
        from specdeploy.speculative.medusa import MedusaHeads

        hidden = json.loads((checkpoint / "config.json").read_text())["hidden_size"]
        heads = path.with_suffix(".safetensors")
        MedusaHeads(hidden, 2).save(heads)
        spec["speculation"] = {"method": "medusa", "num_draft_tokens": 2,
                               "medusa": {"heads": str(heads), "num_heads": 2, "choices": [[0], [0, 0]]}}
        spec["backend"]["trtllm"]["medusa_converter"] = str(DOUBLE / "medusa_convert_checkpoint.py")
    elif variant == "moe":
        spec["target"]["moe"] = {"experts": 8, "experts_per_token": 2}
        spec["speculation"]["draft"] = {"derive": "int4_dense"}
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def weights_gib(pipeline_path: Path) -> float:
    """The pipeline's weights as the deploy sizing counts them (what build_memory_gib is given)."""
    from specdeploy.build.checkpoints import target_config
    from specdeploy.deploy.sizing import estimate_weights_gib
    from specdeploy.spec.pipeline import load_pipeline

    pipeline = load_pipeline(pipeline_path)
    return estimate_weights_gib(pipeline, target_config(pipeline))


def cases(work: Path) -> list[dict]:
    """name, build kind, our path (build_memory.our_path's names), pipeline, worker environment, and for the
    synthetic checkpoints the variant (the two sizes of a variant give a path's slope)."""
    found = [{"name": f"{name} (torch)", "kind": "torch", "path": "torch",
              "pipeline": REPO / "pipelines" / f"{name}.yaml"} for name in SHIPPED]
    for name in ("smollm2-draft-target", "smollm2-moe-draft-target"):  # the GGUF exported for TensorRT-LLM
        spec = yaml.safe_load((REPO / "pipelines" / f"{name}.yaml").read_text())
        spec = {**spec, "backend": {"kind": "trtllm", "trtllm": {}}, "serving": {}}
        path = work / f"{name}-trtllm.yaml"
        path.write_text(yaml.safe_dump(spec, sort_keys=False))
        found.append({"name": f"{name} (whole export)", "kind": "export", "path": "whole", "pipeline": path})
    env = double_env(work / "double-bin")
    for size, dimensions in SIZES.items():
        checkpoint = work / size
        if not (checkpoint / "config.json").is_file():
            synthetic_checkpoint(checkpoint, **dimensions)
        for variant, kind, path in (("torch", "torch", "torch"), ("trtllm", "trtllm", "read"),
                                    ("medusa", "trtllm", "read"), ("moe", "trtllm", "streamed"),
                                    ("trtllm", "export", "whole")):
            pipeline = synthetic_pipeline(work / f"{size}-{variant}.yaml", checkpoint, variant)
            label = "whole export" if kind == "export" else variant
            found.append({"name": f"{size} ({label})", "kind": kind, "path": path, "pipeline": pipeline,
                          "env": env if kind == "trtllm" else None, "variant": label})
    return found


def fits(results: list[dict]) -> dict[str, dict[str, float]]:
    """Per path, the line peak = runtime + k x weights: k the steepest slope between a synthetic variant's two sizes,
    runtime the largest residual of the path's builds, so every measured build is at or under its line."""
    lines = {}
    for path in dict.fromkeys(row["path"] for row in results):
        rows = [row for row in results if row["path"] == path]
        pairs: dict[str, list[tuple[float, float]]] = {}
        for row in rows:
            if "variant" in row:
                pairs.setdefault(row["variant"], []).append((row["weights_gib"], row["peak_gib"]))
        slopes = [(max(pair)[1] - min(pair)[1]) / (max(pair)[0] - min(pair)[0]) for pair in pairs.values()
                  if len(pair) > 1]
        if not slopes:
            continue
        k = max(0.0, *slopes)
        line = {"k": k, "runtime_gib": max(row["peak_gib"] - k * row["weights_gib"] for row in rows)}
        if path == "streamed":  # per GiB of one layer: the derivation holds about one layer
            line["k_per_layer"] = k * LAYERS
        lines[path] = line
    return lines


def main(argv: list[str]) -> None:
    if argv[:1] == ["worker"]:
        worker(argv[1], Path(argv[2]), Path(argv[3]))
        return
    parser = argparse.ArgumentParser(prog="measure_build_memory.py")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--only")
    parser.add_argument("--work", type=Path, help="where the synthetic checkpoints are kept (default: a temporary "
                                                  "directory)")
    args = parser.parse_args(argv)
    from rich.console import Console
    from rich.table import Table

    work = args.work or Path(tempfile.mkdtemp(prefix="build-memory-"))
    work.mkdir(parents=True, exist_ok=True)
    baseline = measure("imports", REPO / "pipelines" / "smollm2-ngram.yaml", work)
    results = []
    for case in cases(work):
        if args.only and args.only not in case["name"]:
            continue
        engines = Path(tempfile.mkdtemp(prefix="engines-", dir=work))
        try:
            figures = measure(case["kind"], case["pipeline"], engines, case.get("env"))
        finally:
            shutil.rmtree(engines, ignore_errors=True)
        row = {key: value for key, value in case.items() if key not in ("env",)}
        results.append({**row, "pipeline": str(case["pipeline"]), "weights_gib": weights_gib(case["pipeline"]),
                        **figures})
        print(f"{case['name']}: {figures['peak_gib']:.3f} GiB", file=sys.stderr)
    lines = fits(results)
    table = Table(title=f"build peak RSS (runtime alone: {baseline['peak_gib']:.3f} GiB)")
    for column in ("case", "our path", "weights GiB", "peak GiB", "seconds"):
        table.add_column(column, justify="left" if column in ("case", "our path") else "right")
    for row in results:
        table.add_row(row["name"], row["path"], f"{row['weights_gib']:.3f}", f"{row['peak_gib']:.3f}",
                      f"{row['seconds']:.0f}")
    console = Console(width=120)
    console.print(table)
    for path, line in lines.items():
        console.print(f"{path}: peak = {line['runtime_gib']:.3f} GiB + {line['k']:.2f} x weights"
                      + (f" (k per GiB of one layer: {line['k_per_layer']:.1f})" if "k_per_layer" in line else ""))
    if args.json:
        import torch
        import transformers

        args.json.write_text(json.dumps({
            "command": "scripts/measure_build_memory.py", "machine": platform.machine(),
            "versions": {"python": platform.python_version(), "torch": torch.__version__,
                         "transformers": transformers.__version__},
            "runtime_alone_gib": baseline["peak_gib"], "cases": results, "fits": lines}, indent=2) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
