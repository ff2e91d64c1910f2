"""Page pool bookkeeping: which KV pages are free, referenced by sequences, or cached for prefix reuse.

Pages are ids 0..num_pages-1. Page 0 is the null page: never handed out, padding entries of block tables point at
it. Every other page is in exactly one state:
  free        ref count 0, holds nothing anyone can find again;
  referenced  ref count > 0: in the block table of at least one live sequence;
  cached      ref count 0, but holds a full page registered in the prefix cache; a later prompt that starts with
              the same tokens can take it back (match_prefix). Cached pages are evicted least recently used first
              when the free list runs out.
Only full pages of computed tokens are registered, under a chained key (the previous page's key and this page's
token ids), so a hit on page i implies the whole prefix up to page i is the same.

Sequences can share pages: prefix-cache hits, and fork (a request's n samples share its prompt's pages). A shared page
that must be written is copied first (copy-on-write); the copies reach the device through take_copies.

With a sliding window (a model whose every layer attends to the last `sliding_window` keys only), the pages of a
sequence that lie wholly before the first key any of its later tokens can read are given back while it runs
(free_outside_window): their block-table entries become the null page, which no kernel reads for a token inside
the window (a kernel's key tile that straddles the window's start may load it, masked).

With a host tier (host_pages, jaxpage.engine.host_page_cache), an evicted cached page is copied to host memory
instead of dropped, and a prefix chain continues there: match_prefix gives such a page a device page and a copy back.
"""

from __future__ import annotations

import array
import collections
import hashlib
import operator

from jaxpage.engine.block_tables import NULL_PAGE, BlockTables
from jaxpage.engine.host_page_cache import HostPageCache
from jaxpage.sequence import Sequence


