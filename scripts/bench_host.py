"""The engine's host work per step, alone: scheduling, the step's arrays, and the outputs (appending tokens,
detokenizing, stop checks, logprobs), with the device's work stubbed out.

    python scripts/bench_host.py [--batches 1,64,256,1024] [--steps 100] [--max-tokens 96] [--variants ...]
        [--profile-batch 256] [--profile-top 8] [--profile-variant stream]

The engine is the real LLMEngine over a 2-layer model of the default model's shape at its ends (its full 49,152-token
vocabulary and its tokenizer, random weights: load_format="dummy"), with the model runner's step replaced by a stub
that returns, for each sampling row, a token drawn from a fixed English corpus (never EOS) and, where asked, random
log-probs: so every figure is host time, what the engine would spend beside a real chip. Each batch size B keeps B
requests running (32-token prompts whose first 16 tokens every prompt shares, temperature 0.8, top_p 0.9,
--max-tokens each; the first B end at staggered lengths, each finished request is replaced at once), so each step
decodes about B sequences while a few prefills arrive, as in a server under load. After a warm-up of
--max-tokens / 2 steps, --steps steps are timed. Once each engine has started, the process's heap is frozen out of
the garbage collector's sight, as `jaxpage serve` and `jaxpage batch` do (jaxpage.entrypoints.startup_heap).

Variants (each a row per batch):
  final      the caller wants only each request's final output (LLM.generate's way: output_kind FINAL_ONLY)
  stream     the caller reads every request's output after every step (a server streaming to every client)
  stop       stream, and each request has two stop strings (that never occur)
  logprobs   stream, and each request asks for logprobs=5
  no-prefix  stream, with prefix caching off
  engine-process  stream as `jaxpage serve`'s engine process steps it: token ids alone (no detokenizers; outputs
             after a request's first as TokenDeltas), each step's outputs pickled as its turn is sent (counted: the
             engine process's work); the text is made in the server's process (jaxpage.engine.output_texts)

Per row: the phases' mean milliseconds per step from LLMEngine.last_step_stats (schedule, the step's arrays,
outputs = results into the sequences + detokenization, stop checks and RequestOutputs), the garbage collector's
milliseconds per step (gc.callbacks; they fall in any phase), the host's whole time per step (engine.step()'s wall
time less the stub's own), per sequence in microseconds, and the issue's target (5 us a sequence + 0.2 ms). `stream`
asks for RequestOutputKind.DELTA, what a server streaming to its clients takes. Then a profile (cProfile) of
--profile-batch's --profile-variant workload (default `stream`), run once more after the timed rows (a profile slows
what it watches), the top functions of each phase by their own time. The last line of stdout is one JSON object with
every figure.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import io
import json
import pickle
import pstats
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

VARIANTS = ("final", "stream", "stop", "logprobs", "no-prefix", "engine-process")
PROMPT_TOKENS, SHARED_PREFIX = 32, 16


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,64,256,1024")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--profile-batch", type=int, default=256, help="0: no profile")
    parser.add_argument("--profile-top", type=int, default=8)
    parser.add_argument("--profile-variant", default="stream", choices=[v for v in VARIANTS if v != "no-prefix"])
    args = parser.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    args.variants = args.variants.split(",")
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        parser.error(f"--variants: unknown {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    return args


class PhaseProfiles:
    """A cProfile per phase of the step, each enabled only while its phase's functions run."""

    PHASES = {
        "schedule": [("jaxpage.engine.scheduler", "Scheduler", "schedule")],
        "arrays": [("jaxpage.worker.step_inputs", "StepInputs", "prepare")],
        "outputs": [
            ("jaxpage.engine.step_pipeline", "StepPipeline", "update"),
            ("jaxpage.engine.output_processor", "OutputProcessor", "process"),
        ],
    }

    def __init__(self):
        self.profiles = {phase: cProfile.Profile() for phase in self.PHASES}
        self.enabled = False

    @contextlib.contextmanager
    def installed(self):
        import importlib

        originals = []
        for phase, targets in self.PHASES.items():
            for module_name, class_name, method in targets:
                cls = getattr(importlib.import_module(module_name), class_name)
                original = getattr(cls, method)
                originals.append((cls, method, original))
                setattr(cls, method, self._wrapped(phase, original))
        try:
            yield self
        finally:
            for cls, method, original in originals:
                setattr(cls, method, original)

    def _wrapped(self, phase: str, original):
        profile = self.profiles[phase]

        def wrapper(*args, **kwargs):
            if not self.enabled:
                return original(*args, **kwargs)
            profile.enable()
            try:
                return original(*args, **kwargs)
            finally:
                profile.disable()

        return wrapper

    def report(self, top: int) -> dict[str, list[dict]]:
        """Per phase: its `top` functions by their own time: (function, calls, own ms, cumulative ms)."""
        report = {}
        for phase, profile in self.profiles.items():
            stats = pstats.Stats(profile, stream=io.StringIO())
            rows = sorted(stats.stats.items(), key=lambda item: -item[1][2])[:top]
            report[phase] = [
                {
                    "function": f"{Path(file).name}:{line}({name})",
                    "calls": calls,
                    "own_ms": round(own * 1e3, 2),
                    "cumulative_ms": round(cumulative * 1e3, 2),
                }
                for (file, line, name), (_, calls, own, cumulative, _) in rows
            ]
        return report


