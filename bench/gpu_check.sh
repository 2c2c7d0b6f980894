#!/usr/bin/env bash
# One prepared run on a CUDA host: the GPU tests, then the kernel, BCT and offload benchmarks.
#
#   bash bench/gpu_check.sh [OUT_DIR]      (default: $OUT, else bench/gpu_results)
#
# Needs only torch (CUDA), triton, transformers, safetensors, pyarrow, pandas and pytest: no Ray, no
# install step (the checkout is put on PYTHONPATH as the `batchgen` package). A host without pytest installs it
# from wheels carried along (WHEELS, default bench/wheels: `pip download -d bench/wheels pytest` on a machine with
# an index; a few hundred KiB) into a folder of the run; with neither, the GPU tests fail as a phase and the
# benchmarks still run. The phases' time limits add up to 480 s, inside the 8 minutes a run may take on
# one H200 (session 19's run of the same phases, without --profile: about 5 minutes). Fails loudly: no CUDA is
# an error at once; after that every phase runs even when an earlier one failed (a GPU lease is short: one
# run should show every failure), and the script exits 1 naming each failed phase (a failing, erroring or
# wrongly skipped GPU test, a benchmark that does not exit 0 within its time limit). Writes to OUT_DIR each
# phase's full log (gpu_tests, kernels, bct, offload .log) and summary.json, the benchmarks'
# --json lines by name.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT_DIR="${1:-${OUT:-$ROOT/bench/gpu_results}}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT_DIR"

"$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "gpu_check: no CUDA device")'
"$PY" -c 'import torch, triton, transformers; print("gpu_check:", torch.cuda.get_device_name(0), "torch", torch.__version__,
    "triton", triton.__version__, "transformers", transformers.__version__)'

PKG="$(mktemp -d)"
trap 'rm -rf "$PKG"' EXIT
ln -s "$ROOT" "$PKG/batchgen"
export PYTHONPATH="$PKG:$ROOT/bench:$ROOT/tests${PYTHONPATH:+:$PYTHONPATH}"
cd "$ROOT"

failed=()
# pytest from the carried wheels where the host has none: into a folder of this run (a system Python may refuse
# installs into itself); without it the GPU tests fail as a phase and the benchmarks still run
if ! "$PY" -c 'import pytest' 2>/dev/null; then
    WHEELS="${WHEELS:-$ROOT/bench/wheels}"
    "$PY" -m pip install -q --no-index --no-compile --find-links "$WHEELS" --target "$PKG/site" pytest &&
        export PYTHONPATH="$PYTHONPATH:$PKG/site" ||
        { echo "gpu_check: no pytest here and none to install from $WHEELS" >&2; failed+=("pytest"); }
fi
# phase NAME LOG TIMEOUT CMD...: run CMD under a time limit, its output shown and kept in LOG
phase() {
    local name=$1 log=$2 limit=$3
    shift 3
    echo "gpu_check: $name"
    if ! timeout "$limit" "$@" 2>&1 | tee "$log"; then
        echo "gpu_check: $name FAILED (exit status, or over its $limit s)" >&2
        failed+=("$name")
    fi
}

# every test in these files runs but those of Triton on CPU tensors (the interpreter's, skipped on a CUDA host):
# -o addopts= drops the 'not gpu' filter
phase "GPU tests" "$OUT_DIR/gpu_tests.log" 130 \
    "$PY" -m pytest -q -p no:cacheprovider -o addopts= -m "not triton_cpu" -rs \
    tests/test_kernels_gpu.py tests/test_engine_triton.py tests/test_engine_gpu.py tests/test_prefill_offload.py \
    tests/test_bench_roofline.py::test_the_gpu_gemm_peak_is_not_launch_bound
if grep "^SKIPPED" "$OUT_DIR/gpu_tests.log" | grep -v "flash-attn missing"; then
    echo "gpu_check: a GPU test was skipped on a CUDA host for a reason other than flash-attn" >&2
    failed+=("GPU tests skipped")
fi

# decode steps replay CUDA graphs; when a GPU test failed (the graphs' own test among them), the BCT below runs every
# step eagerly instead, so that the lease still gives its figures (its JSON's decode_graphs says which)
bct_flags=()
if ((${#failed[@]})); then
    echo "gpu_check: a GPU test failed, so the BCT runs without decode graphs (--eager)" >&2
    bct_flags=(--eager)
fi

phase "bench/kernels.py (Triton vs torch vs transformers, bf16)" "$OUT_DIR/kernels.log" 70 \
    "$PY" bench/kernels.py --json --dtype bfloat16 --min-time 0.1

# --profile: after the timed runs, one more BatchGen run under cProfile per scenario (where a step's host time goes)
phase "bench/bct.py (BatchGen vs lockstep vs transformers, bf16)" "$OUT_DIR/bct.log" 210 \
    "$PY" bench/bct.py --json --dtype bfloat16 --profile "${bct_flags[@]}"

phase "bench/offload.py (memory-constrained mode vs layer streaming at 25 % of the weights, bf16)" \
    "$OUT_DIR/offload.log" 70 \
    "$PY" bench/offload.py --json --dtype bfloat16 --budgets 0.25 --num-prompts 128 --max-tokens 64

# one file of figures: each benchmark's --json line under its name (null where it printed none)
"$PY" - "$OUT_DIR" <<'SUMMARY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
def last_json(name):
    log = out / f"{name}.log"
    lines = [line for line in log.read_text().splitlines() if line.startswith("{")] if log.exists() else []
    return json.loads(lines[-1]) if lines else None
summary = {name: last_json(name) for name in ("kernels", "bct", "offload")}
(out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
SUMMARY

if ((${#failed[@]})); then
    printf 'gpu_check: FAILED: %s\n' "${failed[@]}" >&2
    exit 1
fi
echo "gpu_check: done, figures in $OUT_DIR"
