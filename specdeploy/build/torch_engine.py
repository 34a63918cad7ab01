"""Torch backend builder: pipeline checkpoints → engines/<name>/{target,draft}/ + pipeline.json.

Each component directory holds model.safetensors, config.json (the architecture and the dtype: what loading the
weights needs) and the tokenizer files; everything else an engine is run with comes from the pipeline.json beside
them. The build manifest is written last and records a fingerprint of every input; a build with the same
fingerprint is skipped (a change in a section that does not shape the engine, such as sampling or serving, only
rewrites pipeline.json). The build happens in a hidden sibling directory that is moved into place only when
complete, so a failed build never leaves an engine that looks finished.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path
from typing import Literal, NamedTuple

import torch
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from safetensors.torch import save_file

import specdeploy
from specdeploy.build.checkpoints import Checkpoint, check_tokenizers_match, load_checkpoint, pipeline_sources
from specdeploy.build.moe_derive import derive_target
from specdeploy.build.text_corpus import documentation_passages, stdlib_functions
from specdeploy.errors import BuildError, SpecdeployError
from specdeploy.models.quantize import GROUP_SIZE, INT4_KERNEL_ROWS, quantize_int4, quantize_int8
from specdeploy.models.registry import DTYPES, projection_key
from specdeploy.spec.engine_paths import engine_path, save_engine_pipeline, staging_dir, write_json
from specdeploy.spec.manifest import build_unless_current, fingerprint, write_manifest
from specdeploy.spec.pipeline import PipelineSpec
from specdeploy.spec.speculation import EAGLE_HEAD, EXIT_ADAPTER, MEDUSA_HEADS
from specdeploy.speculative.draft_vocabulary import most_frequent_tokens
from specdeploy.speculative.eagle_head import REPORT_FILE as EAGLE_REPORT_FILE
from specdeploy.speculative.eagle_head import Eagle3Head
from specdeploy.speculative.early_exit import EARLY_EXIT_FILE
from specdeploy.speculative.exit_adapter import REPORT_FILE as EXIT_ADAPTER_REPORT_FILE
from specdeploy.speculative.exit_adapter import ExitAdapter, target_name
from specdeploy.speculative.medusa import ACCURACY_FILE, DRAFT_VOCAB_FILE, HEADS_FILE, MedusaHeads, write_heads_config

ENGINE_FORMAT = 7  # bump whenever what a build writes changes, so existing engines are rebuilt
LINEAR_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
EXPERT_SUFFIXES = ("experts.gate_up_proj", "experts.down_proj")  # an MoE's stacked experts (models/moe.py)


class BuildResult(NamedTuple):
    directory: Path
    built: bool  # False: the engine was already up to date


def build_inputs(pipeline: PipelineSpec, final: Path) -> dict:
    """The fingerprint of a build: spec sections, sources and versions."""
    versions = {"specdeploy": specdeploy.__version__, "engine_format": ENGINE_FORMAT, "torch": torch.__version__}
    return fingerprint(pipeline, pipeline_sources(pipeline), versions, final)


def quantization_record(state: dict[str, torch.Tensor], precision: Literal["int4", "int8"]) -> dict:
    """What quantized_state produced, for the component's config.json."""
    if precision == "int8":
        return {"method": "int8", "lm_head": "int8"}
    head = "int4, top logits rescored at int8" if "lm_head.codes" in state else "int8"
    return {"method": "int4", "group_size": GROUP_SIZE, "lm_head": head}


