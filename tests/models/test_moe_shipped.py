"""The shipped MoE pipeline, built as it ships (only in fp32 without its int4 experts, for exactness, and at a fixed
gamma instead of a measured one): its answer to the demo's prompt is the dense model's kind of answer, and its
greedy speculative output equals its plain decode."""

from __future__ import annotations

import re

import pytest
import torch
import yaml
from helpers.engines import assert_greedy_speculation_equals_plain
from helpers.pipelines import write_pipeline
from helpers.prompts import SMOLLM2_PROMPTS
from helpers.repo import REPO

from specdeploy.build.torch_engine import build
from specdeploy.runtime.engine import Engine
from specdeploy.spec.pipeline import load_pipeline
from specdeploy.spec.sampling_params import SamplingParams

PIPELINE = REPO / "pipelines" / "smollm2-moe-draft-target.yaml"


def demo_prompt() -> str:
    """The prompt `make demo` sends (the Makefile's demo target)."""
    return re.search(r'specdeploy demo \$\(PIPELINE\) \\\s*"([^"]+)"', (REPO / "Makefile").read_text()).group(1)


@pytest.fixture(scope="module")
def moe_fp32(tmp_path_factory) -> Engine:
    root = tmp_path_factory.mktemp("smollm2-moe")
    spec = yaml.safe_load(PIPELINE.read_text())
    spec["name"] = "smollm2-moe-fp32"
    spec["target"]["dtype"] = "float32"
    spec["target"].pop("weight_only")  # the int4 kernels take bf16 activations
    spec["serving"]["policy"]["gamma_cap"] = spec["speculation"]["num_draft_tokens"]
    return Engine(build(load_pipeline(write_pipeline(root / "moe.yaml", **spec)), root / "engines",
                        quiet=True).directory)


def distinct_fraction(tokens: list[int], n: int = 4) -> float:
    """The share of an answer's n-grams that occur once in it: a model stuck in a loop ("a man who is a man who
    is ...") repeats most of them."""
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams)


def answer_perplexity(engine: Engine, prompt: list[int], answer: list[int]) -> tuple[float, float]:
    """Teacher-forced over prompt + answer, the engine's target: (perplexity of the answer, the fraction of its
    tokens that are the target's own greedy choice)."""
    model = engine.target
    tokens = torch.tensor([prompt + answer])
    positions = torch.arange(tokens.shape[1])[None]
    with torch.inference_mode():
        logits = model.logits(model(tokens, positions, model.new_cache(1, tokens.shape[1])).hidden).float()[0]
    predicted = logits[len(prompt) - 1:-1]  # [A, V]: the distribution each answer token was drawn against
    target = torch.tensor(answer)
    nll = torch.nn.functional.cross_entropy(predicted, target)
    return float(nll.exp()), float((predicted.argmax(-1) == target).float().mean())


@pytest.mark.smollm2
@pytest.mark.slow
def test_the_shipped_moe_answers_the_demo_prompt_as_the_dense_model_would(moe_fp32, smollm2_fp32_engines):
    dense = smollm2_fp32_engines["draft-target"]
    assert moe_fp32.target.config.num_experts == 8 and moe_fp32.target.config.experts_per_token == 2
    prompt = dense.encode_prompt(demo_prompt())
    assert prompt == moe_fp32.encode_prompt(demo_prompt())
    max_tokens = moe_fp32.pipeline.sampling.max_tokens
    ours = moe_fp32.generate(prompt, SamplingParams(), max_tokens, num_draft_tokens=0).run()
    theirs = dense.generate(prompt, SamplingParams(), max_tokens, num_draft_tokens=0).run()
    assert len(ours) >= 0.75 * len(theirs) and len(theirs) >= 64  # an answer, not an early end
    # the dense model reads the MoE's answer as one of its own: mostly its own greedy choices, at a perplexity near
    # its own answer's; and the answer does not loop
    dense_on_ours, agreement = answer_perplexity(dense, prompt, ours)
    dense_on_theirs, _ = answer_perplexity(dense, prompt, theirs)
    assert agreement >= 0.9, dense.decode(ours)
    assert dense_on_ours <= 1.5 * dense_on_theirs, (dense_on_ours, dense_on_theirs)
    assert distinct_fraction(ours) >= 0.9 * distinct_fraction(theirs)
    # and the MoE reads the dense answer as the dense model does, token for token, at nearly every position
    assert answer_perplexity(moe_fp32, prompt, theirs)[1] >= 0.93


@pytest.mark.smollm2
@pytest.mark.slow
def test_greedy_speculation_on_the_shipped_moe_equals_plain(moe_fp32):
    assert_greedy_speculation_equals_plain(moe_fp32, [demo_prompt(), *SMOLLM2_PROMPTS])
