"""Data-parallel replicas: each its own page pool (a range of the device pool's pages) and scheduler state, and the
routing of a new request to one of them. Host-only (no jax).

A request goes to the replica that holds the longest prefix of its prompt in its prefix cache; where none holds any,
to the least loaded (fewest sequences running and waiting); ties to the lowest index. It stays there: its pages,
its preemptions and its recomputation all happen on that replica.
"""

from __future__ import annotations

import dataclasses

from jaxpage.config import CacheConfig, ModelConfig, SchedulerConfig
from jaxpage.engine.block_manager import BlockManager
from jaxpage.engine.kv_cache_groups import KVCacheGroups
from jaxpage.engine.lora_slots import LoRASlots
from jaxpage.engine.scheduler import Scheduler


@dataclasses.dataclass
class Replica:
    block_manager: BlockManager | KVCacheGroups
    scheduler: Scheduler

    @classmethod
    def new(
        cls,
        num_pages: int,
        cache: CacheConfig,
        config: SchedulerConfig,
        models=(),
        window_pages: int | None = None,
        lora_slots: LoRASlots | None = None,
        host_pages: tuple[int, ...] = (0, 0),
    ) -> Replica:
        """A replica of `num_pages` pages for the models that share its block tables (the target, and a draft; none
        given: pages kept until a request ends); window_pages: the window group's pages of a hybrid target's grouped
        pool (jaxpage.engine.kv_cache_groups); lora_slots: the LoRA adapters' slots, which every replica shares;
        host_pages: the slots of the prefix cache's host tier, per group of layers (0: none)."""
        caching = (cache.page_size, cache.enable_prefix_caching)
        if window_pages is not None:
            window = models[0].sliding_window
            block_manager = KVCacheGroups(num_pages, window_pages, *caching, window, host_pages)
        else:
            window = window_to_free(models)
            block_manager = BlockManager(num_pages, *caching, window, host_pages=host_pages[0])
        return cls(block_manager, Scheduler(config, block_manager, lora_slots))

    @property
    def load(self) -> int:
        return len(self.scheduler.running) + len(self.scheduler.waiting)


def window_to_free(models: list[ModelConfig] | tuple) -> int | None:
    """The window outside which a running request's KV pages are given back (BlockManager.free_outside_window): the
    sliding window of the models that read the pages, when every layer of each reads through one and none reaches
    further back than the first model's; else None (a hybrid's global layers, Gemma's, read every key)."""
    if not models or not all(all(m.sliding_layers) for m in models):
        return None
    window = models[0].sliding_window
    return window if all(m.sliding_window <= window for m in models) else None


class Replicas(list):
    """The engine's replicas, in order, and their counts summed over them."""

    def num_running(self) -> int:
        return sum(len(r.scheduler.running) for r in self)

    def num_waiting(self) -> int:
        return sum(len(r.scheduler.waiting) for r in self)

    def num_waiting_requests(self) -> int:
        """Requests with a sequence waiting: the n samples of one request count once."""
        return len({id(seq.group[0] if seq.group else seq) for r in self for seq in r.scheduler.waiting})

    def kv_cache_usage(self) -> float:
        """The share of the KV pages in use (the null pages not counted)."""
        used = sum(r.block_manager.num_used_pages for r in self)
        return used / max(sum(r.block_manager.num_pages - 1 for r in self), 1)

    def prefix_cache_counts(self) -> tuple[int, int]:
        """(prompt tokens looked up in the prefix cache, tokens found there)."""
        return (
            sum(r.scheduler.num_prefix_query_tokens for r in self),
            sum(r.scheduler.num_prefix_hit_tokens for r in self),
        )


@dataclasses.dataclass(frozen=True)
class HostTierCounts:
    """The prefix cache's host tier over every replica and group of layers (jaxpage.engine.host_page_cache)."""

    offloaded_pages: int  # device pages copied to host slots
    loaded_pages: int  # host slots copied back to device pages: the host tier's prefix hits
    hit_tokens: int  # prompt tokens whose K/V came back from host memory (a grouped pool's full group's)
    used_slots: int
    slots: int


def host_tier_counts(replicas: list[Replica]) -> HostTierCounts | None:
    """The host tier's counts (None without one)."""
    tiers = [group.host for r in replicas for group in getattr(r.block_manager, "groups", (r.block_manager,))]
    if not tiers or tiers[0] is None:
        return None
    first = [getattr(r.block_manager, "full", r.block_manager) for r in replicas]  # a grouped pool's full group
    return HostTierCounts(
        sum(t.num_offloaded_pages for t in tiers),
        sum(t.num_loaded_pages for t in tiers),
        sum(bm.host.num_loaded_pages * bm.page_size for bm in first),
        sum(t.num_used_slots for t in tiers),
        sum(t.num_slots for t in tiers),
    )


def choose_replica(replicas: list[Replica], prompt_token_ids: list[int], prefix_root: bytes | None = None) -> int:
    """The index of the replica a new request with this prompt (and LoRA adapter's prefix_root) goes to (see the
    module docstring)."""
    if len(replicas) == 1:
        return 0
    hits = [r.block_manager.cached_prefix_tokens(prompt_token_ids, prefix_root) for r in replicas]
    best = max(hits)
    candidates = [i for i, h in enumerate(hits) if h == best]
    return min(candidates, key=lambda i: (replicas[i].load, i))
