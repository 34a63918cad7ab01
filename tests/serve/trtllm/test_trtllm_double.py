"""The TensorRT-LLM doubles behave like upstream, including where upstream is unkind (each behaviour's source is in
tests/trtllm_double/README.md): what the backend refuses to load, how it reads parameters, the sequence budget,
how its kernels sample, how it verifies drafts with and without draft logits; what trtllm-build and the Medusa
converter refuse or adjust. The orchestration's own tests (test_orchestration.py) then run against these."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.repo import REPO
from scipy import stats

from specdeploy.build.trtllm.upstream import LOOKAHEAD_PARAMETERS_MISSING, TENSORRTLLM_REQUIRED_PARAMETERS
from specdeploy.decoding.sampling import sampling_distribution
from specdeploy.package.trtllm_models import tensorrtllm_model
from specdeploy.serve.trtllm.sampling import draft_logits, executor_distribution, point_mass_logits
from specdeploy.spec.pipeline import load_pipeline
from specdeploy.spec.sampling_params import SamplingParams

sys.path.insert(0, str(REPO / "tests" / "trtllm_double" / "backend"))
from bls_double import build_double  # noqa: E402
from tensorrtllm_double import (  # noqa: E402
    DEFAULT_LOOKAHEAD,
    BackendSettings,
    DoubleError,
    EngineConfig,
    LoadError,
    LookaheadConfig,
    Sampling,
    TensorrtllmDouble,
    load_settings,
)

LLAMA70B = REPO / "pipelines" / "gpu" / "llama70b-draft-target.yaml"
LOOKAHEAD = REPO / "pipelines" / "gpu" / "llama8b-lookahead.yaml"  # (W, N, G) = (4, 4, 4): 23 draft tokens
DOUBLE = REPO / "tests" / "trtllm_double"


def engine(directory: Path, *flags: str) -> Path:
    """An engine directory whose config.json is what the build double writes for these trtllm-build flags."""
    directory.mkdir(parents=True)
    config = build_double().build_config(["--checkpoint_dir", "c", "--output_dir", str(directory), *flags])
    (directory / "config.json").write_text(json.dumps({"build_config": config}))
    return directory


TARGET_FLAGS = ("--max_batch_size", "8", "--max_input_len", "256", "--max_seq_len", "256",
                "--speculative_decoding_mode", "draft_tokens_external", "--max_draft_len", "8")


def parameters(engine_dir: Path, draft: bool = False, example: Path = LLAMA70B) -> dict[str, str]:
    """The parameters `package` writes for a tensorrtllm model (the example's settings, the 70B's by default) over
    engine_dir."""
    config = tensorrtllm_model("tensorrt_llm", load_pipeline(example), str(engine_dir), draft=draft)
    return {key: value.string_value for key, value in config.parameters.items()}


def request(tokens: list[int], count: int, **fields) -> dict[str, np.ndarray]:
    inputs = {"input_ids": np.array([tokens], dtype=np.int32),
              "input_lengths": np.array([[len(tokens)]], dtype=np.int32),
              "request_output_len": np.array([[count]], dtype=np.int32)}
    kinds = {"temperature": np.float32, "runtime_top_p": np.float32, "seed": np.uint64,
             "return_generation_logits": np.bool_, "draft_logits": np.float32}
    for name, value in fields.items():
        array = np.asarray(value, dtype=kinds.get(name, np.int32))
        inputs[name] = array if array.ndim >= 2 else array.reshape(1, -1)
    return inputs


def new_tokens(double: TensorrtllmDouble, inputs: dict) -> list[int]:
    return [token for step in double.run(inputs) for token in step.tokens]


# ---- loading ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(TENSORRTLLM_REQUIRED_PARAMETERS))
def test_a_config_without_a_required_parameter_fails_to_load_with_upstreams_message(tmp_path, name):
    given = parameters(engine(tmp_path / "engine", *TARGET_FLAGS))
    assert load_settings(given).engine.draft_tokens_external  # the generated config loads
    del given[name]
    with pytest.raises(LoadError) as refused:
        load_settings(given)
    assert str(refused.value) == ("unexpected error when creating modelInstanceState: Cannot find parameter with "
                                  f"name: {name}")


@pytest.mark.parametrize("change, message", [
    ({"gpt_model_type": "static"}, "Invalid gpt_model_type. Must be v1/inflight_batching/inflight_fused_batching."),
    ({"kv_cache_free_gpu_mem_fraction": "1.0"}, "freeGpuMemoryFraction"),
    ({"max_tokens_in_paged_kv_cache": "0"}, "maxTokens > 0"),
    ({"gpt_model_path": "/nowhere"}, "Both encoder and decoder model paths are empty"),
    ({"enable_kv_cache_reuse": "false"}, "KV cache block reuse must be enabled for speculative decoding target"),
    ({"guided_decoding_backend": "xgrammar", "xgrammar_tokenizer_info_path": "/nowhere.json"},
     "Xgrammar's tokenizer info path at /nowhere.json does not exist."),
], ids=["model-type", "kv-fraction-1", "kv-tokens-0", "no-engine", "target-without-reuse", "guided-no-file"])
def test_values_upstream_refuses_fail_the_load(tmp_path, change, message):
    given = {**parameters(engine(tmp_path / "engine", *TARGET_FLAGS)), **change}
    with pytest.raises(LoadError, match=message.replace(".", r"\.")):
        load_settings(given)


def test_a_misspelled_boolean_silently_takes_its_default(tmp_path, tiny_engines):
    """GetParameter<bool> accepts eight spellings; any other value is caught and the default used: "yes" for
    exclude_input_in_output gives false, and the input comes back with the output."""
    directory = engine(tmp_path / "engine", "--max_seq_len", "256", "--max_input_len", "256")
    given = {**parameters(directory, draft=True), "exclude_input_in_output": "yes", "enable_kv_cache_reuse": "no"}
    settings = load_settings(given)
    assert not settings.exclude_input_in_output and settings.enable_kv_cache_reuse  # both defaults
    double = TensorrtllmDouble(tiny_engines["draft_target"].dir / "target", settings)
    assert new_tokens(double, request([5, 6, 7], 3, runtime_top_k=1))[:3] == [5, 6, 7]


# ---- requests ---------------------------------------------------------------------------------------------------

def test_the_budget_reserves_max_draft_len_and_the_build_pays_for_it(tmp_path, tiny_engines):
    """LlmRequest::validate reserves the engine's max_draft_len for a request that brings no drafts; trtllm-build
    added it to max_seq_len, so a request inside the pipeline's limit keeps its length. Without that addition the
    same request would be cut by max_draft_len."""
    component = tiny_engines["draft_target"].dir / "target"
    built = engine(tmp_path / "built", *TARGET_FLAGS)
    assert json.loads((built / "config.json").read_text())["build_config"]["max_seq_len"] == 256 + 8
    double = TensorrtllmDouble.load(component, parameters(built))
    prompt = [5] * 200
    assert len(new_tokens(double, request(prompt, 56, runtime_top_k=1))) == 56
    unpaid = tmp_path / "unpaid"
    unpaid.mkdir()
    config = json.loads((built / "config.json").read_text())
    config["build_config"]["max_seq_len"] = 256
    (unpaid / "config.json").write_text(json.dumps(config))
    cut = TensorrtllmDouble.load(component, parameters(unpaid))
    assert len(new_tokens(cut, request(prompt, 56, runtime_top_k=1))) == 56 - 8
    with pytest.raises(DoubleError, match=r"Draft tokens length \(9\) exceeds maximum draft tokens length \(8\)"):
        new_tokens(double, request(prompt, 10, runtime_top_k=1, draft_input_ids=[[1] * 9]))


def test_a_request_with_drafts_ends_after_one_step_and_logits_need_the_build_flag(tmp_path, tiny_engines):
    """trtGptModelInflightBatching updateRequests: a draft_tokens_external request that brought drafts is done after
    its step, whatever request_output_len says; generation logits only from an engine that gathers them."""
    double = TensorrtllmDouble.load(tiny_engines["draft_target"].dir / "target",
                                    parameters(engine(tmp_path / "engine", *TARGET_FLAGS)))
    tokens = new_tokens(double, request([5, 6, 7], 50, runtime_top_k=1, draft_input_ids=[[1, 2, 3]]))
    assert 1 <= len(tokens) <= 4
    with pytest.raises(DoubleError, match="gather_generation_logits must be enabled"):
        new_tokens(double, request([5, 6, 7], 2, runtime_top_k=1, return_generation_logits=True))


def test_sampling_settings_are_regularised_as_the_executor_does():
    """SamplingConfig::validate and regularizeTopKTopP: temperature 0 with top-k is greedy; neither top-k nor top-p
    is greedy whatever the temperature; top-k alone gets top-p 1; no seed is seed 0."""
    assert Sampling.of(request([1], 1, temperature=0.0, runtime_top_k=5)).top_k == 1
    assert Sampling.of(request([1], 1, temperature=0.8)).top_k == 1
    of = Sampling.of(request([1], 1, temperature=0.8, runtime_top_k=4))
    assert (of.top_k, of.top_p, of.seed) == (4, 1.0, 0)
    assert Sampling.of(request([1], 1, runtime_top_k=0, runtime_top_p=0.9)).top_k == 0


# ---- lookahead ----------------------------------------------------------------------------------------------------

def lookahead_engine(directory: Path, max_draft_len: int | None) -> Path:
    """A lookahead engine as the build double writes it (None: --max_draft_len left at its default, 0)."""
    flags = ("--max_seq_len", "256", "--max_input_len", "256", "--speculative_decoding_mode", "lookahead_decoding")
    return engine(directory, *flags, *(() if max_draft_len is None else ("--max_draft_len", str(max_draft_len))))


def test_the_formula_is_upstreams_and_the_pipelines_node_count():
    """calculateSpeculativeResourceTuple's draft tokens at the worked values of docs/tensorrt-llm.md, and the
    pipeline's LookaheadSpec.nodes giving the same count for every (W, N, G) it allows."""
    from specdeploy.spec.speculation import LookaheadSpec

    worked = {(1, 1, 0): 0, (2, 2, 1): 2, (4, 3, 4): 15, (3, 3, 3): 11, (4, 4, 4): 23, (5, 5, 5): 39, (7, 7, 7): 83}
    assert {sizes: LookaheadConfig(*sizes).max_draft_len for sizes in worked} == worked
    for sizes in [(w, n, g) for w in range(1, 9) for n in range(2, 9) for g in range(1, 9)]:
        assert LookaheadSpec(*sizes).nodes == LookaheadConfig(*sizes).max_draft_len, sizes
    assert DEFAULT_LOOKAHEAD.max_draft_len == 15


