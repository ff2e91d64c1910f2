"""Parallel layouts side by side: per-device bytes, step time, tokens/s and the compiled step's collectives.

    python scripts/bench_parallel.py [--model SRC] [--devices 8] [--layouts 1x1,3x1,1x2,3x2] [--requests 8]
        [--max-tokens 32]
    python scripts/bench_parallel.py --tiny     # a tiny random model (8 heads, 2 KV heads): 1x1,2x1,4x1,8x1,1x2,2x2
    python scripts/bench_parallel.py --tiny --moe --layouts 1x1,8x1,8x1ep   # a tiny Qwen3-MoE (8 experts, top 2)

On a CPU the devices are simulated (XLA's --xla_force_host_platform_device_count=--devices, set here before jax
starts): every "device" shares the same cores, so step times show the overhead of a layout, not its scaling; real
scaling figures come from a machine with several accelerators. Per layout TPxDP (tensor_parallel_size x
data_parallel_size; TPxDPep: with enable_expert_parallel):
  weights    bytes on each device (the most any holds), against the stored model's / TP (KV heads copied to the
             shards that read them, and the norms and o/down biases every device holds whole, come on top)
  experts    a mixture of experts' routed experts' bytes on each device (the most any holds): 1 / TP of them
             whether split by feature (tensor parallelism) or whole (expert parallelism)
  KV         bytes per token on each device (KV heads copied to the shards that read them count), and the pool's
  collectives all-reduces and all-gathers one run of the compiled forward pass and sampler executes, read from the
             optimized HLO with the layer loop's trip count (Megatron: 2 all-reduces per layer + 1 for the embedding;
             the sampler's all-gather of the logits; data parallelism adds none)
  speed      --requests random prompts (seeded) generated greedily to --max-tokens each: tokens/s, the median
             decode step, and compile seconds (warm-up, no compilation cache)
Greedy outputs are compared with the first layout's. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

TINY_CONFIG = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
TINY_MOE_CONFIG = TINY_CONFIG | dict(
    architectures=["Qwen3MoeForCausalLM"],
    model_type="qwen3_moe",
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    norm_topk_prob=True,
)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="anything load_model takes (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices (CPU only)")
    parser.add_argument("--layouts", default=None, help="TPxDP, comma-separated (default 1x1,3x1,1x2,3x2)")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--tiny", action="store_true", help="a tiny random model: checks the script anywhere")
    parser.add_argument("--moe", action="store_true", help="with --tiny: a mixture of experts (Qwen3-MoE's shape)")
    parser.add_argument(
        "--skip-warmup", action="store_true", help="compile only the programs the workload runs (no compile seconds)"
    )
    return parser.parse_args()


def parse_layout(text: str) -> tuple[int, int, bool]:
    """ "TPxDP" or "TPxDPep" (expert parallelism) -> (tp, dp, expert_parallel)."""
    expert_parallel = text.endswith("ep")
    tp, dp = text.removesuffix("ep").split("x")
    return int(tp), int(dp), expert_parallel


def layout_name(tp: int, dp: int, expert_parallel: bool) -> str:
    return f"{tp}x{dp}{'ep' if expert_parallel else ''}"


def main() -> None:
    args = parse_args()
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:  # before jax starts its backend
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.devices}".strip()

    import jax
    import numpy as np

    from jaxpage.benchmarks.hlo_collectives import executed
    from jaxpage.benchmarks.measure import record_decode_steps
    from jaxpage.benchmarks.progress import log
    from jaxpage.entrypoints.llm import LLM
    from jaxpage.models.llama import param_shapes
    from jaxpage.sampling_params import SamplingParams
    from jaxpage.worker import parallel

    model = args.model
    if args.tiny:  # random weights (load_format="dummy") in a tiny Llama's shape
        model = tempfile.mkdtemp(prefix="jaxpage-bench-parallel-")
        (Path(model) / "config.json").write_text(json.dumps(TINY_MOE_CONFIG if args.moe else TINY_CONFIG))
    default = "1x1,2x1,4x1,8x1,1x2,2x2" if args.tiny else "1x1,3x1,1x2,3x2"
    layouts = [parse_layout(layout) for layout in (args.layouts or default).split(",")]
    rng = np.random.default_rng(0)
    engine_args = dict(
        skip_tokenizer_init=True,
        max_model_len=args.prompt_len + args.max_tokens + 16,
        max_num_seqs=args.requests,
        max_num_batched_tokens=256,
        compilation_cache_dir=None,
        load_format="dummy" if args.tiny else "auto",
    )
    log(f"{len(jax.devices())} {jax.devices()[0].platform} devices; layouts TPxDP: {layouts}")
    rows, reference = [], None
    for tp, dp, expert_parallel in layouts:
        llm = LLM(
            model, **engine_args, tensor_parallel_size=tp, data_parallel_size=dp, enable_expert_parallel=expert_parallel
        )
        engine, runner = llm.engine, llm.engine.runner
        vocab = engine.model_config.vocab_size
        if reference is None:
            prompts = [
                {"prompt_token_ids": rng.integers(3, vocab, args.prompt_len).tolist()} for _ in range(args.requests)
            ]
        compile_s = None  # with --skip-warmup: the programs compile as the workload reaches them, untimed
        if not args.skip_warmup:
            start = time.perf_counter()
            engine.warmup()
            compile_s = time.perf_counter() - start
        held = parallel.device_bytes(runner.params)
        experts = runner.params["layers"]["mlp"].get("experts")  # a mixture of experts' routed experts
        experts_held = parallel.device_bytes(experts) if experts is not None else None
        total = sum(leaf.nbytes for leaf in jax.tree.leaves(runner.params))
        # The model as stored, without the KV heads' copies (these are overhead of the layout).
        dtype = jax.tree.leaves(runner.params)[0].dtype
        stored = sum(
            math.prod(x.shape) * dtype.itemsize for x in jax.tree.leaves(param_shapes(engine.model_config, dtype))
        )
        specs = jax.tree.leaves(
            parallel.param_specs(runner.params, expert_parallel=runner.config.expert_parallel_size > 1),
            is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec),
        )
        whole = sum(
            leaf.nbytes for leaf, spec in zip(jax.tree.leaves(runner.params), specs, strict=True) if not any(spec)
        )
        pool = parallel.device_bytes(runner.kv_cache)
        tokens_in_pool = runner.pages_per_replica * runner.kv_cache.page_size  # what one device holds pages of
        decode_s = record_decode_steps(engine)
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        shape = next(s for s in runner.shapes if s.kind == "decode" and s in runner.executables)  # compiled: ran
        forward = executed(runner.executables[shape].as_text())
        sampler = executed(runner.samplers[shape.sample_rows, 0, 0].as_text())
        tokens = [o.outputs[0].token_ids for o in outputs]
        reference = reference or tokens
        layers = engine.model_config.num_layers
        row = dict(
            tensor_parallel_size=tp,
            data_parallel_size=dp,
            enable_expert_parallel=expert_parallel,
            expert_bytes_per_device=None if experts_held is None else max(experts_held.values()),
            expert_bytes_total=None if experts is None else sum(leaf.nbytes for leaf in jax.tree.leaves(experts)),
            weight_bytes_per_device=max(held.values()),
            weight_bytes_total=total,
            weight_bytes_stored_model=stored,
            weight_bytes_whole_on_every_device=whole,
            weight_ratio_to_stored_over_tp=max(held.values()) / (stored / tp),
            kv_heads_in_pool=runner.kv_cache.k.shape[3],
            kv_bytes_per_token_per_device=max(pool.values()) // tokens_in_pool,
            kv_pool_bytes_per_device=max(pool.values()),
            forward_all_reduces=forward["all-reduce"],
            forward_all_reduces_per_layer=(forward["all-reduce"] - (1 if tp > 1 else 0)) / layers,
            sampler_all_gathers=sampler["all-gather"],
            other_collectives={
                k: v for k, v in (forward | sampler).items() if k not in ("all-reduce", "all-gather") and v
            },
            compile_s=compile_s,
            tokens_per_s=sum(map(len, tokens)) / seconds,
            decode_step_s=statistics.median(decode_s) if decode_s else None,
            same_tokens_as_first=tokens == reference,
        )
        rows.append(row)
        expert_note = "" if experts is None else f"experts {row['expert_bytes_per_device'] / 2**20:.2f} MiB/device, "
        log(
            f"{layout_name(tp, dp, expert_parallel)}: weights {row['weight_bytes_per_device'] / 2**20:.1f} MiB/device "
            f"({row['weight_ratio_to_stored_over_tp']:.3f} x stored model / TP), "
            f"{expert_note}KV {row['kv_bytes_per_token_per_device']} B/token/device, "
            f"all-reduces {forward['all-reduce']} per forward, "
            f"{row['tokens_per_s']:.1f} tokens/s, "
            f"same tokens as {layout_name(*layouts[0])}: {row['same_tokens_as_first']}"
        )
        del llm, engine, runner
    columns = (
        "TPxDP",
        "MiB/dev",
        "x model/TP",
        "expert MiB/dev",
        "KV B/tok/dev",
        "AR/fwd",
        "AR/layer",
        "AG/smp",
        "tok/s",
        "decode s",
    )
    print(" ".join(f"{c:>12}" for c in columns), "compile s", "same")
    for r in rows:
        values = (
            layout_name(r["tensor_parallel_size"], r["data_parallel_size"], r["enable_expert_parallel"]),
            f"{r['weight_bytes_per_device'] / 2**20:.1f}",
            f"{r['weight_ratio_to_stored_over_tp']:.3f}",
            "-" if r["expert_bytes_per_device"] is None else f"{r['expert_bytes_per_device'] / 2**20:.3f}",
            r["kv_bytes_per_token_per_device"],
            r["forward_all_reduces"],
            f"{r['forward_all_reduces_per_layer']:.2f}",
            r["sampler_all_gathers"],
            f"{r['tokens_per_s']:.1f}",
            f"{r['decode_step_s'] or float('nan'):.4f}",
        )
        compile_s = "-" if r["compile_s"] is None else f"{r['compile_s']:.1f}"
        print(" ".join(f"{v:>12}" for v in values), f"{compile_s:>9}", r["same_tokens_as_first"])
    print(json.dumps(dict(model=model or "SmolLM2-135M-Instruct", devices=len(jax.devices()), layouts=rows)))
    sys.exit(0 if all(r["same_tokens_as_first"] for r in rows) else 1)


if __name__ == "__main__":
    main()
