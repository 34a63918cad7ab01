"""Measure the model's forms against the alternatives, eager, in one run (issue 26).

The base, "model", is what specdeploy/models/llama.py runs eagerly: rotary in the model's dtype (rotate-half, the
Hugging Face weights' layout), RMS norm as layer norm of [x, -x], submodules called through .forward, F.linear.
The forms that can replace a piece of it:
  packed      bf16 weights prepacked for oneDNN (DenseLinear.prepack: what the eager engine runs, model+packed)
  fp32norm    RMS norm as x * rsqrt(mean(x²) + eps) * w in fp32, eight kernels (the form a compiled model runs)
  rmsnorm     torch's F.rms_norm
  fp32rotary  rotary computed in fp32 and rounded back
  complex     rotary as one complex multiply in fp32 (torch.polar table, q/k rows permuted to interleaved pairs)
  calls       submodules called through nn.Module.__call__
Variants are "model", "model+<form>+<form>..." and two named sets: "before" (model+packed+complex, the engine
before issue 26) and "issue26" (model+packed+fp32norm+fp32rotary+calls, its first, slower plain forms). Each
round times every variant once, in a rotated order, so the machine's drift falls on all of them alike; the figures
are medians (and minimums) over rounds, per step: a one-token decode step and an 8-position verify, at a cache of
--context tokens, by wall clock or (--clock cpu) the process's CPU time. `--compile` also tries torch.compile
(inductor, freezing) of the model's step. On a loaded machine read the minimums.

Usage (from the repository root; loads SmolLM2-135M-Instruct from the embedded GGUF, about a minute):
    .venv/bin/python scripts/measure_model_forms.py [--dtypes bfloat16 float32] [--rounds 7] [--steps 10]
        [--threads 2] [--context 128] [--variants model+packed before issue26] [--clock cpu] [--compile]
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
FORMS = ("packed", "fp32norm", "rmsnorm", "fp32rotary", "complex", "calls")
NAMED = {"before": {"packed", "complex"}, "issue26": {"packed", "fp32norm", "fp32rotary", "calls"}}


def packed_linear(weight: torch.Tensor) -> llama.DenseLinear:
    """A DenseLinear holding its own copy of `weight`, prepacked for oneDNN."""
    linear = llama.DenseLinear(weight.clone())
    linear.prepack()
    return linear


class Fp32RMS(nn.Module):
    """RMS norm in fp32, rounded once: the form a compiled model runs (llama.RMSNorm under torch.compile)."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = weight.float(), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.float()
        return (wide * torch.rsqrt(wide.square().mean(-1, keepdim=True) + self.eps) * self.weight).to(x.dtype)


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


