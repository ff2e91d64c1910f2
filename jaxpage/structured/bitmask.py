"""Filling grammar bitmasks for a step: every constrained row's matcher computes its allowed tokens into one int32
array [rows, ceil(vocab / 32)], in parallel threads (llguidance's executor, which releases the GIL), and, for a row
that verifies draft tokens, the masks after each draft token too."""

from __future__ import annotations

import functools

import numpy as np


@functools.cache
def _executor():
    import llguidance

    return llguidance.LLExecutor()


def fill_grammar_bitmasks(rows: list[tuple[object, int, list[int]]], bitmask: np.ndarray) -> None:
    """rows: (matcher, first bitmask row, draft tokens). Writes the matcher's mask for its next token at that row,
    and, after each draft token it accepts, the mask for the token after it at the rows that follow (rows after a
    draft token it refuses are left as they are: verification rejects that token, so they go unused). The matchers
    end in the state they started in."""
    if not rows:
        return
    import llguidance.numpy

    assert bitmask.dtype == np.int32 and bitmask.flags["C_CONTIGUOUS"], (bitmask.dtype, bitmask.flags)
    with_drafts = [(m, row, drafts) for m, row, drafts in rows if drafts]  # llguidance wants them non-empty there
    if with_drafts:
        llguidance.numpy.fill_next_token_bitmask_par_with_draft_tokens(_executor(), with_drafts, bitmask)
    without = [(m, row) for m, row, drafts in rows if not drafts]
    if without:
        llguidance.numpy.fill_next_token_bitmask_par(_executor(), without, bitmask)
