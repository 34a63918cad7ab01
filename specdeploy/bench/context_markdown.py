"""`bench PIPELINE --context ... --report DIR`: DIR/report.md, DIR/context.json and DIR/context.png, speedup against
context length, measured and predicted, beside the plain step's slowdown, measured and predicted by the bytes it
reads (context_sweep.py)."""

from __future__ import annotations

import json
from pathlib import Path

from specdeploy.bench.context_printing import bytes_line, rows
from specdeploy.bench.context_sweep import ContextSweep
from specdeploy.bench.markdown import versions
from specdeploy.bench.plots import WIDE_FIGURE, pyplot, save


def plot_context(plt, sweep: ContextSweep, path: Path) -> None:
    points = sweep.points
    lengths = [p.prompt_tokens for p in points]
    figure, (speedups, slowdowns) = plt.subplots(1, 2, figsize=WIDE_FIGURE)
    speedups.plot(lengths, [p.speedup for p in points], marker="o", linestyle="", label="measured")
    speedups.plot(lengths, [p.predicted_speedup for p in points], label="predicted (bytes model)")
    speedups.plot(lengths, [p.speedup_from_measured_costs for p in points], linestyle="--",
                  label="tokens per step / measured costs")
    speedups.axhline(1.0, color="grey", linestyle=":")
    speedups.set_ylabel("speedup over plain decode")
    speedups.set_title(f"{sweep.pipeline}: speedup against context")
    slowdowns.plot(lengths, [p.plain_slowdown for p in points], marker="o", linestyle="", label="measured")
    slowdowns.plot(lengths, [p.predicted_plain_slowdown for p in points], label="predicted: (W + m K) / (W + m0 K)")
    slowdowns.set_ylabel("plain step time / the shortest context's")
    slowdowns.set_title("Plain decode step against context")
    for axes in (speedups, slowdowns):
        axes.set_xlabel("prompt tokens (padded with held-out text)")
        axes.legend(fontsize=8)
    save(plt, figure, path)


def write_context_report(sweep: ContextSweep, directory: Path) -> Path:
    plt = pyplot()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    plot_context(plt, sweep, directory / "context.png")
    (directory / "context.json").write_text(json.dumps(sweep.to_json(), indent=2))
    machine = sweep.machine
    lines = [f"# specdeploy bench --context: {sweep.pipeline}", "",
             f"{sweep.method}, gamma {sweep.num_draft_tokens}, {sweep.dtype}; {sweep.prompts} prompts, each padded "
             f"with held-out text to every length, {sweep.max_tokens} tokens per answer; {machine['cpu']}, "
             f"{machine['threads']} torch threads.", "",
             *(f"- {package} {version}" for package, version in versions().items()), "",
             "| context | " + " | ".join(str(point.context) for point in sweep.points) + " |",
             "|---|" + "---|" * len(sweep.points),
             *(f"| {name} | " + " | ".join(values) + " |" for name, values in rows(sweep)), "",
             f"{bytes_line(sweep)}. Costs are in plain steps at each length; the prediction carries the shortest "
             "length's costs to the others by the bytes each step reads (bench/context_sweep.py).", "",
             "![Speedup and plain step against context](context.png)", ""]
    path = directory / "report.md"
    path.write_text("\n".join(lines))
    return path
