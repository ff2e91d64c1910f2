"""KV memory: requests running at once with paged KV, against contiguous per-request reservations, same bytes.

    python scripts/bench_memory.py [--contiguous-requests 8] [--num-requests 64] [--max-model-len 1024]
        [--workload FILE.jsonl] [--model SRC] [--plot FILE.png]

The KV budget is the bytes of --contiguous-requests reservations of max_model_len tokens each: what a server
without paging must set aside per request, since it cannot know how long a request will grow. Contiguous KV runs
at most that many requests at once. jaxpage gets the same bytes as its page pool and serves the workload of
bench_throughput.py (same generator and seed; greedy, every request to its max_tokens, max_num_seqs 64): pages are
taken as requests grow, so more of them fit. After every step the script samples the requests in the step, the
pages in use and the KV utilization. While requests are still waiting, the pool is what limits how many run: the
mean (over time) of that phase and the peak are reported against the contiguous count. --plot draws the run. The
last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from jaxpage.benchmarks.kv_plot import plot_kv_run
from jaxpage.benchmarks.progress import log
from jaxpage.benchmarks.workloads import describe, make_workload, read_workload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contiguous-requests", type=int, default=8, help="the KV budget, in max_model_len slots")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workload", type=Path, help="JSONL rows {id, prompt_token_ids, max_tokens}")
    parser.add_argument("--model", help="HF directory or .gguf file (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--plot", type=Path, help="PNG of KV utilization and running requests over the run")
    args = parser.parse_args()
    if args.contiguous_requests < 1:
        raise SystemExit("--contiguous-requests must be at least 1")

    from jaxpage.llm import LLM
    from jaxpage.sampling_params import SamplingParams
    from jaxpage.tokenizer import load_tokenizer

    rows = (
        read_workload(args.workload)
        if args.workload
        else make_workload(load_tokenizer(args.model), args.num_requests, args.seed)
    )
    workload = describe(rows)
    if workload["longest_request"] > args.max_model_len:
        raise SystemExit(f"a request needs {workload['longest_request']} tokens: raise --max-model-len")
    page_size = 16
    budget_tokens = args.contiguous_requests * args.max_model_len
    num_pages = budget_tokens // page_size + 1  # + the null page, which holds no request's tokens
    llm = LLM(args.model, max_model_len=args.max_model_len, max_num_seqs=64, num_pages=num_pages, page_size=page_size)
    engine, bm = llm.engine, llm.engine.block_manager
    log(f"KV budget {budget_tokens} tokens = {args.contiguous_requests} x {args.max_model_len}; {num_pages - 1} pages")
    log("warming up")
    engine.warmup()
    for row in rows:
        params = SamplingParams(temperature=0, max_tokens=row["max_tokens"], ignore_eos=True)
        engine.add_request(row["id"], {"prompt_token_ids": row["prompt_token_ids"]}, params)
    seconds, running, utilization, pages, waiting = [], [], [], [], []
    start = last_report = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        now = time.perf_counter()
        if bm.num_used_pages:
            waiting.append(bool(engine.scheduler.waiting))
            seconds.append(now - start)
            running.append(engine.last_step_stats.num_seqs)
            utilization.append(bm.kv_utilization())
            pages.append(bm.num_used_pages)
        if now - last_report > 10:
            log(f"{len(seconds)} steps, {now - start:.0f}s, {running[-1] if running else 0} running")
            last_report = now
    wall_s = time.perf_counter() - start
    # mean over time while requests waited: each step's count holds from the previous step's end to its own
    spans = [b - a for a, b in zip([0.0, *seconds[:-1]], seconds, strict=True)]
    saturated = [(r, s) for r, s, w in zip(running, spans, waiting, strict=True) if w]
    if not saturated:
        raise SystemExit("no request ever waited: the pool never limited the run (more requests, or a smaller budget)")
    mean_running = sum(r * s for r, s in saturated) / sum(s for _, s in saturated)
    result = {
        "kv_budget_tokens": budget_tokens,
        "max_model_len": args.max_model_len,
        "page_size": page_size,
        "contiguous_requests": args.contiguous_requests,
        "paged_running_mean_while_requests_waited": round(mean_running, 2),
        "seconds_while_requests_waited": round(sum(s for _, s in saturated), 1),
        "paged_running_peak": max(running),
        "paged_over_contiguous_mean": round(mean_running / args.contiguous_requests, 2),
        "paged_over_contiguous_peak": round(max(running) / args.contiguous_requests, 2),
        "kv_utilization_mean": round(statistics.mean(utilization), 4),
        "kv_utilization_min": round(min(utilization), 4),
        "pool_pages_in_use_mean": round(statistics.mean(pages) / (num_pages - 1), 4),
        "preemptions": engine.scheduler.num_preemptions,
        "steps": len(seconds),
        "wall_s": round(wall_s, 1),
        "workload": workload,
    }
    print(
        f"same KV bytes ({budget_tokens} tokens): contiguous {args.contiguous_requests} requests; paged "
        f"{mean_running:.1f} on average while requests waited ({result['paged_over_contiguous_mean']}x), peak "
        f"{max(running)} ({result['paged_over_contiguous_peak']}x); KV utilization mean "
        f"{result['kv_utilization_mean']:.1%}, min {result['kv_utilization_min']:.1%}; "
        f"{result['preemptions']} preemptions"
    )
    if args.plot:
        title = f"KV budget {budget_tokens} tokens ({args.contiguous_requests} x max_model_len {args.max_model_len})"
        plot_kv_run(args.plot, seconds, utilization, running, pages, num_pages - 1, args.contiguous_requests, title)
        log(f"plot written to {args.plot}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