def test_a_lookahead_engine_loads_only_with_the_sizes_it_was_built_for(tmp_path):
    """The packaged parameters (decoding_mode lookahead and W, N, G) over an engine built with their draft-token
    count load; every other combination upstream refuses fails the load with its message."""
    packaged = parameters(lookahead_engine(tmp_path / "built", 23), example=LOOKAHEAD)
    settings = load_settings(packaged)
    assert settings.lookahead == LookaheadConfig(4, 4, 4) and settings.lookahead_configured and not settings.warnings

    def refused(change: dict, max_draft_len: int | None = 23) -> str:
        directory = lookahead_engine(tmp_path / f"engine{len(list(tmp_path.iterdir()))}", max_draft_len)
        given = {**parameters(directory, example=LOOKAHEAD), **change}
        given = {key: value for key, value in given.items() if value is not None}
        with pytest.raises(LoadError) as failed:
            load_settings(given)
        return str(failed.value).removeprefix("unexpected error when creating modelInstanceState: ")

    assertion = "[TensorRT-LLM][ERROR] Assertion failed: "
    # the engine built for fewer draft tokens than (4, 4, 4) needs, or for more
    assert refused({}, 15) == assertion + "maxDraftTokens <= mModelConfig.getMaxDecodingDraftTokens()"
    assert refused({}, 40) == assertion + "24 != 41"
    # trtllm-build takes lookahead_decoding without --max_draft_len (0): the load is where it fails
    assert refused({}, None) == assertion + "maxDraftTokens <= mModelConfig.getMaxDecodingDraftTokens()"
    # without decoding_mode lookahead the three sizes are not read: the executor's default (4, 3, 4) runs, 16 tokens
    # a step against the engine's 24 (tensorrtllm_backend issue #710 shows "16 != 40")
    assert refused({"decoding_mode": "top_k_top_p"}) == assertion + "16 != 24"
    assert refused({"decoding_mode": None}) == assertion + "16 != 24"
    # decoding_mode lookahead without all three, or with the template's unfilled placeholder
    assert refused({"lookahead_ngram_size": None}) == LOOKAHEAD_PARAMETERS_MISSING
    assert refused({"lookahead_window_size": "${lookahead_window_size}"}) == LOOKAHEAD_PARAMETERS_MISSING
    assert refused({"lookahead_ngram_size": "1"}) == assertion + "ngramSize=1 requires verificationSetSize=0"
    assert refused({"max_beam_width": "2"}) == assertion + "Lookahead requires beam width = 1"


