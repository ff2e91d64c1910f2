"""Routing new requests to data-parallel replicas (host-only, property-based): the longest cached prefix wins, then
the lightest load, then the lowest index."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from jaxpage.config import CacheConfig, EngineConfig
from jaxpage.engine.replica import Replica, choose_replica
from jaxpage.engine.scheduler import SchedulerConfig
from jaxpage.sequence import Sequence

PAGE = 2
PREFIX = [5, 6, 7, 8, 9, 10, 11, 12]  # four pages


def replica_with(cached_pages: int, load: int, seq_ids) -> Replica:
    """A replica whose prefix cache holds the first `cached_pages` pages of PREFIX and that has `load` sequences
    waiting."""
    cache = EngineConfig(page_size=PAGE, compilation_cache_dir=None).part(CacheConfig)
    replica = Replica.new(64, cache, SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64))
    if cached_pages:
        bm = replica.block_manager
        seq = Sequence(next(seq_ids), PREFIX[: cached_pages * PAGE])
        bm.match_prefix(seq)
        assert bm.allocate_slots(seq, seq.num_prompt_tokens)
        seq.num_computed_tokens = seq.num_prompt_tokens
        bm.cache_full_pages(seq)
        bm.free(seq)  # its full pages stay in the prefix cache
    for _ in range(load):
        replica.scheduler.add(Sequence(next(seq_ids), [1, 2, 3]))
    return replica


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 3)), min_size=1, max_size=4))
def test_the_longest_cached_prefix_then_the_lightest_load_then_the_lowest_index(layout):
    seq_ids = iter(range(10**6))
    replicas = [replica_with(cached, load, seq_ids) for cached, load in layout]
    prompt = PREFIX + [99]
    chosen = choose_replica(replicas, prompt)
    # What match_prefix would find: the cached pages, but never the prompt's last token.
    hits = [min(cached, (len(prompt) - 1) // PAGE) * PAGE for cached, _ in layout]
    if len(replicas) == 1:
        assert chosen == 0
        return
    assert [r.block_manager.cached_prefix_tokens(prompt) for r in replicas] == hits
    best = [i for i, h in enumerate(hits) if h == max(hits)]
    assert chosen == min(best, key=lambda i: (layout[i][1], i))


def test_a_prompt_no_replica_has_goes_to_the_least_loaded():
    seq_ids = iter(range(100))
    replicas = [replica_with(0, 2, seq_ids), replica_with(0, 1, seq_ids), replica_with(0, 1, seq_ids)]
    assert choose_replica(replicas, [40, 41, 42, 43, 44]) == 1
