"""scripts/trtllm-check.sh, the one command that settles the TensorRT-LLM path on a GPU, checked here where no GPU
is: the script parses, its dry run prints every step and does nothing, and its Python steps (scripts/
trtllm_check.py) give pipelines the build can plan, the overlay's serving command, a two-sample test that passes
equal samples and fails different ones, and a summary whose exit status says whether anything failed."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
from helpers.repo import REPO, load_script

from specdeploy.build.trtllm.engine_build import plan
from specdeploy.spec.pipeline import load_pipeline

SCRIPT = REPO / "scripts" / "trtllm-check.sh"
METHODS = ("draft-target", "ngram", "medusa")


@pytest.fixture(autouse=True, scope="module")
def configs_read_once():
    """The SmolLM2 GGUF's configuration, read once for this module (transformers parses the whole file)."""
    from specdeploy.build import checkpoints
    from specdeploy.build.trtllm import engine_build as trtllm

    read, seen = checkpoints.target_config, {}
    with pytest.MonkeyPatch.context() as patch:
        def cached(pipeline):
            key = pipeline.target.checkpoint
            if key not in seen:
                seen[key] = read(pipeline)
            return seen[key]

        patch.setattr(checkpoints, "target_config", cached)
        patch.setattr(trtllm, "target_config", cached)
        yield


def helper():
    return load_script("trtllm_check")


