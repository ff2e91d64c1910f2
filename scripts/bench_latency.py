"""Where a decode step's time goes, at batch 1, 4 and 64: the engine's own split of each step, and each device
program timed alone.

    python scripts/bench_latency.py [--model PATH] [--batch-sizes 1,4,64] [--tokens 128] [--quantization int8] [--hf]
        [--async-scheduling off|on|both]

Per batch size: that many requests of a 16-token prompt decode --tokens tokens each (greedy, ignore_eos), after a
warm-up that compiles every step shape. Every decode-only step of the run is split as the engine times it
(LLMEngine.last_step_stats): schedule, prepare (the step's arrays), device (dispatch until the sampled tokens are on
the host), postprocess (the scheduler's update, detokenization -- also reported alone -- stop checks, outputs). Then
the step's programs run again alone on its own inputs, each waited for: forward pass, sampler (LM head and sampling).
The idle gap is the device part of a step less those programs: dispatch, transfer, and time the device waits.
Reported per batch size: the medians in milliseconds, decode tokens/s, host time (schedule + prepare +
postprocess) as a share of the step, and the time to the first token (from adding the requests) beside the device
time of the steps before it (the prompts' prefill). --hf: transformers' float32 `generate` at batch 1 on the same
model, same run. Each of it with synchronous and asynchronous scheduling (an engine each, same run), unless
--async-scheduling says one; with asynchronous scheduling a step's parts overlap other steps' device time, and the
step time is the wall time between two outputs. Compiled shapes and compile seconds are printed as they compile. The
last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from jaxpage.benchmarks.progress import log

PROMPT_LEN = 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a .gguf file or HF directory (default: the default model)")
    parser.add_argument("--batch-sizes", default="1,4,64")
    parser.add_argument("--tokens", type=int, default=128, help="decode tokens per request")
    parser.add_argument("--quantization", choices=["int8"], help="weights as int8 (jaxpage only)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--hf", action="store_true", help="transformers' generate at batch 1 too")
    parser.add_argument("--repeats", type=int, default=5, help="runs of each program alone")
    parser.add_argument(
        "--async-scheduling",
        choices=["off", "on", "both"],
        default="both",
        help="the engine's async_scheduling; both: an engine of each, one after the other, in this run",
    )
    args = parser.parse_args()
    from jaxpage.entrypoints.llm import LLM

    sizes = [int(b) for b in args.batch_sizes.split(",")]
    engine_args = dict(dtype=args.dtype, max_num_seqs=max(sizes), max_model_len=PROMPT_LEN + args.tokens + 16)
    if args.quantization:
        engine_args["quantization"] = args.quantization
    rows = []
    for mode in ("off", "on") if args.async_scheduling == "both" else (args.async_scheduling,):
        mode_args = dict(engine_args, async_scheduling=mode == "on")
        llm = LLM(args.model, **mode_args) if args.model else LLM(**mode_args)
        start = time.perf_counter()
        compiled = llm.engine.warmup()
        log(f"async_scheduling {mode}: warm-up: {len(compiled)} programs in {time.perf_counter() - start:.1f} s")
        rows += [dict(measure(llm.engine, batch, args.tokens, args.repeats), async_scheduling=mode) for batch in sizes]
        del llm
    result = {"jaxpage": rows, "engine_args": engine_args}
    if args.hf:
        hf = result["hf_generate_batch1_tokens_per_s"] = hf_generate_tokens_per_s(args.model, args.tokens)
        for row in rows:
            if row["batch"] == 1:
                result[f"jaxpage_over_hf_batch1_async_{row['async_scheduling']}"] = row["decode_tokens_per_s"] / hf
    for row in rows:
        print(describe(row))
    if args.hf:
        print(f"HF generate, batch 1: {result['hf_generate_batch1_tokens_per_s']:.1f} tokens/s")
    print(json.dumps(result))


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


def hf_generate_tokens_per_s(model: str | None, tokens: int) -> float:
    """transformers' float32 generate, batch 1, greedy: tokens/s of its decode (a run of 1 token subtracted)."""
    import torch

    from jaxpage.benchmarks.hf_baselines import hf_source, load_hf_baseline

    hf = load_hf_baseline(hf_source(model))
    prompt = torch.tensor([[(j % 1000) + 10 for j in range(PROMPT_LEN)]])

    def run(n: int) -> float:
        start = time.perf_counter()
        with torch.no_grad():
            hf.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return time.perf_counter() - start

    run(4)  # warm
    return (tokens - 1) / (run(tokens) - run(1))


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
