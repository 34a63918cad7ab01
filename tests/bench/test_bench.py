"""bench with several pipelines: measured prompt by prompt in one run, so load drift hits every pipeline alike."""

from __future__ import annotations

import torch
from helpers.made_reports import made_report

from specdeploy.bench.printing import why_it_loses
from specdeploy.bench.results import Machine
from specdeploy.bench.run import run_benches
from specdeploy.models import machine


def test_pipelines_take_turns_prompt_by_prompt(tiny_engines, monkeypatch):
    engines = [tiny_engines["ngram"], tiny_engines["draft_target"]]
    calls = []
    for name, engine in zip(("ngram", "dt"), engines):
        original = engine.generate

        def recording(ids, params, max_tokens, num_draft_tokens=None, _name=name, _original=original):
            calls.append((_name, "plain" if num_draft_tokens == 0 else "speculative", len(ids)))
            return _original(ids, params, max_tokens, num_draft_tokens=num_draft_tokens)

        monkeypatch.setattr(engine, "generate", recording)
    prompts = [{"prompt": "abcabcabc", "kind": "copy"}, {"prompt": "hello world, hello", "kind": "open"}]
    reports = run_benches(engines, prompts, 8, 0.0, 0, with_transformers=False, quiet=True)
    measured = calls[2:]  # after one warm-up call per engine
    lengths = [len(engines[0].encode_prompt(p["prompt"])) for p in prompts]
    assert measured == [(name, mode, length) for length in lengths for name in ("ngram", "dt")
                        for mode in ("plain", "speculative")]
    assert [r.setup.pipeline for r in reports] == [e.pipeline.name for e in engines]
    assert all(r.setup.prompts == 2 and set(r.summary.by_kind) == {"copy", "open"} for r in reports)


def test_a_loss_is_explained_and_blames_the_cpu_only_when_bf16_runs_generic():
    def losing_report(dtype: str, bf16_matmul: str, speedup: float = 0.26):
        report = made_report(summary={"speedup": speedup, "proposal_cost_per_step": 0.26, "verify_cost_ratio": 5.94,
                                      "mean_accepted_length": 1.58}, setup={"dtype": dtype})
        report.setup.machine.bf16_matmul = bf16_matmul
        return report

    generic = why_it_loses(losing_report("bfloat16", "generic (time grows with rows)"))
    assert "0.26x" in generic and "5.94 to verify" in generic and "AVX-512 or AMX" in generic
    assert "AVX-512" not in why_it_loses(losing_report("bfloat16", "oneDNN"))
    assert "AVX-512" not in why_it_loses(losing_report("float32", "generic (time grows with rows)"))
    assert why_it_loses(losing_report("bfloat16", "generic (time grows with rows)", speedup=1.2)) is None


def test_the_machine_is_described_from_cpuinfo_and_torch():
    described = machine.describe()
    flags = set(machine.cpu_info().get("flags", "").split())
    assert set(described["matmul_flags"]) == flags & set(machine.MATMUL_FLAGS)
    assert described["bf16_matmul"].startswith("oneDNN") == machine.onednn_bf16()
    capability = described["weight_only_kernels"].removeprefix("ATen ")
    assert capability in ("AVX512", "AVX2", "DEFAULT", "ZVECTOR", "VSX", "SVE256", "SVE128")
    if flags and "avx2" not in flags:
        assert capability not in ("AVX512", "AVX2")
    assert described["threads"] == torch.get_num_threads() and described["cpu"]
    assert described["cpu_threads"]["threads"] == described["threads"]  # and how the count was chosen
    assert Machine.from_json(described).cpu_threads == described["cpu_threads"]
    # oneDNN's bf16 kernels need AVX-512 (BW) or AMX or AVX-NE-CONVERT: a CPU with none of them gets the generic one
    if flags and not flags & {"avx512bw", "amx_bf16", "avx_ne_convert"}:
        assert not machine.onednn_bf16()


def test_a_kind_that_decoded_nothing_has_no_speedup(tiny_engines):
    from specdeploy.bench.summary import PromptRun, summarize
    from specdeploy.decoding.stats import RequestStats

    def stats(tokens: int, seconds: float) -> RequestStats:
        return RequestStats(generated_tokens=tokens, steps=tokens, verify_seconds=seconds, total_seconds=seconds)

    runs = [PromptRun("code", stats(10, 1.0), stats(10, 0.5), [], []),
            PromptRun("summary", stats(1, 0.0), stats(1, 0.0), [], [])]  # ended at its first token
    by_kind = summarize(tiny_engines["ngram"], runs).by_kind
    assert set(by_kind) == {"code"} and by_kind["code"].prompts == 1
