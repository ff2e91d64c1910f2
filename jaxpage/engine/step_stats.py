"""What one engine step held and where its time went (LLMEngine.last_step_stats). Host-only (no jax)."""

from __future__ import annotations

import functools

import numpy as np

from jaxpage.config import ModelConfig
from jaxpage.sequence import SchedulerOutput, SequenceUpdate


class StepStats:
    """What one engine step held and where its time went (seconds, wall clock). Its counts are worked out when read
    (benchmarks read them; serving does not), from the step's parts it keeps."""

    def __init__(
        self,
        steps: list[SchedulerOutput],
        results: list,
        updates: list[tuple[list[SequenceUpdate], object]],
        schedule_s: float,
        postprocess_s: float,
        model: ModelConfig,
    ):
        """A step's stats: its replicas' scheduled steps, their StepOutputs and the schedulers' updates (each
        replica's, with its StepOutput: StepPipeline.update); postprocess_s: from the results on the host to the
        outputs."""
        self._steps, self._results, self._updates, self._model = steps, results, updates, model
        self.schedule_s = schedule_s  # host: the scheduler
        self.prepare_s = results[0].prepare_s  # host: the step's arrays
        # dispatch until the sampled tokens are on the host (with asynchronous scheduling this spans the launch of the
        # next step and the device's tail of the step before)
        self.device_s = results[0].device_s
        self.postprocess_s = postprocess_s  # host: commit, appending tokens, detokenizing, stop checks, outputs

    @property
    def num_sampled(self) -> int:
        """Sequences whose logits give a token this step (the rows of the LM head)."""
        return sum(o.num_sampled for o in self._steps)

    @property
    def host_s(self) -> float:
        return self.schedule_s + self.prepare_s + self.postprocess_s

    @functools.cached_property
    def _items(self) -> tuple[list, np.ndarray, np.ndarray]:
        every = [item for o in self._steps for item in o.scheduled]
        computed = np.array([item.num_computed_tokens for item in every], np.int64)
        return every, computed, np.array([item.num_new_tokens for item in every], np.int64)

    @property
    def num_seqs(self) -> int:
        return len(self._items[0])

    @property
    def num_tokens(self) -> int:
        """Scheduled tokens (before padding to the bucket)."""
        return int(self._items[2].sum())

    @property
    def num_decodes(self) -> int:
        """Sequences with one new token."""
        return int(np.count_nonzero(self._items[2] == 1))

    @property
    def num_draft_tokens(self) -> int:
        """Speculative tokens verified (0 without speculative decoding)."""
        return sum(len(item.draft_token_ids) for item in self._items[0])

    @property
    def num_accepted_tokens(self) -> int:
        """Speculative tokens verified and accepted."""
        return sum(update.num_accepted for updates, _ in self._updates for update in updates)

    @functools.cached_property
    def num_attended_keys(self) -> float:
        """Query-key pairs of the step's causal attention (sum over its tokens of keys seen), per layer: a hybrid's
        sliding and full layers see different keys, and this is their mean."""
        model, (_, computed, counts) = self._model, self._items
        sliding = sum(model.sliding_layers)  # layers that see the window, the others every key
        windows = [(model.sliding_window, sliding), (None, model.num_layers - sliding)]
        keys = sum(n * int(attended_keys_of(computed, counts, window).sum()) for window, n in windows if n)
        return keys / model.num_layers

    @property
    def shape(self) -> str:
        """The step shape it was padded to, e.g. "decode(T=8, S=8, R=16)"."""
        return str(self._results[0].shape)


def attended_keys_of(computed: np.ndarray, counts: np.ndarray, sliding_window: int | None) -> np.ndarray:
    """Keys the step's new tokens of each item attend to (items given by their computed and new tokens): token i
    (0-based) of q sees computed + i + 1 keys, at most sliding_window."""
    full = counts * computed + counts * (counts + 1) // 2  # keys computed + 1 .. computed + q
    if sliding_window is None:
        return full
    w, end = sliding_window, computed + counts
    inside_then_window = (w * (w + 1) // 2 - computed * (computed + 1) // 2) + (end - w) * w
    return np.where(end <= w, full, np.where(computed >= w, counts * w, inside_then_window))
