"""Structured outputs against free generation, in one run: tokens/s of a batch whose every request is JSON-schema
constrained and of the same batch unconstrained; host milliseconds per step spent on grammar masks; grammar compile
time; and whether every constrained output parses and validates against its schema.

    python scripts/bench_structured.py [--model SRC] [--num-requests 32] [--max-tokens 160] [--temperature 0]
        [--repeats 2] [--max-model-len 1024]

Requests cycle through the 24 tasks of jaxpage.benchmarks.json_schemas (a chat prompt and a JSON schema each). One
engine, warmed up first (untimed). A round runs the batch constrained (each request under its schema), then the same
prompts unconstrained with EOS ignored and max_tokens set to the length each constrained output had: the same
requests, the same tokens per request, the same batch sizes step by step; only the grammars differ. --repeats
rounds alternate which half runs first; a mode's tokens/s is its output tokens over the sum of its step seconds.
Host ms per step on masks: the mean difference of the steps' array-building time (StepStats.prepare_s, where the
bitmasks are filled), constrained minus unconstrained. Compile time: each schema compiled by a fresh compiler
(jaxpage.structured.grammar), cold. Validity: json.loads then jsonschema over every constrained output that ended
by itself (finish_reason "stop"); outputs cut by max_tokens are counted apart.
Progress goes to stderr; a table and, as the last line, one JSON object with every figure go to stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from jaxpage.benchmarks.json_schemas import SCHEMA_TASKS
from jaxpage.benchmarks.progress import log


def run_batch(engine, prompts: list[list[int]], params: list) -> tuple[list, float, list]:
    """(outputs in order, the sum of the step seconds, each step's StepStats) of one batch run to completion."""
    ids = [f"r{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for rid, prompt, p in zip(ids, prompts, params, strict=True):
        engine.add_request(rid, {"prompt_token_ids": prompt}, p)
    finished, seconds, stats = {}, 0.0, []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        seconds += time.perf_counter() - start
        if engine.last_step_stats is not None:
            stats.append(engine.last_step_stats)
    return [finished[rid] for rid in ids], seconds, stats


def validity(outputs: list, schemas: list[dict]) -> dict:
    """Counts of constrained outputs that ended by themselves and parse and validate, and of those cut by length."""
    import jsonschema

    valid, invalid, cut = 0, [], 0
    for out, schema in zip(outputs, schemas, strict=True):
        completion = out.outputs[0]
        if completion.finish_reason == "length":
            cut += 1
            continue
        try:
            jsonschema.validate(json.loads(completion.text), schema)
            valid += 1
        except (ValueError, jsonschema.ValidationError) as e:
            invalid.append((completion.text, f"{type(e).__name__}: {str(e)[:120]}"))
    return {"valid": valid, "invalid": len(invalid), "cut_by_max_tokens": cut, "invalid_examples": invalid[:3]}


def compile_seconds(tokenizer, vocab_size: int, eos: list[int]) -> dict:
    """Cold compile time of each schema (a fresh compiler; its tokenizer built first, timed apart)."""
    from jaxpage.sampling_params import StructuredOutputsParams
    from jaxpage.structured.grammar import GrammarCompiler

    compiler = GrammarCompiler(tokenizer, vocab_size, eos)
    start = time.perf_counter()
    compiler.tokenizer  # noqa: B018 (built on first use)
    tokenizer_s = time.perf_counter() - start
    seconds = []
    for task in SCHEMA_TASKS:
        start = time.perf_counter()
        compiler.matcher(StructuredOutputsParams(json=task.schema))
        seconds.append(time.perf_counter() - start)
    return {
        "tokenizer_s": round(tokenizer_s, 3),
        "schema_ms_mean": round(1e3 * statistics.mean(seconds), 2),
        "schema_ms_max": round(1e3 * max(seconds), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model source (default: the default model)")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-model-len", type=int, default=1024)
    args = parser.parse_args()

    from jaxpage import LLM, SamplingParams
    from jaxpage.sampling_params import StructuredOutputsParams
    from jaxpage.tokenizers.tokenizer import encode_chat

    llm = LLM(args.model, max_model_len=args.max_model_len, max_num_seqs=max(args.num_requests, 8))
    engine = llm.engine
    start = time.perf_counter()
    warmed = engine.warmup()
    log(f"warm-up: {len(warmed)} programs in {time.perf_counter() - start:.1f}s")
    for c in warmed:
        log(f"  {c}")
    tasks = [SCHEMA_TASKS[i % len(SCHEMA_TASKS)] for i in range(args.num_requests)]
    system = "Answer with a JSON object."
    prompts = [
        encode_chat(engine.tokenizer, [{"role": "system", "content": system}, {"role": "user", "content": t.prompt}])
        for t in tasks
    ]
    schemas = [t.schema for t in tasks]

    def constrained_params() -> list:
        return [
            SamplingParams(
                temperature=args.temperature,
                seed=i,
                max_tokens=args.max_tokens,
                structured_outputs=StructuredOutputsParams(json=schema),
            )
            for i, schema in enumerate(schemas)
        ]

    compiled_before = engine.runner.num_compilations
    figures = {"constrained": [0, 0.0, []], "unconstrained": [0, 0.0, []]}  # tokens, seconds, step stats
    checks = []
    lengths = None  # each request's output length under its schema (seeded: the same every round)
    for round_index in range(args.repeats):
        modes = ["constrained", "unconstrained"] if round_index % 2 == 0 else ["unconstrained", "constrained"]
        if lengths is None:
            modes = ["constrained", "unconstrained"]
        for mode in modes:
            if mode == "constrained":
                outputs, seconds, steps = run_batch(engine, prompts, constrained_params())
                lengths = [len(o.outputs[0].token_ids) for o in outputs]
                checks.append(validity(outputs, schemas))
            else:
                free = [
                    SamplingParams(temperature=args.temperature, seed=i, max_tokens=n, ignore_eos=True)
                    for i, n in enumerate(lengths)
                ]
                outputs, seconds, steps = run_batch(engine, prompts, free)
            figures[mode][0] += sum(len(o.outputs[0].token_ids) for o in outputs)
            figures[mode][1] += seconds
            figures[mode][2] += steps
            log(f"round {round_index + 1} {mode}: {figures[mode][0]} tokens so far, {seconds:.2f}s")
        log(f"round {round_index + 1}: {checks[-1]['valid']}/{len(schemas)} valid, {sum(lengths)} tokens")

    report = {
        "model": args.model or "default",
        "num_requests": args.num_requests,
        "temperature": args.temperature,
        "new_compilations_after_warmup": engine.runner.num_compilations - compiled_before,
    }
    for mode, (tokens, seconds, steps) in figures.items():
        report[f"{mode}_tokens_per_s"] = round(tokens / seconds, 1)
        report[f"{mode}_prepare_ms_per_step"] = round(1e3 * statistics.mean(s.prepare_s for s in steps), 3)
        report[f"{mode}_steps"] = len(steps)
    report["ratio"] = round(report["constrained_tokens_per_s"] / report["unconstrained_tokens_per_s"], 3)
    report["mask_host_ms_per_step"] = round(
        report["constrained_prepare_ms_per_step"] - report["unconstrained_prepare_ms_per_step"], 3
    )
    report["validity"] = checks
    report["compile"] = compile_seconds(
        engine.tokenizer, engine.model_config.vocab_size, sorted(engine.input_processor.eos_token_ids)
    )
    print(f"{'mode':<14}{'tokens/s':>10}{'prepare ms/step':>17}{'steps':>7}")
    for mode in figures:
        print(
            f"{mode:<14}{report[f'{mode}_tokens_per_s']:>10}{report[f'{mode}_prepare_ms_per_step']:>17}"
            f"{report[f'{mode}_steps']:>7}"
        )
    masks = report["mask_host_ms_per_step"]
    print(f"constrained / unconstrained: {report['ratio']}; masks on the host: {masks} ms/step")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
