"""The steps on their way: each replica's next step scheduled and launched on the device, and the results of a launched
step taken back into its sequences (the schedulers' update), one step at a time or, with asynchronous scheduling, one
step ahead.

Asynchronous scheduling (engine argument `async_scheduling`, vLLM's name): while the device runs step n, the host
schedules and launches step n + 1, whose decoding sequences read their token of step n on the device (the runner keeps
each step's sampled tokens there: jaxpage.worker.step_inputs, StepInput.feed_index); the host then takes step n's
results, and builds its outputs while the device runs step n + 1. The schedulers see step n + 1's tokens as pending
(Scheduler.launched). A sequence that step n ends costs step n + 1 one row, thrown away; one that a length ends is not
scheduled. A step whose sampled sequences have logits processors (a grammar's bitmask, penalties, bad words: their
next arrays need the token on the host) is taken before the next is scheduled, as without asynchronous scheduling.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from jaxpage.config import EngineConfig
from jaxpage.engine.replica import Replicas
from jaxpage.engine.spec_decoder import SpeculativeDecoder
from jaxpage.sequence import NO_PROCESSORS, PROCESSOR_LEVEL_COLUMN, SchedulerOutput, SequenceUpdate
from jaxpage.worker.executor import Executor, LaunchedStep


def use_async_scheduling(config: EngineConfig, platform: str, num_processes: int = 1) -> bool:
    """Whether the engine schedules asynchronously: as `async_scheduling` says, by default (None) on GPU and TPU,
    where a step's host work is a large share of a small model's step; never with speculative decoding (its drafts
    come from the tokens on the host: EngineConfig refuses both). ValueError naming it with several processes,
    which replay process 0's steps in lockstep."""
    wanted = config.async_scheduling
    if wanted and num_processes > 1:
        raise ValueError("engine argument async_scheduling: not with several processes; leave it unset (or False)")
    if wanted is None:
        return platform != "cpu" and config.speculative_config is None and num_processes == 1
    return wanted


@dataclasses.dataclass(frozen=True)
class InFlightStep:
    """A step launched on the device whose results are not taken yet."""

    steps: list[SchedulerOutput]  # each replica's
    launched: LaunchedStep
    draft_computed: dict[int, int] | None  # a draft model's computed tokens by seq_id (speculative decoding)
    schedule_s: float  # host: scheduling it
    started: float  # time.perf_counter() when its scheduling began


class StepPipeline:
    def __init__(
        self,
        replicas: Replicas,
        executor: Executor,
        spec_decoder: SpeculativeDecoder | None,
        asynchronous: bool,
        on_scheduled: Callable,
    ):
        """on_scheduled(items, now): told of the items of every step that were admitted to it (the only ones that
        can be scheduled for the first time) as it is launched."""
        self.replicas = replicas
        self.executor = executor
        self.spec_decoder = spec_decoder
        self.asynchronous = asynchronous
        self.on_scheduled = on_scheduled
        self.in_flight: InFlightStep | None = None

    def advance(self) -> InFlightStep | None:
        """Launches the next step (unless the step in flight must be taken first) and returns the step whose results
        are to be taken now: the one just launched, or with asynchronous scheduling the one launched before; None if
        there is none."""
        if self.in_flight is not None and not self._can_schedule_ahead():
            done, self.in_flight = self.in_flight, None  # its tokens decide what comes next
            return done
        launched = self._launch_next()
        if not self.asynchronous:
            return launched
        done, self.in_flight = self.in_flight, launched
        return done

    def drop(self) -> None:
        """Forgets the step in flight (after a failed step: the pool and the bookkeeping start afresh)."""
        self.in_flight = None

    def _can_schedule_ahead(self) -> bool:
        """Whether the next step can be scheduled before the tokens of the step in flight are known: unless a
        sequence it samples has logits processors."""
        steps = self.in_flight.steps
        return self.asynchronous and all(o.max_sampled(PROCESSOR_LEVEL_COLUMN) == NO_PROCESSORS for o in steps)

    def _launch_next(self) -> InFlightStep | None:
        """Schedules every replica's next step and launches it on the device (a draft model's drafts first, where it
        drafts); None when nothing can be scheduled."""
        start = time.perf_counter()
        # Speculative decoding runs without data parallelism: on the one replica.
        drafts = self.spec_decoder.propose(self.replicas[0].scheduler) if self.spec_decoder is not None else None
        steps = [r.scheduler.schedule(drafts if i == 0 else None) for i, r in enumerate(self.replicas)]
        self.executor.transfer_pages(steps)  # the host tier's copies, made even where nothing is scheduled
        if not any(o.scheduled for o in steps):
            return None
        scheduled = time.perf_counter()
        admitted = [item for o in steps for item in o.scheduled[len(o.scheduled) - o.num_admitted :]]
        self.on_scheduled(admitted, time.time())
        draft_probs = draft_computed = None
        if self.spec_decoder is not None:
            steps[0], draft_probs, draft_computed = self.spec_decoder.draft(steps[0])
        pending_rows = None
        if self.in_flight is not None:  # the rows that sample the tokens this step reads on the device
            pending_rows = [
                {item.seq.seq_id: row for row, item in enumerate(o.scheduled) if item.samples}
                for o in self.in_flight.steps
            ]
        launched = self.executor.launch_step(steps, draft_probs, pending_rows)
        for replica, output in zip(self.replicas, steps, strict=True):
            replica.scheduler.launched(output)
        return InFlightStep(steps, launched, draft_computed, scheduled - start, start)

    def results(self, step: InFlightStep) -> list:
        """The results of a launched step (each replica's StepOutput), waiting for the device."""
        results = self.executor.results(step.launched)
        if step.draft_computed is not None:  # the step's seconds include the draft model's
            device_s = time.perf_counter() - step.started - step.schedule_s - results[0].prepare_s
            results[0] = dataclasses.replace(results[0], device_s=device_s)
        return results

    def update(self, step: InFlightStep, results: list) -> list[tuple[list[SequenceUpdate], object]]:
        """A step's results into its sequences (each replica's scheduler's update): a replica's updates of the
        sequences that sampled, with its StepOutput, for each replica."""
        updates = [
            (
                replica.scheduler.update_from_output(
                    output, result.token_ids, result.num_accepted, step.draft_computed
                ),
                result,
            )
            for replica, output, result in zip(self.replicas, step.steps, results, strict=True)
        ]
        if self.spec_decoder is not None:
            every = [update for replica_updates, _ in updates for update in replica_updates]
            self.spec_decoder.observe(results[0].shape, results[0].device_s, every)
        return updates
