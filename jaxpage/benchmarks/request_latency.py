"""One request timed whole, as its user times it: `LLM.generate` around the call, `LLM.generate_stream` and the
server's stream for the time to the first token (TTFT) and between tokens (ITL), and transformers' `generate` timed
the same way (its streamer for TTFT and ITL). Every side gets the same prompt tokens and makes exactly `max_tokens`
tokens greedily. Each timed call gets a prompt of its own (a list of them, of one length): none finds its prompt in
jaxpage's prefix cache, as a user's first request would not."""

from __future__ import annotations

import statistics
import time


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times[:-1], times[1:], strict=True)]


def summary(request_s: list[float], ttft_s: list[float], itl_s: list[float], tokens: int) -> dict:
    """Medians over repeats: request seconds, TTFT, ITL (every gap of every repeat), and tokens/s of the request."""
    request = statistics.median(request_s)
    return {
        "request_s": request,
        "ttft_s": statistics.median(ttft_s) if ttft_s else None,
        "itl_s": statistics.median(itl_s) if itl_s else None,
        "tokens_per_s": tokens / request,
        "repeats": len(request_s),
    }


def time_generate(llm, prompts: list[str], max_tokens: int) -> dict:
    """`LLM.generate` timed around the call for the first half of `prompts`, then `LLM.generate_stream` for TTFT
    and ITL (each output with new tokens; the call is timed from before it is made) for the second half."""
    from jaxpage.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    request_s, ttft_s, itl_s = [], [], []
    half = len(prompts) // 2
    for prompt in prompts[:half]:
        start = time.perf_counter()
        (output,) = llm.generate(prompt, params)
        request_s.append(time.perf_counter() - start)
        assert len(output.outputs[0].token_ids) == max_tokens
    for prompt in prompts[half:]:
        start = time.perf_counter()
        times, seen = [], 0
        for output in llm.generate_stream(prompt, params):
            now, count = time.perf_counter(), len(output.outputs[0].token_ids)
            times += [now] * (count - seen)  # tokens that arrive together arrive at once
            seen = count
        ttft_s.append(times[0] - start)
        itl_s += gaps(times)
    return summary(request_s, ttft_s, itl_s, max_tokens)


def time_server(url: str, prompts: list[str], max_tokens: int) -> dict:
    """Streaming /v1/completions calls, one at a time: request seconds from sending to the last event, TTFT to the
    first chunk with a token, ITL between such chunks."""
    import asyncio

    import httpx

    from jaxpage.benchmarks.live_server import completion_body, stream_completion

    async def run() -> list[dict]:
        async with httpx.AsyncClient(timeout=None) as http:
            return [await stream_completion(http, url, completion_body(p, max_tokens)) for p in prompts]

    results = asyncio.run(run())
    for r in results:
        if r["tokens"] != max_tokens:
            raise SystemExit(f"the server made {r['tokens']} tokens, not {max_tokens}")
    return summary(
        [r["done"] - r["sent"] for r in results],
        [r["chunk_times"][0] - r["sent"] for r in results],
        [gap for r in results for gap in gaps(r["chunk_times"])],
        max_tokens,
    )


def time_hf_generate(hf, prompts_ids: list[list[int]], max_tokens: int) -> dict:
    """transformers' greedy `generate` of exactly max_tokens tokens, timed around the call; TTFT and ITL from a
    streamer's callbacks (the first `put` is the prompt, each later one a token), in the same calls."""
    import torch
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):
        def __init__(self):
            self.times = []

        def put(self, value):
            self.times.append(time.perf_counter())

        def end(self):
            pass

    request_s, ttft_s, itl_s = [], [], []
    for prompt_ids in prompts_ids:
        input_ids = torch.tensor([prompt_ids])
        clock = Clock()
        start = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(
                input_ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, streamer=clock
            )
        request_s.append(time.perf_counter() - start)
        assert out.shape[1] == len(prompt_ids) + max_tokens
        tokens = clock.times[1:]  # the first put is the prompt
        ttft_s.append(tokens[0] - start)
        itl_s += gaps(tokens)
    return summary(request_s, ttft_s, itl_s, max_tokens)
