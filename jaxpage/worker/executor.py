"""The one door to the device: every program the engine launches goes through an Executor.

The executor holds the runners (0: the target model's ModelRunner, 1: a draft model's DraftModelRunner) and, with
several hosts, the channel (jaxpage.worker.step_broadcast). A runner launches each program through its door, which is
the executor's `launch`: on process 0 the program is first told to the other processes, then run (ModelRunner.run).
The other processes `follow`: each message they receive goes to the same ModelRunner.run, with the arrays unpacked
after the runner's templates. So what process 0 runs and what the others replay are one dispatch.

Data parallelism: `execute` runs one step of every replica as one program over the devices, their arrays stacked
on a leading axis, and gives each replica its own results back. The runner builds one replica's arrays
(ModelRunner.prepare) and runs the programs.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time

import jax

from jaxpage.attention import AttentionBackend
from jaxpage.config import EngineConfig
from jaxpage.sequence import SchedulerOutput, prompt_logprob_rows
from jaxpage.spec_decode.draft_runner import DraftModelRunner
from jaxpage.worker.compilation_cache import CompilationCache, CompiledShape
from jaxpage.worker.model_runner import ModelRunner, StepOutput, fetch, step_flag
from jaxpage.worker.step_broadcast import Message, StepBroadcast

logger = logging.getLogger("jaxpage")


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
    full group's pages."""
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
    runners = [ModelRunner(*target, backend, **args, draft_probs=draft is not None, window_pages=window_pages)]
    if draft is not None:
        runners.append(DraftModelRunner(*draft, backend, **args))
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

    def execute(self, outputs: list[SchedulerOutput], draft_probs: jax.Array | None = None) -> list[StepOutput]:
        """Runs one step of every data-parallel replica (an output each, in order; empty ones are padding), as one
        program over the devices: their results, in order. draft_probs: a draft model's distributions for its
        verify step (one replica), on the device."""
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
        start = time.perf_counter()
        shape = runner.inputs.shape_for(*outputs)
        level = runner.inputs.processor_level(*outputs)
        prepared = [runner.inputs.prepare(output, shape, level) for output in outputs]
        step, sample_input = runner.inputs.stacked(prepared)
        dispatched = time.perf_counter()
        flag = step_flag(level, draft_probs is not None)
        key = runner.shapes.index(shape)
        token_ids, num_accepted, logprobs = self.launch(0, Message.STEP, key, (step, sample_input), flag, draft_probs)
        want_logprobs = any(bool(s.want_logprobs) for _, s in prepared)
        token_ids, num_accepted = fetch(token_ids), fetch(num_accepted)
        logprobs = tuple(fetch(x) for x in logprobs) if want_logprobs else (None, None, None)
        if runner.mesh is None:  # one replica: give its results the replica axis they have on several devices
            token_ids, num_accepted = token_ids[None], num_accepted[None]
            logprobs = tuple(x if x is None else x[None] for x in logprobs)
        prompt_logprobs = self._prompt_logprobs(outputs)
        device_s = time.perf_counter() - dispatched
        results = []
        for r, output in enumerate(outputs):
            count = len(output.scheduled)
            mine = tuple(x if x is None else x[r, :count] for x in logprobs)
            prompt = None if prompt_logprobs is None else tuple(x[r] for x in prompt_logprobs)
            results.append(
                StepOutput(
                    token_ids[r, :count],
                    num_accepted[r, :count],
                    *mine,
                    shape,
                    dispatched - start,
                    device_s,
                    prompt,
                )
            )
        return results

    def _prompt_logprobs(self, outputs: list[SchedulerOutput]) -> tuple | None:
        """After a step: the prompt log-probs its items asked for (see StepOutput.prompt_logprobs), each array with
        a leading replica axis; None when no item asked (nothing is launched)."""
        if not any(prompt_logprob_rows(output.scheduled) for output in outputs):
            return None
        runner = self.runners[0]
        targets = runner.inputs.stacked([runner.inputs.prompt_targets(output) for output in outputs])
        arrays = tuple(fetch(x) for x in self.launch(0, Message.PROMPT_LOGPROBS, 0, targets))
        return arrays if runner.mesh is not None else tuple(x[None] for x in arrays)

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