def make_engine(batch: int, max_tokens: int, prefix_caching: bool, model_dir: str, tokenizer: str):
    from jaxpage.config import EngineConfig
    from jaxpage.engine.llm_engine import LLMEngine

    config = EngineConfig(
        model=model_dir,
        tokenizer=tokenizer,
        load_format="dummy",
        max_num_seqs=batch,
        max_num_batched_tokens=batch + 8 * PROMPT_TOKENS,
        max_model_len=PROMPT_TOKENS + max_tokens + 16,
        num_pages=batch * ((PROMPT_TOKENS + max_tokens) // 16 + 2) + 64,
        enable_prefix_caching=prefix_caching,
        compilation_cache_dir=None,
    )
    return LLMEngine(config)


class GarbageCollections:
    """Seconds the cyclic garbage collector ran, and its runs, while `counting` (gc.callbacks)."""

    def __init__(self):
        self.seconds, self.runs, self.counting, self._start = 0.0, 0, False, None
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self.counting and self._start is not None:
            self.seconds += time.perf_counter() - self._start
            self.runs += 1


def run_row(engine, stub, corpus, batch: int, variant: str, steps: int, max_tokens: int, profiles=None) -> dict:
    """Keeps `batch` requests running through the engine; times `steps` steps after a warm-up."""
    from jaxpage.outputs import RequestOutput
    from jaxpage.sampling_params import RequestOutputKind, SamplingParams

    rng = np.random.default_rng(1)
    shared = corpus[:SHARED_PREFIX].tolist()
    kind = RequestOutputKind.FINAL_ONLY if variant == "final" else RequestOutputKind.DELTA
    extra = {"stop": ["\n\n\n\n\n", "<|never|>"]} if variant == "stop" else {}
    extra |= {"logprobs": 5} if variant == "logprobs" else {}
    serial = iter(range(10**9))

    def add(length: int) -> None:
        start = int(rng.integers(SHARED_PREFIX, len(corpus) - PROMPT_TOKENS))
        prompt = shared + corpus[start : start + PROMPT_TOKENS - SHARED_PREFIX].tolist()
        params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=length, output_kind=kind, **extra)
        request = engine.prepare_request(f"{variant}-{next(serial)}", {"prompt_token_ids": prompt}, params)
        if variant == "engine-process":  # as jaxpage.entrypoints.engine_process makes it its own
            request.detokenizers = [None] * len(request.seqs)
            request.token_deltas = True
        engine.add_prepared_requests([request])

    for i in range(batch):  # staggered ends, so that a few requests arrive at every step from the start
        add(1 + (i * max_tokens) // batch)
    warmup = max_tokens // 2
    phases = {"schedule": [], "arrays": [], "outputs": []}
    host, stub_s, seqs, consumed = [], [], [], 0
    collections = GarbageCollections()
    for index in range(warmup + steps):
        timed = index >= warmup
        collections.counting = timed
        if profiles is not None:
            profiles.enabled = timed
        stub_before = stub.seconds
        start = time.perf_counter()
        outputs = engine.step()
        if variant == "engine-process":  # its turn pickled, as the engine process sends it (under the same GIL)
            pickle.dumps(outputs, protocol=pickle.HIGHEST_PROTOCOL)
        wall = time.perf_counter() - start
        if profiles is not None:
            profiles.enabled = False
        finished = 0
        for output in outputs:  # the caller: what it reads
            if not isinstance(output, RequestOutput):  # a TokenDelta or StepTokens (engine-process): never a last one
                continue
            consumed += len(output.outputs[0].text)
            finished += output.finished
        for _ in range(finished):
            add(max_tokens)
        stats = engine.last_step_stats
        if timed and stats is not None:
            phases["schedule"].append(stats.schedule_s)
            phases["arrays"].append(stats.prepare_s)
            phases["outputs"].append(stats.postprocess_s)
            host.append(wall - (stub.seconds - stub_before))
            stub_s.append(stub.seconds - stub_before)
            seqs.append(stats.num_seqs)
    collections.counting = False
    engine.abort_request([rid for rid in list(engine.output_processor.requests)])
    engine.step()
    mean_seqs = statistics.mean(seqs)
    host_ms = statistics.mean(host) * 1e3
    target_ms = 0.005 * mean_seqs + 0.2
    return {
        "batch": batch,
        "variant": variant,
        "seqs_per_step": round(mean_seqs, 1),
        **{f"{phase}_ms": round(statistics.mean(values) * 1e3, 3) for phase, values in phases.items()},
        "host_ms": round(host_ms, 3),
        "host_median_ms": round(statistics.median(host) * 1e3, 3),
        "per_seq_us": round(host_ms * 1e3 / mean_seqs, 2),
        "target_ms": round(target_ms, 3),
        "meets_target": host_ms <= target_ms,
        "stub_ms": round(statistics.mean(stub_s) * 1e3, 3),
        "gc_ms": round(collections.seconds * 1e3 / steps, 3),  # the garbage collector's share of host_ms
        "gc_runs_per_step": round(collections.runs / steps, 2),
        "text_chars_read": consumed,
    }


def main() -> None:
    args = parse_args()
    import jax

    from jaxpage.benchmarks.progress import log
    from jaxpage.benchmarks.stub_device import install_stub_device, write_tiny_full_vocab
    from jaxpage.entrypoints.startup_heap import freeze_startup_heap
    from jaxpage.models.default_model import default_model_path

    gguf = str(default_model_path())
    model_dir = write_tiny_full_vocab(tempfile.mkdtemp(prefix="jaxpage-bench-host-"))
    rows, profile_report = [], None
    for prefix_caching in (True, False):
        variants = [v for v in args.variants if (v == "no-prefix") != prefix_caching]
        if not variants:
            continue
        for batch in args.batches:
            log(f"batch {batch}, prefix caching {'on' if prefix_caching else 'off'}: {', '.join(variants)}")
            engine = make_engine(batch, args.max_tokens, prefix_caching, model_dir, gguf)
            freeze_startup_heap()  # as `jaxpage serve` and `jaxpage batch` do once their engine has started
            stub = install_stub_device(engine)
            corpus = stub.tokens
            for variant in variants:
                rows.append(run_row(engine, stub, corpus, batch, variant, args.steps, args.max_tokens))
                log(f"  {variant}: {rows[-1]['host_ms']} ms/step, {rows[-1]['per_seq_us']} us/seq")
            if prefix_caching and batch == args.profile_batch:  # again, profiled (a profile slows what it watches)
                profiles = PhaseProfiles()
                with profiles.installed():
                    run_row(engine, stub, corpus, batch, args.profile_variant, args.steps, args.max_tokens, profiles)
                profile_report = {"batch": batch, "variant": args.profile_variant, **profiles.report(args.profile_top)}
            del engine
    print(f"host work per step ({jax.default_backend()}, device stubbed; ms per step, mean of {args.steps} steps)\n")
    print(
        "| batch | variant | seqs/step | schedule | step arrays | outputs | GC (all phases) | host per step "
        "| per sequence | target |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in sorted(rows, key=lambda r: (r["batch"], VARIANTS.index(r["variant"]))):
        mark = "ok" if row["meets_target"] else "MISSED"
        print(
            f"| {row['batch']} | {row['variant']} | {row['seqs_per_step']} | {row['schedule_ms']:.3f} | "
            f"{row['arrays_ms']:.3f} | {row['outputs_ms']:.3f} | {row['gc_ms']:.3f} | {row['host_ms']:.3f} | "
            f"{row['per_seq_us']:.1f} us "
            f"| {row['target_ms']:.2f} {mark} |"
        )
    if profile_report is not None:
        print(f"\nprofile: batch {profile_report['batch']}, {profile_report['variant']}; top functions by own time")
        for phase in PhaseProfiles.PHASES:
            print(f"  {phase}:")
            for entry in profile_report[phase]:
                print(
                    f"    {entry['own_ms']:9.2f} ms own {entry['cumulative_ms']:9.2f} ms cum "
                    f"{entry['calls']:8d} calls  {entry['function']}"
                )
    print(json.dumps({"rows": rows, "profile": profile_report}, default=str))


if __name__ == "__main__":
    main()