def test_without_decoding_mode_lookahead_the_sizes_are_silently_ignored(tmp_path):
    """On an engine built for the default's 15 draft tokens, a config whose decoding_mode is not lookahead loads
    and runs (4, 3, 4) whatever its lookahead_* parameters say, with only a warning; decoding_mode lookahead on an
    engine built without the mode falls back to plain decoding, also with a warning."""
    given = {**parameters(lookahead_engine(tmp_path / "default", 15), example=LOOKAHEAD),
             "decoding_mode": "top_k_top_p", "lookahead_window_size": "7", "lookahead_ngram_size": "7",
             "lookahead_verification_set_size": "7"}
    settings = load_settings(given)
    assert settings.lookahead == DEFAULT_LOOKAHEAD and not settings.lookahead_configured
    assert settings.warnings == ("Model is Lookahead, but decoding mode is not Lookahead. Overwriting decoding mode "
                                 "to Lookahead.",)
    plain_engine = engine(tmp_path / "plain", "--max_seq_len", "256", "--max_input_len", "256")
    fallback = load_settings(parameters(plain_engine, example=LOOKAHEAD))
    assert not fallback.is_lookahead and fallback.lookahead_configured
    assert fallback.warnings[0].startswith("Model is not built with Lookahead decoding")


def lookahead_double(tiny_engines, tmp_path: Path, sizes: tuple[int, int, int] = (2, 3, 2),
                     configured: bool = True) -> TensorrtllmDouble:
    """The double of a lookahead engine over the tiny target, running `sizes`."""
    config = LookaheadConfig(*sizes)
    engine_config = EngineConfig(256, 256 + config.max_draft_len, config.max_draft_len, "lookahead_decoding", False)
    return TensorrtllmDouble(tiny_engines["ngram"].dir / "target",
                             BackendSettings(engine_config, True, True, config, configured))


