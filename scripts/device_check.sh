#!/usr/bin/env bash
# The device check for an NVIDIA GPU (written for an H200; 9 minutes at most):
#   1. the kernel tests with the GPU kernel compiled, not interpreted (tests/kernels picks
#      interpret=False when jax's default backend is a GPU), plus the reference and KV-cache
#      tests (not the C++ CPU kernel's: its custom call exists for the CPU platform only, and
#      jax's default device here is the GPU);
#   2. scripts/bench_attention.py: decode-heavy, prefill-heavy and mixed batches against the
#      device's copy bandwidth, which it measures first (goal: decode >= 70% of it, 80% better);
#   3. scripts/bench_device_engine.py: a Llama-3-8B-shaped bfloat16 model with random weights
#      through the offline engine at batch 1, 64 and 256: output tok/s, decode step against its
#      HBM floor (goal: within 1.5x at batch 64), start-up, compiles after warm-up (must be 0);
#   4. scripts/bench_moe.py --skip-e2e: one MoE layer of Qwen3-30B-A3B's shapes (128 experts,
#      top 8) at 64, 512 and 4096 tokens, the grouped matmul as `triton` (the Pallas GPU kernel,
#      the GPU default of moe_runner_backend), `blocked` and `ragged_dot` (which XLA:GPU compiles
#      as a dense matmul over every expert: 32 GiB of temporaries at 8192 tokens,
#      docs/performance.md), to check that default against both.
#
#   scripts/device_check.sh [--dry-run] [OUT_DIR]
#
# OUT_DIR (default: $OUT, else ./device_check_out) receives everything printed: one .txt per step,
# the benchmarks' JSON, and summary.txt. --dry-run needs no GPU: it checks the Python, the imports
# (the engine without fastapi/uvicorn/pydantic), the tests' collection and every step's arguments,
# and runs each script's dry path; the test suite runs it (tests/scripts/test_device_check.py).
# Exit status: 0 when every step passed, else the first failing step's.
set -uo pipefail
cd "$(dirname "$0")/.."

dry_run=0
out_dir="${OUT:-device_check_out}"
for arg in "$@"; do
    case "$arg" in
        --dry-run) dry_run=1 ;;
        -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
        -*) echo "unknown option $arg (options: --dry-run)" >&2; exit 2 ;;
        *) out_dir="$arg" ;;
    esac
done
mkdir -p "$out_dir" || exit 2
if [[ -z "${VIRTUAL_ENV:-}" && -f .venv/bin/activate ]]; then source .venv/bin/activate; fi
python="${PYTHON:-python}"
# The checkout comes first, whatever is installed.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# JAX's allocator setting: don't take 75% of the GPU up front (pytest runs many programs side by
# side with nothing freed); the engine step sizes its KV cache itself.
export XLA_PYTHON_CLIENT_PREALLOCATE=false

summary="$out_dir/summary.txt"
: > "$summary"
status=0

# step NAME TIMEOUT_S COMMAND...: runs it with its output in OUT_DIR/NAME.txt and on stdout.
step() {
    local name="$1" limit="$2"
    shift 2
    echo "== $name: $*" | tee -a "$summary"
    local t0=$SECONDS
    timeout "$limit" "$@" 2>&1 | tee "$out_dir/$name.txt"
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$summary"
    if [[ $rc -ne 0 && $status -eq 0 ]]; then status=$rc; fi
}

step device 60 "$python" - "$dry_run" <<'PY'
import importlib.util, sys

import jax

dry_run = sys.argv[1] == "1"
print("python", sys.version.split()[0], "jax", jax.__version__, "devices", jax.devices())
absent = [m for m in ("fastapi", "uvicorn", "pydantic") if importlib.util.find_spec(m) is None]
print("server packages absent:", absent or "none")
import pytest, hypothesis  # noqa: E401, F401  (the kernel tests need them)
from jaxrunner import Engine  # noqa: F401  (the engine imports without the server's packages)
import kernels_pallas  # noqa: F401
if not dry_run and jax.default_backend() != "gpu":
    sys.exit("no GPU: this check would only re-run the CPU tests (use --dry-run)")
PY
if [[ $status -ne 0 ]]; then echo "device check: no usable device or imports" >&2; exit "$status"; fi

kernel_tests=(tests/kernels --ignore=tests/kernels/test_cpu_attention.py -q -p no:cacheprovider)
moe_args=(--skip-e2e --tokens 64 512 4096 --hidden 2048 --moe-intermediate 768 --num-experts 128
          --top-k 8 --reps 3 --dtype bfloat16)
if [[ $dry_run -eq 1 ]]; then
    step kernel_tests 120 "$python" -m pytest "${kernel_tests[@]}" --collect-only
    step bench_attention 60 "$python" -c \
        "import sys; sys.path.insert(0, 'scripts'); import bench_attention; bench_attention.parse_args([])"
    step bench_device_engine 120 "$python" scripts/bench_device_engine.py \
        --out-dir "$out_dir/engine" --work-dir "$out_dir/engine/work" --dry-run
    step bench_moe 60 "$python" -c \
        "import sys; sys.path.insert(0, 'scripts'); import bench_moe; bench_moe.parse_args(sys.argv[1:])" \
        "${moe_args[@]}" --json-out "$out_dir/bench_moe.json"
else
    step kernel_tests 150 "$python" -m pytest "${kernel_tests[@]}" --durations=10
    step bench_attention 60 "$python" scripts/bench_attention.py \
        --json-out "$out_dir/bench_attention.json"
    step bench_device_engine 180 "$python" scripts/bench_device_engine.py \
        --out-dir "$out_dir/engine"
    step bench_moe 60 "$python" scripts/bench_moe.py "${moe_args[@]}" \
        --json-out "$out_dir/bench_moe.json"
fi

echo "device check: exit $status (output in $out_dir)" | tee -a "$summary"
exit "$status"