def fp32_rotate(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """Rotary in fp32, rounded back: x [B, T, heads, D], rotation [2, B, T, 1, D] fp32 (llama.rotary_table)."""
    cos, signed_sin = rotation.float()
    wide = x.float()
    return (wide * cos + wide.roll(x.shape[-1] // 2, dims=-1) * signed_sin).to(x.dtype)


def complex_rotate(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """The old rotary: x [B, T, heads, D] interleaved, rotation [B, T, 1, D/2] complex."""
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * rotation).flatten(-2).to(x.dtype)


class Variant:
    """Which forms a step uses, and the modules each layer swaps in for it."""

    def __init__(self, name: str, forms: set[str]) -> None:
        self.name, self.forms = name, forms


def variant_named(name: str) -> Variant:
    """A name from NAMED, or model+<form>+<form>... with each form one of FORMS; ValueError otherwise."""
    if name in NAMED:
        return Variant(name, NAMED[name])
    base, *forms = name.split("+")
    unknown = [form for form in forms if form not in FORMS]
    if base != "model" or unknown:
        raise ValueError(f"variant {name!r}: expected one of {', '.join(NAMED)} or model+<form>+..., "
                         f"forms from {', '.join(FORMS)}")
    return Variant(name, set(forms))


class Swaps:
    """Both forms of every swappable piece of one model, built once (weights shared where a form allows)."""

    def __init__(self, model: llama.LlamaModel) -> None:
        config, dtype = model.config, model.dtype
        self.model = model
        self.own_norms = [(layer.input_norm, layer.post_attention_norm) for layer in model.layers]
        self.own_final_norm = model.norm
        self.own_qkv = [layer.qkv for layer in model.layers]
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
        self.fp32_table = llama.rotary_table(config, config.max_position_embeddings)

    def norm(self, own: llama.RMSNorm, forms: set[str]) -> nn.Module:
        if "fp32norm" in forms:
            return Fp32RMS(own.weight, own.eps)
        if "rmsnorm" in forms:
            return TorchRMS(own.weight.to(self.model.dtype), own.eps)
        return own

    def apply(self, forms: set[str]) -> None:
        model = self.model
        for (parent, name, module) in self.linears:
            setattr(parent, name, module)
        for index, layer in enumerate(model.layers):
            layer.qkv = self.interleaved_qkv[index] if "complex" in forms else self.own_qkv[index]
            input_norm, post_norm = self.own_norms[index]
            layer.input_norm, layer.post_attention_norm = self.norm(input_norm, forms), self.norm(post_norm, forms)
        model.norm = self.norm(self.own_final_norm, forms)
        for layer in model.layers:  # layer.forward is this step function (the class's forward for the model)
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
    if "calls" in forms:
        norm1, qkv_proj, out_proj = layer.input_norm, layer.qkv, layer.out
        norm2 = layer.post_attention_norm
    else:
        norm1, qkv_proj, out_proj = layer.input_norm.forward, layer.qkv.forward, layer.out.forward
        norm2 = layer.post_attention_norm.forward
    qkv = qkv_proj(norm1(x)).unflatten(-1, (heads + 2 * kv_heads, dim))
    rotary = complex_rotate if "complex" in forms else fp32_rotate if "fp32rotary" in forms else llama.rotate
    qk = rotary(qkv[:, :, :heads + kv_heads], rotation)
    k = qk[:, :, heads:].transpose(1, 2)
    v = qkv[:, :, heads + kv_heads:].transpose(1, 2)
    write_entries(keys_cache, values_cache, slots, k, v)
    keys, values = keys_cache[:, :, :kv_len], values_cache[:, :, :kv_len]
    q = qk[:, :, :heads].transpose(1, 2).reshape(batch, kv_heads, (heads // kv_heads) * length, dim)
    attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
    attended = attended.view(batch, kv_heads, heads // kv_heads, length, dim).permute(0, 3, 1, 2, 4)
    x = x + out_proj(attended.reshape(batch, length, heads * dim))
    return x + layer.feed_forward(norm2(x))


def model_step(swaps: Swaps, forms: set[str], tokens: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
    """LlamaModel.forward (causal by position) with the forms chosen; the model variant calls the model itself."""
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
        rotation = swaps.fp32_table[:, positions, None] if "fp32rotary" in forms else model.rotation_at(positions)
    x = model.embed[tokens]
    for index, layer in enumerate(model.layers):
        args = (x, rotation, *cache.layer(index), positions, mask, kv_len)
        x = layer(*args) if "calls" in forms else layer.forward(*args)  # either reaches layer_step (Swaps.apply)
    return model.norm(x)


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def time_steps(run, steps: int, clock=time.perf_counter) -> float:
    """Milliseconds per call of run() by `clock`, over `steps` calls after one warm-up."""
    run()
    start = clock()
    for _ in range(steps):
        run()
    return (clock() - start) / steps * 1000


def measure(dtype: torch.dtype, state: dict, config, args) -> None:
    model = llama.LlamaModel(config, state, dtype, prepack=False).eval()
    swaps = Swaps(model)
    variants = [Variant("model", set())] + [Variant(f"model+{form}", {form}) for form in FORMS]
    if not swaps.packed:
        variants = [v for v in variants if "packed" not in v.forms]
    variants += [variant_named(name) for name in NAMED]
    if args.variants:
        variants = [Variant("model", set())] + [variant_named(name) for name in args.variants if name != "model"]
    context = args.context
    prompt = torch.randint(0, config.vocab_size, (1, context + 8), generator=torch.Generator().manual_seed(0))
    cache = model.new_cache(1, context + 16)
    shapes = {"decode": 1, "verify8": 8}
    times: dict[tuple[str, str], list[float]] = {}
    with torch.inference_mode():
        for forms_name, width in shapes.items():
            for variant in variants:  # every variant's outputs against the model's, same weights and inputs
                swaps.apply(variant.forms)
                cache.lengths = [0]
                model_step(swaps, variant.forms, prompt[:, :context], torch.arange(context)[None], cache)
                cache.lengths = [context]
                out = model_step(swaps, variant.forms, prompt[:, context:context + width],
                                 torch.arange(context, context + width)[None], cache)
                logits = model.logits(out)
                if variant.name == "model":
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

                    elapsed = time_steps(run, args.steps, CLOCKS[args.clock])
                    times.setdefault((variant.name, forms_name), []).append(elapsed)
    swaps.apply(set())
    print(f"\n{dtype}, {torch.get_num_threads()} threads, cache {context}, median over {args.rounds} rounds "
          f"({args.clock} ms per step; ratio = model / variant, > 1 means the variant is faster)")
    for forms_name in shapes:
        base = statistics.median(times[("model", forms_name)])
        base_min = min(times[("model", forms_name)])
        for variant in variants:
            median = statistics.median(times[(variant.name, forms_name)])
            fastest = min(times[(variant.name, forms_name)])
            print(f"  {forms_name:8} {variant.name:16} median {median:8.2f} ms  ratio {base / median:.3f}   "
                  f"min {fastest:8.2f} ms  ratio {base_min / fastest:.3f}")
    if args.compile:
        try_compile(model, prompt, cache, context, args.steps, dtype)


def try_compile(model: llama.LlamaModel, prompt: torch.Tensor, cache, context: int, steps: int,
                dtype: torch.dtype) -> None:
    """torch.compile (inductor) of the model's step at a fixed position: does it lower, and how fast."""
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
                        help="measure only these variants (and model), e.g. before issue26 model+packed+fp32norm")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="cpu: the process's CPU time (both threads), steadier than wall on a shared machine "
                             "when OMP_WAIT_POLICY=PASSIVE keeps idle threads from spinning")
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
