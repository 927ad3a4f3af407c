#!/usr/bin/env bash
# One prepared GPU check for a lent machine (one H200; ~15 min of device time in all, at
# most 8 files back). From the repository root, on the device machine:
#
#     bash benchmarks/gpu/gpu_check.sh              # $OUT set by the device tool
#     bash benchmarks/gpu/gpu_check.sh --dry-run    # here, on a CPU: the plumbing, tiny models
#
# (device tool: run with timeout_s=600 and the command above; nothing to carry.)
# It needs only what that machine's image has: torch, triton, transformers (tokenizers
# with it), safetensors; pytest if present. Nothing is installed (no registry there) and
# the built-in model is not used: the models are random-weight checkpoints written at run
# time (benchmarks/gpu/random_llama.py; a SmolLM2-135M shape and a Llama-3.2-1B shape) with a
# tokenizer built in memory. The dry run imports through benchmarks/gpu/gpu_image.py, which
# refuses the packages that image lacks, so a CPU run proves the path import-light.
#
# Under $OUT (default ./gpu_results), three files: summary.json (every step's exit code,
# time and results; rewritten after each step, so a run cut short keeps what it measured;
# see benchmarks/gpu/gpu_summary.py), gpu_check.log (all output, unbuffered) and kernels.md.
# GPU_CHECK_STEPS="a b" runs only those steps (plus env and models), e.g. a rerun of the
# ones that failed.
# Every step runs under `timeout`, capped by what is left of GPU_CHECK_BUDGET (540 s on a
# GPU: 9 minutes of work in the 10 a call may take, machine start excluded); the
# script goes on after a failed step. Exit status: 0 when every step passed, 1 when one
# failed, 2 when it refused to start (no CUDA device without --dry-run, no Python).
set -u
cd "$(dirname "$0")/../.."  # the repository root: every path below is relative to it
MODE=gpu
case "${1:-}" in
    --dry-run) MODE=dry-run ;;
    "") ;;
    *) echo "usage: $0 [--dry-run]" >&2; exit 2 ;;
esac
OUT=${OUT:-./gpu_results}
mkdir -p "$OUT"
SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")  # not under $OUT: 8 files at most
trap 'rm -rf "$SCRATCH"' EXIT
LOG="$OUT/gpu_check.log"
: > "$LOG"
export PYTHONUNBUFFERED=1  # a step killed at its limit keeps the output it printed
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1  # only pytest itself: no third-party plugin
export LLMSERVE_CACHE="$SCRATCH/cache"  # so nothing needs platformdirs (not in the image)
STARTED=$(date +%s)
if [ "$MODE" = gpu ]; then
    unset TRITON_INTERPRET  # kernels on the GPU, not in Triton's CPU interpreter
    BUDGET=${GPU_CHECK_BUDGET:-540}
    RUN=()  # the steps' Python runs as is
    SMOKE=()
else
    export TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES=""  # a CPU run, even on a GPU machine
    # CUDA engines never build the CPU C kernels (nor import what their build cache needs)
    export LLMSERVE_CPU_KERNELS=torch
    BUDGET=${GPU_CHECK_BUDGET:-1500}
    RUN=(benchmarks/gpu/gpu_image.py)  # refuses what the GPU image lacks
    SMOKE=(--smoke)
fi

log() { echo "$*" | tee -a "$LOG"; }

summarize() {  # summarize [ERROR]: rewrite $OUT/summary.json from the scratch folder
    "$PY" benchmarks/gpu/gpu_summary.py "$SCRATCH" "$OUT/summary.json" --mode "$MODE" \
        --budget "$BUDGET" --started "$STARTED" ${1:+--error "$1"} 2>&1 | tee -a "$LOG"
}

