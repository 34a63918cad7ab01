"""The steps of scripts/trtllm-check.sh that are Python: run inside the pinned TensorRT-LLM image, beside a checkout
of this repository with specdeploy installed (build/Dockerfile.gpu installs it the same way).

  python3 scripts/trtllm_check.py pipeline SHIPPED.yaml OUT_DIR
      write the shipped pipeline's TensorRT-LLM variant (engine line, bf16, speculating at any load) to OUT_DIR
      and print its path
  python3 scripts/trtllm_check.py serve-command PIPELINE.yaml REPOSITORY
      print the tritonserver command line as the Kubernetes overlay serves the pipeline (one node; two engines or
      more than one GPU: orchestrator mode), one shell-quoted line
  python3 scripts/trtllm_check.py wait-ready HTTP_URL SECONDS PID
      until the server answers ready; fails at once if process PID (the server) has ended
  python3 scripts/trtllm_check.py greedy SHIPPED.yaml URL PROMPTS.jsonl OUT.json
      greedy text of each prompt: the server's speculative against its plain decoding, and against the torch engine
      of the shipped pipeline (built beforehand; SPECDEPLOY_DEVICE, default cpu)
  python3 scripts/trtllm_check.py distribution URL OUT.json
      sampled tokens at each of SAMPLED_ARMS (T 0.7 top-k 4; T 1.0 top-k 0; T 0.7 top-k 4 with a repetition penalty;
      T 0.7 top-p 0.9 with a penalty, reported only): the server's speculative against its plain decoding (a
      two-sample test pooled over each trial's prefix; TRTLLM_CHECK_TRIALS requests per arm and side, default 3000)
  python3 scripts/trtllm_check.py budget SHIPPED.yaml URL OUT.json
      one greedy request filling limits.max_sequence_length exactly returns every token, and one more is refused
  python3 scripts/trtllm_check.py summary DIR
      one table of every check in DIR; exit status 1 if any failed

The EAGLE-3 slice runs on the llm_api line (TensorRT-LLM's engine EAGLE reads EAGLE-1 drafts only), whose server is
Triton's LLM-API model with its own requests: no `speculative` model, no per-request switch to plain decoding. So
it serves two repositories in turn, the speculative one and a plain one of the same target, and compares them:
  python3 scripts/trtllm_check.py pipeline SHIPPED.yaml OUT_DIR [--plain]
      for an EAGLE-3 pipeline, the llm_api variant (a chain: top_k 1); --plain, the same target without speculation
  python3 scripts/trtllm_check.py llmapi-run HTTP_URL TOKENIZER_DIR PROMPTS.jsonl SEED_OFFSET OUT.json
      on one LLM-API server: each prompt's greedy text, DISTRIBUTION_TRIALS sampled requests (T 0.7, top-k 4, each
      its own seed from SEED_OFFSET on) and tokens/s at concurrency 1 and 8, with the drafts each request counted
      (every request asks for them: sampling_param_return_perf_metrics)
  python3 scripts/trtllm_check.py llmapi-compare SHIPPED.yaml SPECULATIVE.json PLAIN.json OUT_DIR
      greedy.json, distribution.json and speed.json in OUT_DIR from the two runs (greedy also against the torch
      engine of the shipped pipeline, whose ids are decoded: greedy answers are compared as text), in the formats
      `summary` reads

The lookahead and Medusa slices run on the engine line, but their target engine speculates on every request (the
`speculative` model refuses num_draft_tokens 0, which cannot turn it off) and samples less than a request can ask
(lookahead: greedily only; Medusa: greedily only, its sampling not being exact), so they too serve a plain twin in
turn and compare:
  python3 scripts/trtllm_check.py pipeline SHIPPED.yaml OUT_DIR --lookahead [--plain]
      SHIPPED's target with lookahead decoding (W, N, G = LOOKAHEAD_SIZES) on the engine line; --plain, the same
      target without speculation (SHIPPED: smollm2-ngram.yaml, whose target the slice borrows); without --lookahead,
      SHIPPED's own method (smollm2-medusa.yaml) and its plain twin
  python3 scripts/trtllm_check.py twin-run GRPC_URL PROMPTS.jsonl OUT.json [--sampled SEED_OFFSET]
      on one server: each prompt's greedy tokens and drafts, a sampled request (refused or not, and the message),
      and tokens/s at concurrency 1 and 8; --sampled (Medusa), TRTLLM_CHECK_TRIALS requests at each of MEDUSA_ARMS
      (T 1.0, top-k 4: what its engine samples), seeds from SEED_OFFSET on; the `speculative` model refuses
      sampled Medusa unless its server runs with SPECDEPLOY_UNCHECKED_MEDUSA_SAMPLING=1, which serve-command sets
      for a Medusa pipeline, so these requests reach the engine
  python3 scripts/trtllm_check.py twin-compare SHIPPED.yaml SPECULATIVE.json PLAIN.json OUT_DIR
      greedy.json (speculative against plain and the torch engine, every prompt drafted), refusal.json (the
      speculative server refused the request at T 0.7, top-k 4 naming temperature, the plain one served it),
      speed.json, and after --sampled runs distribution.json (the twins' samples, two-sample test)
"""

