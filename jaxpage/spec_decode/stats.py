"""Speculative decoding counters, as vLLM keeps them: drafts, draft tokens, accepted tokens, acceptance per position.

One `observe_draft(num_draft_tokens, num_accepted)` per sequence per step that verified a draft. Derived figures:
  acceptance_rate       accepted / draft tokens
  mean_accepted_length  1 + accepted / drafts: tokens a verification step gives a sequence (the +1 is the token
                        the target emits after the accepted ones)
  acceptance_per_position[i]  drafts whose token i was accepted / drafts
No jax here: the engine's host bookkeeping keeps these.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class SpecDecodingStats:
    num_spec_tokens: int  # k: the most draft tokens a sequence brings to a step
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = dataclasses.field(default_factory=list)

    def __post_init__(self):
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens

    def observe_draft(self, num_draft_tokens: int, num_accepted: int) -> None:
        """A draft of num_draft_tokens tokens (1..k) was verified and its first num_accepted were kept."""
        if not 1 <= num_draft_tokens <= self.num_spec_tokens or not 0 <= num_accepted <= num_draft_tokens:
            raise ValueError(
                f"a draft of {num_draft_tokens} tokens (k={self.num_spec_tokens}) cannot keep {num_accepted}"
            )
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.num_accepted_tokens_per_pos[position] += 1

    def merge(self, other: SpecDecodingStats) -> None:
        """Adds other's counts (the same k) to these."""
        if other.num_spec_tokens != self.num_spec_tokens:
            raise ValueError(f"cannot merge counters of k={other.num_spec_tokens} into k={self.num_spec_tokens}")
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        for position, count in enumerate(other.num_accepted_tokens_per_pos):
            self.num_accepted_tokens_per_pos[position] += count

    def copy(self) -> SpecDecodingStats:
        return dataclasses.replace(self, num_accepted_tokens_per_pos=list(self.num_accepted_tokens_per_pos))

    def since(self, earlier: SpecDecodingStats) -> SpecDecodingStats:
        """The counts added after `earlier`, a copy of these counters taken before."""
        return SpecDecodingStats(
            self.num_spec_tokens,
            self.num_drafts - earlier.num_drafts,
            self.num_draft_tokens - earlier.num_draft_tokens,
            self.num_accepted_tokens - earlier.num_accepted_tokens,
            [a - b for a, b in zip(self.num_accepted_tokens_per_pos, earlier.num_accepted_tokens_per_pos, strict=True)],
        )

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    @property
    def acceptance_per_position(self) -> list[float] | None:
        if not self.num_drafts:
            return None
        return [count / self.num_drafts for count in self.num_accepted_tokens_per_pos]

    def as_dict(self) -> dict:
        """The counters and the derived figures, for logs and benchmark output."""
        return {
            **dataclasses.asdict(self),
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "acceptance_per_position": self.acceptance_per_position,
        }
