"""The prefix cache's host tier (engine argument kv_offload_bytes; vLLM's KV offloading to CPU, SGLang's HiCache):
full pages evicted from the device pool are copied into slots of a pool in host memory, under the same prefix keys,
instead of dropped; a later prompt whose prefix chain reaches one gets a device page and a copy back
(BlockManager.match_prefix). Host slots are evicted least recently used first.

The copies are recorded here in the order the block manager needs them and reach the device through
`take_transfers`: the device applies them in that order, before the step's copy-on-write copies and the step itself.
Order is what makes the bookkeeping simple: a device page evicted (offload) and handed out again in one step is read
before anything writes it, a slot that one load reads may be given to a later offload, and a page loaded then evicted
in one step is offloaded after its load. Host-only (no jax).
"""

from __future__ import annotations

import collections
import dataclasses


@dataclasses.dataclass(frozen=True)
class PageTransfer:
    """One page copy between the tiers: "offload" device page -> host slot, or "load" host slot -> device page."""

    kind: str
    page: int
    slot: int


class HostPageCache:
    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"a host tier needs at least one page slot, got {num_slots}")
        self.num_slots = num_slots
        self._free_slots = collections.deque(range(num_slots))
        self._slots: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # key -> slot, LRU first
        self._slot_key: dict[int, tuple[bytes, tuple[int, ...]]] = {}  # slot -> (key, its token ids)
        self._transfers: list[PageTransfer] = []
        self.pinned: set[int] = set()  # slots that a prefix hit is about to load: never given to an offload
        self.num_offloaded_pages = 0  # copies made, each way
        self.num_loaded_pages = 0

    @property
    def num_used_slots(self) -> int:
        """Slots that hold a page."""
        return len(self._slots)

    def find(self, key: bytes, tokens: tuple[int, ...]) -> int | None:
        """The slot that holds the page of `key` (whose token ids must be `tokens`), or None. Does not count as use."""
        slot = self._slots.get(key)
        return slot if slot is not None and self._slot_key[slot][1] == tokens else None

    def offload(self, page: int, key: bytes, tokens: tuple[int, ...]) -> None:
        """Device page `page`, registered under key with these tokens, is evicted: keep a copy (unless one is kept
        already), in a free slot or the least recently used unpinned one's (none: the page is dropped)."""
        if key in self._slots:
            self._slots.move_to_end(key)
            return
        if self._free_slots:
            slot = self._free_slots.popleft()
        else:
            victim = next((k for k, s in self._slots.items() if s not in self.pinned), None)
            if victim is None:
                return
            slot = self._slots.pop(victim)
            del self._slot_key[slot]
        self._slots[key] = slot
        self._slot_key[slot] = (key, tokens)
        self._transfers.append(PageTransfer("offload", page, slot))
        self.num_offloaded_pages += 1

    def load(self, slot: int, page: int) -> None:
        """Copy slot's page back into device page `page` (a prefix hit on the host tier); the slot keeps it."""
        self._slots.move_to_end(self._slot_key[slot][0])
        self._transfers.append(PageTransfer("load", page, slot))
        self.num_loaded_pages += 1

    def take_transfers(self) -> list[PageTransfer]:
        """The copies recorded since the last call, in the order the device must apply them; clears them."""
        transfers, self._transfers = self._transfers, []
        return transfers

    def check_invariants(self) -> None:
        slots = set(self._slots.values())
        assert len(slots) == len(self._slots) == len(self._slot_key), "a slot holds two pages"
        assert slots.isdisjoint(self._free_slots) and len(slots) + len(self._free_slots) == self.num_slots
        assert all(self._slot_key[slot][0] == key for key, slot in self._slots.items())
