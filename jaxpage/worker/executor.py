"""The one door to the device: every program the engine launches goes through an Executor.

The executor holds the runners (0: the target model's ModelRunner, 1: a draft model's DraftModelRunner) and, with
several hosts, the channel (jaxpage.worker.step_broadcast). A runner launches each program through its door, which is
the executor's `launch`: on process 0 the program is first told to the other processes, then run (ModelRunner.run).
The other processes `follow`: each message they receive goes to the same ModelRunner.run, with the arrays unpacked
after the runner's templates. So what process 0 runs and what the others replay are one dispatch.

Data parallelism: `launch_step` runs one step of every replica as one program over the devices, their arrays stacked
on a leading axis, and gives each replica its own results back. The runner builds one replica's arrays
(ModelRunner.prepare) and runs the programs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time

import jax

from jaxpage.attention import AttentionBackend
from jaxpage.config import EngineConfig
from jaxpage.sequence import SchedulerOutput
from jaxpage.worker.compilation_cache import CompilationCache, CompiledShape
from jaxpage.worker.draft_runner import DraftModelRunner
from jaxpage.worker.host_kv_pool import transfer_calls
from jaxpage.worker.model_runner import ModelRunner, StepOutput, fetch
from jaxpage.worker.pool_sizing import host_tier_slots
from jaxpage.worker.step_broadcast import Message, StepBroadcast
from jaxpage.worker.step_inputs import step_flag
from jaxpage.worker.step_shapes import StepShape

logger = logging.getLogger("jaxpage")


@dataclasses.dataclass(frozen=True)
class LaunchedStep:
    """A step on its way (Executor.launch_step): its replicas' scheduled steps and the device arrays of its results."""

    outputs: list[SchedulerOutput]
    shape: StepShape
    sampled: tuple  # the sampler's token ids, accepted draft tokens, log-probs (ModelRunner._run_step)
    want_logprobs: bool  # some row asked for log-probs (else they are not read)
    prompt_logprobs: tuple | None  # the prompt log-probs program's results, None: none asked
    prepare_s: float  # host: building its arrays
    dispatched: float  # time.perf_counter() when it was launched


def make_runners(
    config: EngineConfig,
    backend: AttentionBackend,
    target: tuple,
    draft: tuple | None,
    num_pages: int,
    max_model_len: int,
    mesh: jax.sharding.Mesh | None,
    num_speculative_tokens: int = 0,
    compilation_cache: CompilationCache | None = None,
    compile_only: bool = False,
    window_pages: int | None = None,
) -> list[ModelRunner]:
    """The target's ModelRunner, and a draft model's DraftModelRunner where `draft` (each a (config, params) as it
    runs, jaxpage.worker.parallel.as_run), with the engine's step shapes (verify steps where num_speculative_tokens).
    compile_only: for a chip this host lacks (jaxpage.aot). window_pages: the target's pool is grouped (a hybrid
    model's: jaxpage.kv_cache.HybridKVCache), with these pages for its window group; a draft model's pool reads the
    full group's pages. With kv_offload_bytes, the target's pool gets its slots of the prefix cache's host tier."""
    args = dict(
        num_pages=num_pages,
        page_size=config.page_size,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=max_model_len,
        compilation_cache=compilation_cache,
        num_speculative_tokens=num_speculative_tokens,
        max_verify_rows=config.max_num_seqs if num_speculative_tokens else 0,
        mesh=mesh,
        compile_only=compile_only,
    )
    lora_slots = (config.max_loras, config.max_lora_rank) if config.enable_lora else None
    runners = [
        ModelRunner(*target, backend, **args, draft_probs=draft is not None, window_pages=window_pages, lora=lora_slots)
    ]
    if draft is not None:
        runners.append(DraftModelRunner(*draft, backend, **args))
    if config.kv_offload_bytes:  # the prefix cache's host tier, for the target's pool (a draft model recomputes a hit)
        pool = runners[0].pool
        pool.add_host_tier(host_tier_slots(config.kv_offload_bytes, pool.layout, config.data_parallel_size))
    return runners


