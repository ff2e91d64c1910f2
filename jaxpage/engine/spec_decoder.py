"""Speculative decoding as the engine calls it: one object, four calls a step.

1. `propose(scheduler)` before scheduling: the drafts of the running sequences (n-gram lookup, or a draft model's
   placeholders of the length each may draft), if the step can verify and verifying is expected to pay
   (jaxpage.spec_decode.policy); None otherwise.
2. `draft(output)` after scheduling, before the target's step: a draft model's pool takes the step's page copies,
   catches up and fills the placeholders (jaxpage.worker.draft_runner); returns the output with the drafts,
   their distributions for verification, and the draft pool's computed tokens per sequence (which the scheduler
   records: nothing here writes a Sequence).
3. The target verifies inside its step (jaxpage.sample.rejection_sampler).
4. `observe(shape, seconds, updates)` after the scheduler's update: the policy's step times (not those of a step that
   compiled a program) and acceptance, and vLLM's counters (`stats`); `forget` for a sequence ended outside a step's
   update. The policy's decisions and estimates: `policy.state()`.
"""

from __future__ import annotations

from jaxpage.config import SpeculativeConfig
from jaxpage.engine.scheduler import Scheduler, SchedulerOutput, SequenceUpdate
from jaxpage.spec_decode.drafter import Drafter
from jaxpage.spec_decode.policy import SpeculationPolicy
from jaxpage.spec_decode.stats import SpecDecodingStats
from jaxpage.worker.step_shapes import StepShape


class SpeculativeDecoder:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, target_runner, draft_runner=None):
        """target_runner: the target's ModelRunner (its step shapes price verification); draft_runner: a
        DraftModelRunner for method "draft_model", else None."""
        self.config = config
        self.drafter = Drafter(config, max_model_len)
        self.policy = SpeculationPolicy()
        self.stats = SpecDecodingStats(config.num_speculative_tokens)
        self.target_runner = target_runner
        self.draft_runner = draft_runner
        self._kinds: dict[int, int] = {}  # seq_id -> the kind of its draft in the current step
        self._compilations = self._num_compilations()  # programs compiled or loaded before the latest step

    def propose(self, scheduler: Scheduler) -> dict[int, list[int]] | None:
        """Draft tokens by seq_id for this step, or None (no step with drafts: see the module docstring)."""
        self._kinds = {}
        if not scheduler.can_draft():
            return None
        drafts = self.drafter.propose(scheduler.running)
        count = len(scheduler.running)
        shapes = (self.target_runner.inputs.smallest_shape(kind, count) for kind in ("verify", "decode"))
        if not drafts or not self.policy.should_verify(count, drafts, *shapes):
            return None
        self._kinds = {seq_id: draft.kind for seq_id, draft in drafts.items()}
        return {seq_id: draft.token_ids for seq_id, draft in drafts.items()}

    def draft(self, output: SchedulerOutput) -> tuple[SchedulerOutput, object, dict[int, int] | None]:
        """(output with a draft model's drafts, their distributions on the device, the draft pool's computed tokens
        by seq_id); (output, None, None) where nothing is drafted on the device."""
        if self.draft_runner is None:
            return output, None, None
        self.draft_runner.copy_pages(output.page_copies)  # its pool has the target's pages
        if not any(item.draft_token_ids for item in output.scheduled):
            return output, None, None  # the draft model runs only in steps that verify its drafts
        self.draft_runner.catch_up(output)
        return self.draft_runner.propose(output)

    def observe(self, shape: StepShape, seconds: float, updates: list[SequenceUpdate]) -> None:
        """After a step of `shape` that took `seconds` on the device: its verified drafts' acceptance; the
        sequences the step ended are forgotten."""
        compilations = self._num_compilations()
        self.policy.observe_step(shape, seconds, compiled=compilations != self._compilations)
        self._compilations = compilations
        for update in updates:
            if update.num_draft_tokens:
                self.stats.observe_draft(update.num_draft_tokens, update.num_accepted)
                kind = self._kinds[update.seq.seq_id]
                self.policy.observe_draft(update.seq.seq_id, kind, update.num_draft_tokens, update.num_accepted)
            if update.finish_reason is not None:
                self.forget(update.seq.seq_id)

    def _num_compilations(self) -> int:
        """Programs the runners have compiled or loaded so far: a step that added one took compile time."""
        runners = (self.target_runner, self.draft_runner)
        return sum(runner.num_compilations for runner in runners if runner is not None)

    def forget(self, seq_id: int) -> None:
        """A sequence ended: its acceptance estimate goes."""
        self.policy.forget(seq_id)
