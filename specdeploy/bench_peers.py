"""`bench --peers`: what a user would otherwise pick, measured in the same run on the same weights and prompts.

transformers' `generate` on the target's weights (same dtype, same threads): plain, with prompt lookup
(`prompt_lookup_num_tokens` = the pipeline's gamma) and, when the pipeline's draft is a plain checkpoint, with it as
`assistant_model` (an int4-derived draft is our own module, which transformers cannot run). Each speed is the decode
rate over the bench's prompts, (tokens - 1) / (time - time of the first token), as the bench measures ours, with
generation ending at the end-of-sequence token like ours.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from specdeploy.models.registry import component_config
from specdeploy.runtime.engine import Engine

PLAIN = "transformers generate"


def hf_model(component: Path, dtype: torch.dtype):
    """An engine component's weights in transformers' model class for its architecture."""
    from safetensors.torch import load_file

    from specdeploy.builders.hf_export import hf_model_class

    config, _ = component_config(component)
    model = hf_model_class(config)(config.to_hf())
    model.load_state_dict(load_file(str(component / "model.safetensors")), strict=False)
    model = model.to(dtype).eval()
    model.tie_weights()
    return model


def generated(model, ids: torch.Tensor, limit: int, end_ids: tuple[int, ...], **options) -> tuple[int, float]:
    """(new tokens, seconds) of one greedy `generate` of at most `limit` tokens, ending at an end token."""
    started = time.perf_counter()
    with torch.inference_mode():
        output = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=limit, do_sample=False,
                                pad_token_id=end_ids[0] if end_ids else 0, eos_token_id=list(end_ids) or None,
                                **options)
    return output.shape[1] - ids.shape[1], time.perf_counter() - started


def decode_rate(model, encoded: list[list[int]], max_tokens: int, end_ids: tuple[int, ...], **options) -> float:
    """Tokens/s of greedy `generate` over the prompts, decode phase only (the first token's time subtracted)."""
    tokens, seconds = 0, 0.0
    for prompt_ids in encoded:
        ids = torch.tensor([prompt_ids])
        _, first = generated(model, ids, 1, end_ids, **options)
        count, total = generated(model, ids, max_tokens, end_ids, **options)
        if count > 1:
            tokens += count - 1
            seconds += max(total - first, 1e-9)
    return tokens / seconds if seconds else 0.0


def transformers_peers(engine: Engine, encoded: list[list[int]], max_tokens: int) -> dict[str, dict]:
    """name → {"tokens_per_s", "what"} (or {"skipped": why})."""
    dtype, gamma = engine.target.dtype, engine.num_draft_tokens
    target = hf_model(engine.dir / "target", dtype)
    end_ids = tuple(engine.target.config.eos_token_ids)
    decode_rate(target, encoded[:1], 4, end_ids)  # warm-up
    peers = {PLAIN: {"tokens_per_s": decode_rate(target, encoded, max_tokens, end_ids),
                     "what": f"greedy generate on the target's weights ({str(dtype).removeprefix('torch.')}, "
                             f"{torch.get_num_threads()} threads)"}}
    lookup = max(gamma, 1)
    peers[f"transformers prompt lookup ({lookup})"] = {
        "tokens_per_s": decode_rate(target, encoded, max_tokens, end_ids, prompt_lookup_num_tokens=lookup),
        "what": f"generate with prompt_lookup_num_tokens={lookup} (n-gram drafts from the prompt)"}
    draft = engine.dir / "draft"
    if not draft.is_dir():
        peers["transformers assistant_model"] = {"skipped": "the pipeline has no draft model"}
    elif component_config(draft)[0].quantization is not None:
        peers["transformers assistant_model"] = {"skipped": "the draft is derived int4, our own module, which "
                                                            "transformers cannot run"}
    else:
        assistant = hf_model(draft, dtype)
        peers["transformers assistant_model"] = {
            "tokens_per_s": decode_rate(target, encoded, max_tokens, end_ids, assistant_model=assistant),
            "what": "generate with the pipeline's draft as assistant_model (transformers' own schedule)"}
    return peers


def peer_ratios(report: dict) -> dict[str, dict]:
    """Our plain and speculative tokens/s over each measured peer's (above 1: ours is faster)."""
    ratios = {}
    for name, peer in report.get("peers", {}).items():
        if "tokens_per_s" in peer and peer["tokens_per_s"]:
            ratios[name] = {"ours_plain": report["baseline_tokens_per_s"] / peer["tokens_per_s"],
                            "ours_speculative": report["speculative_tokens_per_s"] / peer["tokens_per_s"]}
    return ratios
