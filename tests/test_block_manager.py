"""BlockManager: page states, prefix cache hits and LRU eviction, fork + copy-on-write, and a stateful property test
that drives it like an engine, with a shadow "device" pool recording which token each KV slot holds."""

from __future__ import annotations

import collections

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from jaxpage.engine import block_manager
from jaxpage.engine.block_manager import NULL_PAGE, BlockManager
from jaxpage.sequence import Sequence


def make_seq(seq_id: int, tokens) -> Sequence:
    return Sequence(seq_id=seq_id, prompt_token_ids=list(tokens))


def num_cached(bm: BlockManager) -> int:
    """Pages with ref count 0 kept in the prefix cache."""
    return len(bm._cached_pages)


def run_chunk(bm: BlockManager, seq: Sequence, num_tokens: int) -> bool:
    """What one engine step does for a sequence: get slots, compute the tokens, register the full pages."""
    if not bm.allocate_slots(seq, num_tokens):
        return False
    seq.num_computed_tokens += num_tokens
    bm.cache_full_pages(seq)
    return True


def computed_and_forked(bm: BlockManager, tokens, fork_at: int) -> tuple[Sequence, Sequence]:
    """A parent with all its tokens computed, and a child of the same tokens forked from it at fork_at."""
    parent = make_seq(0, tokens)
    assert run_chunk(bm, parent, len(parent.prompt_token_ids))
    child = make_seq(1, tokens)
    bm.fork(parent, child, fork_at)
    return parent, child


def test_rejects_bad_sizes():
    with pytest.raises(ValueError, match="num_pages"):
        BlockManager(num_pages=1, page_size=4)
    with pytest.raises(ValueError, match="page_size"):
        BlockManager(num_pages=8, page_size=0)


def test_allocates_pages_on_demand_and_never_page_zero():
    bm = BlockManager(num_pages=8, page_size=4)
    seq = make_seq(0, range(10))
    assert bm.pages_needed(seq, 3) == 1
    assert run_chunk(bm, seq, 3) and len(seq.block_table) == 1
    assert bm.pages_needed(seq, 1) == 0  # position 3 is in the first page
    assert run_chunk(bm, seq, 1) and len(seq.block_table) == 1
    assert bm.pages_needed(seq, 6) == 2  # positions 4..9: pages 1 and 2
    assert run_chunk(bm, seq, 6) and len(seq.block_table) == 3
    assert (bm.num_used_pages, bm.num_free_pages) == (3, 4)
    other = make_seq(1, range(100, 116))
    assert run_chunk(bm, other, 16)  # takes the last 4 pages
    assert bm.num_free_pages == 0
    assert sorted(seq.block_table + other.block_table) == list(range(1, 8))  # every page but the null page
    assert NULL_PAGE not in seq.block_table + other.block_table
    bm.check_invariants()


def test_allocation_is_all_or_nothing():
    bm = BlockManager(num_pages=4, page_size=2)  # 3 usable pages
    a, b = make_seq(0, range(4)), make_seq(1, range(10, 14))
    assert run_chunk(bm, a, 4)
    assert bm.pages_needed(b, 4) == 2 > bm.num_free_pages == 1
    assert not bm.allocate_slots(b, 4)
    assert (b.block_table, b.num_computed_tokens) == ([], 0)
    assert (bm.num_used_pages, bm.num_free_pages, bm.take_copies()) == (2, 1, [])
    assert bm.allocate_slots(b, 2)
    bm.check_invariants()


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_free_returns_pages(prefix_caching):
    bm = BlockManager(num_pages=8, page_size=2, enable_prefix_caching=prefix_caching)
    seq = make_seq(0, [1, 2, 3, 4, 5])
    assert run_chunk(bm, seq, 5)
    bm.free(seq)
    assert (seq.block_table, seq.num_computed_tokens) == ([], 0)
    assert (bm.num_free_pages, bm.num_used_pages) == (7, 0)
    assert num_cached(bm) == (2 if prefix_caching else 0)  # the two full pages stay findable
    bm.check_invariants()


