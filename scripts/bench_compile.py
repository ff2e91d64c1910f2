"""Compile time and start-up: the step shapes and their compile seconds, a job in a fresh process against the same
job warm, and a second start served by the persistent compilation cache.

    python scripts/bench_compile.py [--model SRC] [--num-requests 24] [--seed 0]

Each part runs in a fresh process (the parent only starts them and prints), at the default engine arguments:
  warmup       engine.warmup() with an EMPTY compilation cache directory: every program a workload can reach,
               with its shape and seconds (lowering + compiling), and the total.
  cold/warm    --num-requests requests (prompts of 100-300 random token ids, 50-150 greedy output tokens, EOS
               ignored; seeded) through LLM.generate in a fresh process with an EMPTY compilation cache directory,
               so it compiles as it goes; then the same job again in the same process, everything compiled
               (prefix caching off in both, so that the second run computes as much as the first).
               Throughput is output tokens / wall time of the generate call; the ratio is cold / warm.
  cached start a fresh process with the directory the warm-up filled: seconds from process start to the first
               token of one request, the programs it loaded and compiled, and what XLA compiled (jax's log of
               compilations: 0 when the cache serves everything).
The last line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import json, sys, time
start = float(sys.argv[1])
args = json.loads(sys.argv[2])
import numpy as np
import jax
from jaxpage import LLM, SamplingParams

import logging

xla_compilations = []  # what jax's log of compilations says XLA compiled in this process


class CountCompilations(logging.Handler):
    def emit(self, record):
        if record.getMessage().startswith("Finished XLA compilation"):
            xla_compilations.append(record.getMessage())


logging.getLogger("jax").addHandler(CountCompilations())
jax.config.update("jax_log_compiles", True)


def job(vocab):
    rng = np.random.default_rng(args["seed"])
    prompts, params = [], []
    for _ in range(args["num_requests"]):
        length = int(rng.integers(100, 301))
        prompts.append({"prompt_token_ids": rng.integers(100, vocab - 100, length).tolist()})
        params.append(SamplingParams(temperature=0, max_tokens=int(rng.integers(50, 151)), ignore_eos=True))
    return prompts, params


def run(llm, prompts, params):
    before = len(llm.engine.runner.compile_log)
    t = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    compiled = llm.engine.runner.compile_log[before:]
    return {
        "seconds": round(seconds, 2),
        "output_tokens": tokens,
        "tokens_per_s": round(tokens / seconds, 2),
        "programs_compiled": sum(not c.loaded for c in compiled),
        "compile_s": round(sum(c.seconds for c in compiled), 2),
    }


mode = args["mode"]
if mode == "warmup":
    llm = LLM(args["model"], compilation_cache_dir=args["cache_dir"])
    t = time.perf_counter()
    compiled = llm.engine.warmup()
    result = {
        "programs": [{"program": c.program, "shape": str(c.shape), "seconds": round(c.seconds, 2)} for c in compiled],
        "total_s": round(time.perf_counter() - t, 2),
    }
elif mode == "cold_warm":
    # Without prefix caching: the second run would otherwise find every prompt cached and compute less.
    llm = LLM(args["model"], compilation_cache_dir=args["cache_dir"], enable_prefix_caching=False)
    prompts, params = job(llm.engine.model_config.vocab_size)
    result = {"cold": run(llm, prompts, params), "warm": run(llm, prompts, params)}
else:  # cached start
    llm = LLM(args["model"], compilation_cache_dir=args["cache_dir"])
    engine_ready = time.time() - start
    out = llm.generate({"prompt_token_ids": list(range(100, 150))}, SamplingParams(temperature=0, max_tokens=1))[0]
    result = {
        "engine_ready_s": round(engine_ready, 2),
        "first_token_s": round(out.metrics.first_token_time - start, 2),
        "programs_loaded": sum(c.loaded for c in llm.engine.runner.compile_log),
        "programs_compiled": sum(not c.loaded for c in llm.engine.runner.compile_log),
        "xla_compilations": len(xla_compilations),
    }
print(json.dumps(result))
"""


def child(**args) -> dict:
    start = time.time()
    result = subprocess.run(
        [sys.executable, "-c", CHILD, repr(start), json.dumps(args)], capture_output=True, text=True
    )
    if result.returncode != 0:
        sys.exit(f"a benchmark process failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--num-requests", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as warm_cache, tempfile.TemporaryDirectory() as cold_cache:
        warmup = results["warmup"] = child(mode="warmup", model=args.model, cache_dir=warm_cache)
        for program in warmup["programs"]:
            print(f"  {program['program']:8s} {program['shape']:28s} {program['seconds']:6.2f}s", flush=True)
        print(f"warm-up: {len(warmup['programs'])} programs in {warmup['total_s']:.1f}s", flush=True)

        job = dict(model=args.model, cache_dir=cold_cache, num_requests=args.num_requests, seed=args.seed)
        runs = results["job"] = child(mode="cold_warm", **job)
        cold, warm = runs["cold"], runs["warm"]
        results["cold_over_warm"] = round(cold["tokens_per_s"] / warm["tokens_per_s"], 3)
        print(
            f"{args.num_requests}-request job: fresh process, empty cache {cold['tokens_per_s']:.1f} tok/s "
            f"({cold['seconds']:.1f}s, {cold['programs_compiled']} programs compiled in {cold['compile_s']:.1f}s); "
            f"warm {warm['tokens_per_s']:.1f} tok/s ({warm['seconds']:.1f}s, {warm['programs_compiled']} compiled); "
            f"cold/warm {results['cold_over_warm']:.2f}",
            flush=True,
        )

        cached = results["cached_start"] = child(mode="cached_start", model=args.model, cache_dir=warm_cache)
        print(
            f"second start, cache filled by the warm-up: engine ready {cached['engine_ready_s']:.2f}s, first token "
            f"{cached['first_token_s']:.2f}s after process start; {cached['programs_loaded']} programs loaded, "
            f"{cached['programs_compiled']} compiled, XLA compilations {cached['xla_compilations']}",
            flush=True,
        )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
