"""A TensorRT-LLM build as a plan: every conversion and engine build of a trtllm pipeline, with every argument and
path, computed without TensorRT-LLM. `specdeploy build --dry-run` prints it; a real build runs it where TensorRT-LLM
and a GPU exist. The flags, keys and file layouts follow the pinned release; docs/tensorrt-llm.md records each
with its upstream path.

The converters read a Hugging Face directory. A checkpoint that is one already (source: hf_dir) and needs no
derivation is read where it is: upstream's converter loads it tensor by tensor, a rank's share at a time, so the
build never holds the model. Only what TensorRT-LLM cannot read is exported: a GGUF or packaged source (which
transformers dequantizes whole), an MoE target we derive (written layer by layer), Medusa heads. An EAGLE-3 head
(the llm_api line) is a Hugging Face-style folder the LLM reads where it is. Lookahead decoding builds the target
alone, its engine sized for the pipeline's (W, N, G) (target_max_draft_len).

Layout under the engine directory (engines/<name>/trtllm/):
  hf/<component>/           our exports, where a component needs one (hf_dirs says which directory each reads)
  checkpoints/<component>/  TensorRT-LLM checkpoints, one rank<r>.safetensors per GPU
  engines/<component>/      TensorRT engines (the engine line)
  llm_api.yaml              the LLM-API configuration (the llm_api line)
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path

from specdeploy.build.trtllm.upstream import LOOKAHEAD_BUILD_MODE
from specdeploy.errors import BuildError
from specdeploy.models.config import ModelConfig
from specdeploy.spec.backend import TrtllmSpec
from specdeploy.spec.pipeline import PipelineSpec
from specdeploy.spec.speculation import DraftSpec
from specdeploy.speculative.eagle_head import named_feature_layers

TRTLLM_VERSION = "1.2.1"
TRITON_IMAGE = "nvcr.io/nvidia/tritonserver:26.04-trtllm-python-py3"  # the first NGC image carrying 1.2.1


@dataclass(frozen=True)
class Step:
    """One unit of the build. `command`: the argv an external step runs (TensorRT-LLM's converters and
    trtllm-build); None for work specdeploy does itself, named by `action` (an export, a configuration file)."""

    title: str
    output: Path
    command: tuple[str, ...] | None = None
    action: str | None = None

    def describe(self) -> str:
        how = shlex.join(self.command) if self.command else f"(specdeploy: {self.action})"
        return f"{self.title} -> {self.output}\n    {how}"


def export(title: str, action: str, output: Path) -> Step:
    return Step(title, output, action=action)


# The components TensorRT-LLM reads as Hugging Face directories: (the export's title, its action).
EXPORTS = {"target": ("export the target as a Hugging Face checkpoint", "export target"),
           "draft": ("export the draft", "export draft"),
           "dense_source": ("export the dense model the MoE target is derived from", "export dense source")}


def draft_reads(draft: DraftSpec) -> str:
    """The component a draft is converted from: its own checkpoint, the dense source of a derived MoE (int4_dense),
    or the target (int4, int8: TensorRT-LLM quantizes it to weight-only itself)."""
    return {"none": "draft", "int4_dense": "dense_source"}.get(draft.derive, "target")


# The component an EAGLE-3 head is (the llm_api line's speculative_model): always read where it is, never exported.
EAGLE_HEAD = "eagle"


def hf_components(pipeline: PipelineSpec) -> list[str]:
    """The components a pipeline's converters (or its LLM) read as Hugging Face directories: EXPORTS keys, and
    EAGLE_HEAD for an EAGLE-3 head."""
    speculation = pipeline.speculation
    if speculation.traits.trtllm.decoding_type == "Eagle":
        return ["target", EAGLE_HEAD]
    if speculation.draft is None:
        return ["target"]
    return list(dict.fromkeys(["target", draft_reads(speculation.draft)]))


def readable_checkpoint(pipeline: PipelineSpec, component: str) -> Path | None:
    """The checkpoint directory TensorRT-LLM reads as it is for `component`, or None when it needs our export: a
    GGUF or packaged source, or the MoE target we derive (its dense source is read as it is). An EAGLE-3 head is
    always read where it is (its folder already holds config.json and model.safetensors)."""
    if component == EAGLE_HEAD:
        return pipeline.resolve(pipeline.speculation.eagle.head)
    target = pipeline.target
    spec = {"target": None if target.moe is not None else target.checkpoint, "dense_source": target.checkpoint,
            "draft": pipeline.speculation.draft.checkpoint if pipeline.speculation.draft else None}[component]
    if spec is None or spec.source != "hf_dir":
        return None
    directory = pipeline.resolve(spec.path)
    if component == "target" and pipeline.speculation.traits.trtllm.converts_heads and ties_embeddings(directory):
        return None  # exported untied: see ties_embeddings
    return directory


def ties_embeddings(directory: Path) -> bool:
    """Whether a Hugging Face checkpoint ties its output head to its embeddings (SmolLM2, Llama-3.2-1B/3B).
    TensorRT-LLM's Medusa converter cannot read such a target: it looks `lm_head.weight` up among the model's
    named_parameters(), which list a tied head only under the embeddings, so it fails with KeyError
    'lm_head.weight' (tensorrt_llm/models/medusa/weight.py `convert_hf_llama`, the 1.2-era copy; the same pattern as
    NVIDIA/TensorRT-LLM#1733). A Medusa build therefore exports a tied target untied. transformers' Llama
    configuration defaults the key to false; a checkpoint not on this machine reads as untied (the build, where it
    is, plans again)."""
    config = Path(directory) / "config.json"
    return config.is_file() and bool(json.loads(config.read_text()).get("tie_word_embeddings", False))


def hf_dirs(pipeline: PipelineSpec, root: Path) -> dict[str, Path]:
    """Component → the Hugging Face directory TensorRT-LLM reads it from: the checkpoint itself where it can, else
    our export under root/hf/<component>."""
    return {component: readable_checkpoint(pipeline, component) or root / "hf" / component
            for component in hf_components(pipeline)}


def streams_target(pipeline: PipelineSpec) -> bool:
    """Whether the target's export is an MoE derived from a Hugging Face checkpoint, read and written a layer at a
    time (moe_derive.export_derived_target); every other export loads its source whole."""
    return pipeline.target.moe is not None and readable_checkpoint(pipeline, "dense_source") is not None


def export_steps(pipeline: PipelineSpec, root: Path) -> list[Step]:
    """The exports of the components TensorRT-LLM cannot read as they are."""
    return [export(*EXPORTS[component], root / "hf" / component) for component in hf_components(pipeline)
            if readable_checkpoint(pipeline, component) is None]


def build_workers(spec: TrtllmSpec) -> int:
    """trtllm-build's --workers: one, its default. Each worker holds about three copies of its rank's weights
    (deploy/build_memory.py), so tp × pp workers at once would hold about three copies of the model: 460 GiB of host
    memory for Llama-3.1-70B. One rank at a time keeps the build Job within a node's memory, at tp × pp times the
    engine-build time."""
    return 1


def moe_mapping(spec: TrtllmSpec) -> tuple[int, int]:
    """(moe_tp_size, moe_ep_size) as TensorRT-LLM completes them: both unset → (tp, 1); one set → tp / it."""
    if spec.moe_tp_size is None and spec.moe_ep_size is None:
        return spec.tp_size, 1
    if spec.moe_ep_size is None:
        return spec.moe_tp_size, spec.tp_size // spec.moe_tp_size
    if spec.moe_tp_size is None:
        return spec.tp_size // spec.moe_ep_size, spec.moe_ep_size
    return spec.moe_tp_size, spec.moe_ep_size


def check_model_fits(pipeline: PipelineSpec, config: ModelConfig) -> None:
    """BuildError naming the key when the parallelism does not divide the model (needs the target's config)."""
    spec = pipeline.backend.settings
    for name, count in (("attention heads", config.num_heads), ("key/value heads", config.num_kv_heads)):
        if count % spec.tp_size:
            raise BuildError(f"backend.trtllm.tp_size: {spec.tp_size} does not divide the target's {count} {name}")
    experts = config.num_experts if config.architecture == "mixtral" else None
    if pipeline.target.moe is not None:
        experts = pipeline.target.moe.experts
    if experts is not None:
        ep = moe_mapping(spec)[1]
        if experts % ep:
            raise BuildError(f"backend.trtllm.moe_ep_size: {ep} does not divide the target's {experts} experts")
        if pipeline.speculation.traits.trtllm.moe_refusal:
            raise BuildError(f"speculation.method: {pipeline.speculation.traits.trtllm.moe_refusal}")


def convert_command(spec: TrtllmSpec, model_dir: Path, output: Path, weight_only: str | None) -> tuple[str, ...]:
    """Our converter (build/trtllm/convert.py): LLaMAForCausalLM.from_hugging_face + save_checkpoint per rank,
    the same call TensorRT-LLM's llama convert_checkpoint.py makes (Mixtral goes through the same class)."""
    moe_tp, moe_ep = moe_mapping(spec)
    command = ["python3", "-m", "specdeploy.build.trtllm.convert", "--model_dir", str(model_dir),
               "--output_dir", str(output), "--dtype", spec.dtype, "--tp_size", str(spec.tp_size),
               "--pp_size", str(spec.pp_size), "--moe_tp_size", str(moe_tp), "--moe_ep_size", str(moe_ep)]
    return (*command, *weight_only_flags(weight_only))


def weight_only_flags(weight_only: str | None) -> tuple[str, ...]:
    """Both converters' weight-only switch: int4 → QuantAlgo.W4A16, int8 → W8A16 (per channel, no calibration)."""
    return () if weight_only is None else ("--use_weight_only", "--weight_only_precision", weight_only)


def engine_command(pipeline: PipelineSpec, checkpoint: Path, output: Path, mode: str | None) -> tuple[str, ...]:
    """trtllm-build for one component; mode: the target's speculative_decoding_mode (None for a draft), with
    --max_draft_len from target_max_draft_len.

    --max_input_len is the whole sequence, not the prompt limit: the orchestration sends every call the sequence so
    far (the executor finds its prefix in the reuse cache), which grows to max_sequence_length; the models enable
    chunked context, so a context longer than --max_num_tokens is processed in pieces."""
    spec, limits = pipeline.backend.settings, pipeline.limits
    command = ["trtllm-build", "--checkpoint_dir", str(checkpoint), "--output_dir", str(output),
               "--gemm_plugin", "auto", "--max_batch_size", str(limits.max_batch_size),
               "--max_input_len", str(limits.max_sequence_length), "--max_seq_len", str(limits.max_sequence_length),
               "--max_num_tokens", str(spec.max_num_tokens), "--use_paged_context_fmha", "enable",
               "--workers", str(build_workers(spec))]
    if mode is not None:
        command += ["--speculative_decoding_mode", mode, "--max_draft_len", str(target_max_draft_len(pipeline))]
    if pipeline.speculation.draft is not None and exact_sampling_needs_logits(pipeline):
        command.append("--gather_generation_logits")
    return tuple(command)


def target_max_draft_len(pipeline: PipelineSpec) -> int:
    """The target engine's --max_draft_len. Drafts from outside (draft_tokens_external) and Medusa's tree:
    limits.max_draft_tokens, the most one step may carry. Lookahead: exactly its (W, N, G)'s draft-token count
    (LookaheadSpec.nodes, upstream's formula), as the engine is served with those three: the executor refuses to
    load with fewer ("Assertion failed: maxDraftTokens <= mModelConfig.getMaxDecodingDraftTokens()") and its
    lookahead layer checks tokens per step against the engine's max_draft_len + 1 ("%d != %d";
    trtGptModelInflightBatching.cpp @ b35ac1b6, lookaheadDecodingLayer.cpp @ 3585984b; examples/lookahead/
    README.md asks for them equal)."""
    if target_mode(pipeline) == LOOKAHEAD_BUILD_MODE:
        return pipeline.speculation.verify_nodes()[0]
    return pipeline.limits.max_draft_tokens


def target_mode(pipeline: PipelineSpec) -> str | None:
    """The target engine's --speculative_decoding_mode: medusa (its heads, converted with it), lookahead_decoding
    (the engine guesses ahead and verifies by itself: no draft, nothing converted but the target),
    draft_tokens_external (drafts from our orchestration: a draft engine or the text), or None (plain)."""
    return pipeline.speculation.traits.trtllm.engine_mode


def exact_sampling_needs_logits(pipeline: PipelineSpec) -> bool:
    """Exact acceptance at temperature > 0 compares the draft's and the target's distributions, so both engines
    must return generation logits. Requests may sample whatever the pipeline's default, so an exact draft-target
    pipeline always gathers them."""
    return pipeline.speculation.acceptance == "exact"


def engine_line_plan(pipeline: PipelineSpec, root: Path) -> list[Step]:
    spec, speculation = pipeline.backend.settings, pipeline.speculation
    hf, checkpoints, engines = root / "hf", root / "checkpoints", root / "engines"
    sources = hf_dirs(pipeline, root)
    steps = export_steps(pipeline, root)
    if speculation.traits.trtllm.converts_heads:
        heads = speculation.medusa
        steps.append(export("write the Medusa heads as medusa_lm_head.safetensors + config.json",
                            "export medusa heads", hf / "medusa"))
        steps.append(Step("convert target + Medusa heads", checkpoints / "target", (
            "python3", spec.medusa_converter, "--model_dir", str(sources["target"]),
            "--medusa_model_dir", str(hf / "medusa"), "--output_dir", str(checkpoints / "target"),
            "--dtype", spec.dtype,
            "--num_medusa_heads", str(heads.num_heads), "--num_medusa_layers", str(heads.num_layers),
            "--max_medusa_token_len", str(pipeline.limits.max_draft_tokens), "--tp_size", str(spec.tp_size),
            "--pp_size", str(spec.pp_size), *weight_only_flags(pipeline.target.weight_only))))
    else:
        steps.append(Step("convert the target", checkpoints / "target",
                          convert_command(spec, sources["target"], checkpoints / "target",
                                          pipeline.target.weight_only)))
    if speculation.draft is not None:
        draft = speculation.draft
        steps.append(Step("convert the draft", checkpoints / "draft",
                          convert_command(spec, sources[draft_reads(draft)], checkpoints / "draft",
                                          draft.weight_only)))
        steps.append(Step("build the draft engine", engines / "draft",
                          engine_command(pipeline, checkpoints / "draft", engines / "draft", None)))
    steps.append(Step("build the target engine", engines / "target",
                      engine_command(pipeline, checkpoints / "target", engines / "target", target_mode(pipeline))))
    return steps


def build_plan(pipeline: PipelineSpec, engine_dir: Path) -> list[Step]:
    """Every step of the pipeline's TensorRT-LLM build, in order, writing under engine_dir/trtllm."""
    root = Path(engine_dir) / "trtllm"
    if pipeline.backend.settings.line == "engine":
        return engine_line_plan(pipeline, root)
    return llm_api_plan(pipeline, root)


def llm_api_config(pipeline: PipelineSpec, root: Path, models: dict[str, Path] | None = None) -> dict:
    """The LLM-API options (PyTorch backend) that Triton's llmapi model reads from model.yaml and trtllm-serve from
    --extra_llm_api_options: the model, parallelism, limits, KV cache and speculation. models: where the LLM finds
    each component (default: hf_dirs(pipeline, root), where the build leaves them)."""
    spec, limits, speculation = pipeline.backend.settings, pipeline.limits, pipeline.speculation
    models = models if models is not None else hf_dirs(pipeline, root)
    moe_tp, moe_ep = moe_mapping(spec)
    config = {"model": str(models["target"]), "backend": "pytorch", "tensor_parallel_size": spec.tp_size,
              "pipeline_parallel_size": spec.pp_size, "moe_tensor_parallel_size": moe_tp,
              "moe_expert_parallel_size": moe_ep, "max_batch_size": limits.max_batch_size,
              "max_num_tokens": spec.max_num_tokens, "max_seq_len": limits.max_sequence_length,
              "kv_cache_config": {"free_gpu_memory_fraction": spec.kv_cache_free_gpu_mem_fraction,
                                  "enable_block_reuse": spec.enable_kv_cache_reuse}}
    decoding_type = speculation.traits.trtllm.decoding_type
    if decoding_type is not None:
        config["speculative_config"] = SPECULATIVE_CONFIGS[decoding_type](pipeline, models)
    return config


def draft_target_config(pipeline: PipelineSpec, models: dict[str, Path]) -> dict:
    return {"decoding_type": "DraftTarget", "max_draft_len": pipeline.speculation.num_draft_tokens,
            "speculative_model_dir": str(models["draft"])}


def ngram_config(pipeline: PipelineSpec, models: dict[str, Path]) -> dict:
    return {"decoding_type": "NGram", "max_draft_len": pipeline.speculation.num_draft_tokens,
            "max_matching_ngram_size": pipeline.speculation.ngram.max_n}


def eagle_speculative_config(pipeline: PipelineSpec, head: Path) -> dict:
    """An EAGLE-3 head through the LLM API's PyTorch backend (llm_args.EagleDecodingConfig, docs/tensorrt-llm.md
    "EAGLE-3"): decoding_type Eagle, which that backend runs as EAGLE-3 in every 1.x release (1.1's from_dict table
    and 1.2's tagged union both take it); the linear chain of max_draft_len tokens its 1.2 line offers (validation
    asks for eagle.top_k 1, and a chain cut at eagle.max_nodes as the torch engine cuts it); and the two-model path
    (eagle3_one_model false), which samples at the request's temperature, top-k and top-p: at T > 0 its sampler
    verifies the greedy drafts by rejection sampling against a one-hot draft distribution (q = the draft's argmax,
    mapped to the target's vocabulary through d2t), so a draft token d is kept with probability p(d) and otherwise
    replaced by a sample of (p - q)+, renormalised: exact. That rests on reading upstream copies not dated to 1.2.1
    (docs/tensorrt-llm.md "Sampling"); trtllm-check's EAGLE slice settles it. The one-model default decodes
    greedily at any temperature unless a prototype switch is on. head: where the LLM finds the head folder; the
    layers it reads are taken from the pipeline's own copy."""
    speculation = pipeline.speculation
    config = {"decoding_type": "Eagle", "max_draft_len": min(speculation.num_draft_tokens,
                                                             speculation.eagle.max_nodes),
              "speculative_model_dir": str(head), "eagle3_one_model": False}
    layers = captured_layers(pipeline.resolve(speculation.eagle.head))
    if layers is not None:
        config["eagle3_layers_to_capture"] = layers
    return config


def captured_layers(head: Path) -> list[int] | None:
    """The target layers whose outputs an EAGLE-3 head reads, as TensorRT-LLM numbers them, or None when its
    config.json names none (then both ecosystems' defaults agree). The layers a config names are read as
    speculative/eagle_head.named_feature_layers reads them, as the hidden state entering layer i; TensorRT-LLM's
    eagle3_layers_to_capture names the layer whose output it captures (maybe_capture_hidden_states after the
    layer's MLP), so i becomes i - 1: its default {1, L//2 - 1, L - 4} is vLLM's (2, L//2, L - 3)."""
    config_file = head / "config.json"
    try:
        data = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise BuildError(f"speculation.eagle.head: cannot read {config_file} ({exc}); the LLM API reads the head "
                         f"folder's config.json and model.safetensors") from None
    layers = named_feature_layers(data)
    if layers is None:
        return None
    if len(layers) != 3:
        raise BuildError(f"speculation.eagle.head: {config_file} names {len(layers)} captured layers; an EAGLE-3 "
                         f"head reads three")
    if min(layers) < 1:
        raise BuildError(f"speculation.eagle.head: {config_file} captures the embedding (layer id 0), which "
                         f"TensorRT-LLM's eagle3_layers_to_capture cannot name (it counts layer outputs)")
    if len(set(layers)) != len(layers):
        raise BuildError(f"speculation.eagle.head: {config_file} names a layer twice ({layers}); TensorRT-LLM takes "
                         f"the captured layers as a set, so its fc would get fewer inputs than it has")
    return sorted(layer - 1 for layer in layers)


def llm_api_plan(pipeline: PipelineSpec, root: Path) -> list[Step]:
    steps = export_steps(pipeline, root)
    steps.append(export("write the LLM-API configuration (model, parallelism, speculative_config)",
                        "write llm_api.yaml", root / "llm_api.yaml"))
    return steps


# The LLM API's speculative_config by the method recipe's decoding_type (spec/speculation.py)
SPECULATIVE_CONFIGS = {"DraftTarget": draft_target_config, "NGram": ngram_config,
                       "Eagle": lambda pipeline, models: eagle_speculative_config(pipeline, models[EAGLE_HEAD])}
