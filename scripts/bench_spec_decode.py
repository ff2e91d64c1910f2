"""Speculative decoding against plain decoding, in one run: tokens/s on an input-grounded and an open-ended chat
workload, at batch 1 and batch 16.

    python scripts/bench_spec_decode.py [--model SRC] [--speculative-config JSON] [--max-tokens 128]
        [--batch1-requests 4] [--batch 16] [--temperature 0] [--max-model-len 2048]

Workloads (chat-formatted prompts, made here from the standard library's own source, no download):
  grounded  outputs that copy much of the prompt: add type hints to a Python function, fix the typos in a
            paragraph (typos put in at seeded random places), extract the sentences of a text that hold a word.
  chat      open-ended questions (explain, compare, write a story).
Two engines serve them in one process, with the same weights and arguments: `plain` (no speculation) and `spec`
(--speculative-config, n-gram prompt lookup by default). Each is warmed up first (untimed; its compiled step shapes
and seconds are printed). Batch 1: --batch1-requests requests, one at a time, each served by both engines in turn
(the order alternating), so that whatever slows the machine slows both alike. Batch --batch: that many requests
at once, plain then spec. Throughput is output tokens / wall seconds; speed-up is spec / plain. With the default
greedy sampling both engines must give the same tokens (checked, and printed as `identical`): speculative decoding
changes the speed, never the output. Per cell the speculative counters (drafts, draft tokens, accepted tokens,
acceptance rate, mean accepted length, acceptance per position) are printed. Progress goes to stderr; a table and,
as the last line, one JSON object with every figure go to stdout.
"""

from __future__ import annotations

import argparse
import inspect
import json
import time

import numpy as np

from jaxpage.benchmarks.progress import log

DEFAULT_SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'

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


def timed_generate(llm, prompts: list, params) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="anything load_model takes (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--speculative-config", default=DEFAULT_SPEC, help="JSON, vLLM's keys (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--batch1-requests", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--workloads", default="grounded,chat", help="comma-separated: grounded, chat")
    args = parser.parse_args()

    from jaxpage.llm import LLM
    from jaxpage.sampling_params import SamplingParams
    from jaxpage.spec_decode_stats import SpecDecodingStats
    from jaxpage.tokenizer import encode_chat

    common = dict(max_model_len=args.max_model_len, max_num_seqs=max(args.batch, 1))
    engines = {}
    compiled = {}
    for name, spec in (("plain", None), ("spec", args.speculative_config)):
        log(f"{name}: loading")
        llm = LLM(args.model, speculative_config=spec, **common)
        start = time.perf_counter()
        shapes = llm.engine.warmup()
        compiled[name] = {"seconds": round(time.perf_counter() - start, 2), "programs": [str(c) for c in shapes]}
        log(f"{name}: warm-up {compiled[name]['seconds']}s, {len(shapes)} programs")
        for c in shapes:
            log(f"{name}:   {c}")
        engines[name] = llm
    spec_config = engines["spec"].engine.config.speculative_config
    tokenizer = engines["plain"].get_tokenizer()
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=0)

    def encode(prompts: list[str]) -> list[dict]:
        return [{"prompt_token_ids": encode_chat(tokenizer, [{"role": "user", "content": p}])} for p in prompts]

    workloads = {"grounded": grounded_prompts, "chat": lambda n: chat_prompts(n)}
    cells = []
    for workload in args.workloads.split(","):
        make = workloads[workload]
        for batch in (1, args.batch):
            prompts = encode(make(args.batch1_requests if batch == 1 else batch))
            seconds = {"plain": 0.0, "spec": 0.0}
            tokens = {"plain": [], "spec": []}
            engines["spec"].engine.spec_decoding_stats = SpecDecodingStats(spec_config.num_speculative_tokens)
            groups = [[p] for p in prompts] if batch == 1 else [prompts]
            for i, group in enumerate(groups):
                for name in ("plain", "spec") if i % 2 == 0 else ("spec", "plain"):
                    s, out = timed_generate(engines[name], group, params)
                    seconds[name] += s
                    tokens[name] += out
            stats = engines["spec"].engine.spec_decoding_stats.as_dict()
            rate = {name: sum(map(len, tokens[name])) / seconds[name] for name in seconds}
            cell = {
                "workload": workload,
                "batch": batch,
                "requests": len(prompts),
                "prompt_tokens": sum(len(p["prompt_token_ids"]) for p in prompts),
                "output_tokens": {name: sum(map(len, tokens[name])) for name in tokens},
                "seconds": {name: round(s, 2) for name, s in seconds.items()},
                "tokens_per_s": {name: round(r, 2) for name, r in rate.items()},
                "speedup": round(rate["spec"] / rate["plain"], 3),
                "identical": tokens["plain"] == tokens["spec"],
                "spec_decoding": stats,
            }
            cells.append(cell)
            log(
                f"{workload} batch {batch}: plain {rate['plain']:.1f} tok/s, spec {rate['spec']:.1f} tok/s, "
                f"x{cell['speedup']:.2f}; acceptance {stats['acceptance_rate']}, drafts {stats['num_drafts']}"
            )

    print(f"speculative_config: {spec_config}")
    print(
        f"{'workload':10} {'batch':>5} {'plain tok/s':>12} {'spec tok/s':>11} {'speed-up':>9} {'accept':>7} "
        f"{'mean len':>8} {'identical':>9}"
    )
    for c in cells:
        s = c["spec_decoding"]
        accept = f"{s['acceptance_rate']:.2f}" if s["acceptance_rate"] is not None else "-"
        mean = f"{s['mean_accepted_length']:.2f}" if s["mean_accepted_length"] is not None else "-"
        print(
            f"{c['workload']:10} {c['batch']:>5} {c['tokens_per_s']['plain']:>12.2f} "
            f"{c['tokens_per_s']['spec']:>11.2f} "
            f"{c['speedup']:>9.3f} {accept:>7} {mean:>8} {str(c['identical']):>9}"
        )
    print(json.dumps({"speculative_config": str(spec_config), "compiled": compiled, "cells": cells}))


if __name__ == "__main__":
    main()