class Executor:
    def __init__(self, runners: list[ModelRunner], channel: StepBroadcast | None = None):
        self.runners = runners
        self.channel = channel
        for index, runner in enumerate(runners):
            runner.door = functools.partial(self.launch, index)

    def launch(self, runner: int, kind: Message, key: int, payload=None, flag: int = 0, draft_probs=None):
        """Runs a program of runner `runner` (ModelRunner.run), told first to the processes that follow this one."""
        if self.channel is not None:
            self.channel.send(kind, runner, key, flag, payload)
        return self.runners[runner].run(kind, key, payload, flag, draft_probs)

    def transfer_pages(self, outputs: list[SchedulerOutput]) -> None:
        """The host tier's copies of every replica's step (SchedulerOutput.page_transfers, an output each, in order),
        launched into the target's pool: before anything of the step reads its pages, and whether or not the step
        has anything to run. (A draft model's pool recomputes what a prefix hit gives the target:
        DraftModelRunner.catch_up from Sequence.num_draft_computed_tokens.)"""
        host = self.runners[0].pool.host
        for group, slots in enumerate(host.num_slots if host is not None else ()):
            transfers = [o.page_transfers[group] if o.page_transfers else [] for o in outputs]
            for kind, sources, destinations in transfer_calls(transfers, scratch_slot=slots):
                self.launch(0, Message[kind.upper()], group, (sources, destinations))

    def launch_step(
        self,
        outputs: list[SchedulerOutput],
        draft_probs: jax.Array | None = None,
        pending_rows: list[dict[int, int]] | None = None,
    ) -> LaunchedStep:
        """Launches one step of every data-parallel replica (an output each, in order; empty ones are padding), as one
        program over the devices, without waiting for it: its results come with `results`. draft_probs: a draft
        model's distributions for its verify step (one replica), on the device. pending_rows: each replica's (by
        seq_id) rows of the step launched before, whose sampled tokens this one reads on the device (asynchronous
        scheduling; the runner keeps the latest step's)."""
        runner = self.runners[0]
        # In the whole pool, each replica has a range of pages (and of the window group's, in a grouped pool).
        pages, window_pages = runner.pages_per_replica, runner.window_pages_per_replica
        copies = [(src + r * pages, dst + r * pages) for r, o in enumerate(outputs) for src, dst in o.page_copies]
        window_copies = [
            (src + r * window_pages, dst + r * window_pages)
            for r, o in enumerate(outputs)
            for src, dst in o.window_page_copies
        ]
        if copies or window_copies:
            runner.copy_pages(copies, window_copies)
        for output in outputs:  # adapters new to their slots (the replicas share the slots)
            for slot, adapter in output.lora_loads:
                self.launch(0, Message.LORA, slot, runner.lora.payload(adapter))
        start = time.perf_counter()
        shape = runner.inputs.shape_for(*outputs)
        level = runner.inputs.processor_level(*outputs)
        pending_rows = pending_rows or [{}] * len(outputs)
        prepared = [runner.inputs.prepare(o, shape, level, rows) for o, rows in zip(outputs, pending_rows, strict=True)]
        step, sample_input = runner.inputs.stacked(prepared)
        dispatched = time.perf_counter()
        flag = step_flag(level, draft_probs is not None, feeds=any(pending_rows))
        key = runner.shapes.index(shape)
        sampled = self.launch(0, Message.STEP, key, (step, sample_input), flag, draft_probs)
        want_logprobs = any(bool(s.want_logprobs) for _, s in prepared)
        prompt_logprobs = self._prompt_logprobs(outputs)
        return LaunchedStep(outputs, shape, sampled, want_logprobs, prompt_logprobs, dispatched - start, dispatched)

    def results(self, launched: LaunchedStep) -> list[StepOutput]:
        """A launched step's results on the host, a StepOutput per replica (waiting for the device)."""
        runner = self.runners[0]
        token_ids, num_accepted, logprobs = launched.sampled
        token_ids, num_accepted = fetch(token_ids), fetch(num_accepted)
        logprobs = tuple(fetch(x) for x in logprobs) if launched.want_logprobs else (None, None, None)
        prompt_logprobs = launched.prompt_logprobs
        if prompt_logprobs is not None:
            prompt_logprobs = tuple(fetch(x) for x in prompt_logprobs)
        if runner.mesh is None:  # one replica: give its results the replica axis they have on several devices
            token_ids, num_accepted = token_ids[None], num_accepted[None]
            logprobs = tuple(x if x is None else x[None] for x in logprobs)
            prompt_logprobs = None if prompt_logprobs is None else tuple(x[None] for x in prompt_logprobs)
        device_s = time.perf_counter() - launched.dispatched
        results = []
        for r, output in enumerate(launched.outputs):
            count = len(output.scheduled)
            mine = tuple(x if x is None else x[r, :count] for x in logprobs)
            prompt = None if prompt_logprobs is None else tuple(x[r] for x in prompt_logprobs)
            step = StepOutput(
                token_ids[r, :count],
                num_accepted[r, :count],
                *mine,
                launched.shape,
                launched.prepare_s,
                device_s,
                prompt,
            )
            results.append(step)
        return results

    def _prompt_logprobs(self, outputs: list[SchedulerOutput]) -> tuple | None:
        """After a step's launch: the program of the prompt log-probs its items asked for (see
        StepOutput.prompt_logprobs), launched; None when no item asked (nothing is launched)."""
        if not any(output.prompt_logprob_rows for output in outputs):
            return None
        runner = self.runners[0]
        targets = runner.inputs.stacked([runner.inputs.prompt_targets(output) for output in outputs])
        return self.launch(0, Message.PROMPT_LOGPROBS, 0, targets)

    def reset(self) -> None:
        """Every runner's pool afresh (after a failed step, whose donated pool may be gone)."""
        for runner in self.runners:
            runner.reset_kv_cache()

    def payload_sizes(self) -> set[int]:
        """The bytes of every message's arrays the runners can send (for StepBroadcast.warmup)."""
        return set().union(*(runner.payload_sizes() for runner in self.runners))

    def warmup(self) -> list[CompiledShape]:
        """Compiles every runner's programs (and, with several hosts, the broadcasts of every message size), each
        process by itself; returns what was compiled (or loaded)."""
        lockstep = contextlib.nullcontext() if self.channel is None else self.channel.lockstep()
        with lockstep:
            compiled = [c for runner in self.runners for c in runner.warmup()]
            if self.channel is not None:
                self.channel.warmup(self.payload_sizes())
        return compiled

    def follow(self) -> None:
        """On a process other than 0: runs every program process 0 launches (its warm-up too), until it stops."""
        draft_probs = None  # a proposal's distributions, for the verify step that follows it
        while True:
            header, data = self.channel.receive()
            if header.kind is Message.STOP:
                return
            if header.kind is Message.WARMUP:
                self.warmup()
                continue
            runner = self.runners[header.runner]
            try:
                result = runner.run(header.kind, header.key, runner.unpack(header, data), header.flag, draft_probs)
            except Exception:  # the leader's launch fails too, and it resets the pool next
                logger.exception("following process 0: %s failed", header.kind.name)
                continue
            if header.kind is Message.PROPOSE:
                draft_probs = result[1]
            elif header.kind is Message.STEP:
                draft_probs = None