def test_prefix_hit_reuses_the_same_pages():
    bm = BlockManager(num_pages=16, page_size=4)
    a = make_seq(0, range(10))
    assert bm.match_prefix(a) == 0
    assert run_chunk(bm, a, 10)
    shared = a.block_table[:2]  # the two full pages; the third holds tokens 8, 9 only
    live_hit = make_seq(1, [*range(8), 50, 51, 52])
    assert bm.match_prefix(live_hit) == 8
    assert (live_hit.block_table, live_hit.num_computed_tokens) == (shared, 8)
    assert bm.num_used_pages == 3  # shared pages count once
    bm.free(a)
    bm.free(live_hit)
    assert num_cached(bm) == 2
    cached_hit = make_seq(2, [*range(4), 60, 61, 62, 63, 64])
    assert bm.match_prefix(cached_hit) == 4
    assert cached_hit.block_table == shared[:1]
    assert (num_cached(bm), bm.num_used_pages) == (1, 1)
    miss = make_seq(3, [0, 1, 2, 9, 4, 5, 6, 7, 8])  # differs in the first page: the chain breaks at once
    assert bm.match_prefix(miss) == 0 and miss.block_table == []
    bm.check_invariants()


def test_never_matches_the_whole_prompt():
    bm = BlockManager(num_pages=16, page_size=4)
    a = make_seq(0, range(12))
    assert run_chunk(bm, a, 12)
    bm.free(a)
    assert num_cached(bm) == 3
    assert bm.match_prefix(make_seq(1, range(8))) == 4  # exactly 2 pages: the last token must still be computed
    assert bm.match_prefix(make_seq(2, range(9))) == 8
    assert bm.match_prefix(make_seq(3, range(4))) == 0
    assert bm.match_prefix(make_seq(4, range(12))) == 8
    bm.check_invariants()


def test_duplicate_page_keeps_the_first_mapping():
    bm = BlockManager(num_pages=8, page_size=2)
    a, b = make_seq(0, [1, 2, 3]), make_seq(1, [1, 2, 3])
    assert bm.match_prefix(a) == bm.match_prefix(b) == 0  # prefilled side by side: neither is registered yet
    assert run_chunk(bm, a, 3) and run_chunk(bm, b, 3)
    first_a, first_b = a.block_table[0], b.block_table[0]
    assert first_a != first_b
    bm.free(a)
    bm.free(b)
    assert num_cached(bm) == 1  # b's duplicate page went back to the free list
    c = make_seq(2, [1, 2, 3])
    assert bm.match_prefix(c) == 2 and c.block_table == [first_a]
    bm.check_invariants()


def test_lru_eviction_order():
    bm = BlockManager(num_pages=5, page_size=2)  # usable pages 1..4
    x, y = make_seq(0, [1, 2, 3]), make_seq(1, [5, 6, 7])
    assert run_chunk(bm, x, 3) and run_chunk(bm, y, 3)
    assert (x.block_table, y.block_table) == ([1, 2], [3, 4])  # pages 1 and 3 are full and registered
    bm.free(x)  # 2 -> free, 1 -> cached
    bm.free(y)  # 4 -> free, 3 -> cached; LRU order [1, 3]
    z = make_seq(2, [1, 2, 9])
    assert bm.match_prefix(z) == 2 and z.block_table == [1]
    bm.free(z)  # the hit made page 1 the most recently used: LRU order [3, 1]
    w = make_seq(3, [8] * 6)
    assert run_chunk(bm, w, 6)
    assert w.block_table == [2, 4, 3]  # free pages first, then the least recently used cached page
    assert bm.match_prefix(make_seq(4, [5, 6, 7])) == 0  # page 3 was evicted: its hash is gone
    assert bm.match_prefix(make_seq(5, [1, 2, 3])) == 2
    bm.check_invariants()


def test_chain_tail_is_evicted_first():
    bm = BlockManager(num_pages=6, page_size=2)  # usable pages 1..5
    a = make_seq(0, [1, 2, 3, 4, 5, 6, 7])
    assert run_chunk(bm, a, 7) and a.block_table == [1, 2, 3, 4]
    bm.free(a)  # reverse order: 4 -> free (partial), then 3, 2, 1 -> cached in that order
    b = make_seq(1, [9] * 6)
    assert run_chunk(bm, b, 6) and b.block_table == [5, 4, 3]  # evicts page 3, the last of the chain
    assert bm.match_prefix(make_seq(2, [1, 2, 3, 4, 5, 6, 7])) == 4  # pages 1, 2 still hit
    bm.check_invariants()


def test_hit_page_is_not_evictable_while_referenced():
    bm = BlockManager(num_pages=4, page_size=2)  # usable pages 1..3
    a = make_seq(0, [1, 2, 3])
    assert run_chunk(bm, a, 3) and a.block_table == [1, 2]
    bm.free(a)
    b = make_seq(1, [1, 2, 3])
    assert bm.match_prefix(b) == 2 and b.block_table == [1]
    assert (num_cached(bm), bm.num_free_pages, bm.num_used_pages) == (0, 2, 1)
    c = make_seq(2, [7] * 6)
    assert not bm.allocate_slots(c, 6)  # would need page 1, which b holds
    assert run_chunk(bm, c, 4) and sorted(c.block_table) == [2, 3]
    assert not bm.allocate_slots(make_seq(3, [8]), 1)
    assert b.block_table == [1]
    bm.check_invariants()


