#!/usr/bin/env bash
# The torch backend on an NVIDIA GPU, in one command (meant to take under 8 minutes; the timeouts below are caps, not
# the budget; its CPU rehearsal took 2m18s on 2 cores with two of the five engines to build): the GPU tests, then a
# short bench of each shipped pipeline (the draft-target one beside an int8 draft) with --device cuda --report, and a
# summary table. Installs nothing: run it where this repository's environment has a CUDA build of torch
# (PYTHON=/path/to/python, default .venv/bin/python).
#   scripts/gpu-check.sh [OUTPUT_DIR]      (default gpu-check/)
# Engines not built yet are built first (on the CPU: the MoE's derivation is the longest, about 2.5 minutes on 2 cores).
# GPU_CHECK_DEVICE=cpu rehearses the script on a machine without a GPU (the GPU tests skip, the benches run on the CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 PIP_NO_INDEX=1
PYTHON=${PYTHON:-.venv/bin/python}
OUT=${1:-gpu-check}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
started=$(date +%s)

"$PYTHON" - "$DEVICE" <<'PY'
import sys

import torch

if sys.argv[1] == "cpu":
    print("gpu-check: a rehearsal on the CPU (GPU_CHECK_DEVICE=cpu): the GPU tests skip, the figures are not a GPU's")
elif not torch.cuda.is_available():
    sys.exit(f"gpu-check: torch {torch.__version__} sees no GPU (CUDA build: {torch.version.cuda or 'no'}); run it "
             f"where torch.cuda.is_available() is true, with PYTHON pointing at that environment's python")
else:
    print(f"gpu-check: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
PY
mkdir -p "$OUT"

# The GPU tests (tests/models/test_cuda.py: greedy exactness, one host sync per step, the int4 and int8 kernels, the MoE
# path, a KIND_GPU repository served by tritonserver) and the device tests that run anywhere.
# A failure is reported at the end: the benches and the summary still run.
status=0
timeout 300 "$PYTHON" -m pytest -q tests/models/test_cuda.py tests/models/test_device.py -p no:cacheprovider || status=$?

# One prompt of each kind, 64 tokens each, on every shipped pipeline.
"$PYTHON" scripts/one_prompt_per_kind.py "$OUT/prompts.jsonl"
# The draft-target pipeline with an int8 draft beside the shipped int4 one: which pays is a measurement (the device's
# weight-only kernels), so both are benched in one run.
"$PYTHON" - "$OUT/smollm2-draft-target-int8.yaml" <<'PY'
import sys

import yaml

spec = yaml.safe_load(open("pipelines/smollm2-draft-target.yaml"))
spec["name"] = "smollm2-draft-target-int8"
spec["speculation"]["draft"]["derive"] = "int8"
open(sys.argv[1], "w").write(yaml.safe_dump(spec, sort_keys=False))
PY
PIPELINES="pipelines/smollm2-draft-target.yaml $OUT/smollm2-draft-target-int8.yaml pipelines/smollm2-ngram.yaml
pipelines/smollm2-medusa.yaml pipelines/smollm2-moe-draft-target.yaml"
for pipeline in $PIPELINES; do  # a built engine is up to date and costs nothing here
    "$PYTHON" -m specdeploy.cli build "$pipeline" || status=$?
done
bench() {  # bench REPORT_NAME PIPELINE...: in one run, side by side
    local name=$1
    shift
    timeout 150 "$PYTHON" -m specdeploy.cli bench "$@" --device "$DEVICE" --prompts "$OUT/prompts.jsonl" \
        --max-tokens 64 --no-transformers --report "$OUT/$name" || status=$?
}
bench smollm2-draft-target pipelines/smollm2-draft-target.yaml "$OUT/smollm2-draft-target-int8.yaml"
for pipeline in smollm2-ngram smollm2-medusa smollm2-moe-draft-target; do
    bench "$pipeline" "pipelines/$pipeline.yaml"
done

"$PYTHON" - "$OUT" <<'PY'
import json
import sys
from pathlib import Path

print(f"\n{'pipeline':28} {'plain tok/s':>12} {'spec tok/s':>11} {'speedup':>8} {'greedy same':>12}")
for path in sorted(Path(sys.argv[1]).glob("*/reports.json")):
    for report in json.loads(path.read_text()):
        print(f"{report['pipeline']:28} {report['baseline_tokens_per_s']:12.1f} {report['speculative_tokens_per_s']:11.1f}"
              f" {report['speedup']:7.2f}x {str(report.get('greedy_match')):>12}")
PY
echo "gpu-check: done in $(( $(date +%s) - started )) s; reports in $OUT/; exit status $status"
exit "$status"