from __future__ import annotations

import json
import os
import queue
import shlex
import sys
import time
import urllib.request
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import yaml

from specdeploy.decoding.prompt_lookup import common_prefix_length

# Greedy texts may part at a near tie of bf16 logits (different kernels, or one position against several); a
# conversion or orchestration defect parts at once. So every prompt's texts must share this many leading tokens.
MIN_SHARED_TOKENS = 16
DISTRIBUTION_TRIALS = int(os.environ.get("TRTLLM_CHECK_TRIALS", 3000))  # per arm
DISTRIBUTION_PROMPT = "Once upon a time"
# The sampling each distribution check compares speculative with plain decoding at, four tokens a request: the top-k
# the check began with, what most clients send (T 1 and no top-k: q is the whole softmax), a repetition penalty on
# the exact path, and a nucleus with a penalty. The last is reported, not required: at top_p < 1 TensorRT-LLM's
# verification keeps the token crossing top_p at full mass while its plain steps give it only its mass below the
# threshold (docs/tensorrt-llm.md), so a sound path may differ there.
SAMPLED_ARMS = {"T 0.7, top-k 4": {"temperature": 0.7, "top_k": 4},
                "T 1.0, top-k 0": {"temperature": 1.0, "top_k": 0},
                "T 0.7, top-k 4, penalty 1.2": {"temperature": 0.7, "top_k": 4, "repetition_penalty": 1.2},
                "T 0.7, top-p 0.9, penalty 1.2": {"temperature": 0.7, "top_p": 0.9, "repetition_penalty": 1.2}}
REPORTED_ONLY = {"T 0.7, top-p 0.9, penalty 1.2"}
# Medusa's engine samples at temperature 1 with top-k alone. Its tree's nodes draw from one random state per request,
# so its tokens are expected NOT to follow the plain twin's distribution (docs/tensorrt-llm.md): the `speculative`
# model refuses sampled Medusa, and lets these requests through only under UNCHECKED_MEDUSA_SAMPLING, which
# serve_command sets for a Medusa pipeline. A pass here is the evidence that would lift the refusal.
MEDUSA_ARMS = {"T 1.0, top-k 4": {"temperature": 1.0, "top_k": 4}}
TESTED_POSITIONS = (1, 2)  # the tokens of the first speculative step (the first comes from the prefill)
DISTRIBUTION_P_VALUE = 1e-3  # below this, speculative sampling differs from plain
MIN_PER_PREFIX = 30  # trials of each arm a prefix needs to enter the test
# what trtllm-check.sh writes
CHECK_FILES = ("greedy.json", "distribution.json", "budget.json", "refusal.json", "speed.json")
# The lookahead slice's (W, N, G): the LLM API example's, as in pipelines/gpu/llama8b-lookahead.yaml (23 draft tokens)
LOOKAHEAD_SIZES = {"window": 4, "ngram": 4, "verification_set": 4}
# What a lookahead or Medusa server must refuse (neither engine scales by a temperature), and a plain one serve
REFUSAL_REQUEST = {"temperature": 0.7, "top_k": 4, "random_seed": 1}
# What every request to the LLM-API model sends beside its prompt and sampling: one answer (not streamed), the new
# text only, and the perf metrics, without which upstream's model leaves out the draft counters the slice needs
# (NVIDIA/TensorRT-LLM@b35ac1b6 triton_backend/all_models/llmapi/tensorrt_llm/1/model.py `_create_response` sends
# them only when the output carries request_perf_metrics; helpers.py `get_sampling_params_from_request` defaults
# sampling_param_return_perf_metrics to False)
LLMAPI_REQUEST = {"streaming": False, "sampling_param_exclude_input_from_output": True,
                  "sampling_param_return_perf_metrics": True}


