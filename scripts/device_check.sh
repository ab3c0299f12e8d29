#!/usr/bin/env bash
# Device check for a GPU machine (about 3 minutes, 5 at most):
#   1. the kernel tests with the GPU kernel compiled (tests/kernels picks interpret=False
#      when jax's default backend is a GPU), plus the reference and KV-cache tests on the GPU;
#   2. the attention benchmark on decode-heavy, prefill-heavy and mixed batches.
# Writes pytest's and the benchmark's output under $OUT (or ./device_check_out) and exits
# non-zero if the tests fail or there is no GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
out_dir="${OUT:-device_check_out}"
mkdir -p "$out_dir"
if [[ -f .venv/bin/activate ]]; then source .venv/bin/activate; fi
# JAX's own allocator setting: don't grab 75% of the GPU up front (pytest runs many programs).
export XLA_PYTHON_CLIENT_PREALLOCATE=false

python - <<'PY' 2>&1 | tee "$out_dir/device.txt" || exit 2
import jax
print("jax", jax.__version__, "devices", jax.devices())
assert jax.default_backend() == "gpu", "no GPU: this check would only re-run the CPU tests"
PY

status=0
timeout 200 python -m pytest tests/kernels -q -p no:cacheprovider --durations=10 \
    2>&1 | tee "$out_dir/pytest_kernels.txt"
status=${PIPESTATUS[0]}

timeout 90 python scripts/bench_attention.py --json-out "$out_dir/bench_attention.json" \
    2>&1 | tee "$out_dir/bench_attention.txt"
bench_status=${PIPESTATUS[0]}

echo "pytest exit ${status}, benchmark exit ${bench_status}"
if [[ $status -ne 0 ]]; then exit "$status"; fi
exit "$bench_status"
