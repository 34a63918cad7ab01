"""Double of how TensorRT-LLM 1.2's LLM API reads an EAGLE `speculative_config` (the key of model.yaml for Triton's
LLM-API model and of trtllm-serve's --extra_llm_api_options): the fields it takes, what it refuses, and what the
PyTorch backend then runs (which draft path, which layers it captures, whether a request at temperature > 0 is
sampled). Each behaviour cites NVIDIA/TensorRT-LLM `tensorrt_llm/llmapi/llm_args.py` as read in the code index's
1.2-line copy (dated by its MTP warning that a flag "will do nothing in release 1.3"; the 1.2.1 tag itself could not
be fetched), and tests/trtllm_double/README.md lists them. Messages are upstream's where upstream raises its own;
pydantic's own errors (an unknown key, an unknown tag) are reduced to their gist.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# DecodingBaseConfig's fields (speculative_model with its alias speculative_model_dir: AliasChoices)
BASE_FIELDS = frozenset({
    "decoding_type", "max_draft_len", "max_total_draft_tokens", "speculative_model", "speculative_model_dir",
    "max_concurrency", "draft_len_schedule", "load_format", "acceptance_window", "acceptance_length_threshold",
    "allow_advanced_sampling"})
# EagleDecodingConfig's own fields (Eagle3DecodingConfig adds none but its tag)
EAGLE_FIELDS = frozenset({
    "eagle_choices", "greedy_sampling", "posterior_threshold", "use_dynamic_tree", "dynamic_tree_max_topK",
    "num_eagle_layers", "max_non_leaves_per_layer", "eagle3_one_model", "eagle3_layers_to_capture",
    "eagle3_model_arch"})
EAGLE_TAGS = ("Eagle", "Eagle3")  # SpeculativeConfig: a union tagged by decoding_type


@dataclass(frozen=True)
class EagleSetup:
    """What the PyTorch backend runs for an accepted config."""

    mode: str  # _torch/speculative/interface.py SpeculativeDecodingMode: EAGLE3 (two models) or EAGLE3_ONE_MODEL
    max_draft_len: int
    max_total_draft_tokens: int  # the chain's length unless a tree is asked for
    draft_dir: Path
    layers_to_capture: tuple[int, ...]  # target layers whose outputs the draft reads
    # False: a request at T > 0 is decoded greedily all the same. True (the two-model path): sampled, its greedy
    # drafts verified by rejection sampling against a one-hot q (not emulated here; see samples below)
    samples_at_temperature: bool


def eagle_setup(config: dict, target_layers: int, backend: str = "pytorch") -> EagleSetup:
    """ValueError where upstream refuses `config`; otherwise what the backend runs. target_layers: the target's
    num_hidden_layers (for the default capture)."""
    tag = config.get("decoding_type")
    if tag not in EAGLE_TAGS:  # the tagged union's error; this double knows only the EAGLE tags
        raise ValueError(f"decoding_type {tag!r}: not an EAGLE tag ({', '.join(EAGLE_TAGS)})")
    extra = sorted(set(config) - BASE_FIELDS - EAGLE_FIELDS)
    if extra:  # StrictBaseModel: extra="forbid"
        raise ValueError(f"{', '.join(extra)}: Extra inputs are not permitted")
    if "speculative_model" in config and "speculative_model_dir" in config:
        raise ValueError("speculative_model and its alias speculative_model_dir both given")
    if backend != "pytorch":
        if tag == "Eagle3":  # BaseLlmArgs.validate_speculative_config, TensorRT backend
            raise ValueError("speculative_config.decoding_type 'Eagle3' is only supported on the PyTorch backend. "
                             "Use decoding_type 'Eagle' for the TensorRT backend.")
        raise ValueError("decoding_type 'Eagle' on the TensorRT backend builds an EAGLE-1 engine "
                         "(SpeculativeDecodingMode.EAGLE): not emulated")
    max_draft_len = config.get("max_draft_len")
    # EagleDecodingConfig.validate_eagle_config
    if not max_draft_len:
        raise ValueError("max_draft_len must be > 0 for Eagle")
    choices, dynamic = config.get("eagle_choices"), config.get("use_dynamic_tree", False)
    total = max_draft_len
    if choices is not None:
        if dynamic:
            raise ValueError("If eagle_choices is provided, use_dynamic_tree should be False")
        total = len({tuple(choice) for choice in choices})
    if dynamic:
        top_k = config.get("dynamic_tree_max_topK")
        if top_k is None or top_k <= 0:
            raise ValueError("dynamic_tree_max_topK should be provided, which indicates the number of nodes to "
                             "expand each time")
        total = config.get("max_total_draft_tokens") or 0
        if total <= 0:
            raise ValueError("max_total_draft_tokens should be provided, which indicates the total nodes of the "
                             "final draft tree. (exclude the root node)")
    # EagleDecodingConfig.validate_speculative_model
    model = config.get("speculative_model", config.get("speculative_model_dir"))
    if model is None:
        raise ValueError("Draft model must be provided for EAGLE")
    draft_dir = Path(model)
    # The draft is loaded from the folder's config.json and weights. Harsher than upstream, which also reads
    # pytorch_model.bin: a repository we package holds safetensors only.
    if not (draft_dir / "config.json").is_file() or not any(draft_dir.glob("*.safetensors")):
        raise ValueError(f"{draft_dir}: the draft model is loaded from its config.json and weights")
    json.loads((draft_dir / "config.json").read_text())
    one_model = config.get("eagle3_one_model", True)  # its default
    layers = config.get("eagle3_layers_to_capture")
    if layers is None:  # the field's documented default
        layers = {1, target_layers // 2 - 1, target_layers - 4}
    # DecodingBaseConfig.allow_advanced_sampling (prototype): "allows non-greedy sampling when speculation is used.
    # Only applicable to 1-model code paths; non-greedy sampling is always enabled on 2-model paths". How the
    # two-model path samples, as read in index copies not dated to 1.2.1: ModelDrafter._create_draft_request asks
    # for the draft's logits when sampler.should_provide_draft_probs(request), _prepare_draft_batch sets
    # py_draft_use_greedy_sampling (the static draft loop) and d2t (_torch/speculative/model_drafter.py); then
    # TorchSampler.process_draft_tokens takes _process_draft_tokens_rejection_sampling with q one-hot on the draft's
    # argmax, scattered to the target's vocabulary through d2t (_torch/pyexecutor/sampler.py): a draft token d is
    # kept with probability p(d), else replaced by a sample of (p - q)+ renormalised, so the output follows p. Not
    # token matching: that is _process_draft_tokens_greedy, for requests without draft logits. The double stops at
    # "sampled"; trtllm-check's EAGLE slice tests the rule on a GPU.
    samples = not one_model or bool(config.get("allow_advanced_sampling", False))
    return EagleSetup(mode="EAGLE3_ONE_MODEL" if one_model else "EAGLE3", max_draft_len=max_draft_len,
                      max_total_draft_tokens=total, draft_dir=draft_dir, layers_to_capture=tuple(sorted(layers)),
                      samples_at_temperature=samples)