def trtllm_variant(shipped: Path, out_dir: Path, plain: bool = False, lookahead: bool = False) -> Path:
    """The shipped torch pipeline as a TensorRT-LLM pipeline: same models and speculation, bf16, relative paths made
    absolute (the copy lives elsewhere), and a policy that speculates at any load (the shipped one stops above 4
    running requests, and the checks send 16 at once). The engine line, but for an EAGLE-3 pipeline the llm_api line
    (its head drafting the chain TensorRT-LLM drafts: top_k 1). lookahead: the shipped pipeline's target with
    lookahead decoding instead of its method (LOOKAHEAD_SIZES, greedy defaults), named smollm2-lookahead-trtllm.
    plain: the same target without speculation."""
    from specdeploy.spec.pipeline import load_pipeline
    from specdeploy.spec.speculation import LookaheadSpec

    llm_api = load_pipeline(shipped).speculation.traits.trtllm.lines == ("llm_api",)
    spec = yaml.safe_load(shipped.read_text())
    if lookahead:
        spec["name"] = "smollm2-lookahead"
        spec["speculation"] = {"method": "lookahead", "lookahead": dict(LOOKAHEAD_SIZES)}
        spec["sampling"] = {**spec.get("sampling", {}), "temperature": 0.0, "repetition_penalty": 1.0}
        nodes = LookaheadSpec(**LOOKAHEAD_SIZES).nodes
        spec["limits"]["max_draft_tokens"] = max(spec["limits"].get("max_draft_tokens", 0), nodes)
    spec["name"] = f"{spec['name']}{'-plain' if plain else ''}-trtllm"
    spec["backend"] = {"kind": "trtllm", "trtllm": {"line": "llm_api" if llm_api else "engine",
                                                    "dtype": "bfloat16"}}
    rows = spec["limits"]["max_batch_size"]
    spec.setdefault("serving", {})["policy"] = {"full_up_to": rows, "off_above": rows}
    medusa = spec["speculation"].get("medusa")
    if medusa and not Path(medusa["heads"]).is_absolute():
        medusa["heads"] = str((shipped.parent / medusa["heads"]).resolve())
    if medusa:
        medusa.pop("draft_vocab", None)  # the torch engine's: TensorRT-LLM projects through the whole head
    # The target in bf16 on either line, so that greedy text is compared like with like. The shipped torch target's
    # weight_only: int4 is the GGUF's own Q4_1 groups (lossless against the file); TensorRT-LLM's weight-only int4
    # re-quantizes the dequantized weights per channel (W4A16, build/trtllm/convert.py), a lossier model whose text
    # may part from the torch engine's early on a sound path. bf16 holds the dequantized weights as the torch engine
    # computes with them (the LLM API line takes checkpoints as they are anyway).
    spec["target"].pop("weight_only", None)
    eagle = spec["speculation"].get("eagle")
    if eagle:
        eagle["head"] = str((shipped.parent / eagle["head"]).resolve())
        eagle["top_k"] = 1
    if plain:
        spec["speculation"] = {"method": "none"}
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{spec['name']}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def serve_command(pipeline_path: Path, repository: Path) -> str:
    """The overlay's serving command for this pipeline on one node (deploy/k8s.py decides the mode). For a Medusa
    pipeline it also sets UNCHECKED_MEDUSA_SAMPLING: the `speculative` model refuses sampled Medusa requests (its
    engine draws a step's tree nodes from one random state), and MEDUSA_ARMS' requests must reach the engine to
    measure that; the setting still refuses what the engine would ignore (a temperature other than 1, a top-p)."""
    from specdeploy.build.checkpoints import target_config
    from specdeploy.deploy.k8s_commands import server_command
    from specdeploy.deploy.sizing import pod_size
    from specdeploy.serve.trtllm.orchestration import UNCHECKED_MEDUSA_SAMPLING
    from specdeploy.spec.pipeline import load_pipeline

    pipeline = load_pipeline(pipeline_path)
    size = pod_size(pipeline, target_config(pipeline), None, gpus_per_node=8)
    command, arguments, environment = server_command(pipeline, str(repository), 30, size)
    assignments = [f"{e['name']}={e['value']}" for e in environment if "value" in e]
    if pipeline.speculation.method == "medusa":
        assignments.append(f"{UNCHECKED_MEDUSA_SAMPLING}=1")
    return shlex.join(["env", *assignments, *command, *arguments] if assignments else [*command, *arguments])