def test_fork_and_copy_on_write():
    bm = BlockManager(num_pages=8, page_size=4)
    parent, child = computed_and_forked(bm, [1, 2, 3, 4, 5, 6], 6)
    p_full, p_tail = parent.block_table
    assert child.block_table == [p_full, p_tail] and child.num_computed_tokens == 6
    assert bm._ref_counts[p_full] == bm._ref_counts[p_tail] == 2
    assert bm.num_used_pages == 2
    bm.check_invariants()

    child.append_token(100)
    assert bm.pages_needed(child, 1) == 1  # the shared tail page must be copied before token 6 goes into it
    assert bm.allocate_slots(child, 1)
    copy_page = child.block_table[1]
    assert child.block_table == [p_full, copy_page] and copy_page not in (NULL_PAGE, p_full, p_tail)
    assert bm.take_copies() == [(p_tail, copy_page)]
    assert bm.take_copies() == []
    assert parent.block_table == [p_full, p_tail]
    assert (bm._ref_counts[p_full], bm._ref_counts[p_tail], bm._ref_counts[copy_page]) == (2, 1, 1)
    child.num_computed_tokens += 1

    parent.append_token(200)
    assert bm.pages_needed(parent, 1) == 0  # the tail page is now the parent's alone
    assert bm.allocate_slots(parent, 1) and bm.take_copies() == []
    parent.num_computed_tokens += 1
    bm.check_invariants()

    bm.free(parent)
    assert (bm._ref_counts[p_full], bm._ref_counts[p_tail]) == (1, 0)
    bm.free(child)
    assert bm.num_used_pages == 0 and bm.num_free_pages == 7
    bm.check_invariants()


def test_fork_at_a_page_boundary_copies_nothing():
    bm = BlockManager(num_pages=8, page_size=4)
    parent, child = computed_and_forked(bm, range(8), 8)
    child.append_token(9)
    assert bm.pages_needed(child, 1) == 1  # a fresh page, not a copy
    assert bm.allocate_slots(child, 1) and bm.take_copies() == []
    assert child.block_table[:2] == parent.block_table and len(child.block_table) == 3
    bm.check_invariants()


def test_fork_of_a_prompt_prefix_shares_only_its_pages():
    # What parallel sampling does: the parent has gone past the prompt (7 tokens, page_size 4); a sibling with the
    # same prompt forks its first 6 tokens and computes token 6 itself.
    bm = BlockManager(num_pages=8, page_size=4)
    parent = make_seq(0, range(7))
    assert run_chunk(bm, parent, 7)
    parent.append_token(50)
    parent.append_token(51)
    assert run_chunk(bm, parent, 2)  # 9 computed tokens: pages [0-3] [4-7] [8]
    p0, p1, p2 = parent.block_table
    child = make_seq(1, range(7))
    bm.fork(parent, child, 6)
    assert (child.block_table, child.num_computed_tokens) == ([p0, p1], 6)  # p1 holds 4, 5 of the child's
    assert [bm._ref_counts[p] for p in (p0, p1, p2)] == [2, 2, 1]
    assert bm._seq_hashes[1] == bm._seq_hashes[0][:1]  # only page 0 is full of the child's tokens
    assert bm.pages_needed(child, 1) == 1
    assert run_chunk(bm, child, 1)  # token 6 goes into a copy of p1 (which holds the parent's 6 and 7)
    c1 = child.block_table[1]
    assert bm.take_copies() == [(p1, c1)] and c1 not in (p0, p1, p2)
    assert [bm._ref_counts[p] for p in (p0, p1, p2, c1)] == [2, 1, 1, 1]
    bm.check_invariants()
    bm.free(parent)
    bm.free(child)
    assert bm.num_used_pages == 0
    bm.check_invariants()


def test_fork_of_no_tokens_shares_nothing():
    bm = BlockManager(num_pages=8, page_size=4)
    parent = make_seq(0, [5])
    assert run_chunk(bm, parent, 1)
    child = make_seq(1, [5])
    bm.fork(parent, child, 0)  # a 1-token prompt: nothing to share
    assert (child.block_table, child.num_computed_tokens) == ([], 0)
    assert run_chunk(bm, child, 1) and child.block_table != parent.block_table and bm.take_copies() == []
    bm.check_invariants()


