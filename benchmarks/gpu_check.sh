#!/usr/bin/env bash
# One prepared GPU check for a lent machine (one H200, ~15 min of device time in all):
# the whole script stays under ~8 minutes on one GPU (the limits sum to 480 s; the
# tensor-parallel step runs only with two GPUs). Run from anywhere:
#
#     OUT=/some/dir bash benchmarks/gpu_check.sh
#
# Everything goes under $OUT (default gpu_results/ in the repo root): env.txt, one
# log per step (nvidia-smi.log, versions.log, ...), pytest.xml, kernels.json/.md and
# summary.txt. Nothing is installed (the machine has no network): it uses the carried
# .venv if that works, else a `python` that has torch and triton. Every step runs
# under `timeout`, and the script goes on after a failed step; summary.txt lists each
# step's exit code (124 = timed out).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-./gpu_results}
mkdir -p "$OUT"
: > "$OUT/summary.txt"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET  # kernels on the GPU, not in Triton's CPU interpreter

step() {  # step NAME SECONDS COMMAND...: log to $OUT/NAME.log, record the exit code
    local name=$1 limit=$2 start=$SECONDS rc
    shift 2
    echo "=== $name (limit ${limit}s): $*"
    timeout -k 10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    rc=${PIPESTATUS[0]}
    echo "$name: rc=$rc in $((SECONDS - start))s" | tee -a "$OUT/summary.txt"
}

# --- 0. Which Python --------------------------------------------------------------
PY=""
for cand in .venv/bin/python python3 python; do
    if command -v "$cand" >/dev/null && timeout 60 "$cand" -c "import torch, triton" 2>/dev/null
    then PY=$cand; break; fi
done
if [ -z "$PY" ]; then
    echo "no Python with torch and triton found (tried .venv/bin/python, python3, python)" \
        | tee -a "$OUT/summary.txt"
    exit 1
fi
echo "python: $PY ($(command -v "$PY"))" | tee "$OUT/env.txt"

# --- 1. Machine and versions ------------------------------------------------------
step nvidia-smi 20 nvidia-smi
step versions 30 "$PY" -c '
import sys, torch, triton
print("python", sys.version.split()[0], sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)
print("cuda available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability())
'
cat "$OUT/versions.log" >> "$OUT/env.txt"

# --- 2. Kernel tests on the GPU (tests/test_kernels.py picks CUDA tensors when the
# interpreter is off; bf16 cases run only here) ------------------------------------
step pytest_kernels 90 "$PY" -m pytest -q -ra -p no:cacheprovider --durations=15 \
    --junitxml="$OUT/pytest.xml" tests/test_kernels.py

# --- 3. Kernel benchmark: JSON/markdown rewritten after each section -------------
step bench_kernels 110 "$PY" benchmarks/kernels.py --out "$OUT/kernels"

# --- 4. The engine end to end in bf16: load + warm-up time, Triton vs torch backend
# greedy agreement, decode tokens/s at batch 1/32/128 (random 1B Llama-shaped model).
step engine_bf16 100 "$PY" benchmarks/engine_gpu_smoke.py --out "$OUT/engine_gpu.json"

# --- 4b. The GPU fast-path flags (off by default until this validates them), each
# against the default on the same model: greedy agreement (staging_tables must be
# identical), decode step time at batch 1/8/32/64 with CUDA graphs on/off, start-up
# time (graph capture), KV blocks with --profile-kv-cache.
step gpu_fast_path 130 "$PY" benchmarks/gpu_fast_path.py --out "$OUT/gpu_fast_path.json"

# --- 5. Tensor parallelism, only on a machine with two GPUs or more (NCCL cannot put two
# ranks on one GPU): TP=1 vs TP=2 decode throughput and per-rank memory on a random
# Llama of the built-in model's size with 8/4 heads (written once under /tmp).
NGPU=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
if [ "${NGPU:-0}" -ge 2 ]; then
    step tensor_parallel 180 "$PY" benchmarks/tensor_parallel.py --device cuda --random-llama \
        --tp 1 2 --batch 1 32 --json "$OUT/tensor_parallel.json"
else
    echo "tensor_parallel: skipped ($NGPU GPU visible, needs 2)" | tee -a "$OUT/summary.txt"
fi

echo "=== summary ($OUT/summary.txt)"
cat "$OUT/summary.txt"
