"""`bench --report DIR`: report.md with every figure and the PNG plots, from real bench reports of tiny engines."""

from __future__ import annotations

import dataclasses
import sys

import pytest
from helpers.made_reports import made_report
from PIL import Image

from specdeploy.bench.bench_report import BenchReport, Footprint, MoeCurve, Peer
from specdeploy.bench.footprint import measure_footprint
from specdeploy.bench.gamma_cap import MARGIN, measured_policy
from specdeploy.bench.report import gamma_curves, write_report
from specdeploy.bench.run import run_benches
from specdeploy.errors import SpecdeployError
from specdeploy.speculative.speedup import predicted_speedup

PROMPTS = [{"prompt": "abcabcabcabc", "kind": "copy"}, {"prompt": "hello world, hello", "kind": "open-ended"}]


@pytest.fixture(scope="module")
def reports(tiny_engines):
    engines = [tiny_engines["draft_target"], tiny_engines["ngram"]]
    return run_benches(engines, PROMPTS, 12, 0.0, 0, with_transformers=False, quiet=True)


def test_the_report_holds_every_figure_and_readable_plots(reports, tmp_path):
    path = write_report(reports, tmp_path / "report", ["a.yaml", "b.yaml"])
    text = path.read_text()
    for report in reports:
        assert f"{report.setup.pipeline} ({report.setup.method})" in text
        assert f"{report.summary.speedup:.2f}×" in text and f"{report.summary.baseline_tokens_per_s:.1f}" in text
        for kind, figures in report.summary.by_kind.items():
            assert f"| {kind} | {figures.prompts} | {figures.plain_tokens_per_s:.1f} |" in text
    assert "torch threads" in text and "- torch " in text
    for name in ("speedup.png", "acceptance.png", "tokens_by_kind.png"):
        assert f"]({name})" in text
        with Image.open(tmp_path / "report" / name) as image:
            assert image.format == "PNG" and image.size[0] >= 800
    assert not list((tmp_path / "report").glob("moe-*.png"))  # no MoE pipeline in this run


def test_by_kind_carries_both_speeds(reports):
    for report in reports:
        for figures in report.summary.by_kind.values():
            assert figures.speedup == pytest.approx(figures.speculative_tokens_per_s / figures.plain_tokens_per_s)


def test_the_two_predictions_agree_when_acceptance_is_geometric():
    """The line from acceptance by position and the seed's formula are the same curve when position i is accepted
    with probability alpha^i (independent acceptance): the plot's two lines then coincide."""
    alpha, c, v = 0.7, 0.1, 1.05
    report = made_report(summary={"draft_cost_ratio": c, "verify_cost_ratio": v, "acceptance_rate": alpha,
                                  "per_position_acceptance": [alpha ** i for i in range(1, 6)]},
                         setup={"num_draft_tokens": 5})
    curves = gamma_curves(report)
    assert list(curves["by_position"]) == [1, 2, 3, 4, 5] and len(curves["formula"]) == 10
    for gamma, value in curves["by_position"].items():
        assert value == pytest.approx(curves["formula"][gamma]) == pytest.approx(predicted_speedup(alpha, gamma, c, v))


def test_the_predicted_lines_follow_the_verify_cost_by_width():
    """Where verifying n tokens costs nearly n plain steps (bf16 without oneDNN), one v for every gamma predicts a
    small gamma far too low: the lines take the measured cost by width, scaled through the v of the served gamma."""
    alpha, c = 0.9, 0.3
    costs = [1.0 + 0.5 * n for n in range(7)]  # a forward over n + 1 positions, in plain steps
    report = made_report(summary={"draft_cost_ratio": c, "verify_cost_ratio": 2.2, "acceptance_rate": alpha,
                                  "per_position_acceptance": [alpha ** i for i in range(1, 4)]},
                         setup={"num_draft_tokens": 3}, verify_costs=costs)
    curves = gamma_curves(report)
    assert list(curves["formula"]) == [1, 2, 3, 4, 5, 6] and list(curves["by_position"]) == [1, 2, 3]
    scale = 2.2 / costs[3]
    for gamma in (1, 3, 6):
        assert curves["formula"][gamma] == pytest.approx(predicted_speedup(alpha, gamma, c, scale * costs[gamma]))
    assert curves["by_position"][3] == pytest.approx(predicted_speedup(alpha, 3, c, 2.2))
    assert curves["formula"][1] > predicted_speedup(alpha, 1, c, 2.2)


