"""bench --peers' llama.cpp: skipped with how to install it where llama-cpp-python is missing, run on the GGUF the
target was built from where it is installed."""

from __future__ import annotations

import sys

import pytest

from specdeploy.bench.footprint import measure_footprint


def test_without_llama_cpp_python_its_peers_say_how_to_install_it(tiny_engines, monkeypatch):
    from specdeploy.bench.peers import llama_cpp_peers

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp raises ImportError
    peers = llama_cpp_peers(tiny_engines["ngram"], [[5, 6, 7]], 4, [[8]])
    assert set(peers) == {"llama.cpp", "llama.cpp prompt lookup (3)"}
    assert all("pip install 'specdeploy[peers]'" in peer.skipped for peer in peers.values())


@pytest.mark.smollm2
def test_llama_cpp_runs_the_gguf_the_target_was_built_from(smollm2_fp32_engines):
    """Where llama-cpp-python is installed (make peers): plain and prompt lookup on the package's GGUF, greedy, at
    our thread count; its Q4_1 weights are the ones our target was dequantized from, so its greedy output starts
    as ours does (its 8-bit activations part from ours later, at some near tie)."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (make peers builds it)")
    from specdeploy.bench.peers import llama_cpp_peers
    from specdeploy.spec.sampling_params import SamplingParams

    engine = smollm2_fp32_engines["draft-target"]
    prompts = ["Write a Python function that adds two numbers.", "Name three colours of the rainbow."]
    encoded = [engine.encode_prompt(prompt) for prompt in prompts]
    ours = [engine.generate(ids, SamplingParams(), 16, num_draft_tokens=0).run() for ids in encoded]
    peers = llama_cpp_peers(engine, encoded, 16, ours, ["code", "open"])
    assert set(peers) == {"llama.cpp", "llama.cpp prompt lookup (5)"}
    for peer in peers.values():
        assert peer.tokens_per_s > 0 and "SmolLM2-135M-Instruct.Q4_1.gguf" in peer.what
        assert peer.common_prefix_tokens >= 3
        assert set(peer.by_kind) == {"code", "open"} and all(rate > 0 for rate in peer.by_kind.values())
    footprint = measure_footprint(engine, encoded[0], 16)  # llama.cpp's fresh process imports no torch
    assert 0 < footprint.llama_cpp_peak_rss_bytes < footprint.peak_rss_bytes
