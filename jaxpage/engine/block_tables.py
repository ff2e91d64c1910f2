"""The block tables of a page pool's live sequences as one int32 numpy array, a row per sequence, which the block
manager writes into as it changes a sequence's pages: a step's tables are then one gather of its sequences' rows
(`gather`), not a Python list copied per sequence. Each row also holds its sequence's sampler row (settings, seed,
prompt length, flags: Sequence.sampler_row), written once when the block manager first sees it (`assign`): a step's
sampling rows are a gather too (vLLM's persistent batch: what does not change from step to step stays in place).
Host-only (no jax)."""

from __future__ import annotations

import numpy as np

from jaxpage.sequence import SAMPLER_ROW_COLUMNS

NULL_PAGE = 0


class BlockTables:
    """Rows of page ids (the null page past each table's end), a row per sequence that holds a table; rows and
    columns grow (doubling) as sequences and tables do."""

    def __init__(self, rows: int = 64, width: int = 16):
        self.array = np.zeros((rows, width), np.int32)
        # Each row's Sequence.sampler_row (settings, seed, prompt length, flags: exact in float64), NaN where none was
        # assigned.
        self.sampling = np.full((rows, SAMPLER_ROW_COLUMNS), np.nan)
        self._rows: dict[int, int] = {}  # seq_id -> its row
        self._lengths: dict[int, int] = {}  # seq_id -> the entries its row holds
        self._free_rows = list(range(rows - 1, -1, -1))
        self._unassigned: set[int] = set()  # seq_ids whose row was taken by `write`, without a sampler row

    def assign(self, seq_id: int, sampler_row: tuple) -> None:
        """A row for seq_id (if it has none yet), with its sampler row (Sequence.sampler_row)."""
        if seq_id not in self._rows:
            row = self._take_row(seq_id)  # (first: it may grow the arrays)
            self.sampling[row] = sampler_row

    def write(self, seq_id: int, table: list[int]) -> None:
        """Sets seq_id's row to `table` (a row taken for it if it has none)."""
        row = self._rows.get(seq_id)
        if row is None:
            row = self._take_row(seq_id)
            self._unassigned.add(seq_id)
        length, before = len(table), self._lengths.get(seq_id, 0)
        if length > self.array.shape[1]:
            self._grow_width(length)
        self.array[row, :length] = table
        if before > length:
            self.array[row, length:before] = NULL_PAGE
        self._lengths[seq_id] = length

    def release(self, seq_id: int) -> None:
        """seq_id holds no table any more: its row is cleared and free."""
        row = self._rows.pop(seq_id, None)
        self._unassigned.discard(seq_id)
        if row is not None:
            self.array[row, : self._lengths.pop(seq_id)] = NULL_PAGE
            self.sampling[row] = np.nan
            self._free_rows.append(row)

    def _take_row(self, seq_id: int) -> int:
        if not self._free_rows:
            self._grow_rows()
        row = self._rows[seq_id] = self._free_rows.pop()
        self._lengths.setdefault(seq_id, 0)
        return row

    def gather(self, seq_ids: list[int]) -> np.ndarray:
        """[len(seq_ids), width] int32: the tables of seq_ids (each must hold one) in order, null pages past their
        ends (width: at least the longest table's)."""
        rows = self._rows
        return self.array[[rows[seq_id] for seq_id in seq_ids]]

    def gather_with_sampling(self, seq_ids: list[int]) -> tuple[np.ndarray, np.ndarray | None]:
        """(gather(seq_ids), [len(seq_ids), SAMPLER_ROW_COLUMNS] float64: their sampler rows, or None where one has none
        assigned)."""
        rows = self._rows
        index = np.array([rows[seq_id] for seq_id in seq_ids], np.intp)
        if self._unassigned and not self._unassigned.isdisjoint(seq_ids):
            return self.array[index], None
        return self.array[index], self.sampling[index]

    def check(self, tables: dict[int, list[int]]) -> None:
        """Asserts that the rows hold exactly `tables` (seq_id -> its block table; one that is empty may have no
        row), null pages elsewhere."""
        assert self._rows.keys() <= tables.keys(), "a row of a sequence that holds no table"
        expected = np.zeros_like(self.array)
        for seq_id, table in tables.items():
            assert seq_id in self._rows or not table, f"sequence {seq_id}'s table has no row"
            if table:
                expected[self._rows[seq_id], : len(table)] = table
        assert np.array_equal(expected, self.array), "a row differs from its block table"

    def _grow_rows(self) -> None:
        rows = self.array.shape[0]
        self.array = np.concatenate([self.array, np.zeros_like(self.array)])
        self.sampling = np.concatenate([self.sampling, np.full_like(self.sampling, np.nan)])
        self._free_rows = list(range(2 * rows - 1, rows - 1, -1))

    def _grow_width(self, length: int) -> None:
        width = self.array.shape[1]
        while width < length:
            width *= 2
        grown = np.zeros((self.array.shape[0], width), np.int32)
        grown[:, : self.array.shape[1]] = self.array
        self.array = grown