# step NAME GPU_LIMIT DRY_LIMIT COMMAND...: output to the log (and $SCRATCH/NAME.log),
# exit code and time to steps.tsv; the limit is capped by what is left of the budget.
step() {
    local name=$1 limit=$2 start=$SECONDS rc left
    [ "$MODE" = dry-run ] && limit=$3
    shift 3
    if [ -n "${GPU_CHECK_STEPS:-}" ] && [[ " env models $GPU_CHECK_STEPS " != *" $name "* ]]
    then return; fi  # not among the steps asked for (env and models always run)
    left=$((BUDGET - ($(date +%s) - STARTED)))
    if [ "$left" -lt 15 ]; then
        log "=== $name: skipped, ${left}s of the ${BUDGET}s budget left"
        printf '%s\tskipped\t0\t%s\tbudget spent\n' "$name" "$limit" >> "$SCRATCH/steps.tsv"
        summarize
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    log "=== $name (limit ${limit}s): $*"
    timeout -k 10 "$limit" "$@" 2>&1 | tee "$SCRATCH/$name.log" >> "$LOG"
    rc=${PIPESTATUS[0]}
    log "$name: rc=$rc in $((SECONDS - start))s"
    printf '%s\t%s\t%s\t%s\t\n' "$name" "$rc" "$((SECONDS - start))" "$limit" \
        >> "$SCRATCH/steps.tsv"
    summarize
}

# --- 0. Python, and a GPU ---------------------------------------------------------------
PY=""
for cand in .venv/bin/python python3 python; do
    if command -v "$cand" >/dev/null && timeout 120 "$cand" -c "import torch, triton" 2>/dev/null
    then PY=$cand; break; fi
done
if [ -z "$PY" ]; then
    log "no Python with torch and triton (tried .venv/bin/python, python3, python)"
    for cand in python3 python; do command -v "$cand" >/dev/null && PY=$cand && break; done
    [ -n "$PY" ] && summarize "no Python with torch and triton"
    exit 2
fi
log "python: $PY ($(command -v "$PY")), mode $MODE, budget ${BUDGET}s, out $OUT"
if [ "$MODE" = gpu ] && ! "$PY" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'
then
    log "refused: torch.cuda.is_available() is False (use --dry-run to check the plumbing)"
    summarize "no CUDA device: torch.cuda.is_available() is False"
    exit 2
fi

# --- 1. Machine and versions (summary.json's env) ---------------------------------------
[ "$MODE" = gpu ] && step nvidia-smi 20 20 nvidia-smi
step env 30 60 "$PY" -c '
import json, subprocess, sys, torch, triton, transformers
env = {"python": sys.version.split()[0], "torch": torch.__version__,
       "torch_cuda": torch.version.cuda, "triton": triton.__version__,
       "transformers": transformers.__version__, "cuda_available": torch.cuda.is_available()}
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    env.update(device=p.name, capability=list(torch.cuda.get_device_capability()),
               memory_gib=round(p.total_memory / 2**30, 1), devices=torch.cuda.device_count())
    q = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                       capture_output=True, text=True)
    env["driver"] = q.stdout.strip().splitlines()[0] if q.returncode == 0 else None
print(env)
json.dump(env, open(sys.argv[1], "w"))
' "$SCRATCH/env.json"

# --- 2. Random-weight models, written once for every step ------------------------------
MODELS="$SCRATCH/models"
SMALL=smollm2-135m BIG=llama-1b
WRITE_BIG="\"$PY\" ${RUN[*]} benchmarks/gpu/random_llama.py $BIG '$MODELS/big'"
if [ "$MODE" = dry-run ]; then  # one tiny model serves as both
    SMALL=tiny WRITE_BIG="cp -r '$MODELS/small' '$MODELS/big'"
fi
step models 60 300 bash -c "\"$PY\" ${RUN[*]} benchmarks/gpu/random_llama.py $SMALL '$MODELS/small' \
    && $WRITE_BIG"

# --- 3. Kernel tests on the GPU (bf16 cases run only there). The test of the engine on
# the built-in model needs its package, which this machine lacks: engine_bf16 covers it.
if "$PY" -c "import pytest" 2>/dev/null; then
    # The fused kernels' own cases too (their engine tests need the built-in model).
    TESTS=(tests/kernels/test_kernels.py tests/kernels/test_fused_kernels.py
           --deselect tests/kernels/test_kernels.py::test_engine_greedy_output_same_with_triton_and_reference
           -k "not engine_greedy_tokens_are_the_same and not routes_every_layer")
    # (a second -k replaces the first: the dry run's subset has no engine test either)
    [ "$MODE" = dry-run ] && TESTS+=(-k "warm_up_launches or check_supported or choose_splits or rms_norm_without")
    step pytest_kernels 90 300 "$PY" "${RUN[@]}" -m pytest -q -ra -p no:cacheprovider \
        --durations=10 "${TESTS[@]}"
