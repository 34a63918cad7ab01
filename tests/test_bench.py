"""bench with several pipelines: measured prompt by prompt in one run, so load drift hits every pipeline alike."""

from __future__ import annotations

from specdeploy.bench import run_benches


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
    assert [r["pipeline"] for r in reports] == [e.pipeline.name for e in engines]
    assert all(r["prompts"] == 2 and set(r["by_kind"]) == {"copy", "open"} for r in reports)