def test_a_cached_page_written_by_its_last_holder_leaves_the_cache():
    # A fork part-way through a full, registered page; once the parent is gone the child writes into it in place:
    # the page no longer holds what its prefix-cache key says, so the key must go.
    bm = BlockManager(num_pages=8, page_size=4)
    parent = make_seq(0, [1, 2, 3, 4, 5])
    assert run_chunk(bm, parent, 5)
    p0 = parent.block_table[0]
    assert p0 in bm._page_key
    child = make_seq(1, [1, 2, 9])
    bm.fork(parent, child, 2)
    bm.free(parent)
    assert bm._ref_counts[p0] == 1
    assert run_chunk(bm, child, 1) and child.block_table == [p0] and bm.take_copies() == []
    assert p0 not in bm._page_key
    assert bm.match_prefix(make_seq(2, [1, 2, 3, 4, 5])) == 0
    bm.check_invariants()


def test_copies_of_one_step_never_chain():
    # b forks a, whose shared page was copied this step but not yet on the device: b's copy must come from the
    # original page, since the device runs a step's copies all at once.
    bm = BlockManager(num_pages=8, page_size=4)
    parent = make_seq(0, range(7))
    assert run_chunk(bm, parent, 7)
    a, b = make_seq(1, range(7)), make_seq(2, range(7))
    bm.fork(parent, a, 6)
    assert bm.allocate_slots(a, 1)
    bm.fork(a, b, 6)
    assert b.block_table == a.block_table
    assert bm.allocate_slots(b, 1)
    p1, a1, b1 = parent.block_table[1], a.block_table[1], b.block_table[1]
    assert len({p1, a1, b1}) == 3
    assert bm.take_copies() == [(p1, a1), (p1, b1)]
    bm.check_invariants()


def test_copy_into_a_page_freed_in_the_same_step_is_dropped():
    bm = BlockManager(num_pages=8, page_size=4)
    parent, child = computed_and_forked(bm, range(7), 6)
    assert bm.allocate_slots(child, 1)
    bm.free(child)  # its copy is gone with it: nobody would read it, and the page may be handed out again
    assert bm.take_copies() == []
    bm.check_invariants()


def test_kv_utilization_worked_example():
    bm = BlockManager(num_pages=8, page_size=4)
    assert bm.kv_utilization() == 1.0  # nothing referenced
    a = make_seq(0, [1, 2, 3, 4, 5, 6])
    assert run_chunk(bm, a, 6)
    assert bm.kv_utilization() == 6 / 8  # page A0 holds 4 slots, A1 holds 2: 6 of 2 * 4
    b = make_seq(1, a.prompt_token_ids)
    bm.fork(a, b, 6)
    assert bm.kv_utilization() == 6 / 8  # shared pages count once
    b.append_token(7)
    assert bm.allocate_slots(b, 1)  # copy-on-write of A1 into B1, which holds positions 4, 5, 6
    assert bm.kv_utilization() == (4 + 2 + 3) / 12  # A0 + A1 + B1 = 9 of 3 * 4
    a.append_token(8)
    assert bm.allocate_slots(a, 1)  # A1 now also holds position 6
    assert bm.kv_utilization() == (4 + 3 + 3) / 12
    bm.free(b)  # B1 goes; A0 is still referenced by a
    assert bm.kv_utilization() == (4 + 3) / 8
    bm.free(a)
    assert bm.kv_utilization() == 1.0
    c = make_seq(2, [1, 2, 3, 4, 9])
    assert bm.match_prefix(c) == 4 and bm.kv_utilization() == 4 / 4  # a hit page is full
    assert bm.allocate_slots(c, 1)
    assert bm.kv_utilization() == (4 + 1) / 8


def test_evicted_pages_go_to_the_host_tier_and_come_back_on_a_hit():
    bm = BlockManager(num_pages=4, page_size=2, host_pages=3)  # 3 usable device pages
    first = make_seq(0, [1, 2, 3, 4, 5])
    assert run_chunk(bm, first, 5)
    full_pages = first.block_table[:2]
    bm.free(first)  # its 2 full pages cached on the device
    other = make_seq(1, [9, 9, 9, 9, 9])
    assert run_chunk(bm, other, 5)  # takes the free page and evicts both cached ones: copied to the host
    [(kind0, page0, slot0), (kind1, page1, slot1)] = [(t.kind, t.page, t.slot) for t in bm.host.take_transfers()]
    assert (kind0, kind1) == ("offload", "offload") and {page0, page1} == set(full_pages)
    bm.free(other)
    again = make_seq(2, [1, 2, 3, 4, 5])
    assert bm.cached_prefix_tokens(again.token_ids) == 4
    assert bm.match_prefix(again) == 4 and again.num_computed_tokens == 4
    loads = bm.host.take_transfers()
    # the first load takes the free page; the second evicts one of other's cached pages (offloaded first)
    assert [t.kind for t in loads] == ["load", "offload", "load"]
    slot_of = {page0: slot0, page1: slot1}  # the tail page was evicted first (freed first: least recently used)
    assert [t.slot for t in loads if t.kind == "load"] == [slot_of[page] for page in full_pages]
    assert [t.page for t in loads if t.kind == "load"] == again.block_table
    assert (bm.host.num_offloaded_pages, bm.host.num_loaded_pages) == (3, 2)
    bm.check_invariants()


