"""The LoRA adapters' device slots (jaxpage.models.lora): their arrays, which the runner keeps among the parameters
under "lora", and the one program that fills a slot with an adapter (every process of several runs it with the
adapter's weights the leader sends: a LORA message)."""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import Mesh

from jaxpage.config import ModelConfig
from jaxpage.models.lora import adapter_slot, empty_slots
from jaxpage.worker.compilation_cache import CompiledShape
from jaxpage.worker.parallel import lora_shardings


class LoRAWeights:
    def __init__(
        self,
        config: ModelConfig,
        num_slots: int,
        rank: int,
        dtype,
        mesh: Mesh | None,
        replicated: jax.sharding.Sharding,
        compile_only: bool,
        load_or_compile: Callable,
    ):
        """`num_slots` slots of rank `rank` for the model `config` as it runs, in the compute dtype, on `mesh` (split
        as their projections under tensor parallelism: jaxpage.worker.parallel.lora_shardings) or, without one, on
        the device of `replicated` (an argument every device holds whole: how an adapter's weights reach the fill
        program); compile_only: shape structs there; load_or_compile: the runner's (its compilation cache)."""
        self.config, self.shape, self.dtype = config, (num_slots, rank), dtype
        zeros = empty_slots(config, num_slots, rank, dtype)
        self.shardings = jax.tree.map(lambda _: replicated, zeros) if mesh is None else lora_shardings(mesh, zeros)
        if compile_only:
            self.arrays = jax.tree.map(
                lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), zeros, self.shardings
            )
        else:
            self.arrays = jax.device_put(zeros, self.shardings)
        self.replicated = replicated
        self.load_or_compile = load_or_compile
        self._fill: jax.stages.Compiled | None = None

    def fill_program(self) -> jax.stages.Compiled:
        """The program that writes one slot (its index traced) with an adapter's weights, donating the slots:
        compiled once, for every slot and adapter."""
        if self._fill is None:

            def fill(slots, slot, weights):
                return jax.tree.map(lambda x, w: x.at[:, slot].set(w.astype(x.dtype)), slots, weights)

            template = self.template()
            one = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self.replicated), template)
            args = (self.arrays, np.int32(0), one)
            program = jax.jit(fill, donate_argnums=(0,), out_shardings=self.shardings)
            what = CompiledShape("lora", self.shape)
            static = (self.config, *self.shape, repr(self.shardings))  # (data parallelism: the same shapes)
            self._fill = self.load_or_compile(what, args, lambda: program.lower(*args).compile(), static)
        return self._fill

    def template(self) -> dict:
        """One slot's weights, zeros (numpy): what a LORA message's payload unpacks after
        (jaxpage.worker.step_broadcast)."""
        return jax.tree.map(lambda x: np.zeros((x.shape[0], *x.shape[2:]), x.dtype), self.arrays)

    def payload(self, adapter) -> dict:
        """An adapter's weights (jaxpage.models.lora_adapter.LoRAAdapter) as one slot takes them, zero-padded."""
        return adapter_slot(adapter, self.config, self.shape[1], self.dtype)

    def fill(self, slot: int, payload: dict) -> dict:
        """Writes slot `slot`; returns the slots' arrays (the old ones are donated)."""
        self.arrays = self.fill_program()(self.arrays, np.int32(slot), payload)
        return self.arrays