else
    log "pytest_kernels: skipped (no pytest on this machine; bench_kernels checks bf16)"
    printf 'pytest_kernels\tskipped\t0\t0\tno pytest\n' >> "$SCRATCH/steps.tsv"
fi

# --- 4. Kernel benchmark: decode sweep (bytes/s vs HBM, vs SDPA), mixed batch, bf16
# correctness, e2e decode of the 1B shape at batch 64 and 256 ---------------------------
step bench_kernels 110 300 "$PY" "${RUN[@]}" benchmarks/gpu/bench_kernels.py "${SMOKE[@]}" \
    --out "$SCRATCH/bench_kernels" --batches 1 16 64 256 --contexts 512 2048 8192 \
    --e2e-model "$MODELS/big"
[ -f "$SCRATCH/bench_kernels.md" ] && cp "$SCRATCH/bench_kernels.md" "$OUT/kernels.md"

# --- 5. The engine end to end in bf16 on the 1B shape: load + warm-up time, Triton vs
# torch backend greedy agreement, decode tokens/s at batch 1/32/128 -------------------
step engine_bf16 60 300 "$PY" "${RUN[@]}" benchmarks/gpu/engine_gpu_smoke.py "${SMOKE[@]}" \
    --model "$MODELS/big" --out "$SCRATCH/engine_bf16.json"

# --- 6. The GPU fast-path flags against eager steps on the 135M shape (where the host's
# per-step work shows): greedy agreement, decode step time at batch 1/32/128 with 2k
# contexts and its share of the HBM roofline, for the default (CUDA graphs), and with
# the graphs: staging + device block tables, --async-scheduling, --fused-kernels and all
# together; start-up time (graph capture), KV blocks with --profile-kv-cache ----------
FAST_CONFIGS=()  # the dry run's interpreter: eager steps and every flag at once
[ "$MODE" = dry-run ] && FAST_CONFIGS=(--configs eager all)
step gpu_fast_path 110 400 "$PY" "${RUN[@]}" benchmarks/gpu/gpu_fast_path.py "${SMOKE[@]}" \
    --model "$MODELS/small" --out "$SCRATCH/gpu_fast_path.json" "${FAST_CONFIGS[@]}"

# --- 7. CUDA graphs (on by default) on every model family: captured or, for a host-side
# expert loop, left off (and an explicit --cuda-graphs refused); greedy tokens against
# eager steps (differences within the rounding noise), decode step time at batch 8 ----
DRY_FAMILIES=() DRY_FEATURES=()  # the dry run's interpreter: one of each, the plumbing
[ "$MODE" = dry-run ] && DRY_FAMILIES=(--families mixtral) DRY_FEATURES=(--features lora)
step graph_families 240 400 "$PY" "${RUN[@]}" benchmarks/gpu/gpu_graph_families.py \
    "${SMOKE[@]}" --out "$SCRATCH/graph_families.json" "${DRY_FAMILIES[@]}"

# --- 8. CUDA graphs with the features whose steps run eagerly: speculative decoding (a
# draft model) and multi-LoRA; greedy tokens against eager steps, graph replays -------
step graph_features 90 300 "$PY" "${RUN[@]}" benchmarks/gpu/gpu_graph_features.py \
    "${SMOKE[@]}" --out "$SCRATCH/graph_features.json" "${DRY_FEATURES[@]}"

# --- 9. Tensor parallelism, only with two GPUs or more (NCCL cannot put two ranks on one
# GPU; the lent machines have one): TP=1 vs TP=2 decode throughput, memory per rank ----
NGPU=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
if [ "$MODE" = gpu ] && [ "${NGPU:-0}" -ge 2 ]; then
    step tensor_parallel 90 90 "$PY" benchmarks/engine/tensor_parallel.py --device cuda \
        --model "$MODELS/big" --tp 1 2 --batch 1 32 --json "$SCRATCH/tensor_parallel.json"
fi

log "=== done in $(($(date +%s) - STARTED))s: $OUT/summary.json"
"$PY" -c 'import json, sys; s = json.load(open(sys.argv[1]))
print("ok" if s["ok"] else "FAILED", [(x["name"], x["status"]) for x in s["steps"]])
sys.exit(0 if s["ok"] else 1)' "$OUT/summary.json" 2>&1 | tee -a "$LOG"
exit "${PIPESTATUS[0]}"
