#!/usr/bin/env bash
# Every device check in one command that fits a 10-minute device call (the lease tool's limit), for a machine with
# one NVIDIA GPU and jax[cuda], flax, torch and transformers installed: the decode kernel's bandwidth, the kernel
# tests natively (scripts/gpu_check.sh's selection, spread over workers), then the Llama-3-8B-shaped decode and
# throughput benchmark (scripts/bench_device.py). Each stage has its own time limit, so a stage that hangs costs
# only its own share; every stage runs even if one before it fails; the logs land in OUT_DIR.
#   bash scripts/device_checks.sh [OUT_DIR]      # about 9 minutes at most; HF=1: with transformers' throughput
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-.}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0
stage() {  # stage NAME SECONDS COMMAND...: runs COMMAND under a time limit, its output to OUT_DIR/NAME.log
    local name="$1" seconds="$2"
    shift 2
    echo "== $name (limit ${seconds}s) $(date +%T)"
    timeout -k 5 "$seconds" "$@" > "$out/$name.log" 2>&1
    local rc=$?
    tail -n 25 "$out/$name.log"
    echo "== $name: exit $rc $(date +%T)"
    [ "$rc" -eq 0 ] || status=1
}
{ python3 -c "import jax, jaxlib; print(jax.__version__, jaxlib.__version__, jax.devices())"; \
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv; } 2>&1 | tee "$out/devices.log"
stage decode_kernel 45 python3 scripts/bench_decode_kernel.py
# The tests' processes share the GPU: each takes memory as it needs it instead of 75% at start. (The engine tests
# with a tokenizer need the default model, which a machine without network cannot fetch: not here.)
XLA_PYTHON_CLIENT_PREALLOCATE=false stage kernel_tests 180 python3 -m pytest -q -p no:cacheprovider -n 8 \
    --durations=10 tests/test_ragged_paged_attention.py tests/test_paged_attention.py tests/test_attention_backend.py \
    tests/test_quantized_kv_attention.py
# The 8B shape's decode steps and throughput; transformers' throughput beside it only with HF=1 (its 8B model and
# run need more than this call's time once jaxpage's ~25 programs have compiled: the first run ran out here).
hf=(--skip-hf)
[ "${HF:-0}" = 1 ] && hf=()
XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 stage bench_device 300 python3 scripts/bench_device.py "${hf[@]}"  # half: torch
exit "$status"