def test_a_dip_in_the_measured_verify_cost_does_not_bend_the_lines_down():
    """Timing noise can make a wider forward look cheaper (1.07 then 0.99): the lines take the running maximum."""
    alpha, c = 0.5, 0.1
    noisy = [1.0, 1.07, 1.09, 0.99, 1.02, 1.06]
    report = made_report(summary={"draft_cost_ratio": c, "verify_cost_ratio": 1.09, "acceptance_rate": alpha,
                                  "per_position_acceptance": [alpha, alpha ** 2]},
                         setup={"num_draft_tokens": 2}, verify_costs=noisy)
    formula = gamma_curves(report)["formula"]
    for gamma, cost in zip(range(1, 6), [1.07, 1.09, 1.09, 1.09, 1.09]):
        assert formula[gamma] == pytest.approx(predicted_speedup(alpha, gamma, c, cost))


def test_dense_reports_carry_the_verify_cost_by_width(reports):
    for report in reports:
        costs = report.verify_costs
        assert len(costs) == min(8, 2 * report.setup.num_draft_tokens) + 1 and costs[0] == pytest.approx(1.0)


def test_moe_reports_get_their_expert_plot(reports, tmp_path):
    moe = dataclasses.replace(reports[0], setup=dataclasses.replace(reports[0].setup, pipeline="tiny-moe"),
                              moe=MoeCurve(verification_length=[1, 2, 3, 4], num_experts=8, experts_per_token=2,
                                           distinct_experts_per_layer=[2.0, 3.4, 4.5, 5.2],
                                           expert_bytes_read=[2e6, 3.4e6, 4.5e6, 5.2e6],
                                           verify_cost=[1.0, 1.5, 1.9, 2.2],
                                           dense_verify_cost=[1.0, 1.05, 1.1, 1.12]))
    path = write_report([moe], tmp_path, ["moe.yaml"])
    assert "(moe-tiny-moe.png)" in path.read_text()
    with Image.open(tmp_path / "moe-tiny-moe.png") as image:
        assert image.format == "PNG"


