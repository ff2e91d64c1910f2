"""A batch job of N requests on the default model: requests/s, output tokens/s and the memory the job held.

    python scripts/bench_batch.py [--num-requests 1000] [--max-tokens 8..64] [--keep DIR]

The input mixes /v1/chat/completions (a question about a passage) and /v1/completions (a passage to continue),
passages cut at seeded random offsets of the benchmark corpus (standard-library docstrings), 20..120 words,
max_tokens uniform in the given range, greedy. `jaxpage batch` runs it in a child process, timed from start to
exit (so model loading and compilation count); the child's peak resident memory comes from getrusage. The last
line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from jaxpage.benchmarks.workloads import corpus_text

ROOT = Path(__file__).resolve().parents[1]


def make_input(path: Path, num_requests: int, max_tokens: tuple[int, int], seed: int = 0) -> None:
    words = corpus_text().split()
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(num_requests):
            start = rng.randrange(len(words) - 200)
            passage = " ".join(words[start : start + rng.randint(20, 120)])
            tokens = rng.randint(*max_tokens)
            if i % 2:
                body = {"messages": [{"role": "user", "content": f"Summarize in one sentence: {passage}"}]}
                body |= {"max_completion_tokens": tokens, "temperature": 0}
                url = "/v1/chat/completions"
            else:
                body, url = {"prompt": passage, "max_tokens": tokens, "temperature": 0}, "/v1/completions"
            f.write(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": url, "body": body}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--max-tokens", default="8..64", help="LO..HI, uniform per request")
    parser.add_argument("--keep", type=Path, help="write input.jsonl and output.jsonl here instead of a temp dir")
    args = parser.parse_args()
    lo, hi = (int(x) for x in args.max_tokens.split(".."))
    with tempfile.TemporaryDirectory() as tmp:
        directory = args.keep or Path(tmp)
        directory.mkdir(parents=True, exist_ok=True)
        input_path, output_path = directory / "input.jsonl", directory / "output.jsonl"
        make_input(input_path, args.num_requests, (lo, hi))
        output_path.unlink(missing_ok=True)
        start = time.perf_counter()
        cmd = [sys.executable, "-m", "jaxpage.entrypoints.cli", "batch", str(input_path), str(output_path), "--quiet"]
        result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        wall_s = time.perf_counter() - start
        if result.returncode != 0:
            sys.exit(f"jaxpage batch failed:\n{result.stderr[-3000:]}")
        records = [json.loads(line) for line in output_path.read_text().splitlines()]
    ok = [r for r in records if r["response"] and r["response"]["status_code"] == 200]
    completion = sum(r["response"]["body"]["usage"]["completion_tokens"] for r in ok)
    prompt = sum(r["response"]["body"]["usage"]["prompt_tokens"] for r in ok)
    peak_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # Linux: kilobytes
    report = {
        "requests": len(records),
        "succeeded": len(ok),
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "wall_s": round(wall_s, 1),
        "requests_per_s": round(len(records) / wall_s, 2),
        "completion_tokens_per_s": round(completion / wall_s, 1),
        "peak_rss_gib": round(peak_rss / 2**30, 2),
        "jaxpage_summary": result.stderr.strip().splitlines()[-1],
    }
    print(
        f"{report['requests']} requests ({report['succeeded']} ok) in {wall_s:.0f}s, load and compilation included: "
        f"{report['requests_per_s']} requests/s, {report['completion_tokens_per_s']} completion tokens/s; peak "
        f"resident memory {report['peak_rss_gib']} GiB"
    )
    print(json.dumps(report))


if __name__ == "__main__":
    main()
