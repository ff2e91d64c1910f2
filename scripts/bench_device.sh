#!/usr/bin/env bash
# Issue 5's device benchmark, for a machine with one NVIDIA GPU (written for an H200) and jax[cuda], flax, torch
# (CUDA), transformers and this project's other dependencies already installed (it installs nothing, downloads
# nothing). A Llama-3-8B-shaped model with random bfloat16 weights: decode step time at batch 1 and 64 against the
# HBM roofline, and throughput against HF transformers' continuous batching on the same GPU (scripts/bench_device.py
# says how). Stops itself after 7.5 minutes.
#   bash scripts/bench_device.sh [OUT_DIR]      # OUT_DIR receives the log and the JSON result (default: .)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-.}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.5}"  # the other half: torch
python3 -c "import jax; print(jax.__version__, jax.devices()); assert jax.default_backend() == 'gpu'" | tee "$out/bench_device_devices.log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$out/bench_device_devices.log" || true
timeout 450 python3 scripts/bench_device.py 2>&1 | tee "$out/bench_device.log"
tail -n 1 "$out/bench_device.log" > "$out/bench_device.json"
