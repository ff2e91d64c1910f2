"""Speculative decoding against plain decoding, in one run: tokens/s on an input-grounded and an open-ended chat
workload, at batch 1 and batch 16.

    python scripts/bench_spec_decode.py [--model SRC] [--speculative-config JSON] [--draft-layers N]
        [--max-tokens 128] [--batch1-requests 4] [--batch 16] [--temperature 0] [--max-model-len 2048]
        [--repeats 2] [--workloads grounded,chat] [--runs 1]

Workloads (chat-formatted prompts, made here from the standard library's own source, no download):
  grounded  outputs that copy much of the prompt: add type hints to a Python function, fix the typos in a
            paragraph (typos put in at seeded random places), extract the sentences of a text that hold a word.
  chat      open-ended questions (explain, compare, write a story).
Engines serve them in one process, with the same weights and arguments: `plain` (no speculation), `spec`
(--speculative-config, n-gram prompt lookup by default) and, with --draft-layers N, `draft`: the draft-model method
with a draft made of the target's first N layers (its final norm and LM head kept: an early exit of the same model,
so that it shares the tokenizer), written as a jaxpage checkpoint into a temporary directory. Each engine is warmed
up first (untimed; its compiled programs and seconds are printed). Batch 1: --batch1-requests requests, one at a
time; batch --batch: that many requests at once, --repeats times. Every engine serves the same requests at the same
time, the engines taking turns one engine.step() each, so that whatever slows this (noisy, shared) machine slows
all alike: separate runs of the same engine differ by 10-20% here. An engine's seconds are the sum of its own
steps; throughput is output tokens / those seconds, speed-up an engine's over plain's. With the default greedy
sampling every engine must give the same tokens (checked, and printed as `identical`): speculative decoding changes
the speed, never the output. Per cell the speculative counters (drafts, draft tokens, accepted tokens, acceptance
rate, mean accepted length, acceptance per position) are printed.
Per cell, too, the speculation policy's state (jaxpage.spec_decode.policy: whether it speculates, its turns on and
off, its probes). --batch 1 leaves out the batched cells. --runs N: N consecutive runs, each with engines made afresh
(a fresh policy, as a new process has: what a user who starts the engine again gets), then each run's speed-ups.
Progress goes to stderr; a table per run and, as the last line, one JSON object with every figure go to stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import time

import numpy as np

from jaxpage.benchmarks.progress import log
from jaxpage.benchmarks.turns import serve_in_turns

DEFAULT_SPEC = '{"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4, "prompt_lookup_min": 1}'

# Short standard-library functions to edit, and module docstrings to correct or quote from.
FUNCTIONS = (
    "textwrap.indent",
    "string.capwords",
    "statistics.median",
    "heapq.nlargest",
    "json.dumps",
    "fnmatch.fnmatch",
    "shlex.quote",
    "os.path.splitext",
)
TEXTS = ("argparse", "json", "csv", "heapq", "difflib", "logging", "textwrap", "fractions")
QUESTIONS = (
    "Why do leaves change color in the autumn?",
    "Write a short story about a robot who learns to paint.",
    "What are the pros and cons of working from home?",
    "Explain how a bicycle stays upright.",
    "Give me some ideas for a rainy weekend.",
    "How does a refrigerator keep food cold?",
    "Describe a day in the life of a lighthouse keeper.",
    "What makes a good friend?",
    "Why is the ocean salty?",
    "Write a poem about the first snow of winter.",
    "How do airplanes fly?",
    "What should I know before adopting a cat?",
    "Explain the water cycle to a child.",
    "What is the best way to learn a new language?",
    "Tell me about the history of bread.",
    "Why do we dream?",
)


def _resolve(dotted: str):
    import importlib

    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _paragraph(module_name: str, max_chars: int = 700) -> str:
    import importlib

    doc = inspect.getdoc(importlib.import_module(module_name)) or module_name
    text = " ".join(doc.split())
    return text[:max_chars].rsplit(" ", 1)[0]


def _with_typos(text: str, rng: np.random.Generator, rate: float = 0.04) -> str:
    """Swaps two neighbouring letters in about `rate` of the words."""
    words = text.split(" ")
    for i, word in enumerate(words):
        if len(word) > 3 and word.isalpha() and rng.random() < rate * 4:
            j = int(rng.integers(0, len(word) - 1))
            words[i] = word[:j] + word[j + 1] + word[j] + word[j + 2 :]
    return " ".join(words)


def grounded_prompts(count: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    prompts = []
    for i in range(count):
        task = i % 3
        if task == 0:
            code = inspect.getsource(_resolve(FUNCTIONS[(i // 3) % len(FUNCTIONS)]))
            prompts.append(f"Add type hints to this Python function. Reply with the whole function only.\n\n{code}")
        elif task == 1:
            text = _with_typos(_paragraph(TEXTS[(i // 3) % len(TEXTS)]), rng)
            prompts.append(f"Fix the typos in the following text. Reply with the corrected text only.\n\n{text}")
        else:
            text = _paragraph(TEXTS[(i // 3 + 3) % len(TEXTS)], 1200)
            prompts.append(f"Quote, word for word, every sentence of this text that contains the word 'the'.\n\n{text}")
    return prompts


def chat_prompts(count: int) -> list[str]:
    return [QUESTIONS[i % len(QUESTIONS)] for i in range(count)]


def write_early_exit_draft(model: str | None, num_layers: int) -> str:
    """A draft model made of the first num_layers layers of `model` (with its final norm and LM head), saved as a
    jaxpage checkpoint (with the tokenizer) in a temporary directory; returns the directory."""
    import tempfile

    import jax

    from jaxpage.models import load_model
    from jaxpage.models.orbax_checkpoint import save_checkpoint
    from jaxpage.tokenizers.tokenizer import load_tokenizer

    config, params = load_model(model)
    if not 1 <= num_layers < config.num_layers:
        raise SystemExit(f"--draft-layers must be in [1, {config.num_layers})")
    params = dict(params, layers=jax.tree.map(lambda x: x[:num_layers], params["layers"]))
    directory = tempfile.mkdtemp(prefix="jaxpage-draft-")
    save_checkpoint(directory, dataclasses.replace(config, num_layers=num_layers), params)
    load_tokenizer(model).save_pretrained(directory)
    log(f"draft: the first {num_layers} of {config.num_layers} layers, written to {directory}")
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="anything load_model takes (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--speculative-config", default=DEFAULT_SPEC, help="JSON, vLLM's keys (default: %(default)s)")
    parser.add_argument("--draft-layers", type=int, default=0, help="add a draft-model engine (0: none)")
    parser.add_argument("--num-draft-tokens", type=int, default=3, help="k of the draft-model engine")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--batch1-requests", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16, help="the batched cells' batch (1: no batched cells)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each batch cell by each engine")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--workloads", default="grounded,chat", help="comma-separated: grounded, chat")
    parser.add_argument("--runs", type=int, default=1, help="consecutive runs, each with fresh engines")
    args = parser.parse_args()

    configs = {"plain": None, "spec": args.speculative_config}
    if args.draft_layers:
        draft_dir = write_early_exit_draft(args.model, args.draft_layers)
        configs["draft"] = {
            "method": "draft_model",
            "model": draft_dir,
            "num_speculative_tokens": args.num_draft_tokens,
        }
    runs = []
    for run in range(args.runs):
        if args.runs > 1:
            log(f"run {run + 1} of {args.runs}")
        runs.append(run_once(args, configs))
    if args.runs > 1:
        print("speed-up by run (identical greedy output: y/n)")
        for i, result in enumerate(runs):
            figures = [
                f"{c['workload']} batch {c['batch']} {name} x{x:.2f} {'y' if c['identical'][name] else 'n'}"
                for c in result["cells"]
                for name, x in c["speedup"].items()
            ]
            print(f"run {i + 1}: " + "; ".join(figures))
    print(json.dumps(runs[0] if args.runs == 1 else {"runs": runs}))


def run_once(args, configs: dict) -> dict:
    """Engines made afresh serve every cell; prints the table, returns every figure."""
    from jaxpage.entrypoints.llm import LLM
    from jaxpage.sampling_params import SamplingParams
    from jaxpage.tokenizers.tokenizer import encode_chat

    common = dict(max_model_len=args.max_model_len, max_num_seqs=max(args.batch, 1))
    engines = {}
    compiled = {}
    for name, spec in configs.items():
        log(f"{name}: loading")
        llm = LLM(args.model, speculative_config=spec, **common)
        start = time.perf_counter()
        shapes = llm.engine.warmup()
        compiled[name] = {"seconds": round(time.perf_counter() - start, 2), "programs": [str(c) for c in shapes]}
        log(f"{name}: warm-up {compiled[name]['seconds']}s, {len(shapes)} programs")
        for c in shapes:
            log(f"{name}:   {c}")
        engines[name] = llm
    tokenizer = engines["plain"].get_tokenizer()
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=0)

    def encode(prompts: list[str]) -> list[dict]:
        return [{"prompt_token_ids": encode_chat(tokenizer, [{"role": "user", "content": p}])} for p in prompts]

    workloads = {"grounded": grounded_prompts, "chat": lambda n: chat_prompts(n)}
    cells = []
    for workload in args.workloads.split(","):
        make = workloads[workload]
        for batch in sorted({1, args.batch}):
            prompts = encode(make(args.batch1_requests if batch == 1 else batch))
            names = list(engines)
            seconds = dict.fromkeys(names, 0.0)
            tokens = {name: [] for name in names}
            before = {name: engines[name].engine.spec_decoding_stats for name in names}
            before = {name: stats.copy() for name, stats in before.items() if stats is not None}
            groups = [[p] for p in prompts] if batch == 1 else [prompts] * args.repeats
            for i, group in enumerate(groups):
                step_seconds, outputs = serve_in_turns(engines, group, params, f"{workload}-{batch}-{i}")
                for name in names:
                    seconds[name] += step_seconds[name]
                    tokens[name] += outputs[name]
            rate = {name: sum(map(len, tokens[name])) / seconds[name] for name in names}
            cell = {
                "workload": workload,
                "batch": batch,
                "requests": len(prompts),
                "prompt_tokens": sum(len(p["prompt_token_ids"]) for p in prompts),
                "output_tokens": {name: sum(map(len, tokens[name])) for name in names},
                "seconds": {name: round(s, 2) for name, s in seconds.items()},
                "tokens_per_s": {name: round(r, 2) for name, r in rate.items()},
                "speedup": {name: round(rate[name] / rate["plain"], 3) for name in names if name != "plain"},
                "identical": {name: tokens[name] == tokens["plain"] for name in names if name != "plain"},
                "spec_decoding": {
                    name: engines[name].engine.spec_decoding_stats.since(stats).as_dict()
                    for name, stats in before.items()
                },
                "policy": {name: dataclasses.asdict(engines[name].engine.spec_decoding_policy) for name in before},
            }
            cells.append(cell)
            log(
                f"{workload} batch {batch}: "
                + ", ".join(f"{name} {rate[name]:.1f} tok/s" for name in names)
                + "; speed-up "
                + ", ".join(f"{name} x{x:.2f}" for name, x in cell["speedup"].items())
            )

    for name, spec in configs.items():
        if spec is not None:
            print(f"{name}: {engines[name].engine.config.speculative_config}")
    print(
        f"{'workload':10} {'batch':>5} {'engine':>6} {'tok/s':>8} {'speed-up':>9} {'accept':>7} {'mean len':>8} "
        f"{'identical':>9}"
    )
    for c in cells:
        for name in engines:
            if name == "plain":
                print(f"{c['workload']:10} {c['batch']:>5} {name:>6} {c['tokens_per_s'][name]:>8.2f}")
                continue
            s = c["spec_decoding"][name]
            accept = f"{s['acceptance_rate']:.2f}" if s["acceptance_rate"] is not None else "-"
            mean = f"{s['mean_accepted_length']:.2f}" if s["mean_accepted_length"] is not None else "-"
            print(
                f"{c['workload']:10} {c['batch']:>5} {name:>6} {c['tokens_per_s'][name]:>8.2f} "
                f"{c['speedup'][name]:>9.3f} {accept:>7} {mean:>8} {str(c['identical'][name]):>9}"
            )
    names = {name: str(engines[name].engine.config.speculative_config) for name in configs}
    for llm in engines.values():
        llm.engine.shutdown()
    return {"configs": names, "compiled": compiled, "cells": cells}


if __name__ == "__main__":
    main()
