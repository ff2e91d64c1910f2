"""One request timed whole as its user times it, against transformers' `generate` timed the same way; and where a
decode step's time goes, at batch 1, 4 and 64: the engine's own split of each step, and each device program timed
alone.

    python scripts/bench_latency.py [--model PATH] [--parts requests,steps] [--prompt-lens 16,128,1024]
        [--tokens 128] [--quantization int8] [--dtype float32] [--repeats 3] [--no-server] [--no-hf]
        [--batch-sizes 1,4,64] [--async-scheduling off|on|both]

requests: an engine as `LLM()` makes it (the engine's defaults; --dtype, --quantization), warmed up (engine.warmup()),
and one untimed request, then for each prompt length (windows of a fixed text corpus, a new one for each timed call:
none is in a prefix cache; given as text, so tokenizing is timed too; their token counts are reported) one
request of --tokens tokens (greedy, ignore_eos), --repeats times each way:
  generate   `LLM.generate` timed around the call (request seconds), then `LLM.generate_stream` for the time to the
             first token (TTFT) and between tokens (ITL);
  serve      `jaxpage serve` (a child process, same engine arguments, warmed up before the timing), streaming
             /v1/completions: TTFT to the first chunk with a token, ITL between them, request seconds to the last event;
  hf         transformers' float32 `generate` of the same prompt tokens (the GGUF dequantized by transformers), timed
             around the call, TTFT and ITL from its streamer's callbacks (--no-hf leaves it out).
Medians of the repeats; jaxpage / hf is the ratio of request seconds (the issue's target: >= 1.3x float32,
>= 2x int8 weights at 128 tokens; a 16-token prompt's first token <= 100 ms).
steps: per batch size, that many requests of a 16-token prompt decode --tokens tokens each (greedy, ignore_eos), after
a warm-up that compiles every step shape. Every decode-only step of the run is split as the engine times it
(LLMEngine.last_step_stats): schedule, prepare (the step's arrays), device (dispatch until the sampled tokens are on
the host), postprocess (the scheduler's update, detokenization -- also reported alone -- stop checks, outputs). Then
the step's programs run again alone on its own inputs, each waited for: forward pass, sampler (LM head and sampling).
The idle gap is the device part of a step less those programs: dispatch, transfer, and time the device waits.
Reported per batch size: the medians in milliseconds, decode tokens/s, host time (schedule + prepare +
postprocess) as a share of the step, and the time to the first token (from adding the requests) beside the device
time of the steps before it (the prompts' prefill). Each of it with synchronous and asynchronous scheduling (an
engine each, same run), unless --async-scheduling says one; with asynchronous scheduling a step's parts overlap other
steps' device time, and the step time is the wall time between two outputs.
Compiled shapes and compile seconds are printed as they compile. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import time

from jaxpage.benchmarks.progress import log

PROMPT_LEN = 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a .gguf file or HF directory (default: the default model)")
    parser.add_argument("--parts", default="requests,steps", help="requests, steps or both (comma-separated)")
    parser.add_argument("--prompt-lens", default="16,128,1024", help="requests: prompt tokens, comma-separated")
    parser.add_argument("--batch-sizes", default="1,4,64", help="steps: batch sizes")
    parser.add_argument("--tokens", type=int, default=128, help="new tokens per request")
    parser.add_argument("--quantization", choices=["int8"], help="weights as int8 (jaxpage only)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--no-hf", dest="hf", action="store_false", help="requests: leave transformers out")
    parser.add_argument("--no-server", dest="server", action="store_false", help="requests: leave jaxpage serve out")
    parser.add_argument("--repeats", type=int, default=3, help="requests: each way; steps: runs of each program alone")
    parser.add_argument(
        "--async-scheduling",
        choices=["off", "on", "both"],
        default="both",
        help="steps: the engine's async_scheduling; both: an engine of each, one after the other, in this run",
    )
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    if not parts or parts - {"requests", "steps"}:
        parser.error(f"--parts: requests and/or steps, not {args.parts!r}")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    result = {}
    if "requests" in parts:
        result["requests"] = requests_part(args, [int(n) for n in args.prompt_lens.split(",")])
        for row in result["requests"]["rows"]:
            print(describe_request(row))
    if "steps" in parts:
        result["steps"] = steps_part(args, [int(b) for b in args.batch_sizes.split(",")])
        for row in result["steps"]["jaxpage"]:
            print(describe(row))
    print(json.dumps(result))


def requests_part(args, prompt_lens: list[int]) -> dict:
    """Each prompt length's request, timed whole by generate, the server and transformers (see the docstring)."""
    from jaxpage.benchmarks.request_latency import time_generate, time_hf_generate, time_server
    from jaxpage.benchmarks.workloads import corpus_text
    from jaxpage.entrypoints.llm import LLM
    from jaxpage.tokenizers.tokenizer import encode_prompt

    engine_args = dict(dtype=args.dtype)
    if args.quantization:
        engine_args["quantization"] = args.quantization
    llm = LLM(args.model, **engine_args)
    start = time.perf_counter()
    compiled = llm.engine.warmup()
    log(f"requests: warm-up: {len(compiled)} programs in {time.perf_counter() - start:.1f} s")
    tokenizer = llm.get_tokenizer()
    corpus = list(tokenizer(corpus_text()).input_ids)
    # Per length, 3 x repeats distinct windows of the corpus (text, its token ids): generate's and its stream's, then
    # the server's; transformers gets generate's token ids.
    prompts = {}
    for n in prompt_lens:
        texts = [tokenizer.decode(corpus[i * n : (i + 1) * n]) for i in range(3 * args.repeats)]
        prompts[n] = [(text, encode_prompt(tokenizer, text)) for text in texts]
    from jaxpage.sampling_params import SamplingParams

    llm.generate(tokenizer.decode(corpus[-64:]), SamplingParams(max_tokens=8))  # a user's engine has run a request
    rows = []
    for n, windows in prompts.items():
        texts = [text for text, _ in windows]
        row = dict(prompt_len=n, prompt_tokens=[len(ids) for _, ids in windows])
        row["generate"] = time_generate(llm, texts[: 2 * args.repeats], args.tokens)
        log(f"requests: generate, {n}-token prompt: {row['generate']}")
        rows.append(row)
    del llm
    if args.server:
        from jaxpage.benchmarks.live_server import free_port, start_server

        port = free_port()
        log("requests: jaxpage serve starting (warm-up untimed)")
        server = start_server(args.model, engine_args, port)
        try:
            for row, windows in zip(rows, prompts.values(), strict=True):
                texts = [text for text, _ in windows[2 * args.repeats :]]
                row["serve"] = time_server(f"http://127.0.0.1:{port}", texts, args.tokens)
                log(f"requests: serve, {row['prompt_len']}-token prompt: {row['serve']}")
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=120)
    if args.hf:
        from jaxpage.benchmarks.hf_baselines import hf_source, load_hf_baseline

        hf = load_hf_baseline(hf_source(args.model))
        time_hf_generate(hf, [prompts[prompt_lens[0]][0][1]], 4)  # its first call's one-time work, untimed
        for row, windows in zip(rows, prompts.values(), strict=True):
            row["hf"] = time_hf_generate(hf, [ids for _, ids in windows[: args.repeats]], args.tokens)
            row["generate_over_hf"] = row["hf"]["request_s"] / row["generate"]["request_s"]
            log(f"requests: hf, {row['prompt_len']}-token prompt: {row['hf']}")
    return {"engine_args": engine_args, "tokens": args.tokens, "rows": rows}


