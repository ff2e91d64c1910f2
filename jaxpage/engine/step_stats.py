"""What one engine step held and where its time went (LLMEngine.last_step_stats). Host-only (no jax)."""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxpage.config import ModelConfig
from jaxpage.sequence import SchedulerOutput, SequenceUpdate


@dataclasses.dataclass(frozen=True)
class StepStats:
    """What one engine step held and where its time went (seconds, wall clock)."""

    num_seqs: int
    num_tokens: int  # scheduled tokens (before padding to the bucket)
    num_decodes: int  # sequences with one new token
    num_draft_tokens: int  # speculative tokens verified (0 without speculative decoding)
    num_accepted_tokens: int  # ... and accepted
    num_sampled: int  # sequences whose logits give a token this step (the rows of the LM head)
    # query-key pairs of the step's causal attention (sum over its tokens of keys seen), per layer: a hybrid's sliding
    # and full layers see different keys, and this is their mean
    num_attended_keys: float
    shape: str  # the step shape it was padded to, e.g. "decode(T=8, S=8, R=16)"
    schedule_s: float  # host: the scheduler
    prepare_s: float  # host: the step's arrays
    # dispatch until the sampled tokens are on the host (with asynchronous scheduling this spans the launch of the
    # next step and the device's tail of the step before)
    device_s: float
    postprocess_s: float  # host: commit, appending tokens, detokenizing, stop checks, outputs

    @property
    def host_s(self) -> float:
        return self.schedule_s + self.prepare_s + self.postprocess_s

    @classmethod
    def of(
        cls,
        steps: list[SchedulerOutput],
        results: list,
        updates: list[SequenceUpdate],
        num_sampled: int,
        schedule_s: float,
        postprocess_s: float,
        model: ModelConfig,
    ) -> StepStats:
        """A step's stats: its replicas' scheduled steps, their StepOutputs and the scheduler's updates; num_sampled
        counted before the update; postprocess_s: from the results on the host to the outputs."""
        every = [item for o in steps for item in o.scheduled]
        computed = np.array([item.num_computed_tokens for item in every], np.int64)
        counts = np.array([item.num_new_tokens for item in every], np.int64)
        sliding = sum(model.sliding_layers)  # layers that see the window, the others every key
        windows = [(model.sliding_window, sliding), (None, model.num_layers - sliding)]
        keys = sum(n * int(attended_keys_of(computed, counts, window).sum()) for window, n in windows if n)
        verified = any(result.shape.num_draft_positions for result in results)  # (else no item has drafts)
        return cls(
            num_seqs=len(every),
            num_tokens=int(counts.sum()),
            num_decodes=int(np.count_nonzero(counts == 1)),
            num_draft_tokens=sum(len(item.draft_token_ids) for item in every) if verified else 0,
            num_accepted_tokens=sum(update.num_accepted for update in updates) if verified else 0,
            num_sampled=num_sampled,
            num_attended_keys=keys / model.num_layers,
            shape=str(results[0].shape),
            schedule_s=schedule_s,
            prepare_s=results[0].prepare_s,
            device_s=results[0].device_s,
            postprocess_s=postprocess_s,
        )


def attended_keys_of(computed: np.ndarray, counts: np.ndarray, sliding_window: int | None) -> np.ndarray:
    """Keys the step's new tokens of each item attend to (items given by their computed and new tokens): token i
    (0-based) of q sees computed + i + 1 keys, at most sliding_window."""
    full = counts * computed + counts * (counts + 1) // 2  # keys computed + 1 .. computed + q
    if sliding_window is None:
        return full
    w, end = sliding_window, computed + counts
    inside_then_window = (w * (w + 1) // 2 - computed * (computed + 1) // 2) + (end - w) * w
    return np.where(end <= w, full, np.where(computed >= w, counts * w, inside_then_window))