def quantized_state(state: dict[str, torch.Tensor], precision: Literal["int4", "int8"], rescored_head: bool
                    ) -> dict[str, torch.Tensor]:
    """Weight-only quantized copy of a model's weights. int4: projections (and each expert's) as int4 groups; int8:
    as int8 rows. The vocabulary head as int8 rows, and with `rescored_head` (a derived int4 draft) also as int4
    groups read first, with only its top logits rescored at int8 (unless the vocabulary does not suit the int4
    kernel). Norms and the embedding table stay bf16 (an embedding lookup reads one row, so quantizing it saves
    nothing)."""
    quantize = quantize_int4 if precision == "int4" else quantize_int8
    quantized = {}
    for name, tensor in state.items():
        base = name.removesuffix(".weight")
        if name.endswith(EXPERT_SUFFIXES):  # [E, N, K]: each expert's quantized parts, stacked
            experts = [quantize(expert) for expert in tensor]
            quantized.update({f"{name}.{k}": torch.stack([e[k] for e in experts]) for k in experts[0]})
        elif base.endswith(LINEAR_SUFFIXES):
            quantized.update({f"{base}.{k}": v for k, v in quantize(tensor).items()})
        elif name != "lm_head.weight":
            quantized[name] = tensor.to(torch.bfloat16)
    head = state[projection_key(state)]  # tied: the quantized head is a copy beside the bf16 embedding table
    if rescored_head and precision == "int4" and head.shape[0] % INT4_KERNEL_ROWS == 0:
        quantized.update({f"lm_head.{k}": v for k, v in quantize_int4(head).items()})
    quantized.update({f"lm_head.{k}": v for k, v in quantize_int8(head).items()})
    return quantized


def write_component(directory: Path, checkpoint: Checkpoint, state: dict[str, torch.Tensor], dtype: str,
                    pipeline: PipelineSpec, quantization: dict | None = None) -> None:
    directory.mkdir(parents=True)
    config = dataclasses.replace(checkpoint.config, quantization=quantization,
                                 max_position_embeddings=max(checkpoint.config.max_position_embeddings,
                                                             pipeline.limits.max_sequence_length))
    (directory / "config.json").write_text(json.dumps({"model": config.to_dict(), "dtype": dtype}, indent=2))
    save_file({k: v.contiguous() for k, v in state.items()}, str(directory / "model.safetensors"))
    checkpoint.tokenizer.save_pretrained(directory)


def check_quantizable(checkpoint: Checkpoint, key: str, fix: str) -> None:
    """Int4 groups run along each projection's input dimension: hidden and intermediate (per expert) sizes.
    `checkpoint`: what is quantized; `key`: the pipeline key asking for int4; `fix`: what to use instead. (Int8 rows
    take any size.)"""
    for name in ("hidden_size", "intermediate_size"):
        if getattr(checkpoint.config, name) % GROUP_SIZE:
            raise BuildError(f"{key} needs {name} divisible by {GROUP_SIZE}, got {getattr(checkpoint.config, name)} "
                             f"in the {checkpoint.config.architecture} model it quantizes ({fix})")


def write_medusa(directory: Path, pipeline: PipelineSpec, target: Checkpoint) -> None:
    """The heads file (checked against the spec and the target), its config.json and the heads' draft vocabulary
    (every id where draft_vocab is 0), in the engine."""
    spec = pipeline.speculation.medusa
    source = pipeline.resolve(spec.heads)
    try:
        heads = MedusaHeads.load(source)
    except SpecdeployError as exc:
        raise BuildError(str(exc)) from None
    found = {"num_heads": heads.num_heads, "num_layers": heads.num_layers}
    for key, value in found.items():
        if value != getattr(spec, key):
            raise BuildError(f"speculation.medusa.{key} is {getattr(spec, key)} but {source} has {value}")
    if heads.hidden_size != target.config.hidden_size:
        raise BuildError(f"{source}: heads of hidden size {heads.hidden_size}, the target's is "
                         f"{target.config.hidden_size}")
    if heads.projections is not None and heads.projections.shape[1] != target.config.vocab_size:
        raise BuildError(f"{source}: projections over {heads.projections.shape[1]} tokens, the target has "
                         f"{target.config.vocab_size}")
    if spec.draft_vocab and heads.projections is not None:
        raise BuildError(f"speculation.medusa.draft_vocab takes rows of the target's head, and {source} has heads "
                         f"with their own projections: set draft_vocab: 0")
    directory.mkdir(parents=True)
    heads.save(directory / HEADS_FILE)
    write_heads_config(directory, heads)
    ids, counted = corpus_vocabulary(target.tokenizer, spec.draft_vocab, target.config.vocab_size)
    write_json(directory / DRAFT_VOCAB_FILE, {"draft_vocab": ids, "source": counted})
    report = source.with_suffix(".json")  # what train-medusa measured: bench predicts the speedup from it
    if report.is_file():
        shutil.copyfile(report, directory / ACCURACY_FILE)


