"""Benchmark workloads: JSONL rows {"id", "prompt_token_ids", "max_tokens"}, made from a fixed text corpus (the
docstrings of standard-library modules), read, written and described."""

from __future__ import annotations

import importlib
import inspect
import json
import statistics
from pathlib import Path

# Standard-library modules whose docstrings make the prompt text: prose and code, in varied styles.
TEXT_MODULES = (
    "argparse",
    "collections",
    "json",
    "re",
    "textwrap",
    "pathlib",
    "functools",
    "itertools",
    "logging",
    "email.message",
    "http.client",
    "unittest",
    "datetime",
    "decimal",
    "fractions",
    "statistics",
    "string",
    "difflib",
    "heapq",
    "csv",
)


def corpus_text() -> str:
    """Docstrings of TEXT_MODULES and their public members, in a fixed order."""
    parts = []
    for name in TEXT_MODULES:
        module = importlib.import_module(name)
        parts.append(inspect.getdoc(module) or "")
        for member_name in sorted(vars(module)):
            if member_name.startswith("_"):
                continue
            doc = inspect.getdoc(getattr(module, member_name))
            if doc and len(doc) > 40:
                parts.append(doc)
    return "\n\n".join(parts)


def make_workload(tokenizer, num_requests: int, seed: int, prompt_lens=(16, 512), max_tokens=(16, 256)) -> list[dict]:
    """Mixed-length requests whose prompts are windows of the tokenized corpus at seeded random offsets."""
    import numpy as np

    corpus = list(tokenizer(corpus_text()).input_ids)
    if len(corpus) < 2 * prompt_lens[1]:
        raise SystemExit(f"the prompt corpus is only {len(corpus)} tokens")
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(num_requests):
        length = int(rng.integers(prompt_lens[0], prompt_lens[1] + 1))
        start = int(rng.integers(0, len(corpus) - length))
        rows.append(
            {
                "id": f"req-{i}",
                "prompt_token_ids": corpus[start : start + length],
                "max_tokens": int(rng.integers(max_tokens[0], max_tokens[1] + 1)),
            }
        )
    return rows


def read_workload(path: Path) -> list[dict]:
    """The rows of a workload file; ends the benchmark with a message when a row lacks a field or there are none."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for row in rows:
        if not {"id", "prompt_token_ids", "max_tokens"} <= set(row):
            raise SystemExit(f"{path}: a row lacks id, prompt_token_ids or max_tokens: {sorted(row)}")
        row["id"] = str(row["id"])
    if not rows:
        raise SystemExit(f"{path}: no rows")
    return rows


def write_workload(rows: list[dict], path: Path) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def describe(rows: list[dict]) -> dict:
    """Request count, token totals, prompt and output length ranges, and the longest request (prompt + output)."""
    prompts = [len(r["prompt_token_ids"]) for r in rows]
    outputs = [r["max_tokens"] for r in rows]
    return {
        "num_requests": len(rows),
        "prompt_tokens": sum(prompts),
        "output_tokens": sum(outputs),
        "prompt_len_min_mean_max": [min(prompts), round(statistics.mean(prompts), 1), max(prompts)],
        "max_tokens_min_mean_max": [min(outputs), round(statistics.mean(outputs), 1), max(outputs)],
        "longest_request": max(p + o for p, o in zip(prompts, outputs, strict=True)),
    }
