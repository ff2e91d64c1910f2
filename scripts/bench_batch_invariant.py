"""The batch-invariant mode against the default mode, in one run: throughput of a batch and one request's latency.

    python scripts/bench_batch_invariant.py [--model SRC] [--requests 32] [--max-tokens 128] [--repeats 2]
        [--latency-tokens 64] [--max-model-len 512] [--skip-warmup]

Two engines of the same model and arguments serve in one process: `default` and `invariant` (batch_invariant=True).
Each is warmed up first (untimed; --skip-warmup: not, for checking the script, whose figures then count compiling).
Throughput: both serve the same --requests prompts at the same time, taking turns one engine.step() each, so that
whatever slows this (noisy, shared) machine slows both alike; an engine's seconds are the sum of its own steps, its
throughput output tokens / those seconds (greedy, ignore_eos: every request makes --max-tokens tokens). Latency: one
request alone (a 60-token prompt, --latency-tokens tokens), timed whole through LLM.generate, on each engine in turn,
--repeats times; the median of each. The last line of stdout is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from jaxpage.benchmarks.progress import log
from jaxpage.benchmarks.turns import serve_in_turns, warm_up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model source (default: the default model)")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--latency-tokens", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--skip-warmup", action="store_true", help="compile as shapes come (checks the script quickly)")
    args = parser.parse_args()

    from jaxpage.entrypoints.llm import LLM
    from jaxpage.sampling_params import SamplingParams

    engine_args = dict(max_num_seqs=args.requests, max_num_batched_tokens=512, max_model_len=args.max_model_len)
    engine_args["skip_tokenizer_init"] = True  # prompts and outputs are token ids
    engines = {}
    for name, invariant in (("default", False), ("invariant", True)):
        log(f"loading the {name} engine")
        engines[name] = LLM(args.model, batch_invariant=invariant, **engine_args)
    compile_s = {} if args.skip_warmup else warm_up(engines)

    vocab = engines["default"].engine.model_config.vocab_size
    prompts = [
        {"prompt_token_ids": [(7 * i + 13 * j) % (vocab - 3) + 3 for j in range(60)]} for i in range(args.requests)
    ]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    seconds, tokens = dict.fromkeys(engines, 0.0), dict.fromkeys(engines, 0)
    for repeat in range(args.repeats):
        step_seconds, outputs = serve_in_turns(engines, prompts, params, f"r{repeat}")
        for name in engines:
            seconds[name] += step_seconds[name]
            tokens[name] += sum(map(len, outputs[name]))
        log(f"repeat {repeat + 1}: " + ", ".join(f"{n} {tokens[n] / seconds[n]:.1f} tokens/s" for n in engines))
    throughput = {name: tokens[name] / seconds[name] for name in engines}

    one = SamplingParams(temperature=0, max_tokens=args.latency_tokens, ignore_eos=True)
    latencies = {name: [] for name in engines}
    for _ in range(max(args.repeats, 3)):
        for name, llm in engines.items():
            start = time.perf_counter()
            llm.generate(prompts[0], one)
            latencies[name].append(time.perf_counter() - start)
    latency = {name: statistics.median(values) for name, values in latencies.items()}

    print(f"{'engine':<10} {'tokens/s':>9} {'batch-1 s':>10}")
    for name in engines:
        print(f"{name:<10} {throughput[name]:>9.1f} {latency[name]:>10.3f}")
    ratio = throughput["invariant"] / throughput["default"]
    slower = latency["invariant"] / latency["default"]
    print(f"invariant / default: throughput {ratio:.3f}, batch-1 latency {slower:.2f}x ({args.requests} requests)")
    figures = dict(throughput=throughput, latency_s=latency, throughput_ratio=ratio, latency_ratio=slower)
    print(json.dumps(figures | dict(compile_s=compile_s, tokens=tokens, seconds=seconds) | vars(args)))


if __name__ == "__main__":
    main()
