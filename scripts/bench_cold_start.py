"""Cold start to first token: process start, imports, weight loading, compilation, one greedy token.

    python scripts/bench_cold_start.py [--model SRC] [--max-tokens N]

Each start is a fresh process: without the compilation cache, then with an empty cache directory (it is filled),
then with that directory again (a second start: nothing to compile). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Prints the seconds since `start` (given by the parent, time.time() just before it started this process) at each
# stage, and jax's compilation cache hits and misses, as JSON.
ONE_START = """
import json, sys, time
start = float(sys.argv[1]); stages = {"python": time.time() - start}
import jax
from jaxpage.llm import LLM
from jaxpage.sampling_params import SamplingParams
stages["imports"] = time.time() - start
events = {}
jax.monitoring.register_event_listener(lambda event, **_: events.__setitem__(event, events.get(event, 0) + 1))
cache_dir = sys.argv[3] or None
llm = LLM(sys.argv[2] or None, compilation_cache_dir=cache_dir, max_num_seqs=1)
stages["engine_ready"] = time.time() - start
prompt = {"prompt_token_ids": llm.get_tokenizer().encode("The capital of France is")}
params = SamplingParams(temperature=0, max_tokens=int(sys.argv[4]), ignore_eos=True)
out = llm.generate(prompt, params)[0]
stages["first_token"] = out.metrics.first_token_time - start
stages["done"] = time.time() - start
cache = {k.rsplit("/", 1)[1]: v for k, v in events.items() if k.startswith("/jax/compilation_cache/cache_")}
print(json.dumps({**{k: round(v, 2) for k, v in stages.items()}, **cache}))
"""


def one_start(model: str, cache_dir: str, max_tokens: int) -> dict:
    start = time.time()
    cmd = [sys.executable, "-c", ONE_START, repr(start), model, cache_dir, str(max_tokens)]
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if result.returncode != 0:
        sys.exit(f"a start failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="", help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--max-tokens", type=int, default=1)
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as cache_dir:
        for name, directory in (("no_cache", ""), ("cache_cold", cache_dir), ("cache_warm", cache_dir)):
            results[name] = one_start(args.model, directory, args.max_tokens)
            r = results[name]
            print(
                f"{name:10s}: imports {r['imports']:5.1f}s  engine ready {r['engine_ready']:5.1f}s  "
                f"first token {r['first_token']:5.1f}s  (cache hits {r.get('cache_hits', 0)}, "
                f"misses {r.get('cache_misses', 0)})",
                flush=True,
            )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
