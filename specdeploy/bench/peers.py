"""`bench --peers`: what a user would otherwise pick, measured in the same run on the same weights and prompts.

transformers' `generate` on the target's weights (same dtype, same threads, same device): plain, with prompt lookup
(`prompt_lookup_num_tokens` = the pipeline's gamma) and, when the pipeline's draft is a plain checkpoint, with it as
`assistant_model` (a derived int4 or int8 draft is our own module, which transformers cannot run). llama.cpp through
llama-cpp-python on the GGUF file the target was built from (its own quantization, on the CPU, same threads): plain
and with llama-cpp-python's prompt-lookup draft (`LlamaPromptLookupDecoding`, gamma tokens per proposal). Each speed
is the decode rate over the bench's prompts, (tokens - 1) / (time - time of the first token), as the bench measures
ours, greedy, with generation ending at the end-of-sequence token like ours.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import NamedTuple

import torch

from specdeploy.bench.results import BenchReport, Peer
from specdeploy.decoding.prompt_lookup import common_prefix_length
from specdeploy.models.device_transfer import finish
from specdeploy.models.registry import component_config
from specdeploy.runtime.engine import Engine

PLAIN = "transformers generate"
LLAMA_CPP = "llama.cpp"
LLAMA_CPP_INSTALL = ("pip install 'specdeploy[peers]', which builds llama.cpp from source: a C++ compiler and cmake, "
                     "about 11 minutes on 2 cores")


def hf_model(component: Path, dtype: torch.dtype, device: torch.device | str = "cpu"):
    """An engine component's weights in transformers' model class for its architecture, on `device`."""
    from safetensors.torch import load_file

    from specdeploy.build.hf_export import hf_model_class

    config, _ = component_config(component)
    model = hf_model_class(config)(config.to_hf())
    model.load_state_dict(load_file(str(component / "model.safetensors")), strict=False)
    model = model.to(device, dtype).eval()
    model.tie_weights()
    return model


def generated(model, ids: torch.Tensor, limit: int, end_ids: tuple[int, ...], **options) -> tuple[int, float]:
    """(new tokens, seconds) of one greedy `generate` of at most `limit` tokens, ending at an end token."""
    started = time.perf_counter()
    with torch.inference_mode():
        output = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=limit, do_sample=False,
                                pad_token_id=end_ids[0] if end_ids else 0, eos_token_id=list(end_ids) or None,
                                **options)
    finish(ids.device)
    return output.shape[1] - ids.shape[1], time.perf_counter() - started


def generate_rate(model, encoded: list[list[int]], max_tokens: int, end_ids: tuple[int, ...], **options) -> float:
    """Tokens/s of greedy `generate` over the prompts, decode phase only (the first token's time subtracted)."""
    tokens, seconds = 0, 0.0
    for prompt_ids in encoded:
        ids = torch.tensor([prompt_ids], device=model.device)
        _, first = generated(model, ids, 1, end_ids, **options)
        count, total = generated(model, ids, max_tokens, end_ids, **options)
        if count > 1:
            tokens += count - 1
            seconds += max(total - first, 1e-9)
    return tokens / seconds if seconds else 0.0


def transformers_peers(engine: Engine, encoded: list[list[int]], max_tokens: int) -> dict[str, Peer]:
    """name → its speed and what it ran, or why it was skipped."""
    dtype, gamma = engine.target.dtype, engine.num_draft_tokens
    target = hf_model(engine.dir / "target", dtype, engine.device)
    end_ids = tuple(engine.target.config.eos_token_ids)
    generate_rate(target, encoded[:1], 4, end_ids)  # warm-up
    peers = {PLAIN: Peer(tokens_per_s=generate_rate(target, encoded, max_tokens, end_ids),
                         what=f"greedy generate on the target's weights ({str(dtype).removeprefix('torch.')}, "
                              f"{torch.get_num_threads()} threads)")}
    lookup = max(gamma, 1)
    peers[f"transformers prompt lookup ({lookup})"] = Peer(
        tokens_per_s=generate_rate(target, encoded, max_tokens, end_ids, prompt_lookup_num_tokens=lookup),
        what=f"generate with prompt_lookup_num_tokens={lookup} (n-gram drafts from the prompt)")
    draft = engine.dir / "draft"
    if not draft.is_dir():
        peers["transformers assistant_model"] = Peer(skipped="the pipeline has no draft model")
    elif (quantization := component_config(draft)[0].quantization) is not None:
        peers["transformers assistant_model"] = Peer(skipped=f"the draft is derived {quantization['method']}, our "
                                                                 f"own module, which transformers cannot run")
    else:
        assistant = hf_model(draft, dtype, engine.device)
        peers["transformers assistant_model"] = Peer(
            tokens_per_s=generate_rate(target, encoded, max_tokens, end_ids, assistant_model=assistant),
            what="generate with the pipeline's draft as assistant_model (transformers' own schedule)")
    return peers


class PeerRatio(NamedTuple):
    """Our tokens/s over a peer's (above 1: ours is faster)."""
    ours_plain: float
    ours_speculative: float


def peer_ratios(report: BenchReport) -> dict[str, PeerRatio]:
    """Our plain and speculative tokens/s over each measured peer's."""
    return {name: PeerRatio(report.summary.baseline_tokens_per_s / peer.tokens_per_s,
                            report.summary.speculative_tokens_per_s / peer.tokens_per_s)
            for name, peer in (report.peers or {}).items() if peer.tokens_per_s}


def llama_cpp_ratio(report: BenchReport, kind: str | None = None) -> PeerRatio | None:
    """Our plain and speculative tokens/s over llama.cpp's plain decode, on every prompt or on one prompt kind's;
    None where llama.cpp was not measured (or not on that kind)."""
    peer = (report.peers or {}).get(LLAMA_CPP)
    if peer is None or not peer.tokens_per_s:
        return None
    if kind is None:
        return PeerRatio(report.summary.baseline_tokens_per_s / peer.tokens_per_s,
                         report.summary.speculative_tokens_per_s / peer.tokens_per_s)
    theirs, ours = (peer.by_kind or {}).get(kind), report.summary.by_kind.get(kind)
    if not theirs or ours is None:
        return None
    return PeerRatio(ours.plain_tokens_per_s / theirs, ours.speculative_tokens_per_s / theirs)


def target_gguf(engine: Engine) -> tuple[Path | None, str]:
    """(the GGUF file the engine's target was built from, "") or (None, why there is none)."""
    from specdeploy.build.checkpoints import locate
    from specdeploy.errors import BuildError

    pipeline = engine.pipeline
    if pipeline.target.moe is not None:
        return None, "the target is an MoE derived at build, which has no GGUF file"
    try:
        path = locate(pipeline.target.checkpoint, pipeline)
    except BuildError as error:
        return None, f"the target's checkpoint is not readable here ({error})"
    if path.suffix != ".gguf":
        return None, f"the target's checkpoint is not a GGUF file ({path.name})"
    return path, ""


def streamed_rate(llm, encoded: list[list[int]], max_tokens: int, end_ids: tuple[int, ...],
                  kinds: list[str] | None = None) -> tuple[float, list, dict[str, float]]:
    """(decode tokens/s, each prompt's tokens, decode tokens/s by prompt kind) of llama.cpp's greedy generation over
    the prompts: (tokens - 1) over the time from the first token to the last, each prompt from an empty cache."""
    outputs = []
    by_kind: dict[str, list[float]] = {}  # kind → [tokens, seconds]
    for prompt_ids, kind in zip(encoded, kinds or ["other"] * len(encoded)):
        llm.reset()
        output, first = [], 0.0
        for token in llm.generate(prompt_ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
            output.append(token)
            if len(output) == 1:
                first = time.perf_counter()
            if token in end_ids or len(output) >= max_tokens:
                break
        if len(output) > 1:
            counted = by_kind.setdefault(kind, [0, 0.0])
            counted[0] += len(output) - 1
            counted[1] += time.perf_counter() - first
        outputs.append(output)
    tokens, seconds = sum(c for c, _ in by_kind.values()), sum(s for _, s in by_kind.values())
    rates = {kind: count / spent for kind, (count, spent) in sorted(by_kind.items()) if spent}
    return (tokens / seconds if seconds else 0.0), outputs, rates


def llama_cpp_peers(engine: Engine, encoded: list[list[int]], max_tokens: int,
                    ours: list[list[int]], kinds: list[str] | None = None) -> dict[str, Peer]:
    """name → its speed, what it ran and common_prefix_tokens (or why it was skipped) for llama.cpp plain and with
    its prompt lookup. ours: our plain greedy tokens per prompt; common_prefix_tokens is the mean number of leading
    tokens llama.cpp's greedy output shares with ours; kinds: each prompt's kind, for the rates by kind. Its Q4_1
    kernels round activations to 8 bits, so the two part at some near tie, but the same prompt on the same weights
    starts alike (a wrong template would part at once)."""
    lookup = max(engine.num_draft_tokens, 1)
    names = (LLAMA_CPP, f"llama.cpp prompt lookup ({lookup})")
    try:
        import llama_cpp
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError:
        return dict.fromkeys(names, Peer(skipped=f"llama-cpp-python is not installed ({LLAMA_CPP_INSTALL})"))
    gguf, why = target_gguf(engine)
    if gguf is None:
        return dict.fromkeys(names, Peer(skipped=why))
    threads = torch.get_num_threads()
    end_ids = tuple(engine.target.config.eos_token_ids)
    where = f"llama.cpp {llama_cpp.__version__} (llama-cpp-python) on {gguf.name}, CPU, {threads} threads"
    peers = {}
    for name, draft in zip(names, (None, LlamaPromptLookupDecoding(num_pred_tokens=lookup))):
        llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=engine.max_length + lookup + 1, n_threads=threads,
                              n_threads_batch=threads, verbose=False, draft_model=draft)
        streamed_rate(llm, encoded[:1], 4, end_ids)  # warm-up
        rate, outputs, by_kind = streamed_rate(llm, encoded, max_tokens, end_ids, kinds)
        peers[name] = Peer(tokens_per_s=rate, by_kind=by_kind,
                           common_prefix_tokens=sum(map(common_prefix_length, outputs, ours)) / max(len(outputs), 1),
                           what=where + ("" if draft is None else f", prompt lookup of {lookup} tokens "
                                                                  f"(max_ngram_size 2)"))
        llm.close()
    return peers