def write_eagle(directory: Path, pipeline: PipelineSpec, target: Checkpoint) -> None:
    """The EAGLE-3 head (checked against the target: hidden size, vocabulary, captured layers) and train-eagle's
    report, in the engine."""
    source = pipeline.resolve(pipeline.speculation.eagle.head)
    config = target.config
    try:
        head = Eagle3Head.load(source, config.num_layers)
    except SpecdeployError as exc:
        raise BuildError(str(exc)) from None
    found = head.config
    if found.hidden_size != config.hidden_size or found.vocab_size != config.vocab_size:
        raise BuildError(f"{source}: a head for hidden size {found.hidden_size} and {found.vocab_size} tokens; the "
                         f"target has {config.hidden_size} and {config.vocab_size}")
    if max(found.feature_layers) >= config.num_layers or min(found.feature_layers) < 0:
        raise BuildError(f"{source}: reads target layers {list(found.feature_layers)}; the target has "
                         f"{config.num_layers}")
    head.save(directory)
    report = source / EAGLE_REPORT_FILE  # what train-eagle measured
    if report.is_file():
        shutil.copyfile(report, directory / EAGLE_REPORT_FILE)


def write_early_exit(directory: Path, pipeline: PipelineSpec, target: Checkpoint) -> None:
    """An early exit's draft vocabulary (the target tokens most frequent in the shipped text corpus, where fewer
    than all; ties and unseen tokens by id, which for a BPE vocabulary is its merge order) into EARLY_EXIT_FILE,
    after checking its layers against the target's."""
    spec, layers = pipeline.speculation.early_exit, target.config.num_layers
    if spec.exit_layer != "measured" and spec.exit_layer >= layers:
        raise BuildError(f"speculation.early_exit.exit_layer: {spec.exit_layer} must be below the target's "
                         f"{layers} layers")
    if spec.exit_layer == "measured" and not any(layer < layers for layer in spec.sweep):
        raise BuildError(f"speculation.early_exit.sweep: {list(spec.sweep)} has no layer count below the target's "
                         f"{layers} layers")
    ids, source = corpus_vocabulary(target.tokenizer, spec.draft_vocab, target.config.vocab_size)
    write_json(directory / EARLY_EXIT_FILE, {"draft_vocab": ids, "source": source})


def corpus_vocabulary(tokenizer, size: int, vocab_size: int) -> tuple[list[int], str]:
    """A draft vocabulary (the `size` target ids most frequent in the shipped text corpus) and where it was counted,
    in words: what the build writes for an early exit or Medusa heads, and what train-exit-adapter trains through."""
    texts = documentation_passages() + stdlib_functions()
    ids = most_frequent_tokens([tokenizer.encode(text) for text in texts], size, vocab_size)
    return ids, f"{len(texts)} texts of build/text_corpus.py"


def write_exit_adapter(directory: Path, pipeline: PipelineSpec, target: Checkpoint) -> None:
    """The early exit's adapter (checked against the target and the exit layer) and train-exit-adapter's report,
    in the engine."""
    source = pipeline.resolve(pipeline.speculation.early_exit.adapter)
    config = target.config
    try:
        adapter = ExitAdapter.load(source, target_name(pipeline.target.checkpoint), config.num_layers,
                                   config.hidden_size, pipeline.speculation.early_exit.exit_layer)
    except SpecdeployError as exc:
        raise BuildError(str(exc)) from None
    adapter.save(directory)
    report = source / EXIT_ADAPTER_REPORT_FILE  # what train-exit-adapter measured
    if report.is_file():
        shutil.copyfile(report, directory / EXIT_ADAPTER_REPORT_FILE)


# Each trained part a method brings (spec/speculation.py), checked against the target and written into the engine
TRAINED_PART_WRITERS = {MEDUSA_HEADS: write_medusa, EAGLE_HEAD: write_eagle, EXIT_ADAPTER: write_exit_adapter}


def build(pipeline: PipelineSpec, engines_root: Path, force: bool = False, quiet: bool = False) -> BuildResult:
    """Build the pipeline's engines under engines_root/<name>/, unless they are up to date."""
    if pipeline.backend.kind != "torch":
        raise BuildError(f"{pipeline.name}: backend.kind is {pipeline.backend.kind}; in-process generation, bench "
                         f"and the torch model repository need backend.kind: torch (specdeploy build builds a "
                         f"trtllm pipeline)")
    final = engine_path(engines_root, pipeline)
    inputs = build_inputs(pipeline, final)
    built = build_unless_current(final, inputs, pipeline, force, lambda: write_engine(pipeline, final, inputs, quiet))
    return BuildResult(final, built)


