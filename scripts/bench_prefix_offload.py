"""The prefix cache's host tier (engine argument kv_offload_bytes) against recomputation, in one run: a multi-turn
workload whose conversations' prefixes do not fit the device pool.

    python scripts/bench_prefix_offload.py [--model SRC] [--conversations 8] [--prefix-tokens 2048] [--turns 2]
        [--message-tokens 32] [--max-tokens 16] [--pool-share 0.25] [--kv-offload-gib G]

Each of --conversations conversations starts with a prefix of its own (--prefix-tokens random token ids: a system
prompt, tool schemas, a document) and a message (--message-tokens); each later turn sends the conversation so far
(prefix, messages, replies) and a new message. A turn is every conversation's request, one after another, each
alone, as an agent's calls come; the device pool holds --pool-share of the conversations' prefixes (by default a
quarter), so a conversation that returns finds its pages evicted by the others. Two engines of the same model and
arguments serve the same requests in one process, taking turns request by request: `recompute` (no host tier) and
`host-tier` (kv_offload_bytes: by default room for every conversation's tokens). A request is timed whole through
LLM.generate_stream: its time to first token (its first token's output) and its seconds. Before the timed turns, each
engine serves one untimed conversation of the same shape (its programs compiled then, each engine loading what the
other compiled). Greedy tokens: the two engines' tokens of every request are compared; none may differ.

Printed: each turn's TTFT p50 (and p90) per engine and their ratio; the whole workload's requests and output tokens per
second per engine; the host tier's pages and bytes each way; compiled shapes and compile seconds. The last line of
stdout is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from jaxpage.benchmarks.progress import log


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q))


def timed_request(llm, prompt: list[int], params) -> tuple[float, float, list[int]]:
    """(seconds to its first token, seconds in all, its tokens) of one request served alone."""
    start = time.perf_counter()
    first = None
    for output in llm.generate_stream({"prompt_token_ids": prompt}, params):
        if first is None and output.outputs[0].token_ids:
            first = time.perf_counter() - start
        final = output
    return first, time.perf_counter() - start, list(final.outputs[0].token_ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model source (default: the default model)")
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--prefix-tokens", type=int, default=2048)
    parser.add_argument("--turns", type=int, default=2, help="turns per conversation (the first one included)")
    parser.add_argument("--message-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=16, help="reply tokens per turn")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--pool-share", type=float, default=0.25, help="share of the prefixes the device pool holds")
    parser.add_argument("--kv-offload-gib", type=float, default=None, help="default: every conversation's tokens")
    args = parser.parse_args()

    from jaxpage.entrypoints.llm import LLM
    from jaxpage.sampling_params import SamplingParams
    from jaxpage.worker.host_kv_pool import group_page_bytes

    longest = args.prefix_tokens + args.turns * (args.message_tokens + args.max_tokens)
    pool_tokens = int(args.conversations * args.prefix_tokens * args.pool_share)
    if pool_tokens < longest:
        raise SystemExit(f"a pool of {pool_tokens} tokens cannot hold a conversation of {longest}: raise --pool-share")
    engine_args = dict(
        model=args.model,
        page_size=args.page_size,
        num_pages=-(-pool_tokens // args.page_size) + 1,  # and the null page
        max_model_len=longest,
        skip_tokenizer_init=True,  # prompts and outputs are token ids
    )
    log(f"loading the recompute engine: a pool of {pool_tokens} tokens, {args.pool_share:.0%} of the prefixes")
    recompute = LLM(**engine_args)
    token_bytes = sum(group_page_bytes(recompute.engine.runner.pool.layout)) // args.page_size
    offload_bytes = (
        int(args.kv_offload_gib * 2**30)
        if args.kv_offload_gib is not None
        else int(1.25 * (args.conversations + 1) * longest * token_bytes)
    )
    log(f"loading the host-tier engine: {offload_bytes / 2**30:.2f} GiB of host slots")
    engines = {"recompute": recompute, "host-tier": LLM(kv_offload_bytes=offload_bytes, **engine_args)}

    vocab = recompute.engine.model_config.vocab_size
    rng = np.random.default_rng(0)

    def tokens(n: int) -> list[int]:
        return rng.integers(3, vocab, n).tolist()

    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    # Untimed: one conversation of the same shape on each engine, which compiles what the timed turns run.
    warm = [tokens(args.prefix_tokens + args.message_tokens)]
    for name, llm in engines.items():
        start = time.perf_counter()
        reply = timed_request(llm, warm[0], params)[2]
        timed_request(llm, warm[0] + reply + tokens(args.message_tokens), params)
        log(f"{name}: warm-up conversation in {time.perf_counter() - start:.1f}s")

    histories = [tokens(args.prefix_tokens) for _ in range(args.conversations)]
    ttft = {name: [[] for _ in range(args.turns)] for name in engines}
    seconds, output_tokens, differ = dict.fromkeys(engines, 0.0), dict.fromkeys(engines, 0), 0
    for turn in range(args.turns):
        for c in range(args.conversations):
            prompt = histories[c] + tokens(args.message_tokens)
            replies = {}
            for name, llm in engines.items():
                first, total, replies[name] = timed_request(llm, prompt, params)
                ttft[name][turn].append(first)
                seconds[name] += total
                output_tokens[name] += len(replies[name])
            differ += replies["recompute"] != replies["host-tier"]
            histories[c] = prompt + replies["recompute"]
        log(
            f"turn {turn + 1}: TTFT p50 "
            + ", ".join(f"{n} {statistics.median(ttft[n][turn]) * 1e3:.0f} ms" for n in engines)
        )

    print(f"{'turn':<6} {'engine':<10} {'TTFT p50 ms':>12} {'TTFT p90 ms':>12}")
    figures = {"ttft_p50_s": {}, "ttft_p90_s": {}, "ttft_p50_speedup": []}
    for turn in range(args.turns):
        for name in engines:
            p50, p90 = percentile(ttft[name][turn], 50), percentile(ttft[name][turn], 90)
            figures["ttft_p50_s"].setdefault(name, []).append(p50)
            figures["ttft_p90_s"].setdefault(name, []).append(p90)
            print(f"{turn + 1:<6} {name:<10} {p50 * 1e3:>12.1f} {p90 * 1e3:>12.1f}")
        figures["ttft_p50_speedup"].append(
            figures["ttft_p50_s"]["recompute"][-1] / figures["ttft_p50_s"]["host-tier"][-1]
        )
    requests = args.turns * args.conversations
    throughput = {name: output_tokens[name] / seconds[name] for name in engines}
    for name in engines:
        print(f"{name:<10} {requests / seconds[name]:.3f} requests/s, {throughput[name]:.1f} output tokens/s")
    returning = figures["ttft_p50_speedup"][1:]
    if returning:
        print(f"returning turns' TTFT p50: host tier {min(returning):.2f}x faster than recomputation (least of turns)")
    print(f"tokens that differ: {differ} requests of {requests}")
    host = engines["host-tier"].engine
    counts = host.runner.pool.host.bytes_moved
    bm = host.block_manager
    print(
        f"host tier: {bm.host.num_offloaded_pages} pages offloaded, {bm.host.num_loaded_pages} loaded; "
        f"{counts['offload'] / 2**20:.1f} MiB out, {counts['load'] / 2**20:.1f} MiB back"
    )
    compiled = {}
    for name, llm in engines.items():
        log_ = llm.engine.runner.compile_log
        compiled[name] = [str(c) for c in log_]
        print(f"{name}: {len(log_)} programs, {sum(c.seconds for c in log_):.1f}s: " + ", ".join(map(str, log_)))
    figures |= dict(
        throughput_tokens_s=throughput,
        requests_s={n: requests / seconds[n] for n in engines},
        differing_requests=differ,
        host_pages={"offload": bm.host.num_offloaded_pages, "load": bm.host.num_loaded_pages},
        host_bytes=counts,
        kv_offload_bytes=offload_bytes,
        pool_tokens=pool_tokens,
        compiled=compiled,
    )
    print(json.dumps(figures | vars(args)))
    if differ:
        raise SystemExit(f"{differ} requests' tokens differ between the engines")


if __name__ == "__main__":
    main()
