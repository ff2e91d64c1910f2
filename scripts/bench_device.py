"""Device benchmark: a Llama-3-8B-shaped model with random weights (no download) on one accelerator.

    bash scripts/bench_device.sh [OUT_DIR]     # on an NVIDIA H200: the 8B shape in bfloat16, under 8 minutes
    python scripts/bench_device.py --tiny      # anywhere: a tiny model of the same structure (checks the script)
    python scripts/bench_device.py --parts decode       # one part (scripts/device_checks.sh runs each in a stage)
    python scripts/bench_device.py --kv-cache-dtype int8   # 8-bit KV pages (the roofline counts their bytes)
    python scripts/bench_device.py --parts decode --batch-sizes 1 --attention-impl xla   # one decode step, A/B
    python scripts/bench_device.py --parts decode --batch-sizes 1 --weights w4a16   # a GPTQ W4A16 checkpoint's shape

Parts (--parts, default all three, in this order):
decode: decode step time at batch 1, 8 and 64. Each request has a 512-token random prompt; once every request
   decodes, 16 steps are timed (after 3 untimed ones), with synchronous and asynchronous scheduling (the engine's
   default, async_scheduling: on for GPU/TPU, is the step_ms; the other first, on the same engine). The HBM roofline
   of a step is the bytes it must read -- every weight except the embedding table, plus K and V of every cached token
   of every layer -- over the device's bandwidth: the copy bandwidth measured in this run, and for an H200 also its
   4.8 TB/s specification. Beside each measured step, what the compiler said of the step's two programs (forward
   pass and sampler: temporaries, and where XLA reports them FLOPs and bytes accessed) and the estimate
   scripts/compile_for.py gives for that chip (jaxpage.aot.decode_roofline: every weight and the K/V read once at the
   chip's published bandwidth, FLOPs at its peak), so that a device run compares the estimate with the measurement.
jaxpage: end-to-end throughput: 64 requests, random prompts of 128..512 tokens, 64..128 output tokens each (EOS
   ignored), greedy, all queued at once. jaxpage runs the workload once to compile its shapes, then once timed.
hf: HF transformers' continuous batching runs the same workload on the same device with the same token budget, row
   limit and KV capacity (its model built from the same config, random weights: the weights differ, the work does
   not), after 4 other requests of 8 tokens untimed (its kernels' first launches). Alone (--parts hf), the process
   never starts jax: the accelerator's memory is torch's.

The workload is sized for one device call of scripts/device_checks.sh (an 8B step reads 15 GB of weights, and each
forward shape jaxpage meets compiles for 5-30 s on an H200). The pool has a fixed size (64 sequences of 2,048
tokens), so that a part run in a process of its own compiles the same programs and loads those another process
compiled from the compilation cache, and transformers gets the same KV capacity without jaxpage in its process.

Each part prints a JSON line per result as it ends ({"check": "decode_step" | "e2e_jaxpage" | "e2e_hf", ...}, read by
scripts/device_table.py); the last line is one JSON object with everything.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from jaxpage import aot
from jaxpage.benchmarks.hf_baselines import run_hf_continuous
from jaxpage.benchmarks.measure import copy_bandwidth
from jaxpage.benchmarks.progress import log
from jaxpage.benchmarks.workloads import describe


def hf_shape(model) -> dict:
    """A model shape (jaxpage.config.ModelConfig) as the fields of a Hugging Face Llama config.json."""
    return dict(
        hidden_size=model.hidden_size,
        intermediate_size=model.intermediate_size,
        num_hidden_layers=model.num_layers,
        num_attention_heads=model.num_heads,
        num_key_value_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        vocab_size=model.vocab_size,
        max_position_embeddings=model.max_position_embeddings,
        rope_theta=model.rope_theta,
        rms_norm_eps=model.rms_norm_eps,
        tie_word_embeddings=model.tie_word_embeddings,
    )


LLAMA3_8B = hf_shape(aot.LLAMA3_8B)  # the shape compile_for builds as "llama3-8b"
TINY = (
    LLAMA3_8B
    | dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    | dict(head_dim=32, vocab_size=512)
)
H200_HBM_BYTES_PER_S = 4.8e12
PARTS = ("decode", "jaxpage", "hf")
ENGINE_LIMITS = dict(max_num_seqs=64, max_num_batched_tokens=512)
MAX_MODEL_LEN, PAGE_SIZE = 2048, 16
NUM_PAGES = 1 + ENGINE_LIMITS["max_num_seqs"] * MAX_MODEL_LEN // PAGE_SIZE  # the null page and 64 full sequences
HF_WARMUP_REQUESTS = 4  # of 8 output tokens each
# --weights: the projections as a pre-quantized checkpoint stores them (config.json's quantization_config, random codes)
QUANTIZATION_CONFIGS = {
    "w4a16": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True},
    "fp8": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
}


def write_config(directory: Path, shape: dict, dtype: str, weights: str = "bf16") -> None:
    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", torch_dtype=dtype, **shape)
    if weights in QUANTIZATION_CONFIGS:
        config["quantization_config"] = QUANTIZATION_CONFIGS[weights]
    (directory / "config.json").write_text(json.dumps(config))


def decode_step_times(llm, batch: int, prompt_len: int, rng) -> dict:
    """Seconds per decode step (wall and device) with `batch` requests decoding at about prompt_len cached tokens."""
    from jaxpage.sampling_params import SamplingParams

    engine = llm.engine
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
    ids = [f"decode-{batch}-{i}" for i in range(batch)]
    for request_id in ids:
        engine.add_request(request_id, {"prompt_token_ids": rng.integers(0, vocab, prompt_len).tolist()}, params)
    while True:  # prefill (chunked) until every request decodes
        engine.step()
        stats = engine.last_step_stats  # None after an asynchronous engine's first step
        if stats is not None and stats.num_decodes == batch and stats.num_tokens == batch:
            break
    for _ in range(3):  # the decode bucket compiles here
        engine.step()
    walls, devices = [], []
    for _ in range(16):
        start = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - start)
        devices.append(engine.last_step_stats.device_s)
    kv_len = prompt_len + 3 + 8  # mid-way through the timed steps
    engine.abort_request(ids)
    return {"wall_s": float(np.median(walls)), "device_s": float(np.median(devices)), "kv_len": kv_len}


def compiler_estimate(engine, batch: int, kv_len: int, param_bytes: int, kv_token_bytes: int) -> dict:
    """What the compiler made of the decode step of `batch` rows (its forward pass and sampler, as compiled on this
    device), and compile_for's roofline estimate of it on this chip (when jaxpage.targets has its figures)."""
    from jaxpage.targets import target_of

    runner = engine.runner
    shape = runner.inputs.smallest_shape("decode", batch)
    programs = (runner.executables[shape], runner.samplers[shape.sample_rows, shape.num_draft_positions, 0])
    layer_bytes = aot.placed_bytes(runner.kv_cache.k) // engine.model_config.num_layers  # a copy this large: the pool
    weight_bytes = aot.layer_weight_bytes(runner.params)
    reports = [aot.describe(str(shape), "forward", 0.0, program, layer_bytes, weight_bytes) for program in programs]
    flops = [r.flops for r in reports]
    accessed = [r.bytes_accessed for r in reports]
    out = {
        "compiler_temp_bytes": sum(r.temp_bytes for r in reports),
        "compiler_flops": None if None in flops else sum(flops),  # XLA's GPU compiler gives no cost analysis
        "compiler_bytes_accessed": None if None in accessed else sum(accessed),
        "compiler_pool_copies": sum(len(r.pool_copies) for r in reports),
        "compiler_weight_copies": sum(len(r.weight_copies) for r in reports),
    }
    target = target_of(jax.devices()[0])
    if target is not None:
        dtype = runner.dtype
        roof = aot.decode_roofline(target, engine.model_config, param_bytes, kv_token_bytes, dtype, batch, kv_len)
        out |= {"estimate_target": target.name, "estimate_ms_compile_for_roofline": round(1e3 * roof.seconds, 3)}
    return out


