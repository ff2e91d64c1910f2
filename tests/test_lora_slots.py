"""LoRASlots (host only): a pinned slot is never refilled, an adapter is in at most one slot, a slot is taken from the
free ones first and then from the least recently used unpinned ones, and an adapter waits only when every slot is
pinned."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from jaxpage.engine.lora_slots import LoRASlots

ADAPTERS = st.integers(1, 7)


class SlotsMachine(RuleBasedStateMachine):
    """A model of the slots (each slot's adapter, pins, last use) beside the real thing."""

    def __init__(self):
        super().__init__()
        self.num_slots = 3
        self.slots = LoRASlots(self.num_slots)
        self.held: dict[int, int] = {}  # adapter -> slot, as the model knows it
        self.pins: dict[int, int] = {}
        self.last_unpinned: dict[int, int] = {}  # adapter -> the time its pins went to 0 (or it was loaded)
        self.clock = 0
        self.filled: dict[int, int] = {}  # slot -> the adapter whose weights the caller copied in

    @rule(adapter=ADAPTERS)
    def acquire(self, adapter):
        self.clock += 1
        pinned_others = {s for a, s in self.held.items() if self.pins.get(a, 0) and a != adapter}
        got = self.slots.acquire(adapter)
        if adapter in self.held:
            assert got == (self.held[adapter], False)
        elif len(pinned_others) == self.num_slots:
            assert got is None
            return
        else:
            slot, load = got
            assert load and slot not in pinned_others
            free = set(range(self.num_slots)) - set(self.held.values())
            if free:
                assert slot in free
            else:  # the least recently unpinned adapter leaves
                unpinned = [a for a in self.held if not self.pins.get(a, 0)]
                victim = min(unpinned, key=self.last_unpinned.__getitem__)
                assert self.held[victim] == slot
                del self.held[victim]
            self.held[adapter] = slot
            self.filled[slot] = adapter
        self.pins[adapter] = self.pins.get(adapter, 0) + 1

    @rule(adapter=ADAPTERS)
    def release(self, adapter):
        if not self.pins.get(adapter, 0):
            return
        self.clock += 1
        self.slots.release(adapter)
        self.pins[adapter] -= 1
        if not self.pins[adapter]:
            self.last_unpinned[adapter] = self.clock

    @rule(adapter=ADAPTERS)
    def remove(self, adapter):
        removed = self.slots.remove(adapter)
        assert removed == (not self.pins.get(adapter, 0))
        if removed and adapter in self.held:
            del self.held[adapter]

    @invariant()
    def agrees_with_the_model(self):
        assert self.slots.adapters() == self.held
        for adapter, slot in self.held.items():
            assert self.filled[slot] == adapter  # every step reads the weights of the adapter its slot says
            assert self.slots.pins(adapter) == self.pins.get(adapter, 0)


TestSlotsMachine = SlotsMachine.TestCase
TestSlotsMachine.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)


def test_an_unpinned_slot_keeps_its_adapter_until_another_needs_it():
    slots = LoRASlots(2)
    assert slots.acquire(10) == (0, True) and slots.acquire(20) == (1, True)
    slots.release(10)
    assert slots.acquire(10) == (0, False)  # still there: nothing to copy
    slots.release(10)
    slots.release(20)
    assert slots.acquire(30) == (0, True)  # 10 was used less recently than 20
    assert slots.slot_of(10) is None and slots.slot_of(20) == 1
    assert slots.can_acquire(40) and slots.acquire(40) == (1, True)  # 20, unpinned, leaves


def test_a_used_adapter_cannot_be_removed_and_a_full_house_waits():
    slots = LoRASlots(1)
    slots.acquire(1)
    assert not slots.remove(1) and not slots.can_acquire(2) and slots.acquire(2) is None
    slots.release(1)
    assert slots.remove(1) and slots.slot_of(1) is None and slots.acquire(2) == (0, True)
    with pytest.raises(ValueError, match="max_loras must be at least 1"):
        LoRASlots(0)