def greedy_reference(tiny_engines, prompt: list[int], count: int) -> list[int]:
    engine = tiny_engines["ngram"]
    return engine.generate(prompt, SamplingParams(), count, num_draft_tokens=0).run()


def test_lookahead_decodes_greedily_whatever_the_request_samples(tiny_engines, tmp_path):
    """LookaheadDecodingLayer takes the top token at every position: a request at temperature 0.9 with top-k 50, a
    top-p and a repetition penalty gets the greedy text, with no error (the orchestration refuses such requests
    for that reason). Steps carry more than one token where the pool's guesses hold."""
    double = lookahead_double(tiny_engines, tmp_path)
    prompt = tiny_engines["ngram"].encode_prompt("abcabcabc")
    expected = greedy_reference(tiny_engines, prompt, 60)
    steps = [step.tokens for step in double.run(request(prompt, 60, runtime_top_k=1, streaming=True))]
    assert [token for step in steps for token in step] == expected
    assert max(len(step) for step in steps) > 1 and all(len(step) <= 3 for step in steps)  # at most N tokens
    sampled = new_tokens(double, request(prompt, 60, temperature=0.9, runtime_top_k=50, runtime_top_p=0.9,
                                         repetition_penalty=1.5, seed=[[7]]))
    assert sampled == expected


def medusa_double(tiny_engines, choices=((0,), (0, 0), (1,))) -> TensorrtllmDouble:
    """The double of a Medusa engine over the tiny target with this tree (its max_draft_len the tree's nodes)."""
    engine_config = EngineConfig(256, 256 + 8, 8, "medusa", False)
    return TensorrtllmDouble(tiny_engines["ngram"].dir / "target",
                             BackendSettings(engine_config, True, True, medusa_choices=choices))


def test_medusa_samples_with_top_k_alone_whatever_else_the_request_says(tiny_engines):
    """DecodingMode::Medusa has no temperature or penalty bit and its layer samples with top-k alone: a greedy
    request's penalty and a sampled request's temperature and top-p change nothing (the same seed gives the same
    tokens), and a top-k of 0 writes no token (the orchestration refuses all of these: test_orchestration)."""
    double = medusa_double(tiny_engines)
    prompt = tiny_engines["ngram"].encode_prompt("abcabcabc")
    greedy = greedy_reference(tiny_engines, prompt, 30)
    assert new_tokens(double, request(prompt, 30, runtime_top_k=1, repetition_penalty=1.5)) == greedy
    plain = new_tokens(double, request(prompt, 30, temperature=1.0, runtime_top_k=8, runtime_top_p=1.0, seed=[[3]]))
    assert plain != greedy
    for changed in ({"temperature": 0.3}, {"runtime_top_p": 0.5}, {"repetition_penalty": 1.5}):
        fields = {"temperature": 1.0, "runtime_top_k": 8, "runtime_top_p": 1.0, "seed": [[3]], **changed}
        assert new_tokens(double, request(prompt, 30, **fields)) == plain, changed
    assert set(new_tokens(double, request(prompt, 5, temperature=1.0, runtime_top_k=0, runtime_top_p=1.0))) == {0}