def describe_request(row: dict) -> str:
    parts = []
    for side in ("generate", "serve", "hf"):
        if side in row:
            s = row[side]
            parts.append(
                f"{side} {s['request_s']:.3f} s ({s['tokens_per_s']:.1f} tokens/s, TTFT {1e3 * s['ttft_s']:.0f} ms, "
                f"ITL {1e3 * s['itl_s']:.1f} ms)"
            )
    ratio = f"; generate {row['generate_over_hf']:.2f}x hf" if "generate_over_hf" in row else ""
    return f"request, {row['prompt_len']}-token prompt: " + "; ".join(parts) + ratio


def steps_part(args, sizes: list[int]) -> dict:
    """Each batch size's decode steps, split as the engine times them (see the docstring)."""
    from jaxpage.entrypoints.llm import LLM

    engine_args = dict(dtype=args.dtype, max_num_seqs=max(sizes), max_model_len=PROMPT_LEN + args.tokens + 16)
    if args.quantization:
        engine_args["quantization"] = args.quantization
    rows = []
    for mode in ("off", "on") if args.async_scheduling == "both" else (args.async_scheduling,):
        mode_args = dict(engine_args, async_scheduling=mode == "on")
        llm = LLM(args.model, **mode_args)
        start = time.perf_counter()
        compiled = llm.engine.warmup()
        log(f"async_scheduling {mode}: warm-up: {len(compiled)} programs in {time.perf_counter() - start:.1f} s")
        rows += [dict(measure(llm.engine, batch, args.tokens, args.repeats), async_scheduling=mode) for batch in sizes]
        del llm
    return {"jaxpage": rows, "engine_args": engine_args}