def test_a_host_hit_takes_no_more_pages_than_are_free():
    bm = BlockManager(num_pages=3, page_size=1, host_pages=4)  # 2 usable device pages
    first = make_seq(0, [1, 2, 3])
    assert run_chunk(bm, first, 3) is False  # 3 tokens need 3 pages
    assert run_chunk(bm, first, 2)
    bm.free(first)
    blocker = make_seq(1, [5, 6])
    assert run_chunk(bm, blocker, 2)  # both cached pages go to the host; no device page is free now
    again = make_seq(2, [1, 2, 3])
    assert bm.cached_prefix_tokens(again.token_ids) == 0 and bm.match_prefix(again) == 0
    bm.free(blocker)  # 2 pages cached (evictable): room for both of the host's
    assert bm.cached_prefix_tokens(again.token_ids) == 2
    bm.check_invariants()


def test_prefix_caching_off():
    bm = BlockManager(num_pages=8, page_size=2, enable_prefix_caching=False)
    a = make_seq(0, [1, 2, 3, 4, 5])
    assert bm.match_prefix(a) == 0
    assert run_chunk(bm, a, 5)
    bm.free(a)
    b = make_seq(1, [1, 2, 3, 4, 5])
    assert bm.match_prefix(b) == 0 and b.block_table == []
    assert num_cached(bm) == 0 and bm.num_free_pages == 7
    bm.check_invariants()


def test_hash_collision_is_not_a_hit(monkeypatch):
    monkeypatch.setattr(block_manager, "hash_page", lambda parent, tokens: b"every page collides")
    bm = BlockManager(num_pages=8, page_size=2)
    a = make_seq(0, [1, 2, 3])
    assert run_chunk(bm, a, 3)
    bm.free(a)
    assert bm.match_prefix(make_seq(1, [4, 5, 6])) == 0  # same key, other tokens: a miss, not false sharing
    assert bm.match_prefix(make_seq(2, [1, 2, 3])) == 2
    bm.check_invariants()


@settings(max_examples=200, deadline=None)
@given(
    page_size=st.integers(1, 4),
    first=st.lists(st.integers(0, 1), min_size=1, max_size=16),
    cut=st.integers(0, 16),
    suffix=st.lists(st.integers(0, 1), max_size=6),
)
def test_prefix_hit_is_the_longest_matching_chain(page_size, first, cut, suffix):
    bm = BlockManager(num_pages=64, page_size=page_size)  # large enough that nothing is evicted
    a = make_seq(0, first)
    assert run_chunk(bm, a, len(first))
    bm.free(a)
    second = first[:cut] + suffix or [0]
    b = make_seq(1, second)
    matched = bm.match_prefix(b)
    expected = 0
    while (
        expected + 1 <= min(len(first) // page_size, (len(second) - 1) // page_size)
        and first[: (expected + 1) * page_size] == second[: (expected + 1) * page_size]
    ):
        expected += 1
    assert matched == expected * page_size == b.num_computed_tokens
    for i, page in enumerate(b.block_table):
        assert bm._page_key[page][1] == tuple(second[i * page_size : (i + 1) * page_size])
    bm.check_invariants()


PREFIXES = [
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12],
    [1, 2, 3, 4, 5, 6, 20, 21, 22, 23, 24, 25],
    [7] * 12,
]
MAX_LIVE = 6
pick = st.integers(0, 1 << 16)


def chain_key(tokens: tuple[int, ...], page_size: int) -> bytes:
    """The prefix-cache key of the page that tokens (whole pages) end with."""
    key = None
    for i in range(0, len(tokens), page_size):
        key = block_manager.hash_page(key, tokens[i : i + page_size])
    return key


def kv_of(seq: Sequence, pos: int) -> tuple[int, ...]:
    """What the K/V of token `pos` depends on: every token up to it (equal tokens after other prefixes differ)."""
    return tuple(seq.token_ids[: pos + 1])