def test_a_medusa_step_is_the_accepted_tree_path_and_its_nodes_share_one_uniform(tiny_engines):
    """The tree {0}, {0, 0}, {1}: greedy, every step accepts the path of top tokens (three tokens a step, the greedy
    text); sampled, the step's nodes draw with one uniform (upstream's one curand state per request), so with the
    uniforms shared the root and its accepted child fall at the same quantile of their top-k walks."""
    double = medusa_double(tiny_engines)
    prompt = tiny_engines["ngram"].encode_prompt("abcabcabc")
    steps = [step.tokens for step in double.run(request(prompt, 30, runtime_top_k=1, streaming=True))]
    assert [token for step in steps for token in step] == greedy_reference(tiny_engines, prompt, 30)
    assert {len(step) for step in steps} == {3}
    drawn = []  # each node's uniform, in order: a step of n tokens drew at the root and its n - 1 accepted nodes
    original = Sampling.draw_at
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Sampling, "draw_at", lambda self, probs, u: drawn.append(u) or original(self, probs, u))
        sampled = [step.tokens for step in double.run(request(prompt, 40, temperature=1.0, runtime_top_k=4,
                                                               runtime_top_p=1.0, seed=[[3]], streaming=True))]
    per_step = []
    for step in sampled[:-1]:  # the last step may be cut to the request's length
        per_step.append(set(drawn[:len(step)]))
        del drawn[:len(step)]
    assert any(len(step) > 1 for step in sampled[:-1])  # some steps accepted a node
    assert all(len(uniforms) == 1 for uniforms in per_step)  # one uniform for all of a step's nodes
    assert len(set.union(*per_step)) == len(per_step)  # a fresh one each step


class Successor(TensorrtllmDouble):
    """A target whose argmax after any context is its last token + 1 (so what a guess must be to hold is known)."""

    def logits(self, tokens, last):
        targets = torch.tensor(tokens[-last:]) + 1
        return torch.nn.functional.one_hot(targets % self.vocab_size, self.vocab_size).float()


def test_lookahead_verifies_min_w_g_guesses(tiny_engines, tmp_path):
    """NVIDIA/TensorRT-LLM issue #4003: LookaheadAlgorithm::guess asks the pool for W n-grams, and a key keeps at
    most G, so min(W, G) are verified. Here the only right 3-gram after token 9 is the oldest of four: with G 4 it
    is verified at W 4 (a first step of three tokens) and not at W 2 (a first step of one)."""
    prompt = [9, 10, 11, 9, 50, 51, 9, 60, 61, 9, 70, 71, 9]
    steps = {}
    for window in (2, 4):
        double = lookahead_double(tiny_engines, tmp_path, (window, 3, 4))
        double.__class__ = Successor
        steps[window] = [step.tokens for step in double.run(request(prompt, 3, runtime_top_k=1, streaming=True))]
    assert steps[4] == [[10, 11, 12]]
    assert steps[2][0] == [10] and sum(steps[2], []) == [10, 11, 12]  # the same text, in more steps


def test_a_requests_own_lookahead_sizes_are_read_as_the_backend_reads_them(tiny_engines, tmp_path):
    """getLookaheadDecodingFromTensors keys on lookahead_window_size alone; nothing checks the sizes against the
    model's until the step runs, which fails there. specdeploy's models never declare these inputs (test_trtllm:
    Triton refuses them), so this is what a client addressing the engine model directly would meet upstream."""
    double = lookahead_double(tiny_engines, tmp_path, (2, 3, 2))
    prompt = tiny_engines["ngram"].encode_prompt("abcabcabc")
    expected = greedy_reference(tiny_engines, prompt, 12)
    assert new_tokens(double, request(prompt, 12, runtime_top_k=1, lookahead_ngram_size=9)) == expected  # ignored
    assert new_tokens(double, request(prompt, 12, runtime_top_k=1, lookahead_window_size=1, lookahead_ngram_size=2,
                                      lookahead_verification_set_size=1)) == expected  # smaller: served
    with pytest.raises(DoubleError, match="^Failed to extract lookahead_ngram_size$"):
        new_tokens(double, request(prompt, 12, lookahead_window_size=2))
    with pytest.raises(DoubleError, match=r"^\[TensorRT-LLM\]\[ERROR\] Assertion failed: windowSize requires >= 1$"):
        new_tokens(double, request(prompt, 12, lookahead_window_size=0, lookahead_ngram_size=2,
                                   lookahead_verification_set_size=1))
    with pytest.raises(DoubleError) as late:
        new_tokens(double, request(prompt, 12, lookahead_window_size=5, lookahead_ngram_size=3,
                                   lookahead_verification_set_size=2))
    assert str(late.value) == ("Encountered an error in forward function: [TensorRT-LLM][ERROR] Assertion failed: "
                               "lookahead requires setup w (5) <= max_w (2)")
    unconfigured = lookahead_double(tiny_engines, tmp_path, (4, 3, 4), configured=False)
    with pytest.raises(DoubleError, match="Cannot set the request lookahead decoding configuration when model "
                                          "instance lookahead parameters are not set."):
        new_tokens(unconfigured, request(prompt, 12, lookahead_window_size=2, lookahead_ngram_size=2,
                                         lookahead_verification_set_size=1))