def write_target(directory: Path, target: Checkpoint, pipeline: PipelineSpec) -> None:
    """The target component, in its dtype or, with target.weight_only, quantized."""
    precision = pipeline.target.weight_only
    if precision is None:
        dtype = DTYPES[pipeline.target.dtype]
        write_component(directory, target, {k: v.to(dtype) for k, v in target.state.items()}, pipeline.target.dtype,
                        pipeline)
        return
    state = quantized_state(target.state, precision, rescored_head=False)
    write_component(directory, target, state, pipeline.target.dtype, pipeline, quantization_record(state, precision))


def write_engine(pipeline: PipelineSpec, final: Path, inputs: dict, quiet: bool) -> None:
    """Write the engine at `final` through a staging directory (the caller holds build_lock(final))."""
    started = time.perf_counter()
    speculation = pipeline.speculation
    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, disable=quiet, transient=False) as progress, staging_dir(final) as staging:
        task = progress.add_task(f"[{pipeline.name}] loading target checkpoint", total=None)
        target = dense = load_checkpoint(pipeline.target.checkpoint, pipeline, final.parent)
        draft_spec = speculation.draft
        derive = None if draft_spec is None else draft_spec.derive
        precision = None if draft_spec is None else draft_spec.weight_only
        draft_key, draft_fix = f"speculation.draft.derive {derive}", "use derive: none with a draft checkpoint"
        if derive == "int4_dense":
            check_quantizable(dense, draft_key, draft_fix)  # before the MoE's derivation, which takes minutes
        moe = pipeline.target.moe
        if moe is not None:
            progress.update(task, description=f"[{pipeline.name}] deriving a {moe.experts}-expert MoE ({moe.method}, "
                                              f"{moe.experts_per_token} per token) from the dense target")
            target = derive_target(moe, dense, str(pipeline.target.checkpoint.path),
                                   DTYPES[pipeline.target.dtype])
        if derive == "int4":
            check_quantizable(target, draft_key, draft_fix)
        if pipeline.target.weight_only == "int4":  # a derived MoE's experts: its intermediate size per expert
            check_quantizable(target, "target.weight_only int4", "use int8")
        stored = pipeline.target.weight_only or pipeline.target.dtype
        progress.update(task, description=f"[{pipeline.name}] writing target ({stored})")
        save_engine_pipeline(staging, pipeline)
        write_target(staging / "target", target, pipeline)
        if draft_spec is not None:
            if precision is not None:
                # int4_dense: a derived MoE's dense source. Either way the attention is the target's, so the draft
                # (activations in the target's dtype) can share the target's KV cache.
                source = dense if derive == "int4_dense" else target
                progress.update(task, description=f"[{pipeline.name}] quantizing the "
                                                  f"{'dense source' if source is dense else 'target'} into an "
                                                  f"{precision} draft")
                draft_state = quantized_state(source.state, precision, rescored_head=True)
                write_component(staging / "draft", source, draft_state, pipeline.target.dtype, pipeline,
                                quantization_record(draft_state, precision))
            else:
                progress.update(task, description=f"[{pipeline.name}] loading draft checkpoint")
                draft = load_checkpoint(draft_spec.checkpoint, pipeline, final.parent)
                check_tokenizers_match(target.tokenizer, draft.tokenizer)
                draft_dtype = DTYPES[draft_spec.dtype]
                write_component(staging / "draft", draft, {k: v.to(draft_dtype) for k, v in draft.state.items()},
                                draft_spec.dtype, pipeline)
        if speculation.traits.reuses_target_layers:
            progress.update(task, description=f"[{pipeline.name}] writing the early exit's draft vocabulary")
            write_early_exit(staging, pipeline, target)
        for source in speculation.trained_sources:
            progress.update(task, description=f"[{pipeline.name}] writing the {source.part.what}")
            TRAINED_PART_WRITERS[source.part](staging / source.part.folder, pipeline, target)
        write_manifest(staging, inputs, started)
        progress.update(task, description=f"[{pipeline.name}] engine written to {final}")
