"""Quantization side by side: quality and decode speed of each mode against float32, in one run.

    python scripts/bench_quantization.py [--model SRC] [--modes float32,int8,kv-int8,kv-fp8_e4m3,kv-fp8_e5m2]
        [--requests 32] [--max-tokens 64]

A mode is a weight format and optionally a KV format, joined by "+": float32 (the weights as loaded, in float32
here), int8 (quantization="int8"), kv-FORMAT (kv_cache_dtype=FORMAT: int8, fp8, fp8_e4m3, fp8_e5m2) with float32
weights, int8+kv-int8 (both); or NAME=PATH, a pre-quantized checkpoint of the same model (FP8, AWQ, GPTQ,
compressed-tensors: its weights as they load; the text is tokenized by --model's tokenizer), NAME=PATH+int8 with
what the checkpoint leaves in floats (the embedding, a tied LM head) in int8. scripts/quantize_gptq.py writes such
checkpoints of the default model. For each:
  weights      the bytes of the weights as this CPU holds them (floats in float32, 4-bit codes a byte each), and as a
               TPU or GPU holds them (floats in bfloat16, 4-bit codes two to a byte, scales in float32): "chip MiB",
               and its ratio to the float model's ("x bf16")
  perplexity   on tests/data/alice_chapter_1.txt (public domain, ~2700 tokens), in 512-token windows, each one
               prefill through a KV page pool of the mode's KV format: the engine's attention path, every K/V read
               back from the pool (jaxpage.benchmarks.perplexity)
  agreement    greedy continuations of --max-tokens tokens of --requests prompts (48-token windows of the same text
               at evenly spaced offsets), EOS ignored: the share of positions whose token equals float32's, and the
               mean length of the prefix that does
  decode       those --requests requests generated together (max_num_seqs = --requests): completion tokens/s from
               the first request queued to the last token, and the median decode step; then the first request
               alone (batch 1: each step reads every weight for one token); after warm-up (compile seconds
               printed; no compilation cache)
The last line is one JSON object with every figure; ratios are against float32 in this run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="anything load_model takes (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--modes", default="float32,int8,kv-int8,kv-fp8_e4m3,kv-fp8_e5m2")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=64)
    return parser.parse_args()


def parse_mode(mode: str, model: str | None) -> tuple[str | None, str | None, str]:
    """(model source, quantization, kv_cache_dtype) of a mode such as "float32", "int8", "kv-fp8_e4m3",
    "int8+kv-int8", or "NAME=PATH": a pre-quantized checkpoint's weights as they load (FP8, AWQ, GPTQ,
    compressed-tensors), named NAME in the table."""
    if "=" in mode:
        path, _, weights = mode.partition("=")[2].partition("+")
        if weights not in ("", "int8"):
            raise SystemExit(f"unknown mode {mode!r}: NAME=PATH or NAME=PATH+int8")
        return path, weights or None, "auto"
    weights, _, kv = mode.partition("+")
    if weights.startswith("kv-"):
        weights, kv = "float32", weights
    if weights not in ("float32", "int8") or (kv and not kv.startswith("kv-")):
        raise SystemExit(f"unknown mode {mode!r}: float32, int8, kv-FORMAT or int8+kv-FORMAT")
    return model, (None if weights == "float32" else weights), (kv[3:] if kv else "auto")


def main() -> None:
    args = parse_args()
    import jax
    import jax.numpy as jnp

    from jaxpage.aot import placed_bytes
    from jaxpage.benchmarks.perplexity import TEXT_PATH, perplexity
    from jaxpage.entrypoints.llm import LLM
    from jaxpage.models import load_model
    from jaxpage.models.llama import param_shapes
    from jaxpage.sampling_params import SamplingParams
    from jaxpage.tokenizers.tokenizer import load_tokenizer

    text_ids = list(load_tokenizer(args.model)(TEXT_PATH.read_text()).input_ids)
    stride = (len(text_ids) - args.prompt_len) // args.requests
    prompts = [{"prompt_token_ids": text_ids[i * stride : i * stride + args.prompt_len]} for i in range(args.requests)]
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    results: dict[str, dict] = {}
    tokens: dict[str, list[list[int]]] = {}
    modes = {mode.partition("=")[0]: parse_mode(mode, args.model) for mode in args.modes.split(",")}
    one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    for mode, (model, quantization, kv_cache_dtype) in modes.items():
        print(f"== {mode}", file=sys.stderr, flush=True)
        config, params = load_model(model, dtype="float32", quantization=quantization)
        weight_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
        chip_shapes = param_shapes(config, jnp.bfloat16, "tpu")  # as a TPU holds them (a GPU alike)
        chip_bytes = placed_bytes(jax.tree.map(lambda x: x.update(sharding=one_device), chip_shapes))
        ppl = perplexity(config, params, text_ids, kv_cache_dtype=kv_cache_dtype)
        del params
        llm = LLM(
            model,
            dtype="float32",
            quantization=quantization,
            kv_cache_dtype=kv_cache_dtype,
            max_num_seqs=args.requests,
            max_model_len=args.prompt_len + args.max_tokens + 16,
            compilation_cache_dir=None,
        )
        compiled = llm.engine.warmup()
        steps: list[float] = []
        step = llm.engine.step

        def timed_step(step=step, engine=llm.engine, steps=steps):
            outputs = step()
            stats = engine.last_step_stats
            if stats is not None and stats.num_decodes == stats.num_seqs:
                steps.append(stats.device_s)
            return outputs

        llm.engine.step = timed_step
        start = time.perf_counter()
        outputs = llm.generate(prompts, greedy)
        seconds = time.perf_counter() - start
        tokens[mode] = [o.outputs[0].token_ids for o in outputs]
        batch_steps = list(steps)
        steps.clear()
        start = time.perf_counter()
        llm.generate(prompts[:1], greedy)  # one request alone: every decode step reads all the weights for a token
        single_seconds = time.perf_counter() - start
        results[mode] = {
            "weight_bytes": weight_bytes,
            "chip_weight_bytes": chip_bytes,
            "kv_bytes_per_token": llm.engine.attention_backend.kv_bytes_per_token(config, 4),
            "perplexity": ppl,
            "tokens_per_s": args.requests * args.max_tokens / seconds,
            "median_decode_step_s": statistics.median(batch_steps),
            "tokens_per_s_one_request": args.max_tokens / single_seconds,
            "median_decode_step_s_one_request": statistics.median(steps),
            "compile_s": sum(c.seconds for c in compiled),
            "compiled": [str(c) for c in compiled],
        }
        del llm
    base = tokens.get("float32")
    for mode, row in results.items():
        if base is not None:
            same = [sum(a == b for a, b in zip(x, y, strict=True)) for x, y in zip(tokens[mode], base, strict=True)]
            prefix = [
                next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), len(x))
                for x, y in zip(tokens[mode], base, strict=True)
            ]
            row["agreement"] = sum(same) / sum(len(x) for x in base)
            row["mean_agreeing_prefix"] = statistics.mean(prefix)
            f32 = results["float32"]
            row["perplexity_ratio"] = row["perplexity"] / f32["perplexity"]
            row["chip_weight_ratio"] = row["chip_weight_bytes"] / f32["chip_weight_bytes"]
            row["speedup"] = row["tokens_per_s"] / f32["tokens_per_s"]
            row["speedup_one_request"] = row["tokens_per_s_one_request"] / f32["tokens_per_s_one_request"]
    print(f"{'mode':<12} {'weights MiB':>11} {'chip MiB':>8} {'x bf16':>6} {'KV B/tok':>8} {'ppl':>8} {'ppl x':>7} "
          f"{'agree':>6} {'prefix':>6} "
          f"{'tok/s':>7} {'x':>5} {'step ms':>8} {'1 req tok/s':>11} {'x':>5} {'step ms':>8} "
          f"{'compile s':>9}")  # fmt: skip
    for mode, row in results.items():
        print(
            f"{mode:<12} {row['weight_bytes'] / 2**20:>11.1f} {row['chip_weight_bytes'] / 2**20:>8.1f} "
            f"{row.get('chip_weight_ratio', 1):>6.3f} {row['kv_bytes_per_token']:>8} {row['perplexity']:>8.3f} "
            f"{row.get('perplexity_ratio', 1):>7.4f} {row.get('agreement', 1):>6.3f} "
            f"{row.get('mean_agreeing_prefix', args.max_tokens):>6.1f} {row['tokens_per_s']:>7.1f} "
            f"{row.get('speedup', 1):>5.2f} {row['median_decode_step_s'] * 1e3:>8.1f} "
            f"{row['tokens_per_s_one_request']:>11.1f} {row.get('speedup_one_request', 1):>5.2f} "
            f"{row['median_decode_step_s_one_request'] * 1e3:>8.1f} {row['compile_s']:>9.1f}"
        )
    print(json.dumps({"requests": args.requests, "max_tokens": args.max_tokens, "modes": results}))


if __name__ == "__main__":
    main()
