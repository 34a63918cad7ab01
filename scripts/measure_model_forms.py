"""Measure the model's plain forms against the eager micro-optimisations it once carried, in one run (issue 26).

The plain forms are what specdeploy/models/llama.py runs: real-arithmetic rotary (rotate-half, the Hugging Face
weights' layout), RMS norm as x * rsqrt(mean(x²) + eps) * w in fp32, modules called through nn.Module.__call__,
F.linear. The alternatives (all but `packed` kept here only to be measured):
  packed     bf16 weights prepacked for oneDNN (DenseLinear.prepack: what the eager engine runs, plain+packed)
  layernorm  RMS norm computed as F.layer_norm of [x, -x] (one fused kernel)
  rmsnorm    torch's F.rms_norm
  complex    rotary as one complex multiply (torch.polar table, q/k rows permuted to interleaved pairs)
  bound      each layer's submodules' forward methods bound once and called directly, skipping __call__
Variants are "plain", "plain+<form>" for each form, and "before" (every old form together: the engine before
issue 26 removed them). Each round times every variant once, in a rotated order, so the machine's drift falls on
all of them alike; the figures are medians (and minimums) over rounds, per step: a one-token decode step and an
8-position verify, at a cache of --context tokens. `--compile` also tries torch.compile (inductor, freezing) of
the plain model's step. On a loaded machine read the minimums; set OMP_WAIT_POLICY=PASSIVE there.

Usage (from the repository root; loads SmolLM2-135M-Instruct from the embedded GGUF, about a minute):
    .venv/bin/python scripts/measure_model_forms.py [--dtypes bfloat16 float32] [--rounds 7] [--steps 10]
        [--threads 2] [--context 128] [--variants plain+packed before] [--compile]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specdeploy.build.checkpoints import load_checkpoint
from specdeploy.models import llama
from specdeploy.models.kv_cache import write_entries
from specdeploy.spec.pipeline import load_pipeline

REPO = Path(__file__).resolve().parents[1]
FORMS = ("packed", "layernorm", "rmsnorm", "complex", "bound")


def packed_linear(weight: torch.Tensor) -> llama.DenseLinear:
    """A DenseLinear holding its own copy of `weight`, prepacked for oneDNN."""
    linear = llama.DenseLinear(weight.clone())
    linear.prepack()
    return linear


class LayerNormRMS(nn.Module):
    """The old RMSNorm: layer norm of [x, -x] (zero mean, variance mean(x²)), first half kept."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.doubled_weight = torch.cat([weight, weight])
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        width = x.shape[-1]
        doubled = torch.cat([x, -x], dim=-1)
        return F.layer_norm(doubled, (2 * width,), self.doubled_weight, None, self.eps)[..., :width]


