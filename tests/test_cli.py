"""The command line and the builder: clear errors, non-zero exits, nothing written half-way, skipped rebuilds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.cli import run_cli
from helpers.pipelines import tiny_pipeline, write_pipeline
from helpers.repo import REPO

from specdeploy.build.torch_engine import build
from specdeploy.errors import BuildError
from specdeploy.spec.pipeline import load_pipeline


def test_console_script_exit_status(tmp_path):
    """One real process: the installed entry point exits 2 with a one-line error."""
    path = tmp_path / "bad.yaml"
    path.write_text("name: [unclosed\n")
    result = subprocess.run([sys.executable, "-m", "specdeploy.cli", "build", str(path)], capture_output=True,
                            text=True, cwd=REPO, timeout=300)
    assert result.returncode == 2
    assert result.stderr.startswith(f"error: {path}: malformed YAML")
    assert "Traceback" not in result.stderr


def assert_no_engine(engines: Path, name: str) -> None:
    """A failed build leaves neither the engine nor a half-written staging directory behind (only the engine's
    lock file, which stays: see engine_paths.build_lock)."""
    assert not (engines / name).exists()
    assert not [p for p in engines.glob(f".{name}*") if p.name != f".{name}.lock"] if engines.exists() else True


@pytest.fixture
def tiny_dt(tmp_path, tiny_checkpoints) -> Path:
    return tiny_pipeline(tmp_path, "tiny-cli", tiny_checkpoints["target"], draft=tiny_checkpoints["draft"])


def test_build_then_skip_then_force(tmp_path, tiny_dt):
    engines = tmp_path / "engines"
    first = run_cli("build", str(tiny_dt), "--engines-dir", str(engines))
    assert first.returncode == 0, first.stderr
    manifest = json.loads((engines / "tiny-cli" / "build_manifest.json").read_text())
    assert manifest["components"] == ["draft", "target"]
    assert len(manifest["source_checksum"]) == 64 and manifest["versions"]["specdeploy"]
    for component in ("target", "draft"):
        files = {p.name for p in (engines / "tiny-cli" / component).iterdir()}
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= files
    config = json.loads((engines / "tiny-cli" / "target" / "config.json").read_text())
    assert set(config) == {"model", "dtype"} and config["model"]["architecture"] == "llama"
    saved = load_pipeline(engines / "tiny-cli" / "pipeline.json")
    assert saved == load_pipeline(tiny_dt).resolved()
    assert saved.speculation.num_draft_tokens == 3 and saved.limits.max_sequence_length == 256
    stamp = (engines / "tiny-cli" / "build_manifest.json").stat().st_mtime_ns

    again = run_cli("build", str(tiny_dt), "--engines-dir", str(engines))
    assert again.returncode == 0 and "up to date" in again.stdout
    assert (engines / "tiny-cli" / "build_manifest.json").stat().st_mtime_ns == stamp

    forced = run_cli("build", str(tiny_dt), "--engines-dir", str(engines), "--force")
    assert forced.returncode == 0, forced.stderr
    assert (engines / "tiny-cli" / "build_manifest.json").stat().st_mtime_ns != stamp


def test_changed_pipeline_rebuilds(tmp_path, tiny_checkpoints):
    engines = tmp_path / "engines"
    path = tiny_pipeline(tmp_path, "tiny-re", tiny_checkpoints["target"], gamma=2)
    build(load_pipeline(path), engines, quiet=True)
    path = tiny_pipeline(tmp_path, "tiny-re", tiny_checkpoints["target"], gamma=4)
    build(load_pipeline(path), engines, quiet=True)
    assert load_pipeline(engines / "tiny-re" / "pipeline.json").speculation.num_draft_tokens == 4


@pytest.mark.parametrize("other, fragment", [("other_vocab", "map to other ids"),
                                             ("smaller_vocab", "vocabulary sizes 112 (draft) and 128 (target)")])
def test_tokenizer_mismatch_refused(tmp_path, tiny_checkpoints, other, fragment):
    engines = tmp_path / "engines"
    path = tiny_pipeline(tmp_path, "tiny-mismatch", tiny_checkpoints["target"], draft=tiny_checkpoints[other])
    result = run_cli("build", str(path), "--engines-dir", str(engines))
    assert result.returncode != 0
    assert "tokenizers differ" in result.stderr and fragment in result.stderr
    assert "Traceback" not in result.stderr
    assert_no_engine(engines, "tiny-mismatch")


def test_failed_rebuild_keeps_the_previous_engine(tmp_path, tiny_checkpoints):
    engines = tmp_path / "engines"
    good = tiny_pipeline(tmp_path, "tiny-keep", tiny_checkpoints["target"], draft=tiny_checkpoints["draft"])
    build(load_pipeline(good), engines, quiet=True)
    bad = tiny_pipeline(tmp_path, "tiny-keep", tiny_checkpoints["target"], draft=tiny_checkpoints["other_vocab"])
    with pytest.raises(BuildError):
        build(load_pipeline(bad), engines, quiet=True)
    assert (engines / "tiny-keep" / "build_manifest.json").is_file()
    assert [p.name for p in engines.glob(".tiny-keep*")] == [".tiny-keep.lock"]  # no staging left, the lock stays


def test_missing_checkpoint(tmp_path):
    path = write_pipeline(tmp_path / "missing.yaml", name="missing",
                          target={"checkpoint": {"source": "hf_dir", "path": "no/such/dir"}})
    result = run_cli("build", str(path), "--engines-dir", str(tmp_path / "engines"))
    assert result.returncode != 0
    assert "checkpoint not found" in result.stderr and "no/such/dir" in result.stderr
    assert_no_engine(tmp_path / "engines", "missing")


@pytest.mark.parametrize("text, fragments", [
    ("name: [unclosed\n", ["malformed YAML"]),
    ("name: x\ntarget: {checkpoint: {source: gguf, path: a.gguf}}\nspeculation: {method: jacobi}\n",
     ["speculation.method", "'jacobi'", "'draft_target', 'ngram', 'medusa', 'eagle', 'early_exit', 'lookahead', "
                                        "'none'"]),
    ("name: x\ntarget: {checkpoint: {source: gguf, path: a.gguf}}\nspeculation: {method: ngram, num_draft_tokens: 0}\n",
     ["speculation.num_draft_tokens", "must be ≥ 1"]),
    ("name: x\ntarget: {checkpoint: {source: gguf, path: a.gguf}}\nspeculation: {method: ngram, num_draft_tokens: 40}"
     "\n", ["speculation.num_draft_tokens", "above limits.max_draft_tokens (16)"]),
    ("name: x\ntarget: {checkpoint: {source: gguf, path: a.gguf}, colour: red}\n", ["target", "unknown key 'colour'"]),
])
def test_bad_pipeline_exits_nonzero_with_clear_message(tmp_path, text, fragments):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    result = run_cli("build", str(path), "--engines-dir", str(tmp_path / "engines"))
    assert result.returncode == 2
    assert str(path) in result.stderr and "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in result.stderr
    assert not (tmp_path / "engines").exists()


def test_generate_json_and_bad_requests(tmp_path, tiny_dt):
    engines = str(tmp_path / "engines")
    ok = run_cli("generate", str(tiny_dt), "hello world", "--max-tokens", "12", "--json", "--engines-dir", engines)
    assert ok.returncode == 0, ok.stderr
    result = json.loads(ok.stdout)
    assert result["generated_tokens"] == len(result["tokens"]) <= 12
    assert result["method"] == "draft_target" and result["num_draft_tokens"] == 3
    for key in ("text", "drafted", "accepted", "acceptance_rate", "mean_accepted_length", "per_position_acceptance",
                "steps", "draft_seconds", "verify_seconds"):
        assert key in result
    plain = run_cli("generate", str(tiny_dt), "hello world", "--max-tokens", "12", "--json", "--no-speculation",
                    "--engines-dir", engines)
    assert json.loads(plain.stdout)["tokens"] == result["tokens"]  # greedy: same text either way
    assert json.loads(plain.stdout)["drafted"] == 0
    compared = json.loads(run_cli("generate", str(tiny_dt), "hello world", "--max-tokens", "12", "--json",
                                  "--compare", "--engines-dir", engines).stdout)
    assert compared["speedup"] == pytest.approx(compared["decode_tokens_per_s"] / compared["plain_tokens_per_s"])
    streamed = run_cli("generate", str(tiny_dt), "hello world", "--max-tokens", "12", "--compare",
                       "--engines-dir", engines)
    assert streamed.returncode == 0 and "acceptance" in streamed.stdout and "speedup" in streamed.stdout
    assert streamed.stdout.startswith(result["text"])

    for args, fragment in [(["   "], "text_input: must not be empty"),
                           (["x" * 65], "prompt: 65 tokens is over limits.max_input_length (64)"),
                           (["hi", "--num-draft-tokens", "9"], "num_draft_tokens: must be in [0, 8]"),
                           (["hi", "--top-p", "1.5"], "top_p: must be in (0, 1]"),
                           (["hi", "--max-tokens", "0"], "max_tokens: must be ≥ 1")]:
        bad = run_cli("generate", str(tiny_dt), *args, "--engines-dir", engines)
        assert bad.returncode == 2, (args, bad.stderr)
        assert fragment in bad.stderr and "Traceback" not in bad.stderr


def test_generate_over_grpc_prints_the_servers_statistics(monkeypatch):
    """The gRPC path's report, without a server: the last response's statistics, the rates end to end."""
    from specdeploy.serve import client

    def responses(url, prompt, max_tokens, stream=True, **fields):
        plain = fields.get("num_draft_tokens") == 0
        statistics = {"total_draft_tokens": 0 if plain else 9, "total_accepted_draft_tokens": 0 if plain else 6,
                      "acceptance_rate": 0.0 if plain else 0.75, "generated_tokens": 9,
                      "verification_steps": 8 if plain else 3}
        yield client.Chunk("hello ", {**statistics, "generated_tokens": 4}, False)
        yield client.Chunk("world", statistics, False)
        yield client.Chunk("", {}, True)

    monkeypatch.setattr(client, "generate", responses)
    shown = run_cli("generate", "--url", "host:1", "hi", "--compare")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("hello world\n[host:1] 9 tokens in ")
    assert "tokens/s end to end); acceptance 0.75, mean accepted length 2.67\n" in shown.stdout
    assert "plain decode over the same server: " in shown.stdout
    report = json.loads(run_cli("generate", "--url", "host:1", "hi", "--json", "--compare").stdout)
    assert list(report) == ["text", "total_draft_tokens", "total_accepted_draft_tokens", "acceptance_rate",
                            "generated_tokens", "verification_steps", "seconds", "tokens_per_s",
                            "mean_accepted_length", "plain_tokens_per_s", "speedup"]
    assert report["text"] == "hello world" and report["mean_accepted_length"] == pytest.approx(8 / 3)
    assert report["speedup"] == pytest.approx(report["tokens_per_s"] / report["plain_tokens_per_s"])


def test_bench_reports_every_key(tmp_path, tiny_checkpoints):
    path = tiny_pipeline(tmp_path, "tiny-bench", tiny_checkpoints["target"], method="ngram")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "abcabcabcabc", "kind": "edit"}\n{"prompt": "hello there"}\n')
    out = tmp_path / "bench.json"
    result = run_cli("bench", str(path), "--prompts", str(prompts), "--max-tokens", "16", "--json", str(out),
                     "--engines-dir", str(tmp_path / "engines"))
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    for key in ("baseline_tokens_per_s", "speculative_tokens_per_s", "speedup", "acceptance_rate",
                "mean_accepted_length", "draft_cost_ratio", "verify_cost_ratio", "predicted_speedup",
                "greedy_match", "per_position_acceptance", "num_draft_tokens", "method", "dtype",
                "bandwidth_ceiling_tokens_per_s", "fraction_of_ceiling", "transformers_tokens_per_s", "machine"):
        assert key in report, key
    assert report["machine"]["threads"] == report["threads"] and "bf16 matmul:" in result.stdout
    assert report["greedy_match"] is True and report["method"] == "ngram" and report["dtype"] == "float32"
    assert report["speedup"] == pytest.approx(report["speculative_tokens_per_s"] / report["baseline_tokens_per_s"])
    assert set(report["by_kind"]) == {"edit", "other"}


def test_bench_puts_pipelines_side_by_side_from_one_run(tmp_path, tiny_checkpoints):
    ngram = tiny_pipeline(tmp_path, "tiny-ngram-side", tiny_checkpoints["target"], method="ngram")
    dt = tiny_pipeline(tmp_path, "tiny-dt-side", tiny_checkpoints["target"], draft=tiny_checkpoints["draft"])
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "abcabcabcabc", "kind": "copy"}\n{"prompt": "hello there", "kind": "open"}\n')
    out = tmp_path / "side.json"
    result = run_cli("bench", str(ngram), str(dt), "--prompts", str(prompts), "--max-tokens", "12", "--json",
                     str(out), "--no-transformers", "--engines-dir", str(tmp_path / "engines"), "--report",
                     str(tmp_path / "report"), "--price-per-hour", "3.6")
    assert result.returncode == 0, result.stderr
    assert "side by side" in result.stdout and "tiny-ngram-side" in result.stdout
    report = (tmp_path / "report" / "report.md").read_text()
    assert "tiny-ngram-side (ngram)" in report and "tiny-dt-side (draft_target)" in report
    assert "| machine price per hour | $3.60 | $3.60 |" in report
    assert "speculative, per million output tokens" in report and "cost: plain_usd_per_million_tokens" in result.stdout
    assert (tmp_path / "report" / "speedup.png").is_file()
    saved = json.loads(out.read_text())
    comparison, reports = saved["comparison"], saved["reports"]
    assert comparison["pipelines"] == ["tiny-ngram-side", "tiny-dt-side"]
    assert [r["method"] for r in reports] == ["ngram", "draft_target"]
    for report in reports:
        assert comparison["figures"]["speedup"][report["pipeline"]] == report["speedup"]
        assert report["greedy_match"] is True
        # $3.60 an hour is $0.001 a second: a million tokens at r tokens/s cost 1000 / r dollars
        cost = report["cost"]
        assert cost["price_per_hour"] == 3.6
        assert cost["plain_usd_per_million_tokens"] == pytest.approx(1000 / report["baseline_tokens_per_s"])
        assert cost["speculative_usd_per_million_tokens"] == pytest.approx(1000 / report["speculative_tokens_per_s"])
    for kind, row in comparison["by_kind"].items():
        assert row["winner"] == max(row["speedup"], key=row["speedup"].get)
        assert row["speedup"] == {r["pipeline"]: r["by_kind"][kind]["speedup"] for r in reports}
    assert run_cli("bench", str(ngram), str(dt), "--url", "localhost:1").returncode == 2
    too_wide = run_cli("bench", str(ngram), "--gammas", "1,99", "--engines-dir", str(tmp_path / "engines"))
    assert too_wide.returncode == 2 and "limits.max_draft_tokens" in too_wide.stderr
    refused = run_cli("bench", "--url", "localhost:1", "--stress", "10", "--report", str(tmp_path / "r"))
    assert refused.returncode == 2 and "--report" in refused.stderr
    for price in ("0", "-1", "free"):
        unpriced = run_cli("bench", str(ngram), "--price-per-hour", price)
        assert unpriced.returncode == 2 and "--price-per-hour" in unpriced.stderr, unpriced.stderr


def test_cost_per_million_tokens_is_the_hourly_price_over_an_hours_tokens():
    from specdeploy.bench.results import BenchReport, Cost

    cost = Cost.at(2.0, plain_tokens_per_s=50.0, speculative_tokens_per_s=0.0)
    assert cost.plain_usd_per_million_tokens == pytest.approx(2.0 / (50 * 3600) * 1e6)  # $11.11
    assert cost.speculative_usd_per_million_tokens is None  # nothing decoded: no price per token
    assert Cost.from_json({"price_per_hour": 2.0, "plain_usd_per_million_tokens": 11.1,
                           "speculative_usd_per_million_tokens": None}).plain_usd_per_million_tokens == 11.1
    assert "cost" in BenchReport.__dataclass_fields__


def test_bench_rejects_bad_prompt_file(tmp_path, tiny_dt):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "fine"}\n{"text": "no prompt key"}\n')
    result = run_cli("bench", str(tiny_dt), "--prompts", str(prompts), "--engines-dir", str(tmp_path / "engines"))
    assert result.returncode == 2
    assert f"{prompts}:2" in result.stderr and "'prompt'" in result.stderr


def test_int4_draft_and_target_need_group_aligned_sizes(tmp_path):
    from helpers.tiny_models import save_tiny_checkpoint

    odd = save_tiny_checkpoint(tmp_path / "odd", seed=4, hidden_size=48, intermediate_size=96)
    path = tiny_pipeline(tmp_path, "tiny-odd", odd)
    with pytest.raises(BuildError, match="hidden_size divisible by 32, got 48"):
        build(load_pipeline(path), tmp_path / "engines", quiet=True)
    assert_no_engine(tmp_path / "engines", "tiny-odd")
    target = tiny_pipeline(tmp_path, "tiny-odd-target", odd, method="ngram", dtype="bfloat16",
                           target_weight_only="int4")
    with pytest.raises(BuildError, match=r"target\.weight_only int4 needs hidden_size divisible by 32, got 48 .*use "
                                         r"int8"):
        build(load_pipeline(target), tmp_path / "engines", quiet=True)
    assert_no_engine(tmp_path / "engines", "tiny-odd-target")


def test_up_to_date_check_hashes_only_changed_sources(tmp_path, tiny_checkpoints, monkeypatch):
    """A second build reads sizes and modification times, and hashes a source only when they changed."""
    import os
    import shutil

    from specdeploy.spec import manifest

    source = shutil.copytree(tiny_checkpoints["target"], tmp_path / "source")
    path = tiny_pipeline(tmp_path, "tiny-hash", source, method="ngram")
    engines = tmp_path / "engines"
    assert build(load_pipeline(path), engines, quiet=True).built
    hashed = []
    original = manifest.file_sha256
    monkeypatch.setattr(manifest, "file_sha256", lambda file: hashed.append(file.name) or original(file))
    assert not build(load_pipeline(path), engines, quiet=True).built
    assert hashed == []
    weights = source / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))  # touched, same bytes
    assert not build(load_pipeline(path), engines, quiet=True).built
    assert hashed == ["model.safetensors"]
    assert not build(load_pipeline(path), engines, quiet=True).built  # its new time was recorded
    assert hashed == ["model.safetensors"]
    config = source / "config.json"
    config.write_text(config.read_text() + "\n")  # changed bytes: rebuilt
    assert build(load_pipeline(path), engines, quiet=True).built


def test_changed_serving_defaults_update_the_engine_pipeline_without_a_rebuild(tmp_path, tiny_checkpoints):
    engines = tmp_path / "engines"
    path = tiny_pipeline(tmp_path, "tiny-serving", tiny_checkpoints["target"], method="ngram")
    assert build(load_pipeline(path), engines, quiet=True).built
    path = tiny_pipeline(tmp_path, "tiny-serving", tiny_checkpoints["target"], method="ngram",
                         sampling={"temperature": 0.5}, serving={"policy": {"full_up_to": 3, "off_above": 5}})
    assert not build(load_pipeline(path), engines, quiet=True).built
    saved = load_pipeline(engines / "tiny-serving" / "pipeline.json")
    assert saved.sampling.temperature == 0.5 and saved.serving.policy.off_above == 5


def test_a_pipeline_named_dot_cannot_remove_the_engines_directory(tmp_path, tiny_checkpoints):
    engines = tmp_path / "engines"
    engines.mkdir()
    (engines / "keep.txt").write_text("another engine's file")
    path = tiny_pipeline(tmp_path, "dot", tiny_checkpoints["target"], method="ngram")
    path.write_text(path.read_text().replace("name: dot", "name: ."))
    result = run_cli("build", str(path), "--engines-dir", str(engines))
    assert result.returncode == 2 and "name" in result.stderr and "not starting with '.'" in result.stderr
    assert (engines / "keep.txt").read_text() == "another engine's file"


def test_an_engine_linked_outside_the_engines_directory_is_refused(tmp_path, tiny_checkpoints):
    from specdeploy.errors import SpecdeployError

    engines, elsewhere = tmp_path / "engines", tmp_path / "elsewhere"
    engines.mkdir()
    elsewhere.mkdir()
    (elsewhere / "precious.txt").write_text("not an engine")
    (engines / "linked").symlink_to(elsewhere)
    with pytest.raises(SpecdeployError, match="directly inside"):
        build(load_pipeline(tiny_pipeline(tmp_path, "linked", tiny_checkpoints["target"], method="ngram")),
              engines, quiet=True)
    assert (elsewhere / "precious.txt").read_text() == "not an engine"


@pytest.fixture
def built_ngram(tmp_path, tiny_checkpoints):
    path = tiny_pipeline(tmp_path, "tiny-checked", tiny_checkpoints["target"], method="ngram")
    directory = build(load_pipeline(path), tmp_path / "engines", quiet=True).directory
    return path, directory


def test_a_truncated_engine_is_rebuilt_and_refused_at_load(tmp_path, built_ngram):
    from specdeploy.errors import SpecdeployError
    from specdeploy.runtime.engine import Engine

    path, directory = built_ngram
    weights = directory / "target" / "model.safetensors"
    size = weights.stat().st_size
    with weights.open("r+b") as handle:
        handle.truncate(size // 2)
    with pytest.raises(SpecdeployError, match=r"target/model.safetensors: \d+ bytes, the build wrote \d+"):
        Engine(directory)
    assert build(load_pipeline(path), tmp_path / "engines", quiet=True).built  # not "up to date"
    assert weights.stat().st_size == size
    Engine(directory)


def test_weights_overwritten_with_nan_are_an_error_not_empty_text(tmp_path, built_ngram):
    """Same size, changed bytes: refused by the manifest's checksum; and a model whose logits are not finite is
    refused at load even without a manifest to compare with."""
    from safetensors.torch import load_file, save_file

    from specdeploy.errors import SpecdeployError
    from specdeploy.models.registry import load_component
    from specdeploy.runtime.engine import Engine

    _, directory = built_ngram
    weights = directory / "target" / "model.safetensors"
    state = load_file(str(weights))
    state["model.norm.weight"] = torch.full_like(state["model.norm.weight"], float("nan"))
    save_file(state, str(weights))
    with pytest.raises(SpecdeployError, match="contents changed since the build"):
        Engine(directory)
    with pytest.raises(SpecdeployError, match="logits are not finite"):
        load_component(directory / "target")


def test_non_finite_logits_during_generation_are_an_error(tiny_engines, monkeypatch):
    from specdeploy.errors import SpecdeployError
    from specdeploy.spec.sampling_params import SamplingParams

    engine = tiny_engines["ngram"]
    original = engine.target.logits
    monkeypatch.setattr(engine.target, "logits", lambda hidden: original(hidden) * float("nan"))
    with pytest.raises(SpecdeployError, match="logits are not finite"):
        engine.generate([5, 6, 7], SamplingParams(), 8).run()