def measure(engine, batch: int, tokens: int, repeats: int) -> dict:
    """One run of `batch` requests: the medians of its decode steps' parts and of its programs timed alone."""
    from jaxpage.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for i in range(batch):
        prompt = [(37 * i + j) % 1000 + 10 for j in range(PROMPT_LEN)]
        engine.add_request(f"{batch}-{i}", {"prompt_token_ids": prompt}, params)
    detokenize = _timed_detokenization(engine)
    steps, walls, last_step = [], [], None
    runner = engine.runner
    captured = _capture_step_inputs(runner)
    added, first_token_s, prefill = time.perf_counter(), None, []
    while engine.has_unfinished_requests():
        detokenize.clear()
        start = time.perf_counter()
        outputs = engine.step()
        wall = time.perf_counter() - start
        stats = engine.last_step_stats
        if first_token_s is None and stats is not None:  # asynchronous: the first step's stats come a call later
            prefill.append((wall, stats))
            if any(o.outputs[0].token_ids for o in outputs):
                first_token_s = time.perf_counter() - added
        if stats is not None and stats.num_decodes == stats.num_seqs == batch:
            steps.append((stats, sum(detokenize)))
            walls.append(wall)
            last_step = captured[-1]
    runner._run_step = captured.original
    forward_s, sampler_s = _programs_alone(runner, *last_step, repeats)
    median = statistics.median
    schedule = median(s.schedule_s for s, _ in steps)
    prepare = median(s.prepare_s for s, _ in steps)
    device = median(s.device_s for s, _ in steps)
    postprocess = median(s.postprocess_s for s, _ in steps)
    wall = median(walls)
    row = dict(
        batch=batch, shape=steps[-1][0].shape, decode_steps=len(steps), step_ms=1e3 * wall,
        schedule_ms=1e3 * schedule, prepare_ms=1e3 * prepare, device_ms=1e3 * device,
        postprocess_ms=1e3 * postprocess, detokenize_ms=1e3 * median(d for _, d in steps),
        forward_alone_ms=1e3 * forward_s, sampler_alone_ms=1e3 * sampler_s,
        idle_gap_ms=1e3 * (device - forward_s - sampler_s),
        host_share=(schedule + prepare + postprocess) / wall,
        decode_tokens_per_s=batch / wall,
        ttft_ms=1e3 * first_token_s, prefill_steps=[str(stats.shape) for _, stats in prefill],
        prefill_forward_and_sampler_ms=1e3 * sum(stats.device_s for _, stats in prefill),
    )  # fmt: skip
    return row


class _Captured(list):
    original = None


def _capture_step_inputs(runner) -> _Captured:
    """Keeps the (shape, step, sample input, level) of every step the runner launches (the last one is timed
    alone after the run)."""
    captured = _Captured()
    captured.original = run_step = runner._run_step

    def capturing(shape, step, sample_input, level):
        captured[:] = [(shape, step, sample_input, level)]
        return run_step(shape, step, sample_input, level)

    runner._run_step = capturing
    return captured


def _programs_alone(runner, shape, step, sample_input, level, repeats: int) -> tuple[float, float]:
    """The forward pass and the sampler of a step, each run alone `repeats` times and waited for: median seconds."""
    import jax

    forward, sampler = runner._forward_program(shape), runner._sampler_program(shape, level)
    forward_s, sampler_s = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        hidden, _, runner.kv_cache = forward(runner.params, runner.kv_cache, step)
        jax.block_until_ready(hidden)
        forward_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        jax.block_until_ready(sampler(runner.params, hidden, sample_input))
        sampler_s.append(time.perf_counter() - start)
    return statistics.median(forward_s), statistics.median(sampler_s)


def _timed_detokenization(engine) -> list[float]:
    """Seconds spent in the detokenizers' `add` during the current step (cleared by the caller before each step)."""
    from jaxpage.tokenizers import tokenizer as module

    spent: list[float] = []
    cls = module.IncrementalDetokenizer
    if getattr(cls, "_bench_timed", False):
        return cls._bench_spent
    add = cls.add

    def timed_add(self, token):
        start = time.perf_counter()
        try:
            return add(self, token)
        finally:
            spent.append(time.perf_counter() - start)

    cls.add, cls._bench_timed, cls._bench_spent = timed_add, True, spent
    return spent


def describe(row: dict) -> str:
    return (
        f"async {row.get('async_scheduling', 'off'):>3}, batch {row['batch']:>3} {row['shape']}: "
        f"step {row['step_ms']:.1f} ms = schedule {row['schedule_ms']:.2f} "
        f"+ prepare {row['prepare_ms']:.2f} + device {row['device_ms']:.1f} (forward alone "
        f"{row['forward_alone_ms']:.1f}, sampler alone {row['sampler_alone_ms']:.1f}, gap {row['idle_gap_ms']:.1f}) "
        "+ postprocess "
        f"{row['postprocess_ms']:.2f} (detokenize {row['detokenize_ms']:.2f}); host {100 * row['host_share']:.1f}%; "
        f"{row['decode_tokens_per_s']:.1f} tokens/s; first token after {row['ttft_ms']:.1f} ms "
        f"(steps {', '.join(row['prefill_steps'])}: device {row['prefill_forward_and_sampler_ms']:.1f} ms)"
    )


if __name__ == "__main__":
    main()
