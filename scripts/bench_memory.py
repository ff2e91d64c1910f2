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

    python scripts/bench_memory.py --window-context 8192 [--window 1024]

Sliding windows instead: one request grown to that many tokens on two random models of the same size (4 layers,
D=256, 2 KV heads of 32, pages of 16): a Mistral-shaped one whose every layer slides over --window keys, and a
Gemma-3-shaped one whose layers 1-3 slide and layer 4 sees everything (a grouped pool: jaxpage.engine.kv_cache_groups).
Reported: the most KV bytes the sequence held after any step (the pages in its block tables, the null page not
counted, each page as many layers' K and V as its group has), beside the whole context's and the ideal
(every full-attention layer the whole context, every sliding layer its window: at most the pages that span the
window - 1 keys before the next token, plus the one it is written into).
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
    parser.add_argument("--window-context", type=int, help="the sliding-window report, at this many tokens")
    parser.add_argument("--window", type=int, default=1024)
    args = parser.parse_args()
    if args.window_context:
        rows = [window_run(model_type, args.window_context, args.window) for model_type in ("mistral", "gemma3_text")]
        for row in rows:
            print(
                f"{row['model']}: {row['context']} tokens, window {row['window']}: held at most "
                f"{row['kv_bytes_held_max']} B of KV ({row['held_over_whole_context']:.3f} of the whole context's "
                f"{row['kv_bytes_whole_context']} B; ideal {row['kv_bytes_ideal']} B, held / ideal "
                f"{row['held_over_ideal']:.3f})"
            )
        print(json.dumps({"window_runs": rows}))
        return
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


def window_run(model_type: str, context: int, window: int) -> dict:
    """One request grown to `context` tokens on a random model with sliding windows (see the module docstring): the
    most KV bytes its block tables held after any step, against the whole context's and the ideal."""
    import tempfile

    from jaxpage.entrypoints.llm import LLM
    from jaxpage.sampling_params import SamplingParams

    layers, page_size = 4, 16
    hf = dict(
        model_type=model_type, vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=2, head_dim=32, max_position_embeddings=context + 16,
        sliding_window=window,
    )  # fmt: skip
    if model_type == "gemma3_text":
        hf["layer_types"] = ["sliding_attention"] * (layers - 1) + ["full_attention"]
    directory = tempfile.mkdtemp(prefix="jaxpage-bench-window-")
    (Path(directory) / "config.json").write_text(json.dumps(hf))
    llm = LLM(
        directory, load_format="dummy", skip_tokenizer_init=True, max_model_len=context + 16, max_num_seqs=1,
        max_num_batched_tokens=512, page_size=page_size, compilation_cache_dir=None, enable_prefix_caching=False,
    )  # fmt: skip
    engine, config = llm.engine, llm.engine.model_config
    engine.add_request("0", {"prompt_token_ids": [i % 1000 + 3 for i in range(context - 8)]},
                       SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # fmt: skip
    layer_page_bytes = page_size * config.kv_bytes_per_token(4) // layers  # one layer's K and V of a page
    full_layers = sum(not sliding for sliding in config.sliding_layers)
    grouped = config.hybrid_attention  # a page of the full group holds its layers' K and V, of the window group its
    group_layers = (full_layers, layers - full_layers) if grouped else (layers, 0)
    held, steps = 0, 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        for seq in engine.scheduler.running:
            pages = [sum(page != 0 for page in table) for table in (seq.block_table, seq.window_block_table)]
            held = max(held, sum(n * g for n, g in zip(pages, group_layers, strict=True)) * layer_page_bytes)
    whole = -(-context // page_size) * layers * layer_page_bytes
    window_pages = -(-(window - 1) // page_size) + 1
    ideal = (full_layers * -(-context // page_size) + (layers - full_layers) * window_pages) * layer_page_bytes
    groups = "grouped pool (full, window)" if grouped else "one pool"
    log(f"{model_type}: {steps} steps, {groups}, at most {held} KV bytes held")
    return dict(
        model=f"{model_type} ({layers - full_layers} of {layers} layers sliding)", context=context, window=window,
        kv_bytes_held_max=held, kv_bytes_whole_context=whole, kv_bytes_ideal=ideal,
        held_over_whole_context=held / whole, held_over_ideal=held / ideal,
    )  # fmt: skip


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
