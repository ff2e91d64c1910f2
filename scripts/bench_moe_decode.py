"""Decode of a Mixtral-shaped tiny model through the engine: routed experts against every expert dense, same run.

    python scripts/bench_moe_decode.py [--batch 32] [--layers 4] [--hidden 256] [--intermediate 896] [--experts 8]
        [--top-k 2] [--max-tokens 48] [--rounds 2]

A Mixtral config (Mixtral's proportions: F = 3.5 D, 8 experts, top 2; random weights, load_format="dummy"; heads 8,
KV heads 2, vocabulary 1024) runs --batch requests of 16-token prompts, greedy, --max-tokens each, twice per round:
once with the experts as the engine computes them on this backend (jaxpage.models.moe.expert_method: the expert
loop on CPU, ragged_dot on TPU/GPU) and once with every expert computed for every token (moe.DENSE_REFERENCE, the
tests' reference), the two taking turns. Reported per
method: decode tokens/s (the decode steps' tokens over their device seconds, jaxpage's step statistics), the median
decode step, compile seconds, and the expert weights' bytes (what a decode step reads at least once, whatever the
method); the speedup is dense's median decode step over the method's. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=896)  # Mixtral's F / D = 14336 / 4096 = 3.5
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2)
    return parser.parse_args()


def mixtral_config(args) -> dict:
    return dict(
        architectures=["MixtralForCausalLM"],
        model_type="mixtral",
        vocab_size=1024,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        num_local_experts=args.experts,
        num_experts_per_tok=args.top_k,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        rope_theta=1e6,
    )


def main() -> None:
    args = parse_args()
    import jax
    import numpy as np

    import jaxpage.models.llama as llama
    from jaxpage.benchmarks.measure import record_decode_steps
    from jaxpage.entrypoints.llm import LLM
    from jaxpage.models.moe import DENSE_REFERENCE, expert_method
    from jaxpage.sampling_params import SamplingParams

    model = tempfile.mkdtemp(prefix="jaxpage-bench-moe-decode-")
    (Path(model) / "config.json").write_text(json.dumps(mixtral_config(args)))
    routed = expert_method()
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(3, 1024, 16).tolist()} for _ in range(args.batch)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    engine_args = dict(
        load_format="dummy", skip_tokenizer_init=True, max_num_seqs=args.batch, max_model_len=16 + args.max_tokens + 16,
        compilation_cache_dir=None, seed=0,
    )  # fmt: skip
    shape = f"{args.layers} layers, D={args.hidden}, F={args.intermediate}, {args.experts} experts, top-{args.top_k}"
    print(f"backend {jax.default_backend()}: Mixtral-shaped, {shape}, batch {args.batch}", flush=True)
    engines, decode_steps = {}, {}
    report = {"backend": jax.default_backend(), "config": mixtral_config(args), "batch": args.batch, "methods": {}}
    for method in (routed, DENSE_REFERENCE):
        llama.expert_method = lambda platform=None, m=method: m  # what Llama's layers compute their experts with
        start = time.perf_counter()
        llm = LLM(model, **engine_args)
        llm.engine.warmup()
        experts = llm.engine.runner.params["layers"]["mlp"]["experts"]
        report["methods"][method] = dict(
            compile_s=time.perf_counter() - start,
            expert_bytes=sum(leaf.nbytes for leaf in jax.tree.leaves(experts)),
        )
        engines[method] = llm
        decode_steps[method] = record_decode_steps(llm.engine, num_seqs=args.batch)
    llama.expert_method = expert_method
    outputs = {}
    for _ in range(args.rounds):
        for method, llm in engines.items():
            outputs[method] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    for method, row in report["methods"].items():
        steps = decode_steps[method]
        row["decode_steps"] = len(steps)
        row["median_decode_step_s"] = statistics.median(steps)
        row["decode_tokens_per_s"] = args.batch * len(steps) / sum(steps)
    dense = report["methods"][DENSE_REFERENCE]
    for method, row in report["methods"].items():
        row["speedup_over_dense"] = dense["median_decode_step_s"] / row["median_decode_step_s"]
        print(
            f"  {method:16s} decode {row['decode_tokens_per_s']:8.1f} tokens/s, median step "
            f"{row['median_decode_step_s'] * 1e3:7.2f} ms over {row['decode_steps']} steps, "
            f"x{row['speedup_over_dense']:.2f} over dense, compile {row['compile_s']:.1f} s, "
            f"experts {row['expert_bytes'] / 2**20:.1f} MiB"
        )
    report["same_tokens"] = outputs[routed] == outputs[DENSE_REFERENCE]
    report["load_average"] = os.getloadavg()
    print(f"same tokens: {report['same_tokens']}; load average {report['load_average']}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