def test_the_script_parses_and_its_dry_run_prints_every_step_and_runs_none(tmp_path):
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    out = tmp_path / "check"
    result = subprocess.run([str(SCRIPT), "--dry-run", str(out)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert not out.exists()  # nothing written, nothing built or started
    lines = result.stdout.splitlines()
    assert "nvidia-smi" in lines[0] and "import tensorrt_llm, specdeploy" in lines[0]
    for method in METHODS:
        name = f"smollm2-{method}-trtllm"
        steps = [line.split(": ")[1] for line in lines if line.startswith(f"[trtllm-check] {name}: ")]
        expected = ["variant", "build", "torch-build", "package", "serve", "ready", "greedy", "distribution",
                    "speed", "stop the server (SIGTERM to its process group, then wait)"]
        if method == "medusa":
            expected.remove("distribution")
        assert steps == expected, (method, steps)
        assert f"specdeploy build {out}/pipelines/{name}.yaml --engines-dir {out}/engines" in result.stdout
        assert f"specdeploy package {out}/pipelines/{name}.yaml" in result.stdout
    assert lines[-2].endswith(f"summary {out}") and "exit status 0" in lines[-1]
    only = subprocess.run([str(SCRIPT), "--dry-run", "--only", "ngram", str(out)], capture_output=True, text=True)
    assert only.returncode == 0 and "smollm2-ngram-trtllm" in only.stdout and "draft-target" not in only.stdout


@pytest.mark.smollm2
@pytest.mark.parametrize("method", METHODS)
def test_the_trtllm_variants_of_the_shipped_pipelines_plan(tmp_path, method):
    path = helper().trtllm_variant(REPO / "pipelines" / f"smollm2-{method}.yaml", tmp_path)
    pipeline = load_pipeline(path)
    assert pipeline.backend.kind == "trtllm" and pipeline.backend.settings.line == "engine"
    assert pipeline.name == f"smollm2-{method}-trtllm"
    policy = pipeline.serving.policy  # the checks send 16 requests at once: speculate at any load
    assert policy.full_up_to == policy.off_above == pipeline.limits.max_batch_size
    steps, notes = plan(pipeline, tmp_path / "engines")
    assert notes[0].startswith("target: llama, 9 attention heads, 3 key/value heads")
    builds = [step for step in steps if step.command and step.command[0] == "trtllm-build"]
    assert len(builds) == (2 if method == "draft-target" else 1)
    if method == "medusa":
        assert Path(pipeline.speculation.medusa.heads).is_file()  # made absolute: the copy lives elsewhere


@pytest.mark.smollm2
def test_the_servers_command_is_the_overlays(tmp_path):
    check = helper()
    two_engines = check.trtllm_variant(REPO / "pipelines" / "smollm2-draft-target.yaml", tmp_path)
    command = check.serve_command(two_engines, tmp_path / "repo")
    # mpirun runs under the launcher, which drains tritonserver on SIGTERM before stopping mpirun
    assert command.startswith("env TRTLLM_ORCHESTRATOR=1 python3 -m specdeploy.deploy.launch run --drain-timeout 40 "
                              "--drain-rank 0 -- mpirun --allow-run-as-root -n 1 tritonserver")
    assert f"--model-repository={tmp_path / 'repo'}" in command
    assert "--pinned-memory-pool-byte-size=0 --enable-peer-access=false --cuda-memory-pool-byte-size=0:0" in command
    one_engine = check.trtllm_variant(REPO / "pipelines" / "smollm2-ngram.yaml", tmp_path)
    plain = check.serve_command(one_engine, tmp_path / "repo")
    assert plain.startswith("tritonserver ") and "--grpc-port=8001" in plain and "TRTLLM_ORCHESTRATOR" not in plain


def samples(probabilities: list[list[float]], trials: int, seed: int) -> list[tuple[int, ...]]:
    """trials sequences of 3 tokens: the first from probabilities[0], the next two from a row picked by the
    previous token (a toy conditional model)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(trials):
        sequence = [int(rng.choice(4, p=probabilities[0]))]
        for _ in range(2):
            sequence.append(int(rng.choice(4, p=probabilities[1 + sequence[-1] % 2])))
        out.append(tuple(sequence))
    return out


def test_the_two_sample_test_passes_equal_samples_and_fails_biased_ones():
    """At the check's trials per arm. The bias: token matching's on a proposal of the mode, p → p(2 − p)."""
    check = helper()
    trials = check.DISTRIBUTION_TRIALS
    model = [[0.4, 0.3, 0.2, 0.1], [0.5, 0.25, 0.15, 0.1], [0.2, 0.3, 0.3, 0.2]]
    biased = [[0.4, 0.3, 0.2, 0.1], [0.75, 0.125, 0.075, 0.05], [0.2, 0.3, 0.3, 0.2]]
    p_value, dof, tested = check.homogeneity(samples(model, trials, 1), samples(model, trials, 2), (1, 2))
    assert p_value > check.DISTRIBUTION_P_VALUE and dof > 0 and tested > trials
    p_value, _, _ = check.homogeneity(samples(model, trials, 1), samples(biased, trials, 2), (1, 2))
    assert p_value < 1e-6


def test_greedy_texts_agree_when_equal_or_parting_after_sixteen_tokens():
    check = helper()
    text = list(range(40))
    assert check.agrees(text, text) and check.agrees(text, text[:20] + [99] * 20)
    assert not check.agrees(text, text[:5] + [99] * 35)
    assert check.agrees(text[:3], text[:3]) and not check.agrees(text[:3], [0, 1, 7])
    assert not check.agrees([], text) and not check.agrees(text[:30], text)  # nothing, or an early end


def test_waiting_for_a_server_that_ended_fails_at_once():
    with pytest.raises(SystemExit, match="ended before it was ready"):
        helper().wait_ready("http://127.0.0.1:9", 600, 2**22 + 7)  # no such process


def test_the_summary_fails_on_any_failed_step_or_check(tmp_path, capsys):
    check = helper()
    assert check.summary(tmp_path) == 1  # nothing ran
    first = tmp_path / "smollm2-ngram-trtllm"
    first.mkdir()
    (first / "greedy.json").write_text(json.dumps({"check": "greedy", "ok": True, "detail": "5/5 equal"}))
    level = {"concurrency": 1, "speculative_tokens_per_s": 300.0, "plain_tokens_per_s": 200.0, "speedup": 1.5,
             "acceptance_rate": 0.6, "failed": 0}
    (first / "speed.json").write_text(json.dumps({"levels": [level, {**level, "concurrency": 8}]}))
    assert check.summary(tmp_path) == 0
    assert "1.50x" in capsys.readouterr().out
    (first / "speed.json").write_text(json.dumps({"levels": [level, {**level, "concurrency": 8, "failed": 2}]}))
    assert check.summary(tmp_path) == 1  # a failure at any concurrency
    (first / "speed.json").write_text(json.dumps({"levels": [level]}))
    second = tmp_path / "smollm2-medusa-trtllm"
    second.mkdir()
    (second / "FAILED-build").write_text("failed; its log: build.log")
    assert check.summary(tmp_path) == 1
    assert "smollm2-medusa-trtllm" in capsys.readouterr().out
