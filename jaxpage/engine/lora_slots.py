"""Which LoRA adapter each device slot holds: the host's bookkeeping of the `max_loras` slots (no jax).

A running sequence with an adapter pins the adapter's slot (`acquire` when it is scheduled in, `release` when it
finishes or is preempted): a pinned slot is never refilled. An adapter that is not in a slot takes a free one, else
the least recently used unpinned one; when every slot is pinned by other adapters, it waits. `acquire` says whether
the slot must be filled (the caller copies the adapter's weights in before the step that reads them).
"""

from __future__ import annotations

import collections


class LoRASlots:
    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"max_loras must be at least 1, got {num_slots}")
        self.num_slots = num_slots
        self._adapter = [None] * num_slots  # slot -> the adapter id it holds, or None
        self._slot: dict[int, int] = {}  # adapter id -> its slot
        self._pins = [0] * num_slots  # running sequences that use the slot's adapter
        self._recent: collections.OrderedDict[int, None] = collections.OrderedDict()  # unpinned slots, LRU first
        self._recent.update((s, None) for s in range(num_slots))

    def slot_of(self, adapter_id: int) -> int | None:
        return self._slot.get(adapter_id)

    def pins(self, adapter_id: int) -> int:
        slot = self._slot.get(adapter_id)
        return 0 if slot is None else self._pins[slot]

    def can_acquire(self, adapter_id: int) -> bool:
        """Whether `acquire` would succeed now."""
        return adapter_id in self._slot or bool(self._recent)

    def acquire(self, adapter_id: int) -> tuple[int, bool] | None:
        """(slot, whether it must be filled with the adapter) and a pin on it; None when every slot is pinned by
        other adapters."""
        slot = self._slot.get(adapter_id)
        load = slot is None
        if load:
            if not self._recent:
                return None
            slot = next(iter(self._recent))  # free slots and evicted adapters' first, then least recently used
            evicted = self._adapter[slot]
            if evicted is not None:
                del self._slot[evicted]
            self._adapter[slot], self._slot[adapter_id] = adapter_id, slot
        self._pins[slot] += 1
        self._recent.pop(slot, None)
        return slot, load

    def release(self, adapter_id: int) -> None:
        """Takes back one pin of `acquire`; an unpinned slot keeps its adapter until another needs the slot."""
        slot = self._slot[adapter_id]
        assert self._pins[slot] > 0, f"adapter {adapter_id} released more often than acquired"
        self._pins[slot] -= 1
        if self._pins[slot] == 0:
            self._recent[slot] = None  # most recently used: evicted last

    def remove(self, adapter_id: int) -> bool:
        """Forgets an unpinned adapter (its slot becomes the first to be taken); False when a running sequence uses
        it (the caller refuses the unload)."""
        slot = self._slot.get(adapter_id)
        if slot is None:
            return True
        if self._pins[slot]:
            return False
        del self._slot[adapter_id]
        self._adapter[slot] = None
        self._recent.move_to_end(slot, last=False)
        return True

    def adapters(self) -> dict[int, int]:
        """{adapter id: slot} of the adapters in slots."""
        return dict(self._slot)