class BlockManagerMachine(RuleBasedStateMachine):
    """Drives the block manager like an engine, one step at a time: sequences get their slots (`schedule`), others
    are forked, freed or readmitted meanwhile, then `run_step` plays the device: every copy-on-write copy at once
    (all read before any is written), then the K/V of the scheduled tokens. `pool` is a shadow of the device KV
    pool: pool[page][offset] is what the K/V in that slot depends on, the tokens up to and including its own. Every
    live sequence's computed tokens must be intact in the pages its table names (catches a missing or chained
    copy-on-write, a page handed out while referenced, a stale or unchained prefix-cache entry). With a sliding
    window, each step gives back the pages outside it (free_outside_window): the tokens inside every window must
    still be intact, and a given-back entry must lie wholly before it. With a host tier (host_pages), `host` shadows
    its slots: evicted pages are copied there and hits copied back (the transfers, in their order, before the
    copy-on-write copies): a hit must read exactly its prefix's K/V, and each host slot hold what its key says."""

    @initialize(
        num_pages=st.integers(2, 14),
        page_size=st.integers(1, 4),
        prefix_caching=st.booleans(),
        first=st.lists(st.integers(0, 2), max_size=9),
        window=st.none() | st.integers(1, 9),
        host_pages=st.sampled_from([0, 1, 3, 8]),
    )
    def setup(self, num_pages, page_size, prefix_caching, first, window, host_pages):
        self.bm = BlockManager(num_pages, page_size, prefix_caching, window, host_pages=host_pages)
        self.pool = [[None] * page_size for _ in range(num_pages)]
        self.host = [None] * host_pages
        self.seqs: dict[int, Sequence] = {}
        self.finished: list[list[int]] = []  # token ids of freed sequences
        self.batch: dict[int, int] = {}  # seq_id -> tokens the next run_step computes (their slots are allocated)
        self.next_id = 0
        if first:  # a computed sequence to fork from at once
            self.add(first, len(first), [])
            self._allocate(self.seqs[0], len(first))
            self.run_step()

    def _pick(self, index, cond=lambda s: True):
        candidates = [s for s in self.seqs.values() if cond(s)]
        return candidates[index % len(candidates)]

    def _device_view(self):
        """The pool as the step's attention will see it: after the transfers and copies not yet taken."""
        view, _ = self._apply_transfers(list(self.pool), list(self.host), self.bm.host and self.bm.host._transfers)
        after_transfers = list(view)
        for dst, src in self.bm._copies.items():
            view[dst] = after_transfers[src]
        return view

    @staticmethod
    def _apply_transfers(pool, host, transfers):
        for t in transfers or ():
            if t.kind == "offload":
                assert pool[t.page] is not None, f"offload of page {t.page}, never written"
                host[t.slot] = list(pool[t.page])
            else:
                assert t.kind == "load" and host[t.slot] is not None, f"load of slot {t.slot}, never written"
                pool[t.page] = list(host[t.slot])
        return pool, host

    def _admit(self, seq):
        bm, ps = self.bm, self.bm.page_size
        foreseen = bm.cached_prefix_tokens(seq.token_ids[: seq.num_prompt_tokens])  # data-parallel routing: no change
        matched = bm.match_prefix(seq)
        assert matched == foreseen == seq.num_computed_tokens == len(seq.block_table) * ps
        assert matched <= (seq.num_prompt_tokens - 1) // ps * ps
        assert matched == 0 or bm.enable_prefix_caching
        view = self._device_view()
        for i, page in enumerate(seq.block_table):
            if page == NULL_PAGE:  # a hit's page before the window, given back at once
                continue
            tokens = seq.token_ids[i * ps : (i + 1) * ps]
            assert bm._page_key[page][1] == tuple(tokens)  # registered tokens equal the new prompt's
            assert view[page] == [kv_of(seq, pos) for pos in range(i * ps, (i + 1) * ps)]  # and the device's

    def _forget(self, seq):
        del self.seqs[seq.seq_id]
        self.batch.pop(seq.seq_id, None)

    @precondition(lambda self: len(self.seqs) < MAX_LIVE)
    @rule(prefix=st.sampled_from(PREFIXES), cut=st.integers(0, 12), suffix=st.lists(st.integers(0, 2), max_size=5))
    def add(self, prefix, cut, suffix):
        seq = make_seq(self.next_id, prefix[:cut] + suffix or [0])
        self.next_id += 1
        self.seqs[seq.seq_id] = seq
        self._admit(seq)

    @precondition(lambda self: any(s.num_uncomputed_tokens and s.seq_id not in self.batch for s in self.seqs.values()))
    @rule(index=pick, chunk=st.integers(1, 8))
    def schedule(self, index, chunk):
        seq = self._pick(index, lambda s: s.num_uncomputed_tokens > 0 and s.seq_id not in self.batch)
        self._allocate(seq, chunk)

    def _allocate(self, seq, chunk):
        bm, ps = self.bm, self.bm.page_size
        n = min(chunk, seq.num_uncomputed_tokens)
        needed, free_before, used_before = bm.pages_needed(seq, n), bm.num_free_pages, bm.num_used_pages
        table_before, computed_before, copies_before = list(seq.block_table), seq.num_computed_tokens, dict(bm._copies)
        if not bm.allocate_slots(seq, n):
            assert needed > free_before
            assert (seq.block_table, seq.num_computed_tokens) == (table_before, computed_before)
            assert (bm.num_free_pages, bm.num_used_pages, bm._copies) == (free_before, used_before, copies_before)
            return
        assert needed <= free_before and bm.num_free_pages == free_before - needed
        assert len(seq.block_table) * ps >= seq.num_computed_tokens + n
        self.batch[seq.seq_id] = n

    @precondition(lambda self: self.batch or self.bm._copies or (self.bm.host and self.bm.host._transfers))
    @rule()
    def run_step(self):
        bm, ps = self.bm, self.bm.page_size
        if bm.host is not None:
            self._apply_transfers(self.pool, self.host, bm.host.take_transfers())
        copies = bm.take_copies()
        assert len({dst for _, dst in copies}) == len(copies)
        sources = [list(self.pool[src]) for src, _ in copies]  # all at once: every source read first
        for (_, dst), data in zip(copies, sources, strict=True):
            self.pool[dst] = data
        for seq_id, n in self.batch.items():
            seq = self.seqs[seq_id]
            for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
                self.pool[seq.block_table[pos // ps]][pos % ps] = kv_of(seq, pos)
            seq.num_computed_tokens += n
            bm.cache_full_pages(seq)
            bm.free_outside_window(seq)
        self.batch.clear()

    @precondition(
        lambda self: any(s.num_uncomputed_tokens == 0 and s.seq_id not in self.batch for s in self.seqs.values())
    )
    @rule(index=pick, token=st.integers(0, 2))
    def decode(self, index, token):
        self._pick(index, lambda s: s.num_uncomputed_tokens == 0 and s.seq_id not in self.batch).append_token(token)

    @precondition(lambda self: len(self.seqs) < MAX_LIVE and any(s.num_computed_tokens for s in self.seqs.values()))
    @rule(
        index=pick,
        back=st.integers(0, 5),
        suffix=st.lists(st.integers(0, 2), min_size=1, max_size=4),
        write=st.booleans(),
    )
    def fork(self, index, back, suffix, write):
        # A sibling that shares the parent's first `num_tokens` computed tokens (all of them, or `back` fewer), then
        # goes its own way; with `write` it computes its next token at once, as the scheduler does.
        parent = self._pick(index, lambda s: s.num_computed_tokens > 0)
        num_tokens = max(0, parent.num_computed_tokens - back)
        if not self.bm.can_fork(parent, num_tokens):  # parent gave back pages inside the child's window
            assert self.bm.sliding_window is not None and num_tokens < parent.num_computed_tokens
            return
        child = make_seq(self.next_id, parent.token_ids[:num_tokens] + suffix)
        self.next_id += 1
        self.bm.fork(parent, child, num_tokens)
        assert child.block_table == parent.block_table[: -(-num_tokens // self.bm.page_size)]
        assert child.num_computed_tokens == num_tokens
        self.seqs[child.seq_id] = child
        if write:
            self._allocate(child, 1)

    @precondition(lambda self: self.seqs)
    @rule(index=pick)
    def free(self, index):
        seq = self._pick(index)
        self.bm.free(seq)
        assert (seq.block_table, seq.num_computed_tokens) == ([], 0)
        self._forget(seq)
        self.finished.append(seq.token_ids)

    @precondition(lambda self: len(self.seqs) < MAX_LIVE and self.finished)
    @rule(index=pick, suffix=st.lists(st.integers(0, 2), max_size=3))
    def return_turn(self, index, suffix):
        # A finished conversation comes back with its next turn: its pages may be cached, on the host, or gone.
        seq = make_seq(self.next_id, self.finished[index % len(self.finished)] + suffix)
        self.next_id += 1
        self.seqs[seq.seq_id] = seq
        self._admit(seq)

    @precondition(lambda self: self.seqs)
    @rule(index=pick)
    def preempt_and_readmit(self, index):
        seq = self._pick(index)
        self.bm.free(seq)
        self.batch.pop(seq.seq_id, None)
        self._admit(seq)  # recompute from scratch, reusing whatever of its prompt is still cached

    @invariant()
    def pages_are_consistent(self):
        bm, ps = self.bm, self.bm.page_size
        bm.check_invariants()
        num_free_list = bm.num_free_pages - num_cached(bm)
        assert num_free_list + bm.num_used_pages + num_cached(bm) == bm.num_pages - 1
        table_entries = collections.Counter(page for s in self.seqs.values() for page in s.block_table)
        given_back = table_entries.pop(NULL_PAGE, 0)
        assert given_back == 0 or bm.sliding_window is not None
        assert len(table_entries) == bm.num_used_pages
        assert all(bm._ref_counts[page] == count for page, count in table_entries.items())
        view = self._device_view()
        for seq in self.seqs.values():
            window_start = 0 if bm.sliding_window is None else max(0, seq.num_computed_tokens - bm.sliding_window + 1)
            for i, page in enumerate(seq.block_table):
                if page == NULL_PAGE:
                    assert (i + 1) * ps <= window_start
            for pos in range(window_start, seq.num_computed_tokens):  # every key a later token of it reads
                assert view[seq.block_table[pos // ps]][pos % ps] == kv_of(seq, pos)
            if bm.sliding_window is not None:  # nothing wholly outside the window is held
                assert all(page == NULL_PAGE for page in seq.block_table[: window_start // ps])
        assert 0.0 < bm.kv_utilization() <= 1.0
        if bm.host is not None:  # every host slot holds its key's page: the K/V of the prefix the key chains
            _, host = self._apply_transfers(list(self.pool), list(self.host), bm.host._transfers)
            for key, slot in bm.host._slots.items():
                prefix = host[slot][-1]
                assert host[slot] == [prefix[: len(prefix) - ps + 1 + j] for j in range(ps)]
                assert key == chain_key(prefix, ps) and bm.host._slot_key[slot] == (key, prefix[-ps:])

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for seq in list(self.seqs.values()):
            self.bm.free(seq)
        self.bm.check_invariants()
        assert self.bm.num_used_pages == 0
        assert self.bm.num_free_pages == self.bm.num_pages - 1
        assert self.bm.kv_utilization() == 1.0
        assert self.bm.take_copies() == []
        if self.bm.host is not None:
            self.bm.host.check_invariants()


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 30),
    st.integers(1, 6),
    st.lists(st.tuples(st.integers(0, 8), st.integers(0, 8)), min_size=1, max_size=12),
)
def test_rejected_draft_slots_are_given_back(prompt_len, page_size, steps):
    # Each step reserves slots for the last token and k draft tokens, accepts n <= k of them and gives back the
    # rest: afterwards the pool is as if only the 1 + n tokens had been allocated (a twin manager does just that),
    # and no page holding a rejected draft token's slot is in the prefix cache.
    spec, plain = BlockManager(64, page_size), BlockManager(64, page_size)
    a, b = make_seq(0, range(prompt_len)), make_seq(0, range(prompt_len))
    assert run_chunk(spec, a, prompt_len) and run_chunk(plain, b, prompt_len)
    for step, (k, n) in enumerate(steps):
        n = min(n, k)
        if not spec.allocate_slots(a, 1 + k):
            break
        assert plain.allocate_slots(b, 1 + n)
        for seq in (a, b):
            seq.num_computed_tokens += 1 + n
            for i in range(1 + n):
                seq.append_token(1000 + 10 * step + i)
        spec.cache_full_pages(a)
        plain.cache_full_pages(b)
        spec.release_slots(a, a.num_computed_tokens)
        spec.check_invariants()
        assert len(a.block_table) == len(b.block_table) == -(-a.num_computed_tokens // page_size)
        assert spec.num_used_pages == plain.num_used_pages and spec.num_free_pages == plain.num_free_pages
        assert spec.kv_utilization() == plain.kv_utilization()
        assert len(spec._page_key) == len(plain._page_key) == a.num_computed_tokens // page_size


def test_release_slots_keeps_shared_pages():
    bm = BlockManager(num_pages=8, page_size=4)
    parent, child = computed_and_forked(bm, range(6), 6)
    bm.release_slots(child, 6)  # nothing reserved past its tokens: its shared pages stay as they are
    assert child.block_table == parent.block_table and bm.num_used_pages == 2
    assert bm.allocate_slots(child, 3)  # its own copy of the shared tail page, and one more page
    bm.release_slots(child, 6)
    assert len(child.block_table) == 2 and child.block_table[0] == parent.block_table[0]
    bm.check_invariants()
    with pytest.raises(AssertionError):
        bm.release_slots(child, 5)  # fewer than its computed tokens
