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

from specdeploy.build.trtllm.upstream import TENSORRTLLM_REQUIRED_PARAMETERS
from specdeploy.decoding.sampling import sampling_distribution
from specdeploy.package.trtllm_models import tensorrtllm_model
from specdeploy.serve.trtllm.sampling import draft_logits, executor_distribution, point_mass_logits
from specdeploy.spec.pipeline import load_pipeline
from specdeploy.spec.sampling_params import SamplingParams

sys.path.insert(0, str(REPO / "tests" / "trtllm_double" / "backend"))
from bls_double import build_double  # noqa: E402
from tensorrtllm_double import DoubleError, LoadError, Sampling, TensorrtllmDouble, load_settings  # noqa: E402

LLAMA70B = REPO / "pipelines" / "gpu" / "llama70b-draft-target.yaml"
DOUBLE = REPO / "tests" / "trtllm_double"


def engine(directory: Path, *flags: str) -> Path:
    """An engine directory whose config.json is what the build double writes for these trtllm-build flags."""
    directory.mkdir(parents=True)
    config = build_double().build_config(["--checkpoint_dir", "c", "--output_dir", str(directory), *flags])
    (directory / "config.json").write_text(json.dumps({"build_config": config}))
    return directory


TARGET_FLAGS = ("--max_batch_size", "8", "--max_input_len", "256", "--max_seq_len", "256",
                "--speculative_decoding_mode", "draft_tokens_external", "--max_draft_len", "8")


def parameters(engine_dir: Path, draft: bool = False) -> dict[str, str]:
    """The parameters `package` writes for a tensorrtllm model (the 70B example's settings) over engine_dir."""
    config = tensorrtllm_model("tensorrt_llm", load_pipeline(LLAMA70B), str(engine_dir), draft=draft)
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