def workload(vocab: int, num_requests: int, prompt_lens, max_tokens, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [
        {
            "id": f"req-{i}",
            "prompt_token_ids": rng.integers(0, vocab, int(rng.integers(*prompt_lens))).tolist(),
            "max_tokens": int(rng.integers(*max_tokens)),
        }
        for i in range(num_requests)
    ]


def workload_facts(rows: list[dict]) -> dict:
    """What the workload is (describe) and a fingerprint: two processes' results compare only when theirs match."""
    digest = hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()[:16]
    return {"workload": describe(rows), "workload_sha256": digest}


def run_jaxpage(llm, rows: list[dict]) -> dict:
    from jaxpage.sampling_params import SamplingParams

    engine = llm.engine
    for row in rows:
        params = SamplingParams(temperature=0, max_tokens=row["max_tokens"], ignore_eos=True)
        engine.add_request(row["id"], {"prompt_token_ids": row["prompt_token_ids"]}, params)
    tokens, steps = 0, 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        tokens += sum(len(out.outputs[0].token_ids) for out in engine.step() if out.finished)
        steps += 1
    wall_s = time.perf_counter() - start
    rate = round(tokens / wall_s, 1)
    return {"output_tokens": tokens, "wall_s": round(wall_s, 3), "output_tokens_per_s": rate, "steps": steps}


def hf_model(directory: Path, device: str, dtype: str):
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(directory)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.eval()
    model.generation_config.eos_token_id = None
    return model


def emit(check: str, record: dict, results: dict) -> None:
    """One result as a JSON line of its own (scripts/device_table.py reads them), kept for the last line too."""
    results[check if check != "decode_step" else f"decode_batch_{record['batch']}"] = record
    print(json.dumps({"check": check, "model": results["model"], "device": results["device"], **record}), flush=True)


def decode_part(llm, results: dict, batches, prompt_len: int, tiny: bool) -> None:
    """Each batch's decode step, with the other scheduling first (the same engine, its pipeline switched: nothing
    compiles again), against the bytes it must read over the copy bandwidth."""
    engine = llm.engine
    params = engine.runner.params
    param_bytes = aot.placed_bytes(params)  # int4 codes two to a byte, as the GPU holds them
    embedding_bytes = aot.placed_bytes(params["embed_tokens"])
    kv_token_bytes = engine.attention_backend.kv_bytes_per_token(engine.model_config, engine.runner.dtype.itemsize)
    bandwidth = copy_bandwidth(min(2 << 30, param_bytes))
    results |= {"param_bytes": int(param_bytes), "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1)}
    log(f"{param_bytes / 1e9:.2f} GB of weights; copy bandwidth {bandwidth / 1e9:.1f} GB/s")
    rng = np.random.default_rng(0)
    default = results["async_scheduling"] = engine.async_scheduling
    mode = {True: "on", False: "off"}
    for batch in batches:
        engine.pipeline.asynchronous = not default
        other = decode_step_times(llm, batch, prompt_len, rng)
        engine.pipeline.asynchronous = default
        step = decode_step_times(llm, batch, prompt_len, rng)
        read_bytes = param_bytes - embedding_bytes + batch * step["kv_len"] * kv_token_bytes
        entry = {
            "batch": batch,
            f"step_ms_async_{mode[not default]}": round(1e3 * other["wall_s"], 2),
            f"step_ms_async_{mode[default]}": round(1e3 * step["wall_s"], 2),
            "step_ms": round(1e3 * step["wall_s"], 2),
            "device_ms": round(1e3 * step["device_s"], 2),
            "kv_len": step["kv_len"],
            "bytes_read_per_step": int(read_bytes),
            "copy_bandwidth_gb_s": results["copy_bandwidth_gb_s"],
            "roofline_ms_measured_bandwidth": round(1e3 * read_bytes / bandwidth, 3),
            "fraction_of_roofline": round(read_bytes / bandwidth / step["wall_s"], 3),
        }
        if not tiny:
            entry["roofline_ms_h200_spec"] = round(1e3 * read_bytes / H200_HBM_BYTES_PER_S, 2)
        entry |= compiler_estimate(engine, batch, step["kv_len"], int(param_bytes), kv_token_bytes)
        emit("decode_step", entry, results)
        log(
            f"decode batch {batch}: {other['wall_s'] * 1e3:.2f} ms async {mode[not default]}, "
            f"{step['wall_s'] * 1e3:.2f} ms async {mode[default]}; bytes / copy {1e3 * read_bytes / bandwidth:.2f} ms"
        )


def jaxpage_part(llm, rows: list[dict], results: dict) -> None:
    """The workload once to compile its shapes, then once timed (which must compile nothing)."""
    engine = llm.engine
    log(f"throughput: {len(rows)} requests, {sum(r['max_tokens'] for r in rows)} output tokens; compile run")
    compiled, logged, start = engine.runner.num_compilations, len(engine.runner.compile_log), time.perf_counter()
    run_jaxpage(llm, rows)
    before, got = engine.runner.num_compilations, engine.runner.compile_log[logged:]
    compile_run = {"compile_run_s": round(time.perf_counter() - start, 1), "compile_run_programs": before - compiled}
    compile_run |= {
        "compile_run_loaded": sum(c.loaded for c in got),
        "compile_run_compile_s": round(sum(c.seconds for c in got if not c.loaded), 1),
    }
    log(f"compile run done ({compile_run}); timed run")
    record = run_jaxpage(llm, rows) | {"compilations": engine.runner.num_compilations - before} | compile_run
    emit("e2e_jaxpage", record | workload_facts(rows), results)
    log(f"jaxpage: {record}")


def hf_part(directory: Path, rows: list[dict], warmup: list[dict], dtype: str, limits: dict, results: dict) -> None:
    """transformers' continuous batching over `rows`, after the `warmup` rows (other prompts: it caches prefixes)."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    log(f"hf: building the model on {device}")
    start = time.perf_counter()
    hf = hf_model(directory, device, dtype)
    build_s = round(time.perf_counter() - start, 1)
    record, _ = run_hf_continuous(hf, rows, **limits, warmup_rows=warmup)
    record["build_s"] = build_s
    results["device"] = results["device"] or (torch.cuda.get_device_name() if device == "cuda" else device)
    emit("e2e_hf", record | workload_facts(rows), results)
    log(f"hf_continuous: {record}")


def start_engine(directory: Path, args, dtype: str):
    from jaxpage.entrypoints.llm import LLM

    start = time.perf_counter()
    engine_args = dict(load_format="dummy", skip_tokenizer_init=True, dtype=dtype, **ENGINE_LIMITS)
    engine_args |= dict(kv_cache_dtype=args.kv_cache_dtype, attention_impl=args.attention_impl)
    engine_args |= dict(max_model_len=MAX_MODEL_LEN, num_pages=NUM_PAGES, enable_prefix_caching=False)
    llm = LLM(str(directory), **engine_args)
    log(f"engine ready in {time.perf_counter() - start:.1f}s")
    return llm, round(time.perf_counter() - start, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a tiny model of the same structure (runs anywhere)")
    parser.add_argument("--parts", default="decode,jaxpage,hf", help="which parts, comma-separated (default all)")
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto, int8, fp8, fp8_e4m3, fp8_e5m2")
    parser.add_argument("--attention-impl", default="auto", help="the engine's attention_impl (auto, xla, pallas, ...)")
    parser.add_argument("--batch-sizes", default="1,8,64", help="decode batches to time, comma-separated")
    weights = ("bf16", *QUANTIZATION_CONFIGS)
    parser.add_argument("--weights", default="bf16", choices=weights, help="projections: bf16, or pre-quantized")
    args = parser.parse_args()
    parts = args.parts.split(",")
    if not set(parts) <= set(PARTS):
        parser.error(f"--parts: choose among {','.join(PARTS)}")
    shape, dtype = (TINY, "float32") if args.tiny else (LLAMA3_8B, "bfloat16")
    prompt_len, num_requests = (64, 8) if args.tiny else (512, 64)
    prompt_lens, max_tokens = ((16, 128), (8, 32)) if args.tiny else ((128, 513), (64, 129))
    batches = tuple(int(b) for b in args.batch_sizes.split(","))
    results = {"model": "tiny" if args.tiny else "llama3-8b", "device": None, "parts": parts}
    results |= {"kv_cache_dtype": args.kv_cache_dtype, "attention_impl": args.attention_impl, "weights": args.weights}
    rows = workload(shape["vocab_size"], num_requests, prompt_lens, max_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        write_config(directory, shape, dtype, args.weights)
        if {"decode", "jaxpage"} & set(parts):
            results["backend"], results["device"] = jax.default_backend(), str(jax.devices()[0])
            llm, results["engine_start_s"] = start_engine(directory, args, dtype)
            if "decode" in parts:
                decode_part(llm, results, batches, prompt_len, args.tiny)
            if "jaxpage" in parts:
                jaxpage_part(llm, rows, results)
            del llm  # its pool and weights stay with jax's allocator: --parts hf alone leaves torch the device
        if "hf" in parts:
            limits = {key: ENGINE_LIMITS[key] for key in ("max_num_batched_tokens", "max_num_seqs")}
            warmup = workload(shape["vocab_size"], HF_WARMUP_REQUESTS, prompt_lens, (8, 9), seed=1)
            hf_part(directory, rows, warmup, dtype, limits | {"kv_tokens": (NUM_PAGES - 1) * PAGE_SIZE}, results)
    if "e2e_jaxpage" in results and "e2e_hf" in results:
        ratio = results["e2e_jaxpage"]["output_tokens_per_s"] / results["e2e_hf"]["output_tokens_per_s"]
        results["jaxpage/hf_continuous"] = round(ratio, 2)
    results["loadavg_1m_after"] = round(os.getloadavg()[0], 2)
    print(json.dumps(results))


if __name__ == "__main__":
    sys.exit(main())
