"""`bench --report DIR`: report.md with every figure and the PNG plots, from real bench reports of tiny engines."""

from __future__ import annotations

import dataclasses
import sys

import pytest
from helpers.made_reports import made_report
from PIL import Image

from specdeploy.bench.markdown import write_report
from specdeploy.bench.printing import why_below_target
from specdeploy.bench.results import BenchReport, Footprint, KindSpeeds, MoeCurve, Peer
from specdeploy.bench.run import run_benches
from specdeploy.errors import SpecdeployError

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
    for report in reports:  # below 1.2x its own plain decode, a report says what limits it
        limits = why_below_target(report)
        assert (limits is None) == (f"What limits it: {limits}" not in text)


def test_a_pipeline_below_the_target_is_told_what_limits_it(tmp_path):
    slow = made_report(summary={"speedup": 0.8, "verify_cost_ratio": 2.5, "proposal_cost_per_step": 0.1})
    text = write_report([slow, made_report()], tmp_path / "report", ["a.yaml", "b.yaml"]).read_text()
    assert text.count("What limits it: ") == 1 and "The verify limits it: 4.0 positions cost 2.50" in text


def test_by_kind_carries_both_speeds(reports):
    for report in reports:
        for figures in report.summary.by_kind.values():
            assert figures.speedup == pytest.approx(figures.speculative_tokens_per_s / figures.plain_tokens_per_s)
            assert 1 <= figures.mean_accepted_length <= report.setup.num_draft_tokens + 1
        low, high = sorted(k.mean_accepted_length for k in report.summary.by_kind.values())
        assert low <= report.summary.mean_accepted_length <= high  # the kinds' steps pooled


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




def test_every_pipeline_against_llama_cpp_in_one_table_and_in_the_comparison(tmp_path):
    """Several pipelines in one run: the figures table and the printed comparison give each one's plain and
    speculative tokens/s over llama.cpp's plain decode, overall and on open-ended prompts; – where a pipeline has
    no llama.cpp figure (an MoE target has no GGUF)."""
    from rich.console import Console

    from specdeploy.bench.comparison import compare, print_comparison

    open_kind = {"open": KindSpeeds(speedup=1.1, prompts=3, plain_tokens_per_s=90.0, speculative_tokens_per_s=99.0)}
    measured = made_report(setup={"pipeline": "with-gguf"},
                           summary={"by_kind": {**made_report().summary.by_kind, **open_kind}},
                           peers={"llama.cpp": Peer(tokens_per_s=80.0, by_kind={"copy": 50.0, "open": 60.0})})
    without = made_report(setup={"pipeline": "moe"}, peers={"llama.cpp": Peer(skipped="an MoE has no GGUF")})
    text = write_report([measured, without], tmp_path, ["a.yaml", "b.yaml"]).read_text()
    # all prompts: ours 100 plain, 150 speculative against 80; open-ended: ours 99 speculative against 60
    assert "| plain ÷ llama.cpp plain | 1.25× | – |" in text
    assert "| speculative ÷ llama.cpp plain | 1.88× | – |" in text
    assert "| speculative ÷ llama.cpp plain, open-ended prompts | 1.65× | – |" in text
    comparison = compare([measured, without])
    assert comparison["figures"]["open_speculative_vs_llama_cpp"] == {"with-gguf": pytest.approx(1.65),
                                                                       "moe": None}
    assert comparison["machine"] == "test cpu, 2 threads"
    console = Console(record=True, width=200)
    print_comparison(comparison, console)
    printed = console.export_text()
    assert "test cpu, 2 threads" in printed and "speculative ÷ llama.cpp plain (open-ended)" in printed
    # without the peer the rows are left out, not printed empty
    alone = Console(record=True, width=200)
    print_comparison(compare([without, made_report(setup={"pipeline": "other"})]), alone)
    assert "llama.cpp" not in alone.export_text()
    assert "÷ llama.cpp plain" not in write_report([without], tmp_path / "none", ["b.yaml"]).read_text()
