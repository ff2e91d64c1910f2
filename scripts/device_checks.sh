#!/usr/bin/env bash
# The device check, in one device call of at most 8 minutes, for a machine with one NVIDIA GPU and jax[cuda], flax,
# torch and transformers installed (it builds, installs and downloads nothing). Each stage runs under its own time
# limit, so that a stage that hangs costs only its share; every stage runs even if one before it failed; each
# writes OUT_DIR/NAME.log (8 files in all, the most a device call brings back), and the last prints one table.
#
#   stage           what                                                          limit  estimate on an H200
#   devices         jax's devices, nvidia-smi                                       20 s   10 s
#   decode_kernel   bench_decode_kernel.py: Pallas and XLA decode attention GB/s    70 s   50 s
#                   at 64 x 2,048, 8 x 8,192, 256 x 512, bf16 and int8 pages,
#                   against the copy bandwidth of the same run
#   prefill_kernel  bench_prefill_kernel.py: TFLOP/s on one causal 4,096-token      40 s   20 s
#                   prompt against a large bf16 jnp.dot's
#   decode_steps    bench_device.py --parts decode: the Llama-3-8B-shaped decode   130 s  100 s
#                   step at batch 1, 8, 64, asynchronous scheduling on and off,
#                   against (weight + KV bytes) / copy bandwidth
#   e2e_jaxpage     bench_device.py --parts jaxpage: 64 requests end to end        110 s   75 s
#                   (a compile run, then a timed one)
#   e2e_hf          bench_device.py --parts hf: the same with transformers'         80 s   45 s
#                   continuous batching (torch alone on the GPU)
#   kernel_tests    the kernel tests natively (not the TPU kernel's, which only    what is left, at most 120 s
#                   its interpreter runs here), 8 workers; the batch-invariance
#                   test's bitwise comparisons on the GPU; the host tier's copies
#   table           device_table.py over the logs: each figure, what it is measured against, its target (table.log)
#
# The estimates: the first H200 run (README, "On an NVIDIA H200") compiled the 8B shape's mixed step (T=512) in
# 30.7 s, each decode shape in 5-6 s and each sampler in 1.5-3 s (before the layers were unrolled; unrolled, the
# deviceless compile of every program took about as long per program on a CPU host); its decode-kernel stage (one
# shape, two implementations) ended within 45 s; a process spends 5-10 s importing jax and starting CUDA. Which
# programs the engine stages meet comes from running them here with the tiny model and the same limits: the decode
# steps compile 8 (mixed T=512 and T=128, decode 1, 8, 64 and their samplers: about 70 s) and prefill 1 + 8 + 64
# prompts of 512 tokens in each scheduling mode; the end-to-end workload meets 14, loads those 8 from the
# compilation cache the decode stage filled (JAXPAGE_CACHE, new for each run), compiles 6 (decode 4 to 48, a
# sampler: about 35 s), then runs the 64 requests twice (154 steps each). The stages' limits add up to
# 450 s, the budget (BUDGET, default 450 s): each stage gets at most what is left of it.
#
#   bash scripts/device_checks.sh [OUT_DIR]        # exit status 0 when every stage passed and every target was met
#   TINY=1 bash scripts/device_checks.sh OUT_DIR   # anywhere: each stage's tiny form, no kernel tests (the tests')
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-.}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
JAXPAGE_CACHE="$(mktemp -d)"  # the stages share compiled programs, and compile every one of them in this run
export JAXPAGE_CACHE
trap 'rm -rf "$JAXPAGE_CACHE"' EXIT
python="${PYTHON:-python3}"
budget="${BUDGET:-450}"
status=0
stage() {  # stage NAME SECONDS COMMAND...: COMMAND under min(SECONDS, what is left of the budget), to OUT_DIR/NAME.log
    local name="$1" seconds="$2" began=$SECONDS
    shift 2
    local left=$((budget - SECONDS))
    ((seconds > left)) && seconds=$left
    if ((seconds < 10)); then
        echo "== $name: not run, ${left}s of the budget left" | tee "$out/$name.log"
        status=1
        return
    fi
    echo "== $name (limit ${seconds}s) $(date +%T)"
    timeout -s INT -k 5 "$seconds" "$@" > "$out/$name.log" 2>&1  # SIGINT: pytest and Python say where they were
    local rc=$?
    grep -v '^{' "$out/$name.log" | tail -n "${TAIL_LINES:-5}"  # its JSON lines go to the table
    echo "== $name: exit $rc after $((SECONDS - began))s"
    [ "$rc" -eq 0 ] || status=1
}
stage devices 20 bash -c "$python -c 'import jax, jaxlib; print(jax.__version__, jaxlib.__version__, jax.devices())';
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv || true"
if [ "${TINY:-0}" = 1 ]; then
    kernel=(--interpret) bench=(--tiny)
else
    kernel=() bench=()
fi
stage decode_kernel 70 "$python" scripts/bench_decode_kernel.py "${kernel[@]}"
stage prefill_kernel 40 "$python" scripts/bench_prefill_kernel.py "${kernel[@]}"
stage decode_steps 130 "$python" scripts/bench_device.py --parts decode "${bench[@]}"
stage e2e_jaxpage 110 "$python" scripts/bench_device.py --parts jaxpage "${bench[@]}"
# transformers alone in its process: that process never starts jax, and this keeps jax from taking memory if it did
XLA_PYTHON_CLIENT_PREALLOCATE=false stage e2e_hf 80 "$python" scripts/bench_device.py --parts hf "${bench[@]}"
if [ "${TINY:-0}" != 1 ]; then
    # The tests' processes share the GPU: each takes memory as it needs it instead of 75% at start. (The engine tests
    # with a tokenizer need the default model, which a machine without network cannot fetch: not here.)
    # With them, the batch-invariance test (issues 45, 54) on the GPU: a request's tokens and log-probs the same bits
    # whatever runs beside it, 20 cases on each of three families (Llama's, and Gemma 2's and 3's sandwich norms and
    # soft caps: the suite runs every family on CPU), its engines' tests on one worker (--dist loadgroup). And the
    # prefix cache's host tier (issue 46): its copies between the GPU's pool and pinned host memory, built and run on
    # the GPU (the deviceless GPU client has no host memory to build them for), and the engine's tokens with and
    # without it.
    JAXPAGE_INVARIANCE_MODEL=smollm2-tied,gemma2-softcap-hybrid,gemma3-qk-norm-local-rope \
        JAXPAGE_INVARIANCE_EXAMPLES=20 XLA_PYTHON_CLIENT_PREALLOCATE=false stage kernel_tests 120 \
        "$python" -m pytest -q -p no:cacheprovider -n 8 -rfE --dist loadgroup --durations=5 -k "not tpu" \
        tests/test_ragged_paged_attention.py tests/test_paged_attention.py tests/test_attention_backend.py \
        tests/test_quantized_kv_attention.py tests/test_batch_invariance.py tests/test_host_kv_pool.py \
        tests/test_host_tier.py
fi
echo "== table $(date +%T), ${SECONDS}s in"
"$python" scripts/device_table.py "$out"/*.log 2>&1 | tee "$out/table.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
exit "$status"
