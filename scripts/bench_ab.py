"""Same-run A/B of jaxpage's serving speed: a git revision (the baseline) against the working tree.

    python scripts/bench_ab.py --baseline REV [--candidate DIR] [--model SRC] [--num-requests 64] [--seed 0]
        [--steps-per-turn 3] [--max-num-batched-tokens 512] [--max-num-seqs 64] [--max-model-len 1024]

Two runs of scripts/bench_throughput.py one after the other differ by up to 10% on a shared 2-core machine, more
than most changes made for speed. Here both versions serve the same workload at the same time, in two worker
processes that take turns: --steps-per-turn engine steps of one, then of the other, until both are done. Whatever
slows the machine slows both alike, and each step of one has its twin in the other (the same sequences and
tokens, when the scheduler did not change between the two).

The baseline is checked out with `git worktree add` into a temporary directory (removed afterwards); the
candidate is this checkout (or --candidate DIR). Each worker imports its own jaxpage, builds
LLM(model, max_model_len, max_num_seqs, max_num_batched_tokens), runs engine.warmup() untimed, adds every request
of the workload (made as bench_throughput.py makes it: greedy, EOS ignored, exactly max_tokens each) and then times
each engine.step(). Printed: total step seconds of each, and by kind of step (decode-only steps by their number of
sequences, mixed steps by their number of tokens), with candidate / baseline ratios; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from jaxpage.benchmarks.progress import log
from jaxpage.benchmarks.workloads import make_workload, write_workload

ROOT = Path(__file__).resolve().parents[1]

WORKER = r"""
import json, sys, time
args = json.loads(sys.argv[1])
from jaxpage import LLM  # the name every revision has
from jaxpage.sampling_params import SamplingParams
engine = LLM(
    args["model"],
    max_model_len=args["max_model_len"],
    max_num_seqs=args["max_num_seqs"],
    max_num_batched_tokens=args["max_num_batched_tokens"],
).engine
engine.warmup()
for line in open(args["workload"]):
    row = json.loads(line)
    params = SamplingParams(temperature=0, max_tokens=row["max_tokens"], ignore_eos=True)
    engine.add_request(row["id"], {"prompt_token_ids": row["prompt_token_ids"]}, params)
print("ready", flush=True)
for line in sys.stdin:
    steps = []
    for _ in range(int(line)):
        if not engine.has_unfinished_requests():
            break
        start = time.perf_counter()
        engine.step()
        seconds = time.perf_counter() - start
        stats = engine.last_step_stats
        steps.append([seconds, stats.num_seqs, stats.num_tokens, stats.num_decodes])
    print(json.dumps(steps), flush=True)
