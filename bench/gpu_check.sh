#!/usr/bin/env bash
# One prepared run on a CUDA host: the GPU tests, then the kernel and BCT benchmarks in bf16.
#
#   bash bench/gpu_check.sh [OUT_DIR]      (default: $OUT, else bench/gpu_results)
#
# Needs only torch (CUDA), triton, transformers, safetensors, pyarrow, pandas and pytest: no Ray, no
# install step (the checkout is put on PYTHONPATH as the `batchgen` package). Fails loudly: no CUDA is
# an error, a failing or erroring GPU test stops the run, and every benchmark must exit 0. Writes
# gpu_tests.log, kernels.json, bct.json and offload.json (the benchmarks' --json lines) plus their full logs
# to OUT_DIR.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT_DIR="${1:-${OUT:-$ROOT/bench/gpu_results}}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT_DIR"

"$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "gpu_check: no CUDA device")'
"$PY" -c 'import torch; print("gpu_check:", torch.cuda.get_device_name(0), "torch", torch.__version__)'

PKG="$(mktemp -d)"
trap 'rm -rf "$PKG"' EXIT
ln -s "$ROOT" "$PKG/batchgen"
export PYTHONPATH="$PKG:$ROOT/bench:$ROOT/tests${PYTHONPATH:+:$PYTHONPATH}"
cd "$ROOT"

last_json() { grep '^{' "$1" | tail -n 1; }

echo "gpu_check: GPU tests (every test in these files runs: -o addopts= drops the 'not gpu' filter)"
"$PY" -m pytest -q -p no:cacheprovider -o addopts= -x -rs tests/test_kernels_gpu.py tests/test_engine_triton.py \
    2>&1 | tee "$OUT_DIR/gpu_tests.log"
if grep "^SKIPPED" "$OUT_DIR/gpu_tests.log" | grep -v "flash-attn missing"; then
    echo "gpu_check: a GPU test was skipped on a CUDA host for a reason other than flash-attn" >&2
    exit 1
fi

echo "gpu_check: bench/kernels.py (Triton vs torch vs transformers, bf16)"
timeout 180 "$PY" bench/kernels.py --json --dtype bfloat16 --min-time 0.1 2>&1 | tee "$OUT_DIR/kernels.log"
last_json "$OUT_DIR/kernels.log" > "$OUT_DIR/kernels.json"

echo "gpu_check: bench/bct.py (BatchGen vs lockstep vs transformers, bf16)"
timeout 300 "$PY" bench/bct.py --json --dtype bfloat16 2>&1 | tee "$OUT_DIR/bct.log"
last_json "$OUT_DIR/bct.log" > "$OUT_DIR/bct.json"

echo "gpu_check: bench/offload.py (memory-constrained mode vs layer streaming at 25 % of the weights, bf16)"
timeout 150 "$PY" bench/offload.py --json --dtype bfloat16 --budgets 0.25 --num-prompts 128 --max-tokens 64 \
    2>&1 | tee "$OUT_DIR/offload.log"
last_json "$OUT_DIR/offload.log" > "$OUT_DIR/offload.json"
echo "gpu_check: done, figures in $OUT_DIR"
