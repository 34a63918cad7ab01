"""scripts/openai_load.py's own logic, where it can go wrong without a server: the served tokenizer as a Hugging Face
cache entry that an offline loader finds by name (aiperf 0.13 looks nowhere else), and the front's cost taken per
level as the median of each round's ratio (a round pairs a gRPC run with the OpenAI run beside it)."""

from __future__ import annotations

import time

import pytest
from helpers.repo import load_script
from helpers.tiny_models import TINY, char_tokenizer

openai_load = load_script("openai_load")


def test_the_served_tokenizer_loads_by_name_from_the_cache_offline(tmp_path, monkeypatch):
    from transformers import AutoTokenizer, LlamaConfig

    served = tmp_path / "target"  # an engine's target folder: the model's config and its tokenizer
    char_tokenizer().save_pretrained(served)
    LlamaConfig(**TINY).save_pretrained(served)
    cache = tmp_path / "hf-cache"
    name = openai_load.tokenizer_cache(served, cache)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    loaded = AutoTokenizer.from_pretrained(name, cache_dir=cache, local_files_only=True)
    text = "What is the capital of France?"
    assert loaded(text)["input_ids"] == AutoTokenizer.from_pretrained(served)(text)["input_ids"]
    with pytest.raises(OSError):  # the negative control: the same name is unknown to an empty cache
        AutoTokenizer.from_pretrained(name, cache_dir=tmp_path / "empty", local_files_only=True)


def bench_report(rates: dict[int, tuple[float, float]], ttft: float) -> dict:
    """A bench --url JSON report: per level (speculative, plain) tokens/s and a TTFT p50 in seconds."""
    return {"levels": [{"concurrency": c, "speculative_tokens_per_s": spec, "plain_tokens_per_s": plain,
                        "speculative_latency": {"time_to_first_token": {"p50": ttft}}}
                       for c, (spec, plain) in rates.items()]}


def test_the_front_cost_is_the_median_of_each_rounds_ratio():
    runs = {"grpc": [bench_report({1: (10.0, 5.0), 8: (40.0, 20.0)}, 0.100),
                     bench_report({1: (20.0, 5.0), 8: (40.0, 20.0)}, 0.200),
                     bench_report({1: (10.0, 5.0), 8: (40.0, 20.0)}, 0.100)],
            "openai": [bench_report({1: (9.0, 5.0), 8: (38.0, 19.0)}, 0.104),
                       bench_report({1: (19.0, 4.0), 8: (36.0, 20.0)}, 0.203),
                       bench_report({1: (9.9, 5.0), 8: (40.0, 18.0)}, 0.110)]}
    one, eight = openai_load.front_cost(runs, [1, 8])
    # round ratios at 1 stream: 0.90, 0.95, 0.99 (a median of the rates, 19 / 20 = 0.95 too, would differ elsewhere)
    assert one["speculative_ratio"] == pytest.approx(0.95)
    assert one["plain_ratio"] == pytest.approx(1.0)
    assert one["added_ttft_ms"] == pytest.approx(4.0)
    assert eight["speculative_ratio"] == pytest.approx(0.95)
    assert eight["plain_ratio"] == pytest.approx(0.95)
    assert eight["added_ttft_ms"] == pytest.approx(4.0)
    table = openai_load.markdown({"front_cost": [one, eight], "tools": []})
    assert "| 1 | 0.950 | 1.000 | +4.0 |" in table and "| 8 | 0.950 | 0.950 | +4.0 |" in table
    assert "tool" not in table  # no aiperf run, no table of tools


def test_cpu_seconds_count_a_process_tree(tmp_path):
    """The server's model work runs in tritonserver's child processes: a busy child counts towards its parent's pid."""
    import subprocess
    import sys

    ready = tmp_path / "busy"
    child = tmp_path / "child.py"
    child.write_text("import sys, time\nend = time.process_time() + 0.6\nwhile time.process_time() < end:\n    pass\n"
                     "open(sys.argv[1], 'w').close()\ntime.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time\n"
                               "subprocess.Popen([sys.executable, sys.argv[1], sys.argv[2]])\ntime.sleep(60)",
                               str(child), str(ready)])
    try:
        deadline = time.monotonic() + 30
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists()
        assert openai_load.cpu_seconds(parent.pid) >= 0.5  # the child's: the parent only sleeps
    finally:
        subprocess.run(["pkill", "-P", str(parent.pid)])
        parent.kill()
        parent.wait()