def wait_ready(url: str, seconds: float, pid: int) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not Path(f"/proc/{pid}").exists():
            sys.exit(f"trtllm-check: the server (pid {pid}) ended before it was ready; see its log")
        try:
            with urllib.request.urlopen(f"{url}/v2/health/ready", timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    sys.exit(f"trtllm-check: the server at {url} was not ready after {seconds:.0f} s")


def generate_ids(url: str, prompt: str, max_tokens: int, **fields) -> tuple[list[int], int]:
    """The new token ids of one request to the `speculative` model (it answers ids when output_ids is asked) and the
    tokens it drafted."""
    ids, drafted, _ = generate_counted(url, prompt, max_tokens, **fields)
    return ids, drafted


def generate_counted(url: str, prompt: str, max_tokens: int, **fields) -> tuple[list[int], int, int]:
    """generate_ids, and the drafted tokens the request accepted."""
    steps = generate_steps(url, prompt, max_tokens, stream=False, **fields)
    return [token for ids, _, _ in steps for token in ids], steps[-1][1], steps[-1][2]


def generate_steps(url: str, prompt: str, max_tokens: int, stream: bool, **fields) -> list[tuple[list[int], int, int]]:
    """The responses of one request to the `speculative` model: (its new token ids, the request's drafted and
    accepted tokens so far). Streamed, a response is one engine step's tokens, so the counts say which steps
    drafted; not streamed, there is one response."""
    import tritonclient.grpc as grpcclient

    from specdeploy.serve.client import ENTRY_MODEL, build_inputs

    client = grpcclient.InferenceServerClient(url)
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    steps: list[tuple[list[int], int, int]] = []
    try:
        client.async_stream_infer(ENTRY_MODEL, build_inputs(prompt, max_tokens, stream, **fields),
                                  outputs=[grpcclient.InferRequestedOutput("output_ids"),
                                           grpcclient.InferRequestedOutput("total_draft_tokens"),
                                           grpcclient.InferRequestedOutput("total_accepted_draft_tokens")],
                                  enable_empty_final_response=True)
        while True:
            result, error = responses.get(timeout=600)
            if error is not None:
                raise RuntimeError(str(error))
            response = result.get_response()
            if response.outputs:
                steps.append((result.as_numpy("output_ids").reshape(-1).tolist(),
                              int(result.as_numpy("total_draft_tokens").reshape(-1)[0]),
                              int(result.as_numpy("total_accepted_draft_tokens").reshape(-1)[0])))
            if response.parameters["triton_final_response"].bool_param:
                return steps or [([], 0, 0)]
    finally:
        client.stop_stream()
        client.close()


def drafted_by(steps: list[tuple[list[int], int, int]], position: int) -> bool:
    """Whether a step up to the one that emitted token `position` (0-based) drafted: the drafted count of the
    response that carried it (counts are cumulative)."""
    emitted = 0
    for ids, drafted, _ in steps:
        emitted += len(ids)
        if emitted > position:
            return drafted > 0
    return False


def agrees(first: list[int] | str, second: list[int] | str, needed: int = MIN_SHARED_TOKENS) -> bool:
    """Equal, or parting after their first `needed` items (MIN_SHARED_TOKENS tokens; for text, the characters of
    those tokens): a near tie, reported. One that ends where the other goes on does not agree: an early end is what
    a cut sequence budget looks like."""
    if first == second:
        return True
    shared = common_prefix_length(first, second)
    return shared < min(len(first), len(second)) and shared >= needed


def greedy(shipped: Path, url: str, prompts_file: Path, out: Path, max_tokens: int = 64) -> dict:
    from specdeploy.spec.sampling_params import SamplingParams
    from specdeploy.workflows import load_engine

    engine = load_engine(shipped, Path(os.environ.get("SPECDEPLOY_ENGINES", "engines")),
                         device=os.environ.get("SPECDEPLOY_DEVICE", "cpu"))
    rows = []
    for line in prompts_file.read_text().splitlines():
        prompt = json.loads(line)["prompt"]
        speculative, _ = generate_ids(url, prompt, max_tokens, temperature=0.0)
        plain, _ = generate_ids(url, prompt, max_tokens, temperature=0.0, num_draft_tokens=0)
        torch_engine = engine.generate(engine.encode_prompt(prompt), SamplingParams(), max_tokens,
                                       num_draft_tokens=0).run()
        rows.append({"prompt": prompt, "tokens": len(speculative),
                     "speculative_vs_plain": common_prefix_length(speculative, plain),
                     "server_vs_torch": common_prefix_length(speculative, torch_engine),
                     "ok": agrees(speculative, plain) and agrees(speculative, torch_engine)})
    fewest = min(min(r["speculative_vs_plain"], r["server_vs_torch"]) for r in rows)
    report = {"check": "greedy", "pipeline": shipped.stem, "prompts": rows, "ok": all(r["ok"] for r in rows),
              "detail": f"{sum(r['speculative_vs_plain'] == r['tokens'] for r in rows)}/{len(rows)} speculative = "
                        f"plain, {sum(r['server_vs_torch'] == r['tokens'] for r in rows)}/{len(rows)} = torch; "
                        f"fewest shared tokens {fewest}"}
    out.write_text(json.dumps(report, indent=2))
    return report


def chi_square_sf(statistic: float, dof: int) -> float:
    """P(χ²_dof ≥ statistic): the regularized upper incomplete gamma Q(dof/2, statistic/2)."""
    import torch

    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def homogeneity(first: list[tuple[int, ...]], second: list[tuple[int, ...]], positions: tuple[int, ...]
                ) -> tuple[float, int, int]:
    """Two samples of token sequences from the same prompt: do the tokens at `positions` follow the same
    distribution given each prefix? A chi-square test of homogeneity per (position, prefix), summed; tokens too rare
    for the approximation are pooled, prefixes either sample reached fewer than MIN_PER_PREFIX times are left out.
    Returns (p-value, degrees of freedom, trials tested)."""
    statistic, dof, tested = 0.0, 0, 0
    for position in positions:
        groups: dict[tuple[int, ...], list[Counter]] = defaultdict(lambda: [Counter(), Counter()])
        for arm, sample in enumerate((first, second)):
            for output in sample:
                if len(output) > position:
                    groups[output[:position]][arm][output[position]] += 1
        for counts in groups.values():
            totals = [sum(c.values()) for c in counts]
            if min(totals) < MIN_PER_PREFIX:
                continue
            pooled = counts[0] + counts[1]
            common = [token for token, n in pooled.items() if n * min(totals) / sum(totals) >= 5]
            table = np.array([[c[token] for token in common] + [totals[arm] - sum(c[t] for t in common)]
                              for arm, c in enumerate(counts)], dtype=np.float64)
            table = table[:, table.sum(0) > 0]
            if table.shape[1] < 2:
                continue
            expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
            statistic += float(((table - expected) ** 2 / expected).sum())
            dof += table.shape[1] - 1
            tested += sum(totals)
    return (chi_square_sf(statistic, dof) if dof else 1.0), dof, tested


def distribution(url: str, out: Path, num_draft_tokens: int = 2, arms: dict[str, dict] | None = None) -> dict:
    """For each sampling arm (SAMPLED_ARMS), DISTRIBUTION_TRIALS requests speculative and as many plain, four tokens
    each, every request its own seed (disjoint between the arms): the first token comes from the prefill, the second
    and third (TESTED_POSITIONS) from the first speculative step, drafted then verified by the executor. The
    requests stream, so that a request counts as drafted only when a step up to the last tested token drafted."""
    def sample(fields: dict, gamma: int, offset: int) -> list[tuple[tuple[int, ...], bool]]:
        def one(seed: int) -> tuple[tuple[int, ...], bool]:
            steps = generate_steps(url, DISTRIBUTION_PROMPT, 4, stream=True, random_seed=seed, end_id=-1,
                                   num_draft_tokens=gamma, **fields)
            return tuple(token for ids, _, _ in steps for token in ids), drafted_by(steps, TESTED_POSITIONS[-1])

        with ThreadPoolExecutor(16) as pool:
            return list(pool.map(one, range(offset, offset + DISTRIBUTION_TRIALS)))

    results = []
    for number, (label, fields) in enumerate((arms or SAMPLED_ARMS).items()):
        offset = 2 * number * DISTRIBUTION_TRIALS
        speculative = sample(fields, num_draft_tokens, offset)
        plain = sample(fields, 0, offset + DISTRIBUTION_TRIALS)
        results.append(arm_report(label, [ids for ids, _ in speculative], [ids for ids, _ in plain],
                                  sum(drafted for _, drafted in speculative) / len(speculative)))
    report = distribution_report(results, "speculative and plain")
    out.write_text(json.dumps(report, indent=2))
    return report


def arm_report(label: str, speculative: list[tuple[int, ...]], plain: list[tuple[int, ...]], drafting: float) -> dict:
    """One sampling arm's two-sample test at TESTED_POSITIONS. Without drafts at those positions both arms decode
    plainly and the test says nothing, so 90% of the speculative requests must have drafted there."""
    p_value, dof, tested = homogeneity(list(speculative), list(plain), TESTED_POSITIONS)
    required = label not in REPORTED_ONLY
    passed = p_value > DISTRIBUTION_P_VALUE and tested > 0 and drafting >= 0.9
    return {"arm": label, "p_value": p_value, "dof": dof, "tested": tested, "drafting": drafting,
            "required": required, "ok": passed or not required,
            "detail": f"{label}: p = {p_value:.3g} (χ², {dof} dof, {tested} tokens), {drafting:.0%} drafted at the "
                      f"tested tokens" + ("" if required else " (reported, not required: the top-p discrepancy)")}


def distribution_report(arms: list[dict], compared: str) -> dict:
    """distribution.json: every arm, ok when each required arm passed."""
    return {"check": "distribution", "arms": arms, "ok": all(arm["ok"] for arm in arms),
            "detail": f"{compared}; " + "; ".join(arm["detail"] for arm in arms)}


def budget(shipped: Path, url: str, out: Path) -> dict:
    """One greedy request whose prompt and max_tokens fill limits.max_sequence_length exactly (end_id -1: it cannot
    end early) must return every token, with drafts, and one token more must be refused naming that limit."""
    from specdeploy.spec.pipeline import load_pipeline
    from specdeploy.workflows import load_engine

    engine = load_engine(shipped, Path(os.environ.get("SPECDEPLOY_ENGINES", "engines")),
                         device=os.environ.get("SPECDEPLOY_DEVICE", "cpu"))
    room = load_pipeline(shipped).limits.max_sequence_length - len(engine.encode_prompt(DISTRIBUTION_PROMPT))
    report = budget_report(room, lambda max_tokens: generate_counted(url, DISTRIBUTION_PROMPT, max_tokens,
                                                                     temperature=0.0, end_id=-1))
    out.write_text(json.dumps(report, indent=2))
    return report


def budget_report(room: int, ask) -> dict:
    """budget.json from ask(max_tokens) → (ids, drafted, accepted), which raises RuntimeError when refused."""
    ids, drafted, _ = ask(room)
    try:
        ask(room + 1)
        refusal = ""
    except RuntimeError as exc:
        refusal = str(exc)
    refused = "max_sequence_length" in refusal
    ok = len(ids) == room and drafted > 0 and refused
    return {"check": "budget", "ok": ok, "room": room, "tokens": len(ids), "drafted": drafted,
            "detail": f"{len(ids)}/{room} tokens up to limits.max_sequence_length, {drafted} drafted; one more: "
                      + (f"refused ({refusal[:80]})" if refusal else "served (should be refused)")}


def llmapi_generate(url: str, prompt: str, max_tokens: int, **sampling) -> tuple[str, int, int]:
    """One request to Triton's LLM-API model (its generate_stream endpoint, the request not streamed: one event):
    the new text, and the drafted and accepted tokens it reports."""
    body = {"text_input": prompt, "sampling_param_max_tokens": max_tokens, **LLMAPI_REQUEST,
            **{f"sampling_param_{name}": value for name, value in sampling.items()}}
    request = urllib.request.Request(f"{url}/v2/models/tensorrt_llm/generate_stream", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    text, drafted, accepted = "", 0, 0
    with urllib.request.urlopen(request, timeout=600) as reply:
        for line in reply.read().decode().splitlines():
            if not line.startswith("data:"):
                continue
            event = json.loads(line.removeprefix("data:"))
            if "error" in event:
                raise RuntimeError(event["error"])
            text += event.get("text_output", "")
            # upstream sends the counters with text_output's dtype (BYTES), so they come as JSON strings
            drafted = int(event.get("total_draft_tokens", drafted))
            accepted = int(event.get("total_accepted_draft_tokens", accepted))
    return text, drafted, accepted


def llmapi_run(url: str, tokenizer_dir: Path, prompts_file: Path, seed_offset: int, out: Path,
               max_tokens: int = 64) -> dict:
    """Everything the comparison needs from one LLM-API server (see the docstring). Greedy answers are kept as
    text: the comparison decodes the torch engine's ids rather than tokenizing the server's text again, which may
    give other ids than the ones generated (a non-canonical tokenization). The sampled answers are tokenized
    again: both sides of the two-sample test go through the same text-to-ids map, so equal text distributions give
    equal id distributions."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)

    def ids_of(answer: tuple[str, int, int]) -> tuple[list[int], int, int]:
        text, drafted, accepted = answer
        return tokenizer.encode(text, add_special_tokens=False), drafted, accepted

    prompts = [json.loads(line)["prompt"] for line in prompts_file.read_text().splitlines()]
    greedy = [llmapi_generate(url, prompt, max_tokens, temperature=0.0) for prompt in prompts]
    with ThreadPoolExecutor(16) as pool:
        samples = list(pool.map(lambda seed: ids_of(llmapi_generate(
            url, DISTRIBUTION_PROMPT, 4, temperature=0.7, top_k=4, seed=seed)),
            range(seed_offset, seed_offset + DISTRIBUTION_TRIALS)))
    speed = speed_run(lambda prompt: ids_of(llmapi_generate(url, prompt, max_tokens, temperature=0.0)), prompts)
    report = {"greedy": [{"prompt": prompt, "text": text, "drafted": drafted}
                         for prompt, (text, drafted, _) in zip(prompts, greedy)],
              "samples": [{"ids": ids, "drafted": drafted} for ids, drafted, _ in samples], "speed": speed}
    out.write_text(json.dumps(report))
    return report


def llmapi_compare(shipped: Path, speculative_file: Path, plain_file: Path, out_dir: Path,
                   max_tokens: int = 64) -> bool:
    """The checks of the EAGLE-3 slice from its two runs, written as the engine slices write theirs."""
    speculative, plain = json.loads(speculative_file.read_text()), json.loads(plain_file.read_text())
    greedy_report = twin_greedy_report(shipped, speculative["greedy"], plain["greedy"], max_tokens)
    # the LLM API answers a request at once, so "drafted" counts the whole request's drafts (four tokens)
    spec_samples, plain_samples = speculative["samples"], plain["samples"]
    arm = arm_report("T 0.7, top-k 4", [tuple(s["ids"]) for s in spec_samples],
                     [tuple(s["ids"]) for s in plain_samples],
                     sum(s["drafted"] > 0 for s in spec_samples) / len(spec_samples))
    report = distribution_report([arm], "speculative and plain servers")
    levels = twin_speed_levels(speculative["speed"], plain["speed"])
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "greedy.json").write_text(json.dumps(greedy_report, indent=2))
    (out_dir / "distribution.json").write_text(json.dumps(report, indent=2))
    (out_dir / "speed.json").write_text(json.dumps({"levels": levels}, indent=2))
    return greedy_report["ok"] and report["ok"] and all(level["failed"] == 0 for level in levels)


def twin_greedy_report(shipped: Path, speculative: list[dict], plain: list[dict], max_tokens: int) -> dict:
    """The greedy check between a speculative and a plain server's runs ({"prompt", "ids", "drafted"} per prompt;
    the LLM-API line's runs have "text" instead of "ids"), each also against the torch engine of the shipped
    pipeline; every prompt must have drafted. Text is compared as text: the torch engine's ids are decoded, since
    tokenizing the server's text again may give other ids than the ones generated."""
    from specdeploy.spec.sampling_params import SamplingParams
    from specdeploy.workflows import load_engine

    engine = load_engine(shipped, Path(os.environ.get("SPECDEPLOY_ENGINES", "engines")),
                         device=os.environ.get("SPECDEPLOY_DEVICE", "cpu"))
    unit = "characters" if speculative and "text" in speculative[0] else "tokens"
    rows = []
    for spec_row, plain_row in zip(speculative, plain):
        torch_ids = engine.generate(engine.encode_prompt(spec_row["prompt"]), SamplingParams(), max_tokens,
                                    num_draft_tokens=0).run()
        if unit == "characters":
            spec_out, plain_out, torch_out = spec_row["text"], plain_row["text"], engine.decode(torch_ids)
            needed = len(engine.decode(torch_ids[:MIN_SHARED_TOKENS]))
        else:
            spec_out, plain_out, torch_out, needed = spec_row["ids"], plain_row["ids"], torch_ids, MIN_SHARED_TOKENS
        rows.append({"prompt": spec_row["prompt"], unit: len(spec_out), "drafted": spec_row["drafted"],
                     "speculative_vs_plain": common_prefix_length(spec_out, plain_out),
                     "server_vs_torch": common_prefix_length(spec_out, torch_out),
                     "ok": agrees(spec_out, plain_out, needed) and agrees(spec_out, torch_out, needed)})
    drafted = sum(row["drafted"] > 0 for row in rows)
    fewest = min(min(r["speculative_vs_plain"], r["server_vs_torch"]) for r in rows)
    return {"check": "greedy", "pipeline": shipped.stem, "prompts": rows,
            "ok": all(r["ok"] for r in rows) and drafted == len(rows),
            "detail": f"{sum(r['speculative_vs_plain'] == r[unit] for r in rows)}/{len(rows)} speculative = "
                      f"plain, {sum(r['server_vs_torch'] == r[unit] for r in rows)}/{len(rows)} = torch; "
                      f"{drafted}/{len(rows)} drafted; fewest shared {unit} {fewest}"}


def twin_speed_levels(speculative: list[dict], plain: list[dict]) -> list[dict]:
    """speed.json's levels from two servers' runs ({"concurrency", "tokens_per_s", "drafted", "accepted",
    "failed"} per level)."""
    return [{"concurrency": s["concurrency"], "speculative_tokens_per_s": s["tokens_per_s"],
             "plain_tokens_per_s": p["tokens_per_s"], "speedup": s["tokens_per_s"] / max(p["tokens_per_s"], 1e-9),
             "acceptance_rate": s["accepted"] / max(s["drafted"], 1), "failed": s["failed"] + p["failed"]}
            for s, p in zip(speculative, plain)]


def speed_run(ask, prompts: list[str]) -> list[dict]:
    """Tokens/s at concurrency 1 and 8 over the prompts (each prompt concurrency times), with the drafts counted;
    ask(prompt) → (ids, drafted, accepted), raising OSError or RuntimeError for a failed request."""
    speed = []
    for concurrency in (1, 8):
        started, failed = time.perf_counter(), 0
        with ThreadPoolExecutor(concurrency) as pool:
            futures = [pool.submit(ask, prompt) for prompt in prompts * concurrency]
            results = []
            for future in futures:
                try:
                    results.append(future.result())
                except (OSError, RuntimeError):
                    failed += 1
        seconds = time.perf_counter() - started
        speed.append({"concurrency": concurrency, "tokens_per_s": sum(len(ids) for ids, *_ in results) / seconds,
                      "drafted": sum(d for _, d, _ in results), "accepted": sum(a for *_, a in results),
                      "failed": failed})
    return speed


def twin_run(url: str, prompts_file: Path, out: Path, max_tokens: int = 64, arms: dict[str, dict] | None = None,
             seed_offset: int = 0) -> dict:
    """Everything the lookahead or Medusa comparison needs from one server, through the `speculative` model
    (gRPC); with arms (Medusa: MEDUSA_ARMS), DISTRIBUTION_TRIALS sampled requests of four tokens for each."""
    prompts = [json.loads(line)["prompt"] for line in prompts_file.read_text().splitlines()]
    greedy = [generate_counted(url, prompt, max_tokens, temperature=0.0) for prompt in prompts]
    try:
        generate_ids(url, DISTRIBUTION_PROMPT, 4, **REFUSAL_REQUEST)
        refusal = {"refused": False, "message": ""}
    except RuntimeError as exc:
        refusal = {"refused": True, "message": str(exc)}
    speed = speed_run(lambda prompt: generate_counted(url, prompt, max_tokens, temperature=0.0), prompts)
    report = {"greedy": [{"prompt": prompt, "ids": ids, "drafted": drafted}
                         for prompt, (ids, drafted, _) in zip(prompts, greedy)],
              "refusal": refusal, "speed": speed, "samples": {}}
    for label, fields in (arms or {}).items():  # seeds from seed_offset on: disjoint between the twins
        def one(seed: int, fields: dict = fields) -> dict:
            steps = generate_steps(url, DISTRIBUTION_PROMPT, 4, stream=True, random_seed=seed, end_id=-1, **fields)
            return {"ids": [token for ids, _, _ in steps for token in ids],
                    "drafted": drafted_by(steps, TESTED_POSITIONS[-1])}

        with ThreadPoolExecutor(16) as pool:
            report["samples"][label] = list(pool.map(one, range(seed_offset, seed_offset + DISTRIBUTION_TRIALS)))
    out.write_text(json.dumps(report))
    return report


def twin_compare(shipped: Path, speculative_file: Path, plain_file: Path, out_dir: Path,
                      max_tokens: int = 64) -> bool:
    """The lookahead or Medusa slice's checks from its two runs: greedy and speed as the other slices write them,
    and refusal: TensorRT-LLM's lookahead decodes a sampled request greedily and its Medusa samples unscaled logits,
    without a word, so the speculative server must refuse a request at T 0.7 naming temperature, while the plain
    server (the control) serves it."""
    speculative, plain = json.loads(speculative_file.read_text()), json.loads(plain_file.read_text())
    greedy_report = twin_greedy_report(shipped, speculative["greedy"], plain["greedy"], max_tokens)
    refused, served = speculative["refusal"], plain["refusal"]
    refusal_ok = refused["refused"] and "temperature" in refused["message"] and not served["refused"]
    refusal_report = {"check": "refusal", "ok": refusal_ok,
                      "detail": f"speculative server: {refused['message'][:100] or 'served it (as something else?)'}"
                                f"; plain "
                                f"server: {'refused: ' + served['message'][:60] if served['refused'] else 'served'}"}
    levels = twin_speed_levels(speculative["speed"], plain["speed"])
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "greedy.json").write_text(json.dumps(greedy_report, indent=2))
    (out_dir / "refusal.json").write_text(json.dumps(refusal_report, indent=2))
    (out_dir / "speed.json").write_text(json.dumps({"levels": levels}, indent=2))
    sampled = speculative.get("samples") or {}
    arms = [arm_report(label, [tuple(s["ids"]) for s in samples], [tuple(s["ids"]) for s in plain["samples"][label]],
                       sum(s["drafted"] for s in samples) / len(samples)) for label, samples in sampled.items()]
    sampled_ok = True  # lookahead samples nothing: its refusal check stands for it
    if arms:
        report = distribution_report(arms, "speculative and plain twins")
        (out_dir / "distribution.json").write_text(json.dumps(report, indent=2))
        sampled_ok = report["ok"]
    return greedy_report["ok"] and refusal_ok and sampled_ok and all(level["failed"] == 0 for level in levels)


def summary(directory: Path) -> int:
    """Print every check's line; 1 if any failed (or none ran), else 0."""
    rows = []
    for path in sorted(path for name in CHECK_FILES for path in directory.glob(f"*/{name}")):
        if path.name == "speed.json":
            for level in json.loads(path.read_text())["levels"]:
                detail = (f"{level['speculative_tokens_per_s']:.1f} vs {level['plain_tokens_per_s']:.1f} tok/s at "
                          f"concurrency {level['concurrency']}: {level['speedup']:.2f}x, acceptance "
                          f"{level['acceptance_rate']:.2f}, {level['failed']} failed")
                rows.append((path.parent.name, "speed", level["failed"] == 0, detail))
        else:
            report = json.loads(path.read_text())
            rows.append((path.parent.name, report["check"], report["ok"], report["detail"]))
    for failed in sorted(directory.glob("*/FAILED-*")):
        rows.append((failed.parent.name, failed.name.removeprefix("FAILED-"), False, failed.read_text().strip()))
    print(f"\n{'pipeline':32} {'check':14} {'result':7} detail")
    for pipeline, check, ok, detail in rows:
        print(f"{pipeline:32} {check:14} {'ok' if ok else 'FAIL':7} {detail}")
    return 0 if rows and all(ok for *_, ok, _ in rows) else 1


def main(argv: list[str]) -> int:
    command, arguments = argv[0], argv[1:]
    if command == "pipeline":
        print(trtllm_variant(Path(arguments[0]), Path(arguments[1]), plain="--plain" in arguments[2:],
                             lookahead="--lookahead" in arguments[2:]))
    elif command == "serve-command":
        print(serve_command(Path(arguments[0]), Path(arguments[1])))
    elif command == "wait-ready":
        wait_ready(arguments[0], float(arguments[1]), int(arguments[2]))
    elif command == "greedy":
        return 0 if greedy(Path(arguments[0]), arguments[1], Path(arguments[2]), Path(arguments[3]))["ok"] else 1
    elif command == "distribution":
        return 0 if distribution(arguments[0], Path(arguments[1]))["ok"] else 1
    elif command == "budget":
        return 0 if budget(Path(arguments[0]), arguments[1], Path(arguments[2]))["ok"] else 1
    elif command == "llmapi-run":
        llmapi_run(arguments[0], Path(arguments[1]), Path(arguments[2]), int(arguments[3]), Path(arguments[4]))
    elif command == "llmapi-compare":
        return 0 if llmapi_compare(Path(arguments[0]), Path(arguments[1]), Path(arguments[2]),
                                   Path(arguments[3])) else 1
    elif command == "twin-run":
        sampled = "--sampled" in arguments[3:]
        twin_run(arguments[0], Path(arguments[1]), Path(arguments[2]), arms=MEDUSA_ARMS if sampled else None,
                 seed_offset=int(arguments[4]) if sampled else 0)
    elif command == "twin-compare":
        return 0 if twin_compare(Path(arguments[0]), Path(arguments[1]), Path(arguments[2]),
                                      Path(arguments[3])) else 1
    elif command == "summary":
        return summary(Path(arguments[0]))
    else:
        sys.exit(f"trtllm_check.py: unknown command {command!r} (see the docstring)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