# ---- sampling and verification --------------------------------------------------------------------------------

PROBE = torch.tensor([2.0, 1.6, 1.5, 1.0, 0.2, -1.0, -3.0, 0.1])  # raw logits of an 8-token vocabulary
DRAWS = 20000


def drawn(sampling: Sampling, probs: torch.Tensor, draws: int = DRAWS) -> np.ndarray:
    generator = torch.Generator().manual_seed(1)
    return np.bincount([sampling.draw(probs, generator) for _ in range(draws)], minlength=probs.shape[0])


def fits(counts: np.ndarray, p: torch.Tensor) -> float:
    """Chi-square p-value of counts against p (p = 0 bins must be empty)."""
    p = p.double().numpy()
    assert counts[p == 0].sum() == 0
    return stats.chisquare(counts[p > 0], counts.sum() * p[p > 0] / p[p > 0].sum()).pvalue


def test_the_kernels_walk_gives_the_token_crossing_top_p_only_its_mass_below_it():
    """The double draws as samplingTopKKernels.cu does; the orchestration's closed form of it
    (trtllm_sampling.executor_distribution) fits the draws, and the renormalised nucleus does not."""
    params = SamplingParams(temperature=0.7, top_k=4, top_p=0.7)
    sampling = Sampling(0.7, 4, 0.7, 1.0, 0)
    counts = drawn(sampling, sampling.probabilities(PROBE, torch.zeros(8, dtype=torch.bool)))
    closed = executor_distribution(PROBE[None], params)[0][0]
    nucleus = sampling_distribution(PROBE[None], params)[0]
    assert fits(counts, closed) > 1e-3
    assert fits(counts, nucleus) < 1e-6
    assert not torch.allclose(closed, nucleus, atol=1e-3)  # the crossing token's mass


def test_verification_uses_the_full_top_p_set_unlike_plain_sampling():
    """invokeMaskTargetLogits keeps the crossing token at full mass: the target's p in a verification is the
    renormalised nucleus, while its plain steps draw by the walk. So at top_p < 1 even exact draft logits give
    speculative tokens the nucleus distribution, not the engine's own plain one (an upstream discrepancy)."""
    params = SamplingParams(temperature=0.7, top_k=4, top_p=0.7)
    sampling = Sampling(0.7, 4, 0.7, 1.0, 0)
    selected = sampling.selected(sampling.probabilities(PROBE, torch.zeros(8, dtype=torch.bool)))
    torch.testing.assert_close(selected.float(), sampling_distribution(PROBE[None], params)[0], atol=1e-5, rtol=0)


