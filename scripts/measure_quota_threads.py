"""Tokens/s of the CPU image under a CPU quota, with the thread count torch took before (the host's cores) and with
the count the engine derives from the quota (models/cpu_threads.py), in one run (`make quota-threads`).

Each arm is `specdeploy bench` in `podman run --cpus CPUS` on one volume (the engine is built once, first, untimed):
"before" pins SPECDEPLOY_CPU_THREADS to torch's own default in that container (what the engine ran before it
derived a count), "derived" sets nothing. The arms alternate, ROUNDS times each, so that a slow spell of the
machine falls on both; the medians are printed and written as JSON. It needs the image (`make image`) and a quiet
machine: under other work the quota is not what limits the arms.

    python3 scripts/measure_quota_threads.py [--cpus 1] [--rounds 3] [--max-tokens 64] [--out bench-results/...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import podman_image  # noqa: E402  (scripts/ is not a package)

PIPELINE = "pipelines/smollm2-draft-target.yaml"  # the image's default pipeline, its programs in the image's store
DATA = "/var/lib/specdeploy"


def run_in_image(volume: str, cpus: str, environment: dict[str, str], *command: str) -> str:
    """One command in the CPU image under the quota, on the shared volume; its stdout."""
    variables = [option for name, value in environment.items() for option in ("--env", f"{name}={value}")]
    return podman_image.podman("run", "--rm", "--network", "none", "--cpus", cpus, "--volume", f"{volume}:{DATA}",
                               *variables, podman_image.CPU_IMAGE, *command, capture=True).stdout


def torch_default_threads(cpus: str) -> int:
    """The count torch takes in the container by itself: what the engine ran with before it derived one."""
    result = podman_image.podman("run", "--rm", "--network", "none", "--cpus", cpus, "--entrypoint", "python",
                                 podman_image.CPU_IMAGE, "-c", "import torch; print(torch.get_num_threads())",
                                 capture=True)
    return int(result.stdout.split()[-1])


def bench_arm(volume: str, cpus: str, environment: dict[str, str], name: str, max_tokens: int) -> dict:
    """One bench of the default pipeline; its speeds and the threads it ran."""
    report = f"{DATA}/quota-{name}.json"
    run_in_image(volume, cpus, environment, "bench", PIPELINE, "--no-transformers", "--max-tokens", str(max_tokens),
                 "--json", report)
    result = podman_image.podman("run", "--rm", "--network", "none", "--volume", f"{volume}:{DATA}", "--entrypoint",
                                 "cat", podman_image.CPU_IMAGE, report, capture=True)
    data = json.loads(result.stdout)
    data = data[0] if isinstance(data, list) else data
    return {"speculative_tokens_per_s": data["speculative_tokens_per_s"],
            "baseline_tokens_per_s": data["baseline_tokens_per_s"], "threads": data["machine"]["threads"],
            "cpu_threads": data["machine"].get("cpu_threads")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpus", default="1")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("bench-results/quota-threads.json"))
    args = parser.parse_args()
    volume = f"specdeploy-quota-threads-{args.cpus}"
    if podman_image.podman("volume", "exists", volume, check=False).returncode != 0:  # Debian's podman 4.3: no --ignore
        podman_image.podman("volume", "create", volume)
    run_in_image(volume, args.cpus, {}, "build", PIPELINE)  # untimed: both arms read this engine
    before = torch_default_threads(args.cpus)
    arms = {"before": {"SPECDEPLOY_CPU_THREADS": str(before)}, "derived": {}}
    runs: dict[str, list[dict]] = {name: [] for name in arms}
    for round_ in range(args.rounds):
        for name, environment in arms.items():
            runs[name].append(bench_arm(volume, args.cpus, environment, f"{name}-{round_}", args.max_tokens))
            print(f"round {round_ + 1} {name}: {runs[name][-1]}", flush=True)
    summary = {name: {"threads": runs[name][0]["threads"], "cpu_threads": runs[name][0]["cpu_threads"],
                      "median_speculative_tokens_per_s": statistics.median(r["speculative_tokens_per_s"]
                                                                           for r in runs[name]),
                      "median_plain_tokens_per_s": statistics.median(r["baseline_tokens_per_s"] for r in runs[name]),
                      "runs": runs[name]} for name in arms}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"cpus": args.cpus, "max_tokens": args.max_tokens, "arms": summary}, indent=2))
    for name, arm in summary.items():
        print(f"--cpus {args.cpus}, {name}: {arm['threads']} threads, {arm['median_speculative_tokens_per_s']:.1f} "
              f"tokens/s speculative, {arm['median_plain_tokens_per_s']:.1f} plain (median of {args.rounds})")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
