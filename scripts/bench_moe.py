"""The mixture-of-experts block (jaxpage.models.moe) against its dense reference, on this machine's default backend.

    python scripts/bench_moe.py [--experts 8] [--top-k 2] [--hidden 256] [--intermediate 512] [--tokens 32,512]
        [--methods ragged_dot,expert_loop] [--rounds 40]

Default: a Mixtral-shaped tiny block (8 experts, top-2, float32) at T = 32 tokens (a decode batch of 32) and 512 (a
prefill chunk). For each T and each method, and for moe_dense_reference (every expert on every token):
  compile    seconds of the first call, and the compiled shapes
  time       after warm-up, min and median of --rounds calls, the methods taking turns (min is the figure to compare
             on a busy machine; the load average is printed)
  speedup    dense reference's min over the method's min
  compiles   programs the jitted function compiled for this T over calls whose routing differs (other group
             sizes): 1
  flops      XLA's estimate for the compiled program (a loop's body counted once) beside the routed work
             (T * k * 6 * D * F) and the dense work (T * E * 6 * D * F)
The last line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--tokens", default="32,512", help="comma-separated token counts T")
    parser.add_argument("--methods", default="ragged_dot,expert_loop")
    parser.add_argument("--rounds", type=int, default=40)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    import jax
    import jax.numpy as jnp

    from jaxpage.models.moe import METHODS, MoEBlock, loop_chunk_rows, moe_dense_reference

    methods = args.methods.split(",")
    if unknown := set(methods) - set(METHODS):
        raise SystemExit(f"unknown methods {sorted(unknown)}: choose from {', '.join(METHODS)}")
    e, k, d, f = args.experts, args.top_k, args.hidden, args.intermediate
    print(f"backend {jax.default_backend()}, {e} experts, top-{k}, D={d}, F={f}, float32", flush=True)
    report = {"backend": jax.default_backend(), "experts": e, "top_k": k, "hidden": d, "intermediate": f, "runs": []}

    def block(method):
        return MoEBlock(e, k, f, normalize_topk=True, method=method)

    params = block(methods[0]).init(jax.random.key(0), jnp.zeros((1, d)))["params"]
    programs = {"dense": jax.jit(lambda p, x: moe_dense_reference(p, x, k, True))}
    for method in methods:
        programs[method] = jax.jit(lambda p, x, m=method: block(m).apply({"params": p}, x))

    for num_tokens in (int(t) for t in args.tokens.split(",")):
        inputs = [jax.random.normal(jax.random.key(seed), (num_tokens, d)) for seed in range(3)]
        x = inputs[0]
        run = {"tokens": num_tokens, "rows": num_tokens * k, "loop_chunk_rows": loop_chunk_rows(num_tokens * k, e)}
        run["routed_flops"] = num_tokens * k * 6 * d * f
        run["dense_flops"] = num_tokens * e * 6 * d * f
        print(f"\nT={num_tokens}: x {tuple(x.shape)}, {num_tokens * k} rows sorted by expert", flush=True)
        expected = programs["dense"](params, x)
        for name, program in programs.items():
            cached_before = program._cache_size() - (name == "dense")  # the dense one compiled `expected` already
            if name != "dense":
                start = time.perf_counter()
                out = program(params, x).block_until_ready()
                run[f"{name}_compile_s"] = time.perf_counter() - start
                run[f"{name}_max_abs_diff"] = float(jnp.max(jnp.abs(out - expected)))
            else:
                run["dense_compile_s"] = 0.0  # compiled by `expected` above; timed below like the others
            compiled = program.lower(params, x).compile()
            run[f"{name}_xla_flops"] = (compiled.cost_analysis() or {}).get("flops")
            for other in inputs[1:]:  # other routings: other group sizes, the same program
                program(params, other).block_until_ready()
            run[f"{name}_compiles"] = program._cache_size() - cached_before
            for _ in range(3):
                program(params, x).block_until_ready()
        times = {name: [] for name in programs}
        for _ in range(args.rounds):
            for name, program in programs.items():
                start = time.perf_counter()
                program(params, x).block_until_ready()
                times[name].append(time.perf_counter() - start)
        for name in programs:
            run[f"{name}_min_ms"] = min(times[name]) * 1e3
            run[f"{name}_median_ms"] = statistics.median(times[name]) * 1e3
        for name in programs:
            line = f"  {name:12s} min {run[f'{name}_min_ms']:8.3f} ms  median {run[f'{name}_median_ms']:8.3f} ms"
            if name != "dense":
                run[f"{name}_speedup"] = run["dense_min_ms"] / run[f"{name}_min_ms"]
                line += f"  x{run[f'{name}_speedup']:.2f} over dense  compile {run[f'{name}_compile_s']:.2f} s"
                line += f"  max |diff| {run[f'{name}_max_abs_diff']:.1e}"
            flops = run[f"{name}_xla_flops"]
            line += f"  compiles {run[f'{name}_compiles']}  XLA flops {flops / 1e6 if flops else float('nan'):.0f}M"
            print(line, flush=True)
        print(f"  routed work {run['routed_flops'] / 1e6:.0f}M flops, dense {run['dense_flops'] / 1e6:.0f}M")
        report["runs"].append(run)
    report["load_average"] = os.getloadavg()
    print(f"\nload average {report['load_average']}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