def hash_page(parent_hash: bytes | None, token_ids: tuple[int, ...]) -> bytes:
    """Chained prefix-cache key of one full page: sha256 of the previous page's key (None for the first page)
    and this page's token ids. A cryptographic hash, so that crafted prompts cannot collide with others' pages."""
    h = hashlib.sha256(b"\x00" if parent_hash is None else b"\x01" + parent_hash)
    h.update(array.array("q", token_ids).tobytes())
    return h.digest()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    """Host bookkeeping of the KV page pool. Plain Python; every call is O(pages it touches)."""

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        enable_prefix_caching: bool = True,
        sliding_window: int | None = None,
        table: str = "block_table",  # the Sequence attribute that holds its pages here (kv_cache_groups)
        host_pages: int = 0,  # slots of the prefix cache's host tier (jaxpage.engine.host_page_cache); 0: none
    ):
        _check_sizes(num_pages, page_size, sliding_window)
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        self._table = operator.attrgetter(table)
        self._free_pages: collections.deque[int] = collections.deque(range(1, num_pages))
        # Ref count 0 and registered; iteration order is LRU first.
        self._cached_pages: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._ref_counts = [0] * num_pages
        self._num_referenced = 0
        # Per referenced page: slots holding or reserved for tokens (max over its sharers); 0 for the others.
        self._filled_slots = [0] * num_pages
        self._num_filled_slots = 0
        self._hash_to_page: dict[bytes, int] = {}
        self._page_key: dict[int, tuple[bytes, tuple[int, ...]]] = {}  # registered page -> (key, its token ids)
        self._seqs: dict[int, Sequence] = {}  # seq_id -> live sequence that holds (or may hold) pages
        self._seq_hashes: dict[int, list[bytes]] = {}  # seq_id -> keys of its leading full computed pages
        self._copies: dict[int, int] = {}  # copy-on-write not yet taken: dst page -> src page
        self.host = HostPageCache(host_pages) if host_pages and enable_prefix_caching else None
        self.tables = BlockTables()  # every live sequence's block table, as one array (a step's is a gather)

    @property
    def num_free_pages(self) -> int:
        """Pages an allocation can take: free ones plus evictable cached ones."""
        return len(self._free_pages) + len(self._cached_pages)

    @property
    def num_used_pages(self) -> int:
        """Pages referenced by at least one live sequence."""
        return self._num_referenced

    def pages_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Pages that allocate_slots(seq, num_new_tokens) would take from the free pool (incl. copy-on-write pages)."""
        end = seq.num_computed_tokens + num_new_tokens
        return max(0, _cdiv(end, self.page_size) - len(self._table(seq))) + len(self._shared_pages(seq, num_new_tokens))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether allocate_slots(seq, num_new_tokens) would find the pages it needs."""
        return self.pages_needed(seq, num_new_tokens) <= self.num_free_pages

    def match_prefix(self, seq: Sequence, max_tokens: int | None = None) -> int:
        """Give a sequence with an empty block table the longest chain of its full prompt pages found in the prefix
        cache (ref += 1 each; a cached page becomes referenced). Sets seq.num_computed_tokens to the tokens they hold
        and returns it. At most (num_prompt_tokens - 1) // page_size pages, so at least one prompt token is left to
        compute (its logits are needed), and no more than max_tokens. Returns 0 when prefix caching is off."""
        assert not self._table(seq), f"match_prefix on sequence {seq.seq_id} that already holds pages"
        if not self.enable_prefix_caching:
            return 0
        self._register(seq)
        hashes = self._seq_hashes[seq.seq_id]
        limit = seq.num_prompt_tokens - 1 if max_tokens is None else min(max_tokens, seq.num_prompt_tokens - 1)
        for key, page in _take_chain(self, _cached_chain(self, seq.token_ids[:limit], seq.prefix_root)):
            self._set_filled(page, self.page_size)
            self._table(seq).append(page)
            hashes.append(key)
        seq.num_computed_tokens = len(hashes) * self.page_size
        self.tables.write(seq.seq_id, self._table(seq))
        self.free_outside_window(seq)  # a long hit's first pages may lie before the window already
        return seq.num_computed_tokens

    def cached_prefix_tokens(self, token_ids: list[int], root: bytes | None = None) -> int:
        """Tokens of a prompt (of root `prefix_root`) that match_prefix would find in the prefix cache now."""
        if not self.enable_prefix_caching:
            return 0
        return len(_cached_chain(self, token_ids[: len(token_ids) - 1], root)) * self.page_size

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make seq's block table cover token positions [0, seq.num_computed_tokens + num_new_tokens).

        New pages come from the free list, else by evicting the least recently used cached page. A shared page
        (ref count > 1) that these tokens would be written into is copied first: a new page replaces it in the table,
        one reference to it is dropped, and (src, dst) is recorded for take_copies when it holds computed tokens of
        seq. If src is itself the destination of a copy not yet taken, dst copies that copy's source instead, so
        the copies of one step never chain. A page of seq's alone that these tokens would be written into leaves the
        prefix cache if it was registered (a fork can end part-way through a full page).
        All or nothing: returns False and changes nothing if there are not enough pages.
        """
        assert num_new_tokens >= 0, num_new_tokens
        ps, table = self.page_size, self._table(seq)
        start = seq.num_computed_tokens
        end = start + num_new_tokens
        if num_new_tokens and _into_own_last_page(self, table, start, end):  # (most decode steps)
            return True
        if not self.can_allocate(seq, num_new_tokens):
            return False
        self._register(seq)
        for i in self._shared_pages(seq, num_new_tokens):
            src, dst = table[i], self._take_page()
            if i * ps < start:
                self._copies[dst] = self._copies.get(src, src)
            self._ref_counts[src] -= 1  # was > 1: src stays referenced by its other sharers
            table[i] = dst
        first = min(start // ps, len(table))
        if num_new_tokens:
            for page in table[first : _cdiv(end, ps)]:
                self._unregister(page)  # seq's alone now, but full of a sibling's tokens (forked part-way)
        while len(table) < _cdiv(end, ps):
            table.append(self._take_page())
        for i in range(first, _cdiv(end, ps)):
            self._set_filled(table[i], min(ps, end - i * ps))
        self.tables.write(seq.seq_id, table)
        return True

    def release_slots(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the slots seq holds past its first num_tokens tokens: those a step reserved for speculative
        draft tokens that verification rejected (num_tokens >= seq.num_computed_tokens). Pages past them return to
        the free list, and the last page kept counts only the slots it keeps. The K/V written into released slots
        is garbage that later tokens overwrite; it was never computed, so it was never registered in the prefix
        cache. Only pages of seq's alone hold such slots (allocate_slots copies a shared page before a write)."""
        assert num_tokens >= seq.num_computed_tokens, (num_tokens, seq.num_computed_tokens)
        ps, table = self.page_size, self._table(seq)
        keep = _cdiv(num_tokens, ps)
        while len(table) > keep:
            page = table.pop()
            assert self._ref_counts[page] == 1 and page not in self._page_key, f"page {page} is not seq's alone"
            self._ref_counts[page] = 0
            self._release(page)
        self.tables.write(seq.seq_id, table)
        if table and len(table) == keep and self._ref_counts[table[-1]] == 1:
            last, slots = table[-1], num_tokens - (keep - 1) * ps
            if slots < self._filled_slots[last]:
                self._num_filled_slots -= self._filled_slots[last] - slots
                self._filled_slots[last] = slots

    def cache_full_pages(self, seq: Sequence) -> None:
        """Register in the prefix cache each page of seq that is now full of computed tokens and not yet registered.
        If an identical key already maps to another page, that mapping is kept. No-op when prefix caching is off.
        Computed tokens not yet in seq.token_ids (accepted draft tokens, before the engine appends them) wait for
        a later call."""
        hashes = self._seq_hashes.get(seq.seq_id)
        full_pages = min(seq.num_computed_tokens, len(seq.token_ids)) // self.page_size
        if hashes is not None and self.enable_prefix_caching and full_pages > len(hashes):  # (most calls: none filled)
            _register_pages(self, seq, hashes, full_pages)

    def free_outside_window(self, seq: Sequence) -> None:
        """With a sliding window: drop seq's references to its pages that hold only tokens before
        num_computed_tokens - sliding_window + 1, the first key its next token reads (later tokens read later keys);
        their table entries become the null page. A page whose count reaches 0 becomes cached if registered in the
        prefix cache (another prompt may start with it), else free. No-op without a window."""
        if self.sliding_window is None:
            return
        ps, table = self.page_size, self._table(seq)
        first_needed = max(0, seq.num_computed_tokens - self.sliding_window + 1)
        changed = False
        for i in range(min(first_needed // ps, len(table))):
            page = table[i]
            if page != NULL_PAGE:
                table[i] = NULL_PAGE
                changed = True
                self._ref_counts[page] -= 1
                if self._ref_counts[page] == 0:
                    self._release(page)
        if changed:
            self.tables.write(seq.seq_id, table)

    def can_fork(self, parent: Sequence, num_tokens: int) -> bool:
        """Whether a child of parent's first num_tokens tokens would find every page it reads in parent's table: not
        when parent, further on, gave back pages inside the child's window (free_outside_window)."""
        first_needed = 0 if self.sliding_window is None else max(0, num_tokens - self.sliding_window + 1)
        pages = self._table(parent)[: _cdiv(num_tokens, self.page_size)]
        return all(page != NULL_PAGE or (i + 1) * self.page_size <= first_needed for i, page in enumerate(pages))

    def fork(self, parent: Sequence, child: Sequence, num_tokens: int) -> None:
        """child (empty block table), whose first num_tokens tokens are parent's first num_tokens, shares the pages
        of parent that hold them (ref += 1 each) and has them computed. A last page that is only partly the child's
        is copied when the child writes into it (allocate_slots)."""
        assert not self._table(child), f"fork into sequence {child.seq_id} that already holds pages"
        assert child.seq_id != parent.seq_id
        assert num_tokens <= parent.num_computed_tokens, (num_tokens, parent.num_computed_tokens)
        assert child.token_ids[:num_tokens] == parent.token_ids[:num_tokens], "fork of other tokens"
        assert self.can_fork(parent, num_tokens), "fork of pages given back inside the child's window"
        self._register(child)
        pages = self._table(parent)[: _cdiv(num_tokens, self.page_size)]
        for page in pages:
            if page != NULL_PAGE:  # given back outside the window: outside the child's too
                self._ref_counts[page] += 1
        self._table(child).extend(pages)
        self.tables.write(child.seq_id, self._table(child))
        child.num_computed_tokens = num_tokens
        child.num_draft_computed_tokens = min(parent.num_draft_computed_tokens, num_tokens)
        self._seq_hashes[child.seq_id].extend(self._seq_hashes.get(parent.seq_id, [])[: num_tokens // self.page_size])

    def free(self, seq: Sequence) -> None:
        """Drop seq's references, tail first so that the tail of a prefix chain is evicted first. A page whose count
        reaches 0 becomes cached if registered in the prefix cache, else free. Clears the block table and sets
        seq.num_computed_tokens (and num_draft_computed_tokens) to 0."""
        table = self._table(seq)
        if table:
            assert self._seqs.get(seq.seq_id) is seq, f"free of sequence {seq.seq_id} unknown to the block manager"
        for page in reversed(table):
            if page == NULL_PAGE:  # given back outside the window
                continue
            self._ref_counts[page] -= 1
            if self._ref_counts[page] == 0:
                self._release(page)
        table.clear()
        seq.num_computed_tokens = seq.num_draft_computed_tokens = 0
        if self._seqs.get(seq.seq_id) is seq:
            del self._seqs[seq.seq_id]
            del self._seq_hashes[seq.seq_id]
            self.tables.release(seq.seq_id)

    def block_tables(self, seqs: list[Sequence]) -> tuple:
        """(the sequences' tables, a row each; None, a grouped pool's window group's; their sampler rows)."""
        tables, sampling = self.tables.gather_with_sampling([seq.seq_id for seq in seqs])
        return tables, None, sampling

    def take_window_copies(self) -> list[tuple[int, int]]:
        """A grouped pool's window group's copies (jaxpage.engine.kv_cache_groups): none, here."""
        return []

    def take_transfers(self) -> tuple[list, ...]:
        """The host tier's copies recorded since the last call (HostPageCache.take_transfers), as one group's."""
        return (self.host.take_transfers() if self.host is not None else [],)

    def take_copies(self) -> list[tuple[int, int]]:
        """The (src_page, dst_page) copy-on-write copies recorded since the last call; clears them. The device
        applies them all at once (every src read before any dst is written), before the step writes new K/V.
        Each dst appears once; a dst page that was freed meanwhile is left out."""
        copies = [(src, dst) for dst, src in self._copies.items()]
        self._copies = {}
        return copies

    def kv_utilization(self) -> float:
        """Token slots holding (or reserved for) tokens / slots of all referenced pages; 1.0 when none is referenced.
        A shared page counts once."""
        if not self._num_referenced:
            return 1.0
        return self._num_filled_slots / (self._num_referenced * self.page_size)

    def check_invariants(self) -> None:
        """Assert the internal invariants (for tests and debugging; O(pool size + block tables))."""
        _check_invariants(self)

    def _register(self, seq: Sequence) -> None:
        known = self._seqs.setdefault(seq.seq_id, seq)
        assert known is seq, f"two live sequences with seq_id {seq.seq_id}"
        self._seq_hashes.setdefault(seq.seq_id, [])
        self.tables.assign(seq.seq_id, seq.sampler_row)

    def _shared_pages(self, seq: Sequence, num_new_tokens: int) -> list[int]:
        """Block-table indices of shared pages that num_new_tokens new tokens of seq would be written into."""
        if num_new_tokens <= 0:
            return []
        ps, start = self.page_size, seq.num_computed_tokens
        table = self._table(seq)
        stop = min(len(table), _cdiv(start + num_new_tokens, ps))
        return [i for i in range(start // ps, stop) if self._ref_counts[table[i]] > 1]

    def _take_page(self) -> int:
        if self._free_pages:
            page = self._free_pages.popleft()
        else:
            page, _ = self._cached_pages.popitem(last=False)
            if self.host is not None:
                self.host.offload(page, *self._page_key[page])
            self._unregister(page)
        self._ref_counts[page] = 1
        self._num_referenced += 1
        return page

    def _unregister(self, page: int) -> None:
        entry = self._page_key.pop(page, None)
        if entry is not None:
            del self._hash_to_page[entry[0]]

    def _add_ref(self, page: int) -> None:
        if self._ref_counts[page] == 0:
            del self._cached_pages[page]
            self._num_referenced += 1
        self._ref_counts[page] += 1

    def _release(self, page: int) -> None:
        self._copies.pop(page, None)  # nobody reads it any more
        self._num_referenced -= 1
        self._num_filled_slots -= self._filled_slots[page]
        self._filled_slots[page] = 0
        if page in self._page_key:
            self._cached_pages[page] = None  # most recently used end
        else:
            self._free_pages.append(page)

    def _set_filled(self, page: int, slots: int) -> None:
        if slots > self._filled_slots[page]:
            self._num_filled_slots += slots - self._filled_slots[page]
            self._filled_slots[page] = slots


def _register_pages(bm: BlockManager, seq: Sequence, hashes: list[bytes], full_pages: int) -> None:
    """cache_full_pages of seq's pages from len(hashes) (its registered ones' keys) to full_pages."""
    ps, table = bm.page_size, bm._table(seq)
    parent = hashes[-1] if hashes else seq.prefix_root
    for i in range(len(hashes), min(full_pages, len(table))):
        tokens = tuple(seq.token_ids[i * ps : (i + 1) * ps])
        key = hash_page(parent, tokens)
        page = table[i]
        if page == NULL_PAGE:  # given back outside the window before it could be registered: the chain ends
            return
        if key not in bm._hash_to_page and page not in bm._page_key:
            bm._hash_to_page[key] = page
            bm._page_key[page] = (key, tokens)
        hashes.append(key)
        parent = key


def _into_own_last_page(bm: BlockManager, table: list[int], start: int, end: int) -> bool:
    """allocate_slots' short way, for tokens [start, end) of a sequence with block table `table`: when they go into
    its last page, which it alone holds and which is not in the prefix cache, they only fill its slots (True); else
    nothing is done (False)."""
    ps, last = bm.page_size, len(table) - 1
    if start // ps != last or end > (last + 1) * ps:
        return False
    page = table[last]
    if bm._ref_counts[page] != 1 or page in bm._page_key:
        return False
    slots, filled = end - last * ps, bm._filled_slots  # (_set_filled's, inline)
    if slots > filled[page]:
        bm._num_filled_slots += slots - filled[page]
        filled[page] = slots
    return True


def _cached_chain(bm: BlockManager, token_ids: list[int], root: bytes | None) -> list[tuple]:
    """(key, tokens, device page, None) or, on the host tier only, (key, tokens, None, host slot) of token_ids' full
    pages in bm's prefix cache, from the first while they chain (from `root`), and while the free pages can take the
    host's (a cached device page of the chain is no longer free once hit)."""
    ps, parent, chain, pages_taken = bm.page_size, root, [], 0
    for i in range(len(token_ids) // ps):
        tokens = tuple(token_ids[i * ps : (i + 1) * ps])
        key = hash_page(parent, tokens)
        page = bm._hash_to_page.get(key)
        slot = None if page is not None or bm.host is None else bm.host.find(key, tokens)
        if (page is None or bm._page_key[page][1] != tokens) and slot is None:
            break
        pages_taken += slot is not None or bm._ref_counts[page] == 0
        if pages_taken > bm.num_free_pages:
            break
        chain.append((key, tokens, None if slot is not None else page, slot))
        parent = key
    return chain


def _take_chain(bm: BlockManager, chain: list[tuple]) -> list[tuple[bytes, int]]:
    """(key, device page) of a prefix hit's `chain` (_cached_chain), each page referenced: the device's pages first
    (none is then evicted by the loads), then a device page for each of the host tier's, its copy back recorded and
    the page registered. The host slots the chain reads are pinned meanwhile: a page evicted to make room is not
    offloaded into one of them before it is read."""
    for _, _, page, _ in chain:
        if page is not None:
            bm._add_ref(page)
    if bm.host is not None:
        bm.host.pinned = {slot for *_, slot in chain if slot is not None}
    taken = []
    for key, tokens, page, slot in chain:
        if page is None:  # on the host tier only
            page = bm._take_page()
            bm.host.load(slot, page)
            bm._hash_to_page[key], bm._page_key[page] = page, (key, tokens)
        taken.append((key, page))
    if bm.host is not None:
        bm.host.pinned = set()
    return taken


def _check_sizes(num_pages: int, page_size: int, sliding_window: int | None) -> None:
    if num_pages < 2:
        raise ValueError(f"num_pages must be >= 2 (page 0 is the reserved null page), got {num_pages}")
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")


def _check_invariants(bm: BlockManager) -> None:
    """BlockManager.check_invariants."""
    n, ps = bm.num_pages, bm.page_size
    free, cached = set(bm._free_pages), set(bm._cached_pages)
    referenced = {p for p in range(n) if bm._ref_counts[p] > 0}
    assert len(free) == len(bm._free_pages), "a page is twice on the free list"
    assert NULL_PAGE not in free | cached | referenced, "the null page was handed out"
    assert free.isdisjoint(cached) and free.isdisjoint(referenced) and cached.isdisjoint(referenced)
    assert len(free) + len(cached) + len(referenced) == n - 1, "a page is in no state"
    assert bm._num_referenced == len(referenced)
    assert min(bm._ref_counts) >= 0
    counts = [0] * n
    for seq_id, seq in bm._seqs.items():
        assert seq.seq_id == seq_id
        assert len(bm._table(seq)) * ps >= seq.num_computed_tokens, f"sequence {seq_id}: computed tokens unpaged"
        assert seq.num_draft_computed_tokens <= seq.num_computed_tokens, f"sequence {seq_id}: draft K/V ahead"
        assert len(bm._seq_hashes[seq_id]) <= len(bm._table(seq))
        window_start = 0 if bm.sliding_window is None else seq.num_computed_tokens - bm.sliding_window + 1
        for i, page in enumerate(bm._table(seq)):
            if page == NULL_PAGE:  # only pages wholly outside the window are given back
                assert (i + 1) * ps <= window_start, f"sequence {seq_id}: page {i} given back inside the window"
                continue
            counts[page] += 1
    assert counts[1:] == bm._ref_counts[1:], "ref counts differ from the block tables of live sequences"
    assert bm._seq_hashes.keys() == bm._seqs.keys()
    assert all(p in bm._page_key for p in cached), "a cached page has no hash"
    assert all(p not in bm._page_key for p in free), "a free page has a hash"
    assert len(bm._hash_to_page) == len(bm._page_key)
    for key, page in bm._hash_to_page.items():
        assert bm._page_key[page][0] == key and len(bm._page_key[page][1]) == ps
    assert bm.enable_prefix_caching or not bm._page_key
    assert all(1 <= bm._filled_slots[p] <= ps for p in referenced)
    assert all(bm._filled_slots[p] == 0 for p in free | cached) and bm._filled_slots[NULL_PAGE] == 0
    assert sum(bm._filled_slots) == bm._num_filled_slots
    assert all(bm._ref_counts[dst] > 0 and src != NULL_PAGE for dst, src in bm._copies.items())
    if bm.host is not None:
        bm.host.check_invariants()
    bm.tables.check({seq_id: bm._table(seq) for seq_id, seq in bm._seqs.items()})
