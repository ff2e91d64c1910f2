"""The engine loop's steps per second with N streaming HTTP clients, against the same load through the Python API.

    python scripts/bench_serve_loop.py [--clients 256] [--max-tokens 256] [--repeats 2] [--pin]

The engine is the benchmarks' stubbed one (jaxpage.benchmarks.stub_device: the default model's vocabulary and
tokenizer, the device's step replaced by tokens drawn on the host), so that the loop's pace is the host's alone, as
beside a chip. Each arrangement runs the same load: N requests at once (32-token prompts given as token ids,
temperature 0.8, top_p 0.9, --max-tokens each, ignore_eos), every one streamed (RequestOutputKind.DELTA, what the
server asks for a stream):

  python-api     LLMEngine.add_request, then LLMEngine.step until every request has finished, reading each output
  async-api      AsyncEngine over an LLMEngine in this process, N asyncio consumers of AsyncEngine.generate
  http-thread    `jaxpage serve --no-engine-process`: the engine loop a thread of the server's process
  http-process   `jaxpage serve` (the default): the engine in a process of its own (jaxpage.entrypoints.engine_process)

The HTTP clients (httpx, one stream each, reading every server-sent event) run in a process of their own, not the
server's. The loop's steps per second are those of its full steps, which give (at least 90% of) the N requests a token
(each timed from the end of the step before, by the clock of the process that steps: AsyncEngine.num_turns and
last_turn_at, or LLMEngine.step's count); each request is also timed whole, as its caller or client sees it. The target
(issue 56): http-process within 10% of python-api. With --pin, the process that steps (the engine process for
http-process, this one for the others) runs on core 0 alone, and the server and the clients on core 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import tempfile
import threading
import time

import numpy as np

PROMPT_TOKENS = 32
ARRANGEMENTS = ("python-api", "async-api", "http-thread", "http-process")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2, help="each arrangement, in turns; the best counts")
    parser.add_argument("--arrangements", default=",".join(ARRANGEMENTS))
    parser.add_argument(
        "--pin",
        action="store_true",
        help="the process that steps on core 0 alone, the server and clients on core 1 (a host with cores to spare)",
    )
    args = parser.parse_args()
    args.arrangements = args.arrangements.split(",")
    if set(args.arrangements) - set(ARRANGEMENTS):
        parser.error(f"--arrangements: choose from {', '.join(ARRANGEMENTS)}")
    return args


def engine_args(model_dir: str, clients: int, max_tokens: int) -> dict:
    from jaxpage.models.default_model import default_model_path

    return dict(
        model=model_dir,
        tokenizer=str(default_model_path()),
        load_format="dummy",
        max_num_seqs=clients,
        max_num_batched_tokens=clients * PROMPT_TOKENS,
        max_model_len=PROMPT_TOKENS + max_tokens + 16,
        num_pages=clients * ((PROMPT_TOKENS + max_tokens) // 16 + 2) + 64,
        compilation_cache_dir=None,
    )


def prompts(clients: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return rng.integers(100, 40000, (clients, PROMPT_TOKENS)).tolist()


class LoopWindow:
    """The loop's steps with the requests running: the turns that gave the N requests an output, each timed from the
    end of the turn before (turn counts and end times as `engine` hands them over: AsyncEngine.num_turns and
    last_turn_at, by the clock of the process that steps)."""

    def __init__(self, engine, clients: int):
        self.engine, self.clients = engine, clients
        self.outputs: dict[int, int] = {}  # turn -> outputs it gave
        self.ends: dict[int, float] = {}  # turn -> when it ended

    def observe(self, output) -> None:
        turn = self.engine.num_turns
        self.outputs[turn] = self.outputs.get(turn, 0) + 1
        self.ends[turn] = self.engine.last_turn_at

    def steps_per_s(self) -> float:
        """Over the turns that gave at least 90% of the requests an output (all of them, but for the requests whose
        clients connected late or finished early)."""
        full = [t for t, n in self.outputs.items() if n >= 0.9 * self.clients and t - 1 in self.ends]
        if not full:
            raise SystemExit(
                "no step ran 90% of the requests at once (they arrived over longer than one lasted): raise --max-tokens"
            )
        return len(full) / sum(self.ends[t] - self.ends[t - 1] for t in full)


class StepCount:
    """LLMEngine's steps as LoopWindow reads AsyncEngine's turns."""

    def __init__(self, engine):
        self.engine = engine
        self.num_turns, self.last_turn_at = 0, 0.0

    def step(self) -> list:
        outputs = self.engine.step()
        self.num_turns, self.last_turn_at = self.num_turns + 1, time.monotonic()
        return outputs


def run_llm_engine(engine, clients: int, max_tokens: int, window: LoopWindow) -> list[float]:
    from jaxpage.sampling_params import RequestOutputKind, SamplingParams

    params = SamplingParams(
        temperature=0.8, top_p=0.9, max_tokens=max_tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    start, seconds, steps = time.perf_counter(), [], window.engine
    for i, prompt in enumerate(prompts(clients)):
        engine.add_request(f"llm-{i}-{time.time()}", {"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests():
        for output in steps.step():
            window.observe(output)
            if output.finished:
                seconds.append(time.perf_counter() - start)
    return seconds


def run_api(engine, clients: int, max_tokens: int) -> list[float]:
    from jaxpage.sampling_params import RequestOutputKind, SamplingParams

    params = SamplingParams(
        temperature=0.8, top_p=0.9, max_tokens=max_tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )

    async def one(i: int, prompt: list[int]) -> float:
        start = time.perf_counter()
        async for _ in engine.generate(f"api-{i}-{time.time()}", {"prompt_token_ids": prompt}, params):
            pass
        return time.perf_counter() - start

    async def everyone():
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts(clients))))

    return asyncio.run(everyone())


def pin(pid: int, core: int | None) -> None:
    if core is not None:
        os.sched_setaffinity(pid, {core})


def http_clients(url: str, clients: int, max_tokens: int, results, core: int | None) -> None:
    """The clients' process: every request streamed at once, each timed whole; their seconds into `results`."""
    import httpx

    pin(0, core)

    async def one(http, prompt: list[int]) -> float:
        body = dict(prompt=prompt, max_tokens=max_tokens, temperature=0.8, top_p=0.9, ignore_eos=True, stream=True)
        start = time.perf_counter()
        async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    break
        return time.perf_counter() - start

    async def everyone():
        limits = httpx.Limits(max_connections=clients + 8)
        async with httpx.AsyncClient(timeout=600, limits=limits) as http:
            return await asyncio.gather(*(one(http, p) for p in prompts(clients)))

    results.extend(asyncio.run(everyone()))


