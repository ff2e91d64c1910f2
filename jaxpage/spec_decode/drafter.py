"""Draft tokens for a step (speculative decoding, host side, no jax): what each sequence may draft, and the n-gram
drafts.

A draft never reaches past what the sequence may still generate: its max_tokens and the engine's max_model_len
leave room for the draft and the token the target emits after it. The n-gram drafter proposes by prompt lookup
(jaxpage.spec_decode.ngram); each of its drafts is of the kind of its match length n, which the speculation policy
uses to estimate acceptance. A draft model's drafts come from the device (ModelRunner.propose), after the scheduler
has reserved their slots: here, the draft-model drafter only says how many tokens each sequence may draft.
"""

from __future__ import annotations

import dataclasses

from jaxpage.config import SpeculativeConfig
from jaxpage.sequence import Sequence
from jaxpage.spec_decode.ngram import propose_ngram


@dataclasses.dataclass(frozen=True)
class Draft:
    token_ids: list[int]
    kind: int  # drafts of a kind share an acceptance estimate: the n-gram match length; 0 for a draft model's


class Drafter:
    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        self.config = config
        self.max_model_len = max_model_len

    def room(self, seq: Sequence) -> int:
        """Draft tokens seq can take: k, or fewer near its max_tokens or max_model_len (one token is left for the
        token the target emits after the draft)."""
        room = min(self.config.num_speculative_tokens, self.max_model_len - seq.num_tokens - 1)
        max_tokens = seq.sampling_params.max_tokens if seq.sampling_params is not None else None
        if max_tokens is not None:
            room = min(room, max_tokens - len(seq.output_token_ids) - 1)
        return max(room, 0)

    def propose(self, seqs: list[Sequence]) -> dict[int, Draft]:
        """Drafts by seq_id, for the sequences that have one. A draft model's are placeholders (zeros) of the
        length each sequence may draft: the scheduler reserves their slots, then the draft model fills them."""
        if self.config.method == "draft_model":
            return {seq.seq_id: Draft([0] * room, 0) for seq in seqs if (room := self.room(seq))}
        drafts = {}
        low, high = self.config.prompt_lookup_min, self.config.prompt_lookup_max
        for seq in seqs:
            room = self.room(seq)
            if room:
                tokens, match_len = propose_ngram(seq.token_ids, room, low, high)
                if tokens:
                    drafts[seq.seq_id] = Draft(tokens, match_len)
        return drafts
