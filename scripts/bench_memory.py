"""KV memory: requests running at once with paged KV, against contiguous per-request reservations, same bytes; and
the same for each KV format (float32, bfloat16, 8-bit pages).

    python scripts/bench_memory.py [--contiguous-requests 8] [--num-requests 64] [--max-model-len 1024]
        [--formats float32] [--max-num-seqs 64] [--workload FILE.jsonl] [--model SRC] [--plot FILE.png]

The KV budget is the bytes of --contiguous-requests float32 reservations of max_model_len tokens each: what a
server without paging must set aside per request, since it cannot know how long a request will grow. Contiguous
KV runs at most that many requests at once. jaxpage gets the same bytes and serves the workload of
bench_throughput.py (same generator and seed; greedy, every request to its max_tokens): pages are taken as
requests grow, so more of them fit. After every step the script samples the requests in the step, the pages in use
and the KV utilization. While requests are still waiting, the pool is what limits how many run: the mean (over
time) of that phase and the peak are reported against the contiguous count, and between formats.

--formats: float32 and bfloat16 are pools of that dtype (the engine's dtype; on CPU the bfloat16 pool's pages are
computed in float32, as XLA's CPU bfloat16 matmuls are very slow: the pages are what decides how many requests
run); int8, fp8 (= fp8_e4m3), fp8_e4m3, fp8_e5m2 are kv_cache_dtype with float32 weights. Each pool has the pages
the budget holds at its format's bytes per token (scales included). For 8-bit pages, raise
--max-num-seqs and lower --contiguous-requests so that the pool, not max_num_seqs, limits the run, e.g.
`--formats float32,bfloat16,int8,fp8 --contiguous-requests 2 --max-num-seqs 128`. --plot draws each format's run
(FILE-FORMAT.png with several). The last line is one JSON object.
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

FLOAT_FORMATS = ("float32", "bfloat16")
KV_FORMATS = ("int8", "fp8", "fp8_e4m3", "fp8_e5m2")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contiguous-requests", type=int, default=8, help="the KV budget, in max_model_len slots")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument(
        "--formats", default="float32", help=f"comma-separated: {', '.join(FLOAT_FORMATS + KV_FORMATS)}"
    )
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workload", type=Path, help="JSONL rows {id, prompt_token_ids, max_tokens}")
    parser.add_argument("--model", help="HF directory or .gguf file (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--plot", type=Path, help="PNG of KV utilization and running requests over the run")
    args = parser.parse_args()
    if args.contiguous_requests < 1:
        raise SystemExit("--contiguous-requests must be at least 1")
    formats = args.formats.split(",")
    if unknown := [f for f in formats if f not in FLOAT_FORMATS + KV_FORMATS]:
        raise SystemExit(f"unknown --formats {unknown}: choose from {', '.join(FLOAT_FORMATS + KV_FORMATS)}")

    from jaxpage.tokenizers.tokenizer import load_tokenizer

    rows = (
        read_workload(args.workload)
        if args.workload
        else make_workload(load_tokenizer(args.model), args.num_requests, args.seed)
    )
    workload = describe(rows)
    if workload["longest_request"] > args.max_model_len:
        raise SystemExit(f"a request needs {workload['longest_request']} tokens: raise --max-model-len")
    from jaxpage.models import load_model

    config, _ = load_model(args.model, dtype="float32")
    budget_bytes = args.contiguous_requests * args.max_model_len * config.kv_bytes_per_token(4)
    log(f"KV budget {budget_bytes} bytes = {args.contiguous_requests} x {args.max_model_len} float32 tokens")
    results = {}
    for kv_format in formats:
        log(f"== {kv_format}")
        results[kv_format] = run(args, rows, config, kv_format, budget_bytes, len(formats) > 1)
        log(f"{kv_format}: {json.dumps(results[kv_format])}")  # each format's figures as soon as it is done
    for kv_format, row in results.items():
        for base in FLOAT_FORMATS:
            if base in results and kv_format != base:
                ratio = (
                    row["paged_running_mean_while_requests_waited"]
                    / results[base]["paged_running_mean_while_requests_waited"]
                )
                row[f"running_mean_over_{base}"] = round(ratio, 2)
        print(
            f"{kv_format}: {row['kv_bytes_per_token']} B/token, {row['pool_tokens']} tokens in the pool; contiguous "
            f"{args.contiguous_requests} float32 requests; paged {row['paged_running_mean_while_requests_waited']:.1f} "
            f"on average while requests waited ({row['paged_over_contiguous_mean']}x), peak "
            f"{row['paged_running_peak']} ({row['paged_over_contiguous_peak']}x)"
            + "".join(
                f", {row[f'running_mean_over_{b}']}x {b}" for b in FLOAT_FORMATS if f"running_mean_over_{b}" in row
            )
            + f"; KV utilization mean {row['kv_utilization_mean']:.1%}, min {row['kv_utilization_min']:.1%}; "
            f"{row['preemptions']} preemptions"
        )
    summary = {
        "kv_budget_bytes": budget_bytes,
        "kv_budget_float32_tokens": args.contiguous_requests * args.max_model_len,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "contiguous_requests": args.contiguous_requests,
        "formats": results,
        "workload": workload,
    }
    print(json.dumps(summary))


def run(args, rows: list[dict], config, kv_format: str, budget_bytes: int, several: bool) -> dict:
    """One format's run of the workload in the budget's bytes: what it samples after every step, summarized."""
    import jax

    from jaxpage.attention import resolve_backend
    from jaxpage.entrypoints.llm import LLM
    from jaxpage.sampling_params import SamplingParams

    page_size = 16
    kv_cache_dtype = "auto" if kv_format in FLOAT_FORMATS else kv_format
    backend = resolve_backend("auto", kv_cache_dtype)
    token_bytes = backend.kv_bytes_per_token(config, 2 if kv_format == "bfloat16" else 4)
    # The pool: as many pages as the budget holds at this format's bytes per token (the engine's own formula). A
    # bfloat16 pool on CPU is computed in float32 (XLA's CPU bfloat16 matmuls are ~20x slower): its pages are
    # a bfloat16 pool's, which is all the scheduler -- and how many requests run at once -- depends on.
    num_pages = budget_bytes // (page_size * token_bytes)
    cpu = jax.default_backend() == "cpu"
    dtype = "bfloat16" if kv_format == "bfloat16" and not cpu else "float32"
    llm = LLM(
        args.model,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        num_pages=num_pages,
        page_size=page_size,
        skip_tokenizer_init=True,
    )
    engine, bm = llm.engine, llm.engine.block_manager
    log(f"{kv_format}: {token_bytes} B/token, {num_pages - 1} pages")
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
        raise SystemExit(
            f"{kv_format}: no request ever waited: the pool never limited the run (more requests, a smaller budget, "
            "or a larger --max-num-seqs)"
        )
    mean_running = sum(r * s for r, s in saturated) / sum(s for _, s in saturated)
    if max(running) >= args.max_num_seqs:
        log(f"{kv_format}: max_num_seqs ({args.max_num_seqs}) was reached: raise it to let the pool be the limit")
    if args.plot:
        path = args.plot.with_name(f"{args.plot.stem}-{kv_format}{args.plot.suffix}") if several else args.plot
        title = (
            f"{kv_format} KV, budget {budget_bytes / 2**20:.0f} MiB ({args.contiguous_requests} x max_model_len "
            f"{args.max_model_len} float32)"
        )
        plot_kv_run(path, seconds, utilization, running, pages, num_pages - 1, args.contiguous_requests, title)
        log(f"plot written to {path}")
    return {
        "dtype": dtype,
        "kv_cache_dtype": kv_cache_dtype,
        "pool_bytes_at_format": (num_pages * page_size * token_bytes),
        "kv_bytes_per_token": token_bytes,
        "page_size": page_size,
        "pool_pages": num_pages - 1,
        "pool_tokens": (num_pages - 1) * page_size,
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
    }


if __name__ == "__main__":
    main()