def test_a_tie_that_decides_q_cuts_the_drafts_there():
    """Equal logits at the top-k boundary (or around the token crossing top-p) leave q to the kernels' order of
    equal values, which the double takes to be the highest id first and torch's topk does not promise: the drafts
    are cut before the first such position, which is exact since the cut depends on logits, not on the drawn token."""
    clear = [3.0, 2.5, 2.0, 1.5, 1.0, 0.5, 0.0, -1.0]
    tied_at_k = [3.0, 2.5, 2.0, 1.5, 1.5, 0.5, 0.0, -1.0]  # the 4th and 5th tie
    tied_crossing = [2.0, 1.0, 1.0, 1.0, 0.0, -2.0, -2.0, -3.0]  # the crossing token ties its neighbours
    top_k, top_p = SamplingParams(temperature=0.7, top_k=4), SamplingParams(temperature=0.7, top_p=0.75)
    assert executor_distribution(torch.tensor([clear, tied_at_k]), top_k)[1].tolist() == [False, True]
    assert executor_distribution(torch.tensor([clear, tied_crossing]), top_p)[1].tolist() == [False, True]
    assert not executor_distribution(torch.tensor([tied_crossing]), top_k)[1].item()  # the tie is inside the top 4
    raw = np.array([clear, clear, tied_at_k, clear], dtype=np.float32)
    assert draft_logits(raw, [1], [0, 1, 2, 3], top_k, 8, 8).shape == (2, 8)  # drafts 3 and 4 are not sent
    sampling = Sampling(0.7, 4, 1.0, 1.0, 0)
    order, _ = sampling.candidates(sampling.probabilities(torch.tensor(tied_at_k), torch.zeros(8, dtype=torch.bool)))
    assert order.tolist() == [0, 1, 2, 4]  # the kernels' own order of the tie: token 3 is never drawn


def test_q_without_top_k_or_top_p_is_the_softmax_and_sorts_nothing(monkeypatch):
    """T > 0 with top-k 0 and top-p 1 (what most clients send) cuts nothing: q is the tempered softmax, with no sort
    of the vocabulary per drafted row (review M5), and equals what the sorting path gives at a top-k of the vocab."""
    logits = torch.randn(3, 32, generator=torch.Generator().manual_seed(5))
    sorted_q = executor_distribution(logits, SamplingParams(temperature=0.7, top_p=1.0 - 1e-7))[0]  # sorts
    monkeypatch.setattr(torch.Tensor, "topk", lambda *_, **__: pytest.fail("sorted the vocabulary"))
    q, ties = executor_distribution(logits, SamplingParams(temperature=0.7))
    torch.testing.assert_close(q, (logits / 0.7).softmax(-1), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(q, sorted_q, atol=1e-6, rtol=1e-5)
    assert not ties.any()


@pytest.mark.parametrize("with_logits", [False, True], ids=["token-matching", "point-mass-logits"])
def test_a_certain_proposal_is_emitted_as_the_rule_says(tiny_engines, tmp_path, with_logits):
    """One drafted token x, proposed with certainty (n-gram). Without draft_logits the executor accepts x when its
    own sample equals x and otherwise draws a fresh sample, so x comes out with probability p(x)(2 − p(x)); with
    point-mass draft logits the exact rule emits x with probability p(x)."""
    double = TensorrtllmDouble.load(tiny_engines["draft_target"].dir / "target",
                                    parameters(engine(tmp_path / "engine", *TARGET_FLAGS)))
    context, params = [5, 17, 3], SamplingParams(temperature=0.7, top_k=4)
    p = sampling_distribution(double.logits(context, 1), params)[0].double()
    drafted = int(p.argsort(descending=True)[1])  # a likely token, not the likeliest
    fields = {"draft_logits": point_mass_logits([drafted], double.padded_vocab)[None]} if with_logits else {}
    trials = 4000
    emitted = sum(new_tokens(double, request(context, 2, temperature=0.7, runtime_top_k=4, runtime_top_p=1.0,
                                             seed=seed, draft_input_ids=[[drafted]], **fields))[0] == drafted
                  for seed in range(trials))
    expected = float(p[drafted]) if with_logits else float(p[drafted] * (2 - p[drafted]))
    assert stats.binomtest(emitted, trials, expected).pvalue > 1e-4, (emitted / trials, expected)
    wrong = float(p[drafted] * (2 - p[drafted])) if with_logits else float(p[drafted])
    assert stats.binomtest(emitted, trials, wrong).pvalue < 1e-6, (emitted / trials, wrong)


def test_draft_logits_must_have_the_padded_vocabulary_in_float32(tmp_path, tiny_engines):
    double = TensorrtllmDouble.load(tiny_engines["draft_target"].dir / "target",
                                    parameters(engine(tmp_path / "engine", *TARGET_FLAGS)))
    narrow = np.zeros((1, 1, double.padded_vocab - 1), dtype=np.float32)
    with pytest.raises(DoubleError, match="draft_logits"):
        new_tokens(double, request([5, 6], 2, temperature=0.7, runtime_top_k=4, draft_input_ids=[[1]],
                                   draft_logits=narrow))


# ---- the build tools --------------------------------------------------------------------------------------------

def test_trtllm_build_refuses_and_adjusts_as_upstream():
    build_config = build_double().build_config
    with pytest.raises(RuntimeError, match="Gather context logits is not support with draft len > 0"):
        build_config(["--checkpoint_dir", "c", "--output_dir", "o", "--gather_context_logits",
                      "--speculative_decoding_mode", "draft_tokens_external", "--max_draft_len", "4"])
    for bad in (["--gemm_plugin", "fp16"], ["--max_seq_len", "lots"], ["--speculative_decoding_mode", "ngram"],
                ["--not_a_flag", "1"]):
        with pytest.raises(SystemExit) as refused:
            build_config(["--checkpoint_dir", "c", "--output_dir", "o", *bad])
        assert refused.value.code == 2, bad
    config = build_config(["--checkpoint_dir", "c", "--output_dir", "o", "--max_batch_size", "4", "--max_input_len",
                           "900", "--max_seq_len", "512", "--max_num_tokens", "16", "--speculative_decoding_mode",
                           "draft_tokens_external", "--max_draft_len", "7"])
    assert config["max_input_len"] == 512  # clipped to max_seq_len
    assert config["max_seq_len"] == 512 + 7 and config["max_draft_len"] == 7
    assert config["max_num_tokens"] == 4 * (7 + 1)  # raised to fit a step of every row
    lookahead = build_config(["--checkpoint_dir", "c", "--output_dir", "o", "--max_seq_len", "512",
                              "--speculative_decoding_mode", "lookahead_decoding"])  # no check of max_draft_len
    assert (lookahead["max_draft_len"], lookahead["max_seq_len"]) == (0, 512)


def medusa_convert(tmp_path: Path, *flags: str) -> str:
    """Runs the converter's double on a two-head checkpoint: "" or how it refused (argparse's exit, an assert)."""
    heads = tmp_path / "heads"
    if not heads.exists():
        from safetensors.torch import save_file

        heads.mkdir()
        (heads / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 1}))
        save_file({f"{h}.{k}": torch.zeros(1) for h in range(2) for k in ("0.linear.weight", "0.linear.bias",
                                                                         "1.weight")},
                  str(heads / "medusa_lm_head.safetensors"))
        (tmp_path / "base").mkdir()
        (tmp_path / "base" / "config.json").write_text("{}")
    spec = importlib.util.spec_from_file_location("medusa_double", DOUBLE / "medusa_convert_checkpoint.py")
    converter = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(converter)
    output = tmp_path / f"out{len(list(tmp_path.iterdir()))}"
    try:
        converter.main(["--model_dir", str(tmp_path / "base"), "--medusa_model_dir", str(heads), "--output_dir",
                        str(output), *flags])
    except (SystemExit, AssertionError, KeyError) as refused:
        return f"{type(refused).__name__}: {refused}"
    return ""


