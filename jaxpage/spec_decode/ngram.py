"""N-gram prompt lookup: draft tokens for speculative decoding copied from the sequence itself, no model.

The last n tokens of a sequence (prompt and output so far) are looked up earlier in the same sequence; the tokens
that followed that earlier occurrence are the draft. Outputs that copy their input (edit this code, fix these
typos, quote this passage) are guessed right for long stretches; open-ended text rarely matches, and then nothing
is drafted.

Which match: the longest n in [prompt_lookup_min, prompt_lookup_max] for which the last n tokens occur earlier,
and among the occurrences of that n-gram the most recent one (the text being copied is usually the one just
read). The draft is up to `num_speculative_tokens` tokens that follow it (fewer when the sequence ends first). The match
length n comes with it: it predicts acceptance (measured on the benchmark's workloads: drafts after a 4-token match
kept about 6 of 8 tokens, after a 1-token match under 1), and the speculation policy estimates acceptance per n.

Host side, numpy only: a search is a few vectorized passes over the sequence's tokens, O(length x
prompt_lookup_max) element compares.
"""

from __future__ import annotations

import numpy as np


def propose_ngram(
    token_ids: np.ndarray | list[int], num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int
) -> tuple[list[int], int]:
    """(draft, n) for a sequence whose tokens so far are `token_ids`: the draft and the length n of the n-gram it
    follows; ([], 0) when no n-gram of the allowed sizes recurs. Arguments are checked by SpeculativeConfig; here
    1 <= prompt_lookup_min <= prompt_lookup_max."""
    tokens = np.asarray(token_ids)
    length = len(tokens)
    if num_speculative_tokens < 1 or length < prompt_lookup_min + 1:
        return [], 0
    # Candidate ends: earlier positions holding the last token, each with a successor to propose.
    ends = np.flatnonzero(tokens[: length - 1] == tokens[-1])
    if len(ends) == 0:
        return [], 0
    # match[i]: how many tokens, counting back from ends[i], equal the sequence's last ones (up to the max).
    match = np.ones(len(ends), np.int64)
    alive = np.ones(len(ends), bool)
    for back in range(1, min(prompt_lookup_max, length - 1)):
        alive &= ends >= back
        alive[alive] = tokens[ends[alive] - back] == tokens[length - 1 - back]
        if not alive.any():
            break
        match += alive
    best = match.max()
    if best < prompt_lookup_min:
        return [], 0
    end = ends[np.flatnonzero(match == best)[-1]]  # the most recent occurrence of the longest n-gram
    return tokens[end + 1 : end + 1 + num_speculative_tokens].tolist(), int(best)
