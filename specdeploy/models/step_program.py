"""Ahead-of-time compiled steps (AOTInductor): the torch engine's counterpart of a built TensorRT engine.

`export_step_program` exports one forward of a model, over any batch size, width and cache length, with an
explicit attention mask and cache slots, and compiles it once into a package (a shared library of fused kernels,
no Python in the step). `load_step_program` loads it in a fraction of a second, with no compiler on the serving
path, and `StepProgram` routes the model's forwards through it.

What a program is, in tensors:
- inputs: tokens, positions, slots [B, T] long; mask [B, T, S] bool over the cache's first S slots; the cache's
  keys and values, a list of [B, kv_heads, L, D] tensors each (one per layer), written at `slots` in place;
- output: the hidden states after the final norm [B, T, hidden] and, for a program compiled with layers to capture
  (EAGLE-3's), the states entering them [B, T, layers * hidden] (models/llama.py, Forward.captured).
B, T, S and L are symbolic: one program serves a server's batches, every verify width, prefills and any context
length. The KV cache's committed lengths, which the eager forward reads from Python, enter as the mask's width.

The weights are not copied into the package: the program reads the model's own tensors (user-managed constants),
so a loaded program costs no second copy of the model. One kind of constant is inductor's own: its lowering of the
CPU int4 matmul stores each layer's group size as a 0-dimensional int64 tensor with a generated name
(torch/_inductor/quantized_lowerings.py, torch 2.13), which the load supplies from the model's Int4Linear layers.
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from torch import nn

from specdeploy.models.kv_cache import KVCache
from specdeploy.models.llama import Forward, LayerSpan, LlamaModel, causal_mask
from specdeploy.models.quantize import Int4Linear

# The example a program is traced with: sizes of 2, since export specializes a size of 1 (a program traced on one
# row would serve one row only).
EXAMPLE_ROWS, EXAMPLE_WIDTH, EXAMPLE_SLOTS = 2, 2, 8
MAX_SLOTS = 1 << 17  # the longest cache a program takes


class ExportedStep(nn.Module):
    """What is exported: `model`'s forward with the cache given as tensors (no Python-side lengths), capturing the
    states entering the layers of `capture`."""

    def __init__(self, model: LlamaModel, capture: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.model, self.capture = model, capture

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, slots: torch.Tensor,
                keys: list[torch.Tensor], values: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        forward = self.model.forward(tokens, positions, KVCache.wrapping(keys, values), attention_mask=mask,
                                     cache_slots=slots, capture=self.capture)
        return (forward.hidden, forward.captured) if self.capture else (forward.hidden,)


# How a program's matmuls are compiled: torch's own kernels (inductor's default), or inductor's C++ GEMM templates
# (max_autotune), which for an int4 layer is a weight-only micro-kernel that unpacks each block of weights once for
# a block of rows (AVX-512 or AMX). Which is faster depends on the CPU (measured: docs/benchmarks.md, "Compiled step
# programs"), so a build may compile both and time them. The template variant leaves ATen out of its choices: with
# it, autotune (timing each matmul at the example's 4 rows) picked torch's kernel for half the layers, whose block
# of 4 rows then made every verify of 5 to 8 tokens unpack those weights twice.
VARIANTS = {"aten": {}, "gemm_template": {"max_autotune": True, "max_autotune_gemm_backends": "CPP"}}

# Rows the int4 template's micro-kernel takes per unpack of a block of weights. Inductor registers blocks of 4 rows
# (CppMicroGemmWoQInt4Avx512 in torch/_inductor/codegen/cpp_micro_gemm.py, torch 2.13), so a verify of 6 tokens
# unpacked each weight twice. The kernel is a C++ template over the rows and instantiates every smaller block too,
# so a block of 8 serves a verify of up to 8 tokens with one unpack and leaves a decode step as it was (measured:
# docs/benchmarks.md, "Compiled step programs").
INT4_BLOCK_ROWS = 8


@contextmanager
def int4_block_rows(rows: int):
    """Inductor's int4 micro-kernel registered with blocks of `rows` rows while the block is active (a compile);
    unchanged where this torch registers it elsewhere (another version), which then compiles its own blocks."""
    import torch._inductor.lowering  # noqa: F401  (inductor's modules import each other; this one loads them in order)
    from torch._inductor.codegen import cpp_micro_gemm

    kernel = getattr(cpp_micro_gemm, "CppMicroGemmWoQInt4Avx512", None)
    configs = cpp_micro_gemm.micro_gemm_configs.get(kernel)
    if not configs:
        yield
        return
    cpp_micro_gemm.micro_gemm_configs[kernel] = [
        dataclasses.replace(config, register_blocking=config.register_blocking._replace(block_m=rows))
        for config in configs]
    try:
        yield
    finally:
        cpp_micro_gemm.micro_gemm_configs[kernel] = configs


def export_step_program(model: LlamaModel, path: Path, max_rows: int, variant: str = "aten",
                        capture: tuple[int, ...] = ()) -> float:
    """Export and compile `model`'s step into the package `path` for batches of up to max_rows, its matmuls as
    `variant` says (VARIANTS), returning the states entering the layers of `capture` too; returns the seconds it
    took. The model must be built with prepack=False (oneDNN's prepacked linear does not export)."""
    started = time.perf_counter()
    device = model.embed.device
    cache = model.new_cache(EXAMPLE_ROWS, EXAMPLE_SLOTS)
    tokens = torch.zeros(EXAMPLE_ROWS, EXAMPLE_WIDTH, dtype=torch.long, device=device)
    positions = (4 + torch.arange(EXAMPLE_WIDTH, device=device))[None].expand(EXAMPLE_ROWS, -1).contiguous()
    mask = torch.ones(EXAMPLE_ROWS, EXAMPLE_WIDTH, 4 + EXAMPLE_WIDTH, dtype=torch.bool, device=device)
    rows = torch.export.Dim("rows", min=1, max=max(max_rows, EXAMPLE_ROWS))
    width = torch.export.Dim("width", min=1, max=MAX_SLOTS - 1)
    span = torch.export.Dim("span", min=1, max=MAX_SLOTS - 1)
    slots = torch.export.Dim("slots", min=2, max=MAX_SLOTS)
    per_token = {0: rows, 1: width}
    per_layer = [{0: rows, 2: slots} for _ in cache.keys]
    shapes = (per_token, per_token, {0: rows, 1: width, 2: span}, per_token, per_layer, per_layer)
    with torch.no_grad():
        exported = torch.export.export(ExportedStep(model, capture).eval(),
                                       (tokens, positions, mask, positions.clone(), list(cache.keys),
                                        list(cache.values)),  # slots: a tensor of its own, or export aliases them
                                       dynamic_shapes=shapes)
    # the wrapper only calls kernels, so optimising its (large, every layer unrolled) C++ buys nothing at run time
    options = {"aot_inductor.package_constants_in_so": False, "aot_inductor.compile_wrapper_opt_level": "O0",
               **VARIANTS[variant]}
    with int4_block_rows(INT4_BLOCK_ROWS) if variant == "gemm_template" else nullcontext():
        torch._inductor.aoti_compile_and_package(exported, package_path=str(path), inductor_configs=options)
    return time.perf_counter() - started


def load_step_program(model: LlamaModel, path: Path):
    """The compiled package at `path`, reading `model`'s own weights. Raises ValueError when the package's
    constants are not the model's (a package built for another model)."""
    program = torch._inductor.aoti_load_package(str(path))
    tensors = {f"model.{name}": tensor for name, tensor in [*model.named_parameters(), *model.named_buffers()]}
    wanted = program.get_constant_fqns()
    generated = [name for name in wanted if name not in tensors]
    group_sizes = {module.group_size for module in model.modules() if isinstance(module, Int4Linear)}
    if generated and len(group_sizes) != 1:
        raise ValueError(f"{path}: constants {generated[:3]}… are not the model's tensors")
    constants = {name: tensors[name] for name in wanted if name in tensors}
    # inductor's int4 group sizes (module docstring): one value for every layer, checked above
    constants |= {name: torch.tensor(next(iter(group_sizes)), dtype=torch.int64) for name in generated}
    program.load_constants(constants, check_full_update=True, user_managed=True)
    return program


class StepProgram:
    """Stands in for LlamaModel.forward (same arguments and result), running the compiled program for every call
    of the whole model on its own tokens that captures what the program was compiled to capture, and the eager
    forward for the rest: part of the stack (an early exit's draft and verify), other layers to capture (a prefill
    of training code), a batch-invariant model's row-by-row attention, or a cache longer than the program takes."""

    def __init__(self, model: LlamaModel, program, capture: tuple[int, ...] = ()) -> None:
        self.model = model
        self.eager = model.forward
        self.program, self.capture = program, tuple(capture)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache,
                 attention_mask: torch.Tensor | None = None, cache_slots: torch.Tensor | None = None,
                 row_lengths: list[int] | None = None, span: LayerSpan | None = None,
                 capture: tuple[int, ...] = ()) -> Forward:
        if span is not None or tuple(capture) != self.capture or self.model.row_invariant \
                or kv_cache.max_length > MAX_SLOTS:
            return self.eager(tokens, positions, kv_cache, attention_mask, cache_slots, row_lengths, span, capture)
        mask = causal_mask(kv_cache, positions) if attention_mask is None else attention_mask
        slots = positions if cache_slots is None else cache_slots
        # the program assumes the strides it was traced with (contiguous); an expanded view would be misread
        outputs = self.program(tokens.contiguous(), positions.contiguous(), mask.contiguous(), slots.contiguous(),
                               kv_cache.keys, kv_cache.values)
        return Forward(outputs[0], outputs[1] if capture else None)


def run_compiled(model: LlamaModel, program, capture: tuple[int, ...] = ()) -> None:
    """Route `model`'s forwards through `program` (StepProgram), compiled to capture `capture`."""
    model.forward = StepProgram(model, program, capture)