def test_without_matplotlib_the_report_says_which_extra_to_install(reports, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(SpecdeployError, match=r"specdeploy\[report\]"):
        write_report(reports, tmp_path, ["a.yaml"])


def test_the_server_report_plots_concurrency_and_the_policy(tmp_path):
    """bench --url --report: the levels' table and the throughput plot, with the served pipeline's policy."""
    from helpers.repo import REPO

    from specdeploy.bench.server_load import LevelResult, RequestResult
    from specdeploy.bench.server_report import write_server_report
    from specdeploy.serve.latency import RequestTiming
    from specdeploy.spec.pipeline import load_pipeline

    def latencies(concurrency: int, burst: int) -> dict:
        """A level's latency summary from requests whose tokens arrive `burst` at a time every 50 ms x streams."""
        results = []
        for index in range(4):
            timing = RequestTiming(0.0)
            for step in range(12 // burst):
                timing.produced(burst if step else 1, 0.1 * concurrency + 0.05 * concurrency * step + 0.01 * index)
            results.append(RequestResult(index, generated_tokens=timing.tokens, finished=True, timing=timing))
        return LevelResult(concurrency, burst > 1, 1.0, results).latencies()

    rows = [{"concurrency": c, "requests": 2 * c, "speculative_tokens_per_s": s, "plain_tokens_per_s": p,
             "speedup": s / p, "acceptance_rate": a, "failed": 0, "vs_single_stream": s / 30.0,
             "speculative_latency": latencies(c, 3), "plain_latency": latencies(c, 1)}
            for c, s, p, a in ((1, 30.0, 22.0, 0.9), (2, 50.0, 40.0, 0.9), (4, 70.0, 66.0, 0.85),
                               (8, 90.0, 90.0, 0.0))]
    server = {"url": "127.0.0.1:8001", "max_tokens": 64, "levels": rows}
    pipeline = load_pipeline(REPO / "pipelines/smollm2-draft-target.yaml")
    text = write_server_report(server, tmp_path, pipeline).read_text()
    assert "| 2 | 50.0 | 40.0 | 1.25× | 0.90 | 0 |" in text
    policy = pipeline.serving.policy
    assert f"up to a batch of {policy.full_up_to}, reduced up to {policy.off_above}" in text
    for name in ("concurrency.png", "latency.png", "itl_cdf.png"):
        with Image.open(tmp_path / name) as image:
            assert image.format == "PNG"
    # 1 stream: first tokens at 100..130 ms; plain, 12 tokens 50 ms apart: genai-perf's ITL 550 / 11 = 50 ms;
    # speculative, 1 token then 3 bursts of 3, 50 ms apart: ITL 150 / 9 = 17 ms, 2.5 tokens a response, gaps 50 ms
    assert "| 1 | plain | 115 | 127 | 130 | 50 | 50 | 50 | 665 | 680 |" in text
    assert "| 1 | speculative | 115 | 127 | 130 | 17 | 17 | 17 | 265 | 280 |" in text
    assert "| 2.50 | 50 | 50 |" in text and "| 1.00 | 50 | 50 |" in text
    # with --price-per-hour, each level's dollars per million tokens, speculative then plain
    for row in rows:
        row.update(speculative_usd_per_million_tokens=1000 / row["speculative_tokens_per_s"],
                   plain_usd_per_million_tokens=1000 / row["plain_tokens_per_s"])
    priced = write_server_report(server | {"price_per_hour": 3.6}, tmp_path / "priced", pipeline).read_text()
    assert "(at $3.60/h)" in priced and "| 2 | 50.0 | 40.0 | 1.25× | 0.90 | 0 | $20.00 | $25.00 |" in priced


def test_peers_run_on_the_same_weights_and_the_report_names_the_faster(tiny_engines, tmp_path):
    """transformers plain, prompt lookup and assistant_model (a plain draft) are measured; an int4-derived draft
    is skipped with its reason; the report gives ours over theirs and says which peer is faster."""
    from specdeploy.bench.peers import PLAIN, peer_ratios

    engines = [tiny_engines["draft_target"], tiny_engines["int4"]]
    measured = run_benches(engines, PROMPTS, 10, 0.0, 0, with_transformers=False, quiet=True, with_peers=True)
    plain_draft, int4 = (report.peers for report in measured)
    assert plain_draft[PLAIN].tokens_per_s > 0 and plain_draft["transformers assistant_model"].tokens_per_s > 0
    assert "int4" in int4["transformers assistant_model"].skipped
    assert any(name.startswith("transformers prompt lookup") for name in int4)
    llama_cpp = [peer for name, peer in int4.items() if name.startswith("llama.cpp")]
    assert len(llama_cpp) == 2 and all("not a GGUF file" in peer.skipped or "not installed" in peer.skipped
                                       for peer in llama_cpp)
    ratios = peer_ratios(measured[0])
    assert ratios[PLAIN].ours_plain == pytest.approx(measured[0].summary.baseline_tokens_per_s
                                                     / plain_draft[PLAIN].tokens_per_s)
    for report, engine in zip(measured, engines):  # where the time went: decodes, analysis, peers, footprint
        assert set(report.phase_seconds) == {"plain_and_speculative", "analysis", "peers", "footprint"}
        assert all(seconds > 0 for seconds in report.phase_seconds.values())
        footprint = report.footprint  # a fresh process loaded the engine and ran the first prompt
        assert footprint.engine_bytes == sum(f.stat().st_size for f in engine.dir.rglob("*") if f.is_file())
        assert footprint.build_seconds > 0 and footprint.compile_seconds is None
        assert 0 < footprint.first_token_seconds <= footprint.first_request_seconds and footprint.load_seconds > 0
        assert footprint.peak_rss_bytes > 150 * 2**20  # importing torch alone takes more
        assert "not a GGUF file" in footprint.llama_cpp_skipped and footprint.rss_vs_llama_cpp is None
        assert BenchReport.from_json(report.to_json()).footprint == footprint
    text = write_report(measured, tmp_path, ["a.yaml", "b.yaml"]).read_text()
    assert "## Footprint: tiny-dt (draft_target)" in text and "skipped: the target's checkpoint is not a GGUF" in text
    assert "## Time spent (seconds)" in text and "- tiny-dt (draft_target): plain and speculative " in text
    assert "## Peers: tiny-dt (draft_target)" in text and "skipped: the draft is derived int4" in text
    faster = [name for name, ratio in ratios.items() if ratio.ours_speculative < 1]
    assert (f"Faster than our speculative decoding here: {', '.join(faster)}." if faster
            else "No peer was faster") in text


def test_a_gamma_sweep_adds_measured_points(tiny_engines, tmp_path):
    engines = [tiny_engines["draft_target"], tiny_engines["ngram"]]
    swept = run_benches(engines, PROMPTS, 10, 0.0, 0, with_transformers=False, quiet=True, gammas=(1, 2))
    for report in swept:
        assert list(report.gamma_sweep) == [1, 2] and all(v > 0 for v in report.gamma_sweep.values())
        assert list(report.to_json()["gamma_sweep"]) == ["1", "2"]  # JSON object keys are strings
        assert report.phase_seconds["gamma_sweep"] > 0
    write_report(swept, tmp_path, ["a.yaml", "b.yaml"])
    with Image.open(tmp_path / "speedup.png") as image:
        assert image.format == "PNG"


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


def test_ours_against_llama_cpp_by_prompt_kind_and_the_footprint_are_tabled(tmp_path):
    peers = {"llama.cpp": Peer(tokens_per_s=80.0, by_kind={"copy": 50.0}, what="llama.cpp")}
    footprint = Footprint(engine_bytes=300 * 2**20, build_seconds=12.0, compile_seconds=None, gamma_cap_seconds=61.5,
                          load_seconds=2.5, first_token_seconds=0.1, first_request_seconds=1.2,
                          peak_rss_bytes=600 * 2**20, llama_cpp_peak_rss_bytes=200 * 2**20)
    text = write_report([made_report(peers=peers, footprint=footprint)], tmp_path, ["made.yaml"]).read_text()
    # copy: ours 100 plain and 150 speculative against llama.cpp's 50; all prompts: against its 80
    assert "| copy | 100.0 | 150.0 | 50.0 | 2.00× | 3.00× | 1.50× |" in text
    assert "| all | 100.0 | 150.0 | 80.0 | 1.25× | 1.88× | 1.50× |" in text
    assert "| 300 MiB | 12.0 s | – | 61.5 s | 2.5 s | 0.1 s | 1.2 s | 600 MiB | 200 MiB | 3.00× |" in text


def test_the_measured_gamma_cap_is_the_best_realized_gamma_beyond_noise_or_none_when_nothing_pays():
    def cap(full_speedup: float, sweep: dict[int, float]) -> int:
        report = made_report({"speedup": full_speedup}, {"num_draft_tokens": 4}, gamma_sweep=sweep)
        return measured_policy(report)["gamma_cap"]

    assert cap(1.40, {1: 1.2, 2: 1.50, 3: 1.45}) == 2  # a smaller gamma that pays more
    assert cap(1.40, {1: 1.2, 2: 1.42, 3: 1.41}) == 4  # within MARGIN of the pipeline's own: keep its gamma
    assert cap(0.90, {1: 0.95, 2: 0.93, 3: 0.91}) == 0  # nothing beats plain decode: draft nothing
    assert cap(1.40, {1: 1.2, 2: 1.40 * MARGIN + 0.01, 3: 1.3}) == 2


def test_gamma_and_position_axes_tick_whole_numbers_only():
    """Two draft positions must not read 0.75, 1.25, ...: the axes of gammas, positions and lengths tick integers."""
    from specdeploy.bench.report import pyplot, whole_number_ticks

    plt = pyplot()
    figure, axes = plt.subplots()
    axes.bar([1, 2], [0.5, 0.1])
    assert any(tick % 1 for tick in axes.get_xticks())  # matplotlib's own choice puts ticks between them
    whole_number_ticks(axes.xaxis)
    assert all(tick % 1 == 0 for tick in axes.get_xticks())
    plt.close(figure)