"""

DECODE_SIZES = (4, 8, 16, 32, 64, 128, 256)
MIXED_SIZES = (128, 256, 512, 1024, 2048, 4096, 8192)


def step_kind(num_seqs: int, num_tokens: int, num_decodes: int) -> tuple[bool, int]:
    """A class of steps to compare: (mixed, size): decode-only steps by sequences, mixed ones by tokens, each
    rounded up to a power of two (or "more" past the table)."""
    if num_decodes == num_seqs:
        return False, next((s for s in DECODE_SIZES if s >= num_seqs), DECODE_SIZES[-1] + 1)
    return True, next((s for s in MIXED_SIZES if s >= num_tokens), MIXED_SIZES[-1] + 1)


def kind_label(kind: tuple[bool, int]) -> str:
    mixed, size = kind
    return f"mixed <= {size} tokens" if mixed else f"decode <= {size} seqs"


class Worker:
    def __init__(self, name: str, root: Path, args: dict):
        self.name = name
        env = dict(os.environ, PYTHONPATH=str(root))
        self.log = tempfile.TemporaryFile("w+")  # the worker's stderr (its logs), shown if it fails
        self.process = subprocess.Popen(
            [sys.executable, "-c", WORKER, json.dumps(args)],
            cwd=root,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )
        self.steps: list[list] = []
        self.done = False
        if self.process.stdout.readline().strip() != "ready":
            self.fail("failed to start")

    def fail(self, what: str) -> None:
        self.process.kill()
        self.log.seek(0)
        raise SystemExit(f"{self.name} ({self.process.args[-1]}): the worker {what}:\n{self.log.read()[-3000:]}")

    def take_turn(self, num_steps: int) -> None:
        self.process.stdin.write(f"{num_steps}\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            self.fail("stopped")
        steps = json.loads(line)
        self.steps += steps
        self.done = len(steps) < num_steps

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)


def compare(baseline: list[list], candidate: list[list]) -> dict:
    """Seconds by kind of step for both, and whether both ran the same steps."""
    kinds = collections.defaultdict(lambda: {"baseline_s": 0.0, "candidate_s": 0.0, "steps": 0})
    for name, steps in (("baseline_s", baseline), ("candidate_s", candidate)):
        for seconds, *stats in steps:
            kinds[step_kind(*stats)][name] += seconds
            kinds[step_kind(*stats)]["steps"] += name == "candidate_s"
    by_kind = {}
    for kind, figures in sorted(kinds.items()):
        if figures["baseline_s"] > 0:
            ratio = figures["candidate_s"] / figures["baseline_s"]
            by_kind[kind_label(kind)] = {**{k: round(v, 2) for k, v in figures.items()}, "ratio": round(ratio, 3)}
    total_b, total_c = sum(s[0] for s in baseline), sum(s[0] for s in candidate)
    return {
        "same_steps": [s[1:] for s in baseline] == [s[1:] for s in candidate],
        "baseline_steps": len(baseline),
        "candidate_steps": len(candidate),
        "baseline_s": round(total_b, 2),
        "candidate_s": round(total_c, 2),
        "candidate_over_baseline": round(total_c / total_b, 4),
        "by_kind": by_kind,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="a git revision of this repository")
    parser.add_argument("--candidate", type=Path, default=ROOT, help="a jaxpage checkout (default: this one)")
    parser.add_argument("--model", help="HF directory or .gguf file (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps-per-turn", type=int, default=3)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=1024)
    args = parser.parse_args()
    if args.steps_per_turn < 1:
        parser.error("--steps-per-turn must be at least 1")
    if not (args.candidate / "jaxpage" / "__init__.py").is_file():
        parser.error(f"--candidate {args.candidate} is not a jaxpage checkout (no jaxpage/__init__.py)")

    from jaxpage.tokenizers.tokenizer import load_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        rows = make_workload(load_tokenizer(args.model), args.num_requests, args.seed)
        write_workload(rows, tmp / "workload.jsonl")
        baseline_root = tmp / "baseline"
        checkout = subprocess.run(
            ["git", "worktree", "add", "--detach", str(baseline_root), args.baseline],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        if checkout.returncode != 0:
            raise SystemExit(f"cannot check out --baseline {args.baseline}: {checkout.stderr.strip()}")
        try:
            worker_args = {
                "model": args.model,
                "workload": str(tmp / "workload.jsonl"),
                "max_model_len": args.max_model_len,
                "max_num_seqs": args.max_num_seqs,
                "max_num_batched_tokens": args.max_num_batched_tokens,
            }
            log(f"starting and warming up both versions ({len(rows)} requests)")
            workers = [Worker("baseline", baseline_root, worker_args), Worker("candidate", args.candidate, worker_args)]
            while not all(w.done for w in workers):
                for worker in workers:
                    if not worker.done:
                        worker.take_turn(args.steps_per_turn)
                log(f"{len(workers[0].steps)} and {len(workers[1].steps)} steps")
            for worker in workers:
                worker.close()
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(baseline_root)], cwd=ROOT, capture_output=True)
    result = compare(workers[0].steps, workers[1].steps)
    result["baseline"] = args.baseline
    print(f"{'kind of step':28s} {'steps':>6s} {'baseline s':>11s} {'candidate s':>12s} {'ratio':>7s}")
    for kind, f in result["by_kind"].items():
        print(f"{kind:28s} {f['steps']:6d} {f['baseline_s']:11.2f} {f['candidate_s']:12.2f} {f['ratio']:7.3f}")
    print(
        f"{'all steps':28s} {result['candidate_steps']:6d} {result['baseline_s']:11.2f} {result['candidate_s']:12.2f} "
        f"{result['candidate_over_baseline']:7.3f}"
    )
    if not result["same_steps"]:
        print("the two versions scheduled different steps: compare the totals only")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
