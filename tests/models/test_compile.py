"""The model compiles whole (torch.compile, inductor, no graph break) and a compiled step equals the eager one:
its logits and the cache entries it writes, decoding over a cache it shares with eager prefill (issue 27)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.pipelines import tiny_pipeline
from helpers.prompts import PROMPTS

from specdeploy.models.config import ModelConfig
from specdeploy.models.llama import LlamaModel


@pytest.mark.slow
def test_a_compiled_decode_step_equals_eager_and_writes_the_same_cache_entries():
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(7)
    model = LlamaModel(ModelConfig.from_hf(hf_config), LlamaForCausalLM(hf_config).state_dict(), prepack=False)
    compiled = torch.compile(model, fullgraph=True, dynamic=False)  # fullgraph: a graph break is an error
    prompt = torch.randint(0, 64, (1, 9))
    caches = {"eager": model.new_cache(1, 16), "compiled": model.new_cache(1, 16)}
    with torch.inference_mode():
        for cache in caches.values():
            model(prompt[:, :8], torch.arange(8)[None], cache)
            cache.lengths = [8]
        step = prompt[:, 8:9], torch.tensor([[8]])
        eager = model.logits(model(*step, caches["eager"]).hidden)
        ours = model.logits(compiled(*step, caches["compiled"]).hidden)
    torch.testing.assert_close(ours, eager, rtol=1e-5, atol=1e-5)
    for written, expected in zip(caches["compiled"].stacked(), caches["eager"].stacked()):  # keys, then values
        assert written[..., 8, :].abs().sum() > 0  # the compiled step wrote its entries into the cache it was given
        torch.testing.assert_close(written[..., :9, :], expected[..., :9, :], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_a_compiled_engine_builds_its_cache_decodes_as_eager_and_reloads_from_a_read_only_copy(tiny_checkpoints,
                                                                                               tmp_path):
    """backend.torch.compile: the build compiles the steps into the engine's compiled/ and records it; the engine's
    fp32 greedy text, plain and speculative, is the eager engine's; a later load reads the kernels from a temporary
    copy of that cache (inductor's cache hits) and writes nothing into the engine (a server may mount it
    read-only)."""
    import json
    import subprocess
    import sys

    from specdeploy.runtime.engine import Engine
    from specdeploy.spec.pipeline import load_pipeline
    from specdeploy.spec.sampling_params import SamplingParams
    from specdeploy.workflows import build_torch_engine

    def engine_dir(name: str, compile_steps: bool) -> Path:
        # one cache row: the build compiles the steps once, in one fresh process (a server-sized cache is a second)
        path = tiny_pipeline(tmp_path, name, tiny_checkpoints["target"], method="ngram", max_batch_size=1,
                             backend={"kind": "torch", "torch": {"compile": compile_steps}})
        return build_torch_engine(load_pipeline(path), tmp_path / "engines", quiet=True).directory

    compiled_dir, eager_dir = engine_dir("tiny-compiled", True), engine_dir("tiny-eager", False)
    record = json.loads((compiled_dir / "compiled" / "build.json").read_text())
    assert record["compile_seconds"] > 0 and record["cache_bytes"] > 0 and record["torch"] == torch.__version__
    assert not (eager_dir / "compiled").exists()
    compiled, eager = Engine(compiled_dir), Engine(eager_dir)
    assert compiled.compile_seconds > 0 and eager.compile_seconds is None
    for prompt in PROMPTS[:2]:
        expected = eager.generate(prompt, SamplingParams(), 24, num_draft_tokens=0).run()
        for gamma in (0, 3):
            assert compiled.generate(prompt, SamplingParams(), 24, num_draft_tokens=gamma).run() == expected
    before = sorted(p.relative_to(compiled_dir) for p in (compiled_dir / "compiled").rglob("*"))
    reload = subprocess.run([sys.executable, "-c", RELOAD, str(compiled_dir)], capture_output=True, text=True,
                            timeout=600)
    assert reload.returncode == 0, reload.stderr[-3000:]
    counts = json.loads(reload.stdout.splitlines()[-1])
    assert counts["fxgraph_cache_hit"] >= 2 and counts.get("fxgraph_cache_miss", 0) == 0, counts
    assert not counts["cache_dir"].startswith(str(compiled_dir))  # a copy
    assert sorted(p.relative_to(compiled_dir) for p in (compiled_dir / "compiled").rglob("*")) == before


RELOAD = """
import json, os, sys
from torch._dynamo.utils import counters
from specdeploy.runtime.engine import Engine
Engine(sys.argv[1])
print(json.dumps({**counters["inductor"], "cache_dir": os.environ["TORCHINDUCTOR_CACHE_DIR"]}))
"""