def run_http(engine, clients: int, max_tokens: int, core: int | None) -> list[float]:
    import uvicorn

    from jaxpage.benchmarks.live_server import free_port
    from jaxpage.entrypoints.server import create_app

    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(engine, "bench"), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    context = multiprocessing.get_context("spawn")
    with context.Manager() as manager:
        results = manager.list()
        url = f"http://127.0.0.1:{port}"
        process = context.Process(target=http_clients, args=(url, clients, max_tokens, results, core))
        process.start()
        process.join()
        seconds = list(results)
    server.should_exit = True
    thread.join(timeout=10)
    return seconds


def make_engine(arrangement: str, args_: dict):
    from jaxpage.benchmarks.stub_device import stubbed_engine
    from jaxpage.config import EngineConfig
    from jaxpage.entrypoints.async_engine import AsyncEngine
    from jaxpage.entrypoints.engine_process import EngineProcess

    if arrangement == "http-process":
        return AsyncEngine(EngineProcess(args_, warmup=False, make_engine=stubbed_engine)).start()
    engine = stubbed_engine(EngineConfig(**args_))
    return engine if arrangement == "python-api" else AsyncEngine(engine).start()


def run_arrangement(
    arrangement: str, engine, clients: int, max_tokens: int, pinned: bool
) -> tuple[list[float], LoopWindow]:
    """(each request's seconds, the loop's window) of one run of the load; pinned: see --pin."""
    if pinned:  # this process steps, but for http-process, whose engine process is on core 0 alone
        pin(0, 1 if arrangement == "http-process" else 0)
        if arrangement == "http-process":
            pin(engine._core._process.pid, 0)
    if arrangement == "python-api":
        window = LoopWindow(StepCount(engine), clients)
        return run_llm_engine(engine, clients, max_tokens, window), window
    window = LoopWindow(engine, clients)
    engine.observers.append(window.observe)
    try:
        if arrangement == "async-api":
            return run_api(engine, clients, max_tokens), window
        return run_http(engine, clients, max_tokens, 1 if pinned else None), window
    finally:
        engine.observers.remove(window.observe)


def main() -> None:
    args = parse_args()
    from jaxpage.benchmarks.progress import log
    from jaxpage.benchmarks.stub_device import write_tiny_full_vocab

    model_dir = write_tiny_full_vocab(tempfile.mkdtemp(prefix="jaxpage-bench-serve-loop-"))
    configuration = engine_args(model_dir, args.clients, args.max_tokens)
    engines = {a: make_engine(a, configuration) for a in args.arrangements}
    rows: dict[str, list[dict]] = {a: [] for a in args.arrangements}
    for repeat in range(args.repeats + 1):  # the first round warms up (compiles the sampler's shapes)
        for arrangement in args.arrangements:
            engine = engines[arrangement]
            seconds, window = run_arrangement(arrangement, engine, args.clients, args.max_tokens, args.pin)
            if repeat == 0:
                continue
            row = {
                "steps_per_s": round(window.steps_per_s(), 1),
                "request_s_median": round(statistics.median(seconds), 3),
                "request_s_max": round(max(seconds), 3),
            }
            rows[arrangement].append(row)
            log(f"{arrangement} (round {repeat}): {row}")
    for engine in engines.values():
        if hasattr(engine, "observers"):  # an AsyncEngine
            engine.shutdown(timeout_s=5)
    best = {a: max(rs, key=lambda r: r["steps_per_s"]) for a, rs in rows.items()}
    api = best.get("python-api", {}).get("steps_per_s")
    streams = f"{args.clients} streams of {args.max_tokens} tokens"
    pinned = "; pinned: the process that steps on a core of its own" if args.pin else ""
    print(f"\nthe engine loop with {streams} (device stubbed; best of {args.repeats}{pinned})\n")
    print("| arrangement | loop steps/s | vs python-api | request seconds (median) | (slowest) |")
    print("|---|---|---|---|---|")
    for arrangement, row in best.items():
        ratio = f"{row['steps_per_s'] / api:.2f}" if api else "-"
        print(
            f"| {arrangement} | {row['steps_per_s']} | {ratio} | {row['request_s_median']} | {row['request_s_max']} |"
        )
    print(json.dumps({"clients": args.clients, "max_tokens": args.max_tokens, "pinned": args.pin, "rows": rows}))


if __name__ == "__main__":
    main()
