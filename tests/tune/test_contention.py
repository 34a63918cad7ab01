"""Build timings that a busy machine cannot fool (tune/contention.py, issue 64 point 5): a contended timing is
recognised (CPU share, rounds that disagree), taken again, and where every attempt was contended the stated rule
decides; the conditions are recorded beside the decision. The timings are injected: canned phase results with the
conditions a fake clock gives, so nothing is compiled."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
from rich.progress import Progress

from specdeploy.tune import contention, step_programs
from specdeploy.tune.contention import Watch, judge, until_quiet
from specdeploy.tune.gamma_cap import decided_gamma_cap


def fake_clock(*readings: float):
    values = iter(readings)
    return lambda: next(values)


def test_a_descheduled_process_is_contended():
    """Two threads for 1 s of wall time got 0.6 CPU seconds: other work had the cores."""
    with Watch(wall=fake_clock(10.0, 11.0), cpu=fake_clock(5.0, 5.6)) as watch:
        pass
    assert (watch.wall_seconds, watch.cpu_seconds) == (1.0, pytest.approx(0.6))
    conditions = judge(watch.wall_seconds, watch.cpu_seconds, 2, {"eager": [700.0] * 8})
    assert conditions.cpu_share == 0.3 and "got 30% of the CPU its 2 threads" in conditions.contended
    assert judge(1.0, 1.9, 2, {"eager": [28.0, 28.4, 28.1, 27.9]}).contended is None


def test_rounds_that_disagree_are_contended():
    noisy = {"aten": [28.0, 700.0, 30.0, 650.0, 29.0, 720.0], "eager": [28.5] * 6}
    conditions = judge(1.0, 2.0, 2, noisy)
    assert conditions.contended.startswith("its rounds disagree")


def test_a_busy_thread_lowers_the_share_of_a_timed_thread():
    """Real clocks: a thread waiting on a lock (as a descheduled one waits on the CPU) gets little CPU time."""
    import threading

    lock = threading.Lock()
    lock.acquire()
    with Watch() as watch:
        threading.Timer(0.3, lock.release).start()
        lock.acquire()
    assert watch.wall_seconds >= 0.25 and judge(watch.wall_seconds, watch.cpu_seconds, 1, {}).contended


def timed(compiled_ms: float, eager_ms: float, share: float) -> dict:
    """A timing phase's JSON, with the conditions a clock gave (share of the CPU)."""
    conditions = judge(1.0, share * 2, 2, {})
    return {"variants": {"aten": {"load_seconds": 0.02, "package_bytes": 10, "compiled_ms": compiled_ms}},
            "eager_ms": eager_ms, "conditions": conditions.as_record()}


def measure(tmp_path, monkeypatch, results: list[dict]) -> dict:
    """measure_programs for one component whose timing phases print `results` in turn."""
    monkeypatch.setattr(contention, "PAUSE_SECONDS", 0)
    phases = iter(results)
    monkeypatch.setattr(step_programs, "run_phase", lambda *args: "process")
    monkeypatch.setattr(step_programs, "phase_result", lambda process: next(phases))
    (tmp_path / "steps").mkdir()
    step_programs.program_path(tmp_path, "target", "aten").write_bytes(b"program")
    record = {"steps": "measured", "components": {}}
    with Progress(disable=True) as progress:
        tasks = {"target": progress.add_task("target", total=None)}
        step_programs.measure_programs(SimpleNamespace(name="tiny"), tmp_path, {
            ("target", "aten"): {"compile_seconds": 90.0, "from_store": False}}, record, progress, tasks)
    return record["components"]["target"]


def test_the_old_rule_chooses_eager_from_noise():
    """The contended build: 724 ms compiled against 704 ms eager, read as they stand, drops the program."""
    noisy = timed(724.0, 704.0, share=0.3)
    assert not (noisy["variants"]["aten"]["compiled_ms"] / noisy["eager_ms"] < step_programs.KEEP_BELOW)


def test_a_contended_timing_is_taken_again_and_the_quiet_one_decides(tmp_path, monkeypatch):
    entry = measure(tmp_path, monkeypatch, [timed(724.0, 704.0, share=0.3), timed(28.0, 38.9, share=0.95)])
    assert entry["kept"] and entry["compiled_ms"] == 28.0 and entry["decided_by"] == "timing (taken again: contended)"
    assert [c["contended"] is None for c in entry["conditions"]] == [False, True]
    assert (tmp_path / "steps" / "target.pt2").is_file()


def test_every_timing_contended_falls_back_to_the_rule_and_says_why(tmp_path, monkeypatch):
    entry = measure(tmp_path, monkeypatch, [timed(724.0, 704.0, share=0.3)] * contention.ATTEMPTS)
    assert entry["kept"] and len(entry["conditions"]) == contention.ATTEMPTS
    assert entry["decided_by"].startswith(step_programs.CONTENDED_RULE) and "got 30% of the CPU" in entry["decided_by"]
    assert "kept by rule" in step_programs.verdict(entry)


def test_until_quiet_stops_at_the_first_quiet_timing():
    calls = itertools.count()
    pauses = []

    def measure_once() -> dict:
        n = next(calls)
        return {"n": n, "conditions": {"contended": "busy" if n == 0 else None}}

    result, attempts = until_quiet(measure_once, attempts=3, pause=1.5, sleep=pauses.append)
    assert result["n"] == 1 and len(attempts) == 2 and pauses == [1.5]


def test_a_contended_gamma_cap_falls_back_to_the_pipelines_gamma():
    noise = {1: 1.4, 2: 1.1, 3: 0.9, 4: 0.8, 5: 0.7}  # as a busy machine's calibration might read
    quiet = [judge(10.0, 19.0, 2, {}).as_record()]
    busy = [judge(10.0, 6.0, 2, {}).as_record()] * contention.ATTEMPTS
    assert decided_gamma_cap(noise, 5, quiet)["gamma_cap"] == 1  # a quiet timing decides, as before
    record = decided_gamma_cap(noise, 5, busy)
    assert record["gamma_cap"] == 5 and record["conditions"] == busy and "the pipeline's own gamma" in \
        record["decided_by"]
