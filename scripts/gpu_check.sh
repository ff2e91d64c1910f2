#!/usr/bin/env bash
# Issue 4's device check, for a machine with an NVIDIA GPU and jax[cuda], flax, torch, transformers and pytest
# already installed (it installs nothing). Runs the kernel tests natively (on a GPU the tests run the Pallas
# kernels without the interpreter), 8-bit KV pages included, and the decode kernel's bandwidth benchmark. Every
# step runs even if one before it fails; the exit status says whether all passed. Takes a few minutes.
#   bash scripts/gpu_check.sh [OUT_DIR]      # OUT_DIR receives the logs (default: .)
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-.}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import jax; print(jax.__version__, jax.devices()); assert jax.default_backend() == 'gpu'" \
    | tee "$out/gpu_check_devices.log" || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$out/gpu_check_devices.log"
status=0
# The kernels' sweeps (the GPU kernel natively, the TPU kernel interpreted), then the engine with attention_impl
# "auto" (the GPU kernels natively) against a dense forward pass.
python3 -m pytest -q -p no:cacheprovider tests/test_ragged_paged_attention.py tests/test_paged_attention.py \
    tests/test_attention_backend.py "tests/test_llm_api.py::test_greedy_equals_the_dense_forward" \
    2>&1 | tee "$out/gpu_check_tests.log" || status=1
# 8-bit KV pages (int8, fp8 e4m3 and e5m2): the GPU kernels dequantize the tiles they read, natively.
python3 -m pytest -q -p no:cacheprovider tests/test_quantized_kv_attention.py 2>&1 \
    | tee "$out/gpu_check_quantized_kv.log" || status=1
python3 scripts/bench_decode_kernel.py 2>&1 | tee "$out/gpu_check_bench.log" || status=1
# Beside those measurements, what XLA's GPU compiler makes of every engine program for this chip (deviceless, as
# on a CPU host; jaxpage.aot): memory per program, pool copies, and the decode step's roofline ESTIMATE at batch 1
# and 64, for the Llama-3-8B shape scripts/bench_device.py measures (a built-in shape: no model file, no network).
python3 scripts/compile_for.py --target gpu-h200 --model llama3-8b --max-model-len 2048 --context 512 2>&1 \
    | tee "$out/gpu_check_compile_for.log" || status=1
exit "$status"