class TorchRMS(nn.Module):
    """torch's own F.rms_norm, in the input's dtype."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = weight, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def interleaved_rows(num_heads: int, head_dim: int) -> torch.Tensor:
    """Row order taking q/k rows from rotate-half pairs (i, i + D/2) to interleaved pairs (2i, 2i + 1)."""
    half = torch.arange(head_dim // 2)
    per_head = torch.stack([half, half + head_dim // 2], dim=-1).flatten()
    return (torch.arange(num_heads)[:, None] * head_dim + per_head).flatten()


def complex_rotate(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """The old rotary: x [B, T, heads, D] interleaved, rotation [B, T, 1, D/2] complex."""
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * rotation).flatten(-2).to(x.dtype)


class Variant:
    """Which forms a step uses, and the modules each layer swaps in for it."""

    def __init__(self, name: str, forms: set[str]) -> None:
        self.name, self.forms = name, forms


def variant_named(name: str) -> Variant:
    """"before" (every old form), or plain+<form>+<form>... with each form one of FORMS; ValueError otherwise."""
    if name == "before":
        return Variant(name, {"packed", "layernorm", "complex", "bound"})
    base, *forms = name.split("+")
    unknown = [form for form in forms if form not in FORMS]
    if base != "plain" or unknown:
        raise ValueError(f"variant {name!r}: expected 'before' or plain+<form>+..., forms from {', '.join(FORMS)}")
    return Variant(name, set(forms))


class Swaps:
    """Both forms of every swappable piece of one model, built once (weights shared where a form allows)."""

    def __init__(self, model: llama.LlamaModel) -> None:
        config, dtype = model.config, model.dtype
        self.model = model
        self.plain_norms = [(layer.input_norm, layer.post_attention_norm) for layer in model.layers]
        self.plain_final_norm = model.norm
        self.plain_qkv = [layer.qkv for layer in model.layers]
        self.linears = [(parent, name, module) for parent in model.modules()
                        for name, module in parent.named_children() if isinstance(module, llama.DenseLinear)]
        packs = dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        self.packed = {id(module): packed_linear(module.weight) for _, _, module in self.linears} if packs else {}
        order = torch.cat([interleaved_rows(config.num_heads, config.head_dim),
                           interleaved_rows(config.num_kv_heads, config.head_dim) + config.hidden_size,
                           torch.arange(config.hidden_size + config.num_kv_heads * config.head_dim,
                                        model.layers[0].qkv.weight.shape[0])])
        self.interleaved_qkv = [llama.DenseLinear(layer.qkv.weight[order].contiguous()) for layer in model.layers]
        if packs:
            self.packed.update({id(m): packed_linear(m.weight) for m in self.interleaved_qkv})
        inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, config.head_dim, 2).float() / config.head_dim)
        angles = torch.outer(torch.arange(config.max_position_embeddings).float(), inv_freq)
        self.complex_table = torch.polar(torch.ones_like(angles), angles)

    def norm(self, plain: nn.Module, forms: set[str]) -> nn.Module:
        if "layernorm" in forms:
            return LayerNormRMS(plain.weight.to(self.model.dtype), plain.eps)
        if "rmsnorm" in forms:
            return TorchRMS(plain.weight.to(self.model.dtype), plain.eps)
        return plain

    def apply(self, forms: set[str]) -> None:
        model = self.model
        for (parent, name, module) in self.linears:
            setattr(parent, name, module)
        for index, layer in enumerate(model.layers):
            layer.qkv = self.interleaved_qkv[index] if "complex" in forms else self.plain_qkv[index]
            input_norm, post_norm = self.plain_norms[index]
            layer.input_norm, layer.post_attention_norm = self.norm(input_norm, forms), self.norm(post_norm, forms)
        model.norm = self.norm(self.plain_final_norm, forms)
        for layer in model.layers:  # __call__ reaches this step function (the class's forward when plain)
            if forms:
                layer.forward = functools.partial(layer_step, layer, forms)
            else:
                layer.__dict__.pop("forward", None)
        if "packed" in forms and self.packed:
            for parent in model.modules():
                for name, module in list(parent.named_children()):
                    if id(module) in self.packed:
                        setattr(parent, name, self.packed[id(module)])


def layer_step(layer: llama.DecoderLayer, forms: set[str], x: torch.Tensor, rotation, keys_cache: torch.Tensor,
               values_cache: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor | None, kv_len: int) -> torch.Tensor:
    """DecoderLayer.forward with the rotary and call forms chosen by `forms` (the same arithmetic otherwise)."""
    batch, length, _ = x.shape
    heads, kv_heads, dim = layer.num_heads, layer.num_kv_heads, layer.head_dim
    if "bound" in forms:
        norm1, qkv_proj, out_proj = layer.input_norm.forward, layer.qkv.forward, layer.out.forward
        norm2, feed_forward = layer.post_attention_norm.forward, layer.feed_forward.forward
    else:
        norm1, qkv_proj, out_proj = layer.input_norm, layer.qkv, layer.out
        norm2, feed_forward = layer.post_attention_norm, layer.feed_forward
    qkv = qkv_proj(norm1(x)).unflatten(-1, (heads + 2 * kv_heads, dim))
    if "complex" in forms:
        qk = complex_rotate(qkv[:, :, :heads + kv_heads], rotation)
    else:
        qk = llama.rotate(qkv[:, :, :heads + kv_heads], rotation)
    k = qk[:, :, heads:].transpose(1, 2)
    v = qkv[:, :, heads + kv_heads:].transpose(1, 2)
    write_entries(keys_cache, values_cache, slots, k, v)
    keys, values = keys_cache[:, :, :kv_len], values_cache[:, :, :kv_len]
    q = qk[:, :, :heads].transpose(1, 2).reshape(batch, kv_heads, (heads // kv_heads) * length, dim)
    attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
    attended = attended.view(batch, kv_heads, heads // kv_heads, length, dim).permute(0, 3, 1, 2, 4)
    x = x + out_proj(attended.reshape(batch, length, heads * dim))
    return x + feed_forward(norm2(x))


def model_step(swaps: Swaps, forms: set[str], tokens: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
    """LlamaModel.forward (causal by position) with the forms chosen; the plain variant calls the model itself."""
    model = swaps.model
    if not forms:
        return model(tokens, positions, cache)
    length = tokens.shape[1]
    kv_len = max(cache.lengths) + length
    mask = None
    if length > 1:
        mask = torch.arange(kv_len) <= positions[..., None]
        group = model.config.num_heads // model.config.num_kv_heads
        mask = mask[:, None].expand(-1, group, -1, -1).reshape(mask.shape[0], 1, -1, kv_len)
    if "complex" in forms:
        rotation = swaps.complex_table[positions][:, :, None]
    else:
        rotation = model.rotation_at(positions)
    x = model.embed[tokens]
    for index, layer in enumerate(model.layers):
        args = (x, rotation, *cache.layer(index), positions, mask, kv_len)
        if "bound" in forms:  # the old loop skipped each layer's __call__ too
            x = layer_step(layer, forms, *args)
        else:
            x = layer(*args)  # through nn.Module.__call__ to the instance's forward, set by Swaps.apply
    return model.norm(x)


def time_steps(run, steps: int) -> float:
    """Milliseconds per call of run(), over `steps` calls after one warm-up."""
    run()
    start = time.perf_counter()
    for _ in range(steps):
        run()
    return (time.perf_counter() - start) / steps * 1000


def measure(dtype: torch.dtype, state: dict, config, args) -> None:
    model = llama.LlamaModel(config, state, dtype, prepack=False).eval()
    swaps = Swaps(model)
    variants = [Variant("plain", set())] + [Variant(f"plain+{form}", {form}) for form in FORMS]
    if not swaps.packed:
        variants = [v for v in variants if "packed" not in v.forms]
    variants.append(variant_named("before"))
    if args.variants:
        variants = [Variant("plain", set())] + [variant_named(name) for name in args.variants if name != "plain"]
    context = args.context
    prompt = torch.randint(0, config.vocab_size, (1, context + 8), generator=torch.Generator().manual_seed(0))
    cache = model.new_cache(1, context + 16)
    shapes = {"decode": 1, "verify8": 8}
    times: dict[tuple[str, str], list[float]] = {}
    with torch.inference_mode():
        for forms_name, width in shapes.items():
            for variant in variants:  # every variant's outputs against plain's, same weights and inputs
                swaps.apply(variant.forms)
                cache.lengths = [0]
                model_step(swaps, variant.forms, prompt[:, :context], torch.arange(context)[None], cache)
                cache.lengths = [context]
                out = model_step(swaps, variant.forms, prompt[:, context:context + width],
                                 torch.arange(context, context + width)[None], cache)
                logits = model.logits(out)
                if variant.name == "plain":
                    reference = logits
                difference = (logits - reference).abs().max().item()
                agree = (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()
                print(f"{str(dtype):15} {forms_name:8} {variant.name:16} max|Δlogit| {difference:.4f}  "
                      f"argmax agreement {agree:.2f}")
        for round_index in range(args.rounds):
            shift = round_index % len(variants)
            for variant in variants[shift:] + variants[:shift]:
                swaps.apply(variant.forms)
                for forms_name, width in shapes.items():
                    tokens = prompt[:, context:context + width]
                    positions = torch.arange(context, context + width)[None]

                    def run(tokens=tokens, positions=positions, forms=variant.forms) -> None:
                        cache.lengths = [context]
                        model_step(swaps, forms, tokens, positions, cache)

                    times.setdefault((variant.name, forms_name), []).append(time_steps(run, args.steps))
    swaps.apply(set())
    print(f"\n{dtype}, {torch.get_num_threads()} threads, cache {context}, median over {args.rounds} rounds "
          f"(ms per step; ratio = plain / variant, > 1 means the variant is faster)")
    for forms_name in shapes:
        plain = statistics.median(times[("plain", forms_name)])
        plain_min = min(times[("plain", forms_name)])
        for variant in variants:
            median = statistics.median(times[(variant.name, forms_name)])
            fastest = min(times[(variant.name, forms_name)])
            print(f"  {forms_name:8} {variant.name:16} median {median:8.2f} ms  ratio {plain / median:.3f}   "
                  f"min {fastest:8.2f} ms  ratio {plain_min / fastest:.3f}")
    if args.compile:
        try_compile(model, prompt, cache, context, args.steps, dtype)


def try_compile(model: llama.LlamaModel, prompt: torch.Tensor, cache, context: int, steps: int,
                dtype: torch.dtype) -> None:
    """torch.compile (inductor) of the plain model's step at a fixed position: does it lower, and how fast."""
    import torch._inductor.config as inductor_config

    inductor_config.freezing = True  # weights as constants: inductor prepacks them for oneDNN itself
    for name, width in (("decode", 1), ("verify8", 8)):
        tokens = prompt[:, context:context + width]
        positions = torch.arange(context, context + width)[None]
        compiled = torch.compile(model, dynamic=False)

        def eager(tokens=tokens, positions=positions) -> torch.Tensor:
            cache.lengths = [context]
            return model(tokens, positions, cache)

        def run(tokens=tokens, positions=positions, compiled=compiled) -> torch.Tensor:
            cache.lengths = [context]
            return compiled(tokens, positions, cache)

        try:
            with torch.inference_mode():
                start = time.perf_counter()
                out = run()
                compile_seconds = time.perf_counter() - start
                difference = (model.logits(out) - model.logits(eager())).abs().max().item()
                rounds_eager, rounds_compiled = [], []
                for _ in range(5):
                    rounds_eager.append(time_steps(eager, steps))
                    rounds_compiled.append(time_steps(run, steps))
        except Exception as exc:  # report what failed to lower, then go on
            print(f"  compile {dtype} {name}: FAILED {type(exc).__name__}: {str(exc)[:600]}")
            continue
        print(f"  compile {dtype} {name}: {compile_seconds:.0f} s to compile, max|Δlogit| {difference:.4f}, "
              f"eager {statistics.median(rounds_eager):.2f} ms, compiled {statistics.median(rounds_compiled):.2f} ms")
        torch._dynamo.reset()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--variants", nargs="+",
                        help="measure only these variants (and plain), e.g. before plain+packed+layernorm")
    parser.add_argument("--compile", action="store_true")
    args = parser.parse_args()
    for name in args.variants or []:
        try:
            variant_named(name)
        except ValueError as error:
            parser.error(f"--variants: {error}")
    torch.set_num_threads(args.threads)
    pipeline = load_pipeline(REPO / "pipelines" / "smollm2-draft-target.yaml")
    checkpoint = load_checkpoint(pipeline.target.checkpoint, pipeline)
    for name in args.dtypes:
        measure(getattr(torch, name), checkpoint.state, checkpoint.config, args)


if __name__ == "__main__":
    main()