def test_the_medusa_converter_refuses_as_upstream(tmp_path):
    assert medusa_convert(tmp_path, "--num_medusa_heads", "2", "--dtype", "bfloat16") == ""
    assert medusa_convert(tmp_path, "--num_medusa_heads", "2", "--dtype", "auto") == "SystemExit: 2"  # argparse
    assert "Invalid model type" in medusa_convert(tmp_path, "--num_medusa_heads", "2", "--model_type", "gpt")
    assert "max_medusa_token_len > 0" in medusa_convert(tmp_path, "--num_medusa_heads", "2",
                                                        "--max_medusa_token_len", "0")
    # the command line's head count (default 4) wins over the heads' config: more heads than the file holds
    assert medusa_convert(tmp_path).startswith("KeyError")


def test_the_medusa_converter_quantizes_only_under_the_switch_as_upstream(tmp_path):
    """examples/medusa/convert_checkpoint.py @ b93e14ca: --weight_only_precision alone changes nothing (quant_algo
    stays None), --use_weight_only picks W8A16 by default or W4A16 for int4, and a precision it lacks is refused."""

    def quant_algo(*flags: str) -> str | None:
        assert medusa_convert(tmp_path, "--num_medusa_heads", "2", *flags) == ""
        output = max(tmp_path.glob("out*"), key=lambda p: int(p.name[3:]))
        return json.loads((output / "config.json").read_text())["quantization"]["quant_algo"]

    assert quant_algo() is None
    assert quant_algo("--weight_only_precision", "int4") is None
    assert quant_algo("--use_weight_only") == "W8A16"
    assert quant_algo("--use_weight_only", "--weight_only_precision", "int4") == "W4A16"
    assert medusa_convert(tmp_path, "--num_medusa_heads", "2", "--use_weight_only", "--weight_only_precision",
                          "int4_awq") == "SystemExit: 2"
