"""An AOTInductor step program (models/step_program.py) computes what the eager forward does, in fp32 to rounding,
for one row and several, a decode step, a verify and a prefill, with the cache entries it writes; it reads the
model's own weights (no copy) and an int4 model's group sizes (issue 46)."""

from __future__ import annotations

import zipfile

import pytest
import torch

from specdeploy.models.config import ModelConfig
from specdeploy.models.llama import LayerSpan, LlamaModel, tree_forward_all
from specdeploy.models.quantize import quantize_int4
from specdeploy.models.step_program import INT4_BLOCK_ROWS, export_step_program, load_step_program, run_compiled


def tiny_model(int4: bool = False) -> LlamaModel:
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(7)
    state = LlamaForCausalLM(hf_config).state_dict()
    if int4:  # the projections as int4 groups, the rest bf16: the shipped n-gram target's form
        for name in [name for name in state if name.endswith("_proj.weight")]:
            prefix = name.removesuffix(".weight")
            state |= {f"{prefix}.{key}": value for key, value in quantize_int4(state.pop(name)).items()}
    dtype = torch.bfloat16 if int4 else torch.float32
    return LlamaModel(ModelConfig.from_hf(hf_config), state, dtype, prepack=False).eval()


PACKAGES = {}  # (int4, variant) → the compiled package


@pytest.fixture(scope="module", params=[(False, "aten"), (True, "aten"), (True, "gemm_template")],
                ids=["fp32", "int4", "int4-template"])
def compiled_pair(request, tmp_path_factory):
    """(eager model, model whose forwards run the compiled program), the same weights. The template variant's int4
    micro-kernel takes INT4_BLOCK_ROWS rows a block (where this CPU has AVX-512): the verify of 6 tokens and the
    prefill of 9 below run a partial block, a whole one and more than one."""
    int4, variant = request.param
    eager, model = tiny_model(int4), tiny_model(int4)
    path = tmp_path_factory.mktemp("programs") / "target.pt2"
    assert export_step_program(model, path, max_rows=4, variant=variant) > 0
    PACKAGES[request.param] = path
    program = load_step_program(model, path)
    run_compiled(model, program)
    return eager, model


def test_the_program_reads_the_models_own_weights(compiled_pair):
    _, model = compiled_pair
    program = model.forward.program
    assert set(program.get_constant_fqns()) >= {"model.embed", "model.layers.0.qkv." + (
        "packed" if model.dtype == torch.bfloat16 else "weight")}


@pytest.mark.parametrize("rows", [1, 3])
def test_prefill_decode_and_verify_equal_eager_with_the_same_cache_entries(compiled_pair, rows):
    eager, model = compiled_pair
    tolerance = dict(rtol=2e-2, atol=2e-2) if model.dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.manual_seed(rows)
    caches = {"eager": eager.new_cache(rows, 40), "compiled": model.new_cache(rows, 40)}
    steps = [torch.randint(0, 64, (rows, width)) for width in (9, 1, 6, 1)]  # prefill, decode, verify, decode
    with torch.inference_mode():
        start = 0
        for tokens in steps:
            positions = start + torch.arange(tokens.shape[1])[None].expand(rows, -1)
            outputs = {}
            for name, forward in (("eager", eager), ("compiled", model)):
                caches[name].lengths = [start] * rows
                outputs[name] = forward.logits(forward(tokens, positions, caches[name]).hidden)
            torch.testing.assert_close(outputs["compiled"], outputs["eager"], **tolerance)
            start += tokens.shape[1]
    for written, expected in zip(caches["compiled"].stacked(), caches["eager"].stacked()):
        assert written[..., start - 1, :].abs().sum() > 0  # the program wrote into the cache it was given
        torch.testing.assert_close(written[..., :start, :], expected[..., :start, :], **tolerance)


def test_a_tree_verify_with_its_mask_and_slots_equals_eager(compiled_pair):
    eager, model = compiled_pair
    if model.dtype != torch.float32:
        pytest.skip("fp32 is the exact comparison")
    depths = torch.tensor([0, 1, 1, 2])
    ancestry = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    prompt = torch.randint(0, 64, (2, 6))
    hidden = {}
    with torch.inference_mode():
        for name, forward in (("eager", eager), ("compiled", model)):
            cache = forward.new_cache(2, 32)
            forward(prompt, torch.arange(6)[None].expand(2, -1), cache)
            hidden[name] = tree_forward_all(forward, cache, torch.randint(0, 64, (2, 4), generator=torch.Generator()
                                                                          .manual_seed(3)), [6, 6], depths,
                                            ancestry).hidden
    torch.testing.assert_close(hidden["compiled"], hidden["eager"], rtol=1e-5, atol=1e-5)


def test_a_layer_range_falls_back_to_the_eager_forward(compiled_pair):
    eager, model = compiled_pair
    tokens = torch.randint(0, 64, (1, 3))
    with torch.inference_mode():
        ours = model(tokens, torch.arange(3)[None], model.new_cache(1, 8), span=LayerSpan(stop=1)).hidden
        theirs = eager(tokens, torch.arange(3)[None], eager.new_cache(1, 8), span=LayerSpan(stop=1)).hidden
    torch.testing.assert_close(ours, theirs)


def test_the_int4_template_unpacks_each_block_of_weights_once_for_a_verify(compiled_pair):
    """Inductor registers its int4 micro-kernel with blocks of 4 rows; the template variant's are INT4_BLOCK_ROWS,
    so a verify of up to 8 tokens unpacks each weight once (the kernel is instantiated at the block's rows)."""
    if (True, "gemm_template") not in PACKAGES or torch.backends.cpu.get_cpu_capability() != "AVX512":
        pytest.skip("the template variant's int4 micro-kernel is inductor's AVX-512 one")
    with zipfile.ZipFile(PACKAGES[True, "gemm_template"]) as package:
        kernels = "".join(package.read(name).decode() for name in package.namelist() if name.endswith(".cpp"))
    assert f"constexpr int64_t Mr = {INT4_BLOCK_ROWS};" in kernels
    assert f"_kernel<{INT4_BLOCK_ROWS}, 64, accum>" in kernels
