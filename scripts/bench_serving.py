"""`jaxpage serve` under load: Poisson arrivals at several request rates against a live server, and LLM.generate on
the same workload in the same run.

    python scripts/bench_serving.py [--model SRC] [--num-requests 64] [--rates 0:8,1,inf] [--repeats 3]
        [--max-num-seqs 64] [--max-num-batched-tokens 512] [--prompt-lens 16,256] [--max-tokens 16,128] [--seed 0]
        [--plot FILE.png] [--async-scheduling on|off]

Workloads: for each rate, --num-requests (or N, with RATE:N) completion requests whose prompts are token-id windows
of a fixed text corpus (jaxpage.benchmarks.workloads; each rate its own seed, so that no rate finds another's
prompts in the prefix cache), each generated greedily to exactly its max_tokens (ignore_eos).
  serve      `jaxpage serve` in a child process (started before the timing, its warm-up untimed). For each rate
             (requests/s; inf: all at once; 0: one at a time, each sent when the one before has finished, the lowest
             load), requests arrive at exponential intervals (seeded) as streaming /v1/completions calls
             (stream_options.include_usage); per request: time to first token (send to the first chunk with a choice:
             the first token's, whose text may be held back by the detokenizer; as vLLM's benchmark counts),
             inter-token latencies (between such chunks), output tokens (from the usage chunk).
  generate   LLM.generate in this process (same engine arguments, prefix cache off so that it can run a workload
             twice), warmed up: on the saturation workload (the highest rate) just before and just after the server
             serves it, the throughput ceiling. At rate 0, before each request, the same prompt alone in this engine:
             the seconds of its first step (the prefill that gives its first token), the floor of time to first
             token. Both are measured next to what they are compared with: this machine's speed drifts by 20-30%
             between minutes, more than the differences measured.
The highest rate runs --repeats times, each time on a new workload (the server must not find the last one's prompts
in its prefix cache), between two runs of generate on it. Throughput is output tokens / seconds from the first
request sent to the last token back. The targets: at saturation the server gives at least 90% of generate's tokens/s
(all repeats pooled: the server's tokens over its seconds against generate's); at the lowest rate its p50 time to
first token is at most the median first step plus 20 ms (at rate 0 by default: no request waits for another's
step). Progress goes to stderr; a table and, as the last line, one JSON object with every figure go to stdout;
--plot draws throughput and latencies against the rate (the first repeat of the highest).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import time
from pathlib import Path

import numpy as np

from jaxpage.benchmarks.live_server import completion_body, free_port, start_server, stream_completion
from jaxpage.benchmarks.progress import log
from jaxpage.benchmarks.workloads import describe, make_workload


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p99": None}
    return {"p50": float(np.percentile(values, 50)), "p99": float(np.percentile(values, 99))}


def local_engine(args, engine_args: dict):
    """LLM in this process, warmed up. Its prefix cache is off: it runs the saturation workload twice, and the
    low-load prompts alone, and must compute every prompt each time (the server sees each prompt once)."""
    from jaxpage.entrypoints.llm import LLM

    llm = LLM(args.model, **engine_args, enable_prefix_caching=False)
    llm.engine.warmup()
    return llm


def run_generate(llm, rows: list[dict]) -> dict:
    from jaxpage.sampling_params import SamplingParams

    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in rows]
    params = [SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True) for r in rows]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def first_step(llm, row: dict) -> float:
    """Seconds of the step that gives the prompt, alone, its first token."""
    from jaxpage.sampling_params import SamplingParams

    llm.engine.add_request("first-step", {"prompt_token_ids": row["prompt_token_ids"]}, SamplingParams(max_tokens=1))
    start = time.perf_counter()
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    return time.perf_counter() - start


async def one_request(http, url: str, row: dict, delay: float, start: float) -> dict:
    await asyncio.sleep(max(0.0, start + delay - time.perf_counter()))
    result = await stream_completion(http, url, completion_body(row["prompt_token_ids"], row["max_tokens"]))
    times = result["chunk_times"]
    return {
        "sent": result["sent"],
        "done": result["done"],
        "tokens": result["tokens"],
        "ttft": times[0] - result["sent"] if times else None,
        "itl": list(np.diff(times)),
    }


async def run_rate(url: str, rows: list[dict], rate: float, seed: int, llm=None) -> dict:
    """The server at `rate`; at rate 0 (one request at a time) each request follows the same prompt's first step in
    the local engine `llm`: first_step_s, measured next to each time to first token (this machine's speed drifts by
    20-30% between minutes)."""
    import httpx

    rng = np.random.default_rng(seed)
    limits = httpx.Limits(max_connections=len(rows) + 8, max_keepalive_connections=len(rows) + 8)
    async with httpx.AsyncClient(timeout=None, limits=limits) as http:
        start = time.perf_counter()
        first_steps = []
        if rate == 0:  # one at a time: each request is sent when the one before has finished
            results = []
            for row in rows:
                first_steps.append(first_step(llm, row))
                results.append(await one_request(http, url, row, 0.0, time.perf_counter()))
        else:
            delays = np.zeros(len(rows)) if math.isinf(rate) else np.cumsum(rng.exponential(1.0 / rate, len(rows)))
            requests = (one_request(http, url, r, d, start) for r, d in zip(rows, delays, strict=True))
            results = await asyncio.gather(*requests)
    seconds = max(r["done"] for r in results) - min(r["sent"] for r in results)
    tokens = sum(r["tokens"] for r in results)
    return {
        "rate": rate,
        "requests": len(rows),
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "ttft_s": percentiles([r["ttft"] for r in results if r["ttft"] is not None]),
        "itl_s": percentiles([x for r in results for x in r["itl"]]),
        "first_step_s": first_steps,
        "ttft_each_s": [r["ttft"] for r in results] if first_steps else [],
    }


def plot(path: Path, cells: list[dict], generate_rate: float | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [str(c["rate"]) for c in cells]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.bar(labels, [c["tokens_per_s"] for c in cells], color="#0a66c2")
    if generate_rate is not None:
        left.axhline(generate_rate, color="black", linestyle="--", label="LLM.generate")
        left.axhline(0.9 * generate_rate, color="grey", linestyle=":", label="90% of it")
    left.set(xlabel="request rate (1/s)", ylabel="output tokens/s", title="throughput")
    left.legend()
    for key, marker in (("ttft_s", "o"), ("itl_s", "s")):
        for q, style in (("p50", "-"), ("p99", "--")):
            right.plot(labels, [c[key][q] for c in cells], style, marker=marker, label=f"{key[:-2]} {q}")
    right.set(xlabel="request rate (1/s)", ylabel="seconds", title="latency", yscale="log")
    right.legend()
    fig.tight_layout()
    fig.savefig(path)


def pooled(runs: list[dict]) -> float:
    return sum(r["tokens"] for r in runs) / sum(r["seconds"] for r in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="anything load_model takes (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument(
        "--rates", default="0:8,1,inf", help="requests/s, comma-separated (RATE:N: N requests); 0: one at a time"
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs of the highest rate, each between two generates")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--prompt-lens", default="16,256", help="min,max prompt tokens")
    parser.add_argument("--max-tokens", default="16,128", help="min,max output tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument(
        "--async-scheduling", choices=["on", "off"], help="the engines' async_scheduling (default: the engine's)"
    )
    args = parser.parse_args()
    rates = [
        (float(r.split(":")[0]), int(r.split(":")[1]) if ":" in r else args.num_requests) for r in args.rates.split(",")
    ]
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    prompt_lens = tuple(int(x) for x in args.prompt_lens.split(","))
    max_tokens = tuple(int(x) for x in args.max_tokens.split(","))
    saturation = max(range(len(rates)), key=lambda i: rates[i][0])
    lowest = min(range(len(rates)), key=lambda i: rates[i][0])

    from jaxpage.tokenizers.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.model)
    # Every run its own seed, so that no run finds another's prompts in the server's prefix cache.
    seeds = iter(range(args.seed, args.seed + len(rates) + args.repeats))
    runs = [  # (rate, workload) in the order they run; the highest rate --repeats times
        (rate, make_workload(tokenizer, count, next(seeds), prompt_lens, max_tokens))
        for i, (rate, count) in enumerate(rates)
        for _ in range(args.repeats if i == saturation else 1)
    ]
    log(f"workload at saturation: {describe(next(w for r, w in runs if r == rates[saturation][0]))}")
    engine_args = dict(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
    )
    if args.async_scheduling is not None:
        engine_args["async_scheduling"] = args.async_scheduling == "on"
    log("generate: warm-up")
    llm = local_engine(args, engine_args)
    port = free_port()
    log("serve: starting (warm-up untimed)")
    server = start_server(args.model, engine_args, port)
    cells, generate, saturated = [], [], []
    try:
        for rate, workload in runs:
            top = rate == rates[saturation][0]
            if top:  # generate on the same workload just before and just after
                generate.append(run_generate(llm, workload))
                log(f"generate: {generate[-1]['tokens_per_s']:.1f} tokens/s")
            cell = asyncio.run(run_rate(f"http://127.0.0.1:{port}", workload, rate, args.seed, llm))
            log(
                f"serve at {rate} req/s: {cell['tokens_per_s']:.1f} tokens/s, ttft p50 {cell['ttft_s']['p50']:.3f}s "
                f"p99 {cell['ttft_s']['p99']:.3f}s, itl p50 {cell['itl_s']['p50']:.3f}s p99 {cell['itl_s']['p99']:.3f}s"
            )
            if top:
                generate.append(run_generate(llm, workload))
                log(f"generate: {generate[-1]['tokens_per_s']:.1f} tokens/s")
                saturated.append(cell)
                if len(saturated) > 1:
                    continue  # the table and the plot show the first repeat
            cells.append(cell)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=120)

    low = cells[lowest]
    first_step_s = float(np.median(low["first_step_s"])) if low["first_step_s"] else None
    each = [
        c["tokens_per_s"] / ((a["tokens_per_s"] + b["tokens_per_s"]) / 2)
        for c, a, b in zip(saturated, generate[::2], generate[1::2], strict=True)
    ]
    targets = {
        "saturation_ratio": pooled(saturated) / pooled(generate),
        "saturation_ratio_each_repeat": each,
        "low_load_ttft_p50_s": low["ttft_s"]["p50"],
        "first_step_s": first_step_s,
        "low_load_ttft_within_first_step_plus_20ms": (
            low["ttft_s"]["p50"] <= first_step_s + 0.020 if first_step_s is not None else None
        ),
    }
    print(f"{'system':8} {'rate':>6} {'tokens/s':>9} {'ttft p50':>9} {'ttft p99':>9} {'itl p50':>8} {'itl p99':>8}")
    for c in cells[:saturation] + saturated + cells[saturation + 1 :]:
        t, i = c["ttft_s"], c["itl_s"]
        print(
            f"{'serve':8} {c['rate']:>6} {c['tokens_per_s']:>9.1f} {t['p50']:>9.3f} {t['p99']:>9.3f} {i['p50']:>8.3f} "
            f"{i['p99']:>8.3f}"
        )
    for g in generate:
        print(f"{'generate':8} {'-':>6} {g['tokens_per_s']:>9.1f}")
    print(
        f"saturation: {targets['saturation_ratio']:.3f} of generate's tokens/s, {len(saturated)} repeats pooled "
        f"(each: {', '.join(f'{r:.3f}' for r in each)}; target >= 0.9)"
    )
    if first_step_s is not None:
        print(f"low load: ttft p50 {low['ttft_s']['p50']:.3f}s against its first step {first_step_s:.3f}s + 0.020s")
    if args.plot:
        plot(args.plot, cells, pooled(generate))
        log(f"plot written to {args.plot}")
    figures = dict(
        workloads=[describe(w) for _, w in runs],
        engine_args=engine_args,
        generate=generate,
        serve=cells,
        saturation_repeats=saturated,
    )
    print(json.dumps(figures | {"targets": targets, "cpu_count": os.cpu_count()}))


if __name__ == "__main__":
    main()
