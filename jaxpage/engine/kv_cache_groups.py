"""The page bookkeeping of a hybrid model's grouped pool (Gemma 2 and 3: jaxpage.kv_cache.HybridKVCache), as vLLM's
hybrid allocator keeps it: a BlockManager per group of layers, each over pages of its own. The full group's layers
read every key, so a sequence keeps all its pages there (`Sequence.block_table`); the window group's read only the
last `sliding_window` keys, so its pages before the window go back while the sequence runs
(`Sequence.window_block_table`, BlockManager.free_outside_window). A long sequence then holds its whole context in
the full layers only, and the window group's pool is sized for what running sequences can hold
(jaxpage.worker.pool_sizing.window_group_pages).

KVCacheGroups answers the scheduler as one BlockManager does: every call goes to both groups, an allocation is all
or nothing over both, and a prefix-cache hit is the prefix both groups still hold. Host-only (no jax).
"""

from __future__ import annotations

from jaxpage.engine.block_manager import BlockManager
from jaxpage.sequence import Sequence


class KVCacheGroups:
    def __init__(
        self,
        num_pages: int,
        window_pages: int,
        page_size: int,
        enable_prefix_caching: bool,
        sliding_window: int,
        host_pages: tuple[int, int] = (0, 0),  # each group's slots in the prefix cache's host tier
    ):
        self.full = BlockManager(num_pages, page_size, enable_prefix_caching, host_pages=host_pages[0])
        window = (sliding_window, "window_block_table", host_pages[1])
        self.window = BlockManager(window_pages, page_size, enable_prefix_caching, *window)
        self.groups = (self.full, self.window)
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window

    @property
    def num_pages(self) -> int:
        """The full group's pages (the group that a long context fills; the window group's never runs short for
        the sequences running)."""
        return self.full.num_pages

    @property
    def num_used_pages(self) -> int:
        """The full group's pages referenced by live sequences (see num_pages)."""
        return self.full.num_used_pages

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return all(group.can_allocate(seq, num_new_tokens) for group in self.groups)

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """BlockManager.allocate_slots in both groups, all or nothing."""
        if not self.can_allocate(seq, num_new_tokens):
            return False
        return all([group.allocate_slots(seq, num_new_tokens) for group in self.groups])

    def cached_prefix_tokens(self, token_ids: list[int], root: bytes | None = None) -> int:
        """Tokens of a prompt that both groups' prefix caches hold now."""
        return min(group.cached_prefix_tokens(token_ids, root) for group in self.groups)

    def match_prefix(self, seq: Sequence) -> int:
        """BlockManager.match_prefix in both groups, of the prefix both hold (the window group may have evicted pages
        that the full group still has, or the other way round)."""
        found = self.cached_prefix_tokens(seq.token_ids, seq.prefix_root)
        return min([group.match_prefix(seq, found) for group in self.groups])

    def can_fork(self, parent: Sequence, num_tokens: int) -> bool:
        return all(group.can_fork(parent, num_tokens) for group in self.groups)

    def fork(self, parent: Sequence, child: Sequence, num_tokens: int) -> None:
        for group in self.groups:
            group.fork(parent, child, num_tokens)

    def release_slots(self, seq: Sequence, num_tokens: int) -> None:
        for group in self.groups:
            group.release_slots(seq, num_tokens)

    def cache_full_pages(self, seq: Sequence) -> None:
        for group in self.groups:
            group.cache_full_pages(seq)

    def free_outside_window(self, seq: Sequence) -> None:
        self.window.free_outside_window(seq)

    def free(self, seq: Sequence) -> None:
        for group in self.groups:
            group.free(seq)

    def block_tables(self, seqs: list[Sequence]) -> tuple:
        """(the full group's block tables of the sequences, the window group's, their sampler rows):
        BlockManager.block_tables."""
        tables, _, sampling = self.full.block_tables(seqs)
        return tables, self.window.tables.gather([seq.seq_id for seq in seqs]), sampling

    def take_copies(self) -> list[tuple[int, int]]:
        return self.full.take_copies()

    def take_window_copies(self) -> list[tuple[int, int]]:
        return self.window.take_copies()

    def take_transfers(self) -> tuple[list, list]:
        """Each group's host tier copies (BlockManager.take_transfers)."""
        return self.full.take_transfers() + self.window.take_transfers()

    def kv_utilization(self) -> float:
        """Token slots holding tokens / slots of referenced pages, over both groups (a slot of either counts once)."""
        filled = sum(group._num_filled_slots for group in self.groups)
        referenced = sum(group.num_used_pages for group in self.groups) * self.page_size
        return filled / referenced if referenced else 1.0

    def check_invariants(self) -> None:
        for group in self.groups:
            group.check_invariants()
        for seq in self.full._seqs.values():
            assert self.window._seqs.get(seq.seq_id) is seq, f"sequence {seq.seq_id} holds pages in one group only"
            assert len(seq.window_block_table) == len(seq.block_table), f"sequence {seq.seq_id}: groups disagree"
