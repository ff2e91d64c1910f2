"""The prefix cache's host tier on the device side (jaxpage.engine.host_page_cache keeps its bookkeeping): a pool of
page slots in host memory, the device pool's layout (its arrays with slots for pages, sharded like it: each
tensor-parallel shard keeps its own KV heads), as jax arrays of memory kind "pinned_host", and the two copies between
the tiers, as programs compiled like the step's: `offload_pages` (device pages into host slots) and `load_pages`
(host slots into device pages). JAX moves the bytes itself (inside jit, across memory kinds): on a GPU or TPU each
copy is a DMA between host and device memory, queued on the device's stream in order with the steps.

The block manager's transfers must be applied in their order (HostPageCache.take_transfers): `transfer_calls` cuts
them into runs of one kind, TRANSFER_CHUNK at a time, and each program copies its pages one after the other (a loop
of dynamic slices, which also keeps the pool updated in place, see jaxpage.kv_cache.copy_pages), so a slot or page
written twice in one call ends as the later copy left it. The host arrays have one slot more than the tier, the
scratch slot, where a call's padding goes (the null page's garbage, never read).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxpage.kv_cache import KVCache
from jaxpage.worker.compilation_cache import CompiledShape

TRANSFER_CHUNK = 8  # pages per call of the offload or load program
HOST_MEMORY = "pinned_host"


def _copy_in_order(src_tree, dst_tree, src_ids, dst_ids, page_shardings):
    """dst_tree's arrays with page src_ids[i] of src_tree's written at dst_ids[i], for i = 0, 1, ... in turn (the
    page axis: 1), each page moved into the destination's memory on the way (page_shardings: a page's there)."""

    def copy(src, dst, where):
        def one(i, dst):
            page = jax.device_put(jax.lax.dynamic_slice_in_dim(src, src_ids[i], 1, axis=1), where)
            return jax.lax.dynamic_update_slice_in_dim(dst, page, dst_ids[i], axis=1)

        return jax.lax.fori_loop(0, src_ids.shape[0], one, dst)

    return jax.tree.map(copy, src_tree, dst_tree, page_shardings)


def page_shardings(shardings: KVCache) -> KVCache:
    """Where one page of each pool array lives, in the same memory: the array's sharding, whole along the page axis
    (which a data-parallel pool splits over its replicas)."""

    def page(s):
        if not isinstance(s, jax.sharding.NamedSharding):
            return s
        spec = list(s.spec) + [None] * (2 - len(s.spec))
        spec[1] = None
        return jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec(*spec), memory_kind=s.memory_kind)

    return jax.tree.map(page, shardings)


def offload_pages(pool: KVCache, host: KVCache, pages: jax.Array, slots: jax.Array, host_pages: KVCache) -> KVCache:
    """host with device pages `pages` [C] of every layer copied into slots `slots` [C], in order (host_pages: a
    host page's shardings)."""
    return _copy_in_order(pool, host, pages, slots, host_pages)


def load_pages(pool: KVCache, host: KVCache, slots: jax.Array, pages: jax.Array, device_pages: KVCache) -> KVCache:
    """pool with host slots `slots` [C] of every layer copied into device pages `pages` [C], in order (device_pages:
    a device page's shardings)."""
    return _copy_in_order(host, pool, slots, pages, device_pages)


def transfer_calls(transfers: list, scratch_slot: int) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """The transfers (jaxpage.engine.host_page_cache.PageTransfer: kind, page, slot), in order, as calls (kind,
    source ids, destination ids) [TRANSFER_CHUNK] of offload_pages ("offload": device pages, host slots) or load_pages
    ("load": host slots, device pages): runs of one kind, TRANSFER_CHUNK at a time, padded with copies of the null
    page into the scratch slot or of the scratch slot into the null page."""
    calls = []
    for t in transfers:
        if not calls or calls[-1][0] != t.kind or len(calls[-1][1]) == TRANSFER_CHUNK:
            calls.append((t.kind, [], []))
        _, sources, destinations = calls[-1]
        sources.append(t.page if t.kind == "offload" else t.slot)
        destinations.append(t.slot if t.kind == "offload" else t.page)
    padded = []
    for kind, sources, destinations in calls:
        pad = TRANSFER_CHUNK - len(sources)
        source_pad, destination_pad = (0, scratch_slot) if kind == "offload" else (scratch_slot, 0)
        padded.append(
            (
                kind,
                np.asarray(sources + [source_pad] * pad, np.int32),
                np.asarray(destinations + [destination_pad] * pad, np.int32),
            )
        )
    return padded


class HostKVPool:
    def __init__(self, layout: KVCache, shardings: KVCache | None, load_or_compile, abstract):
        """layout: the host arrays' shapes (the device pool's layout with num_slots + 1 pages); shardings: the device
        pool's (None: one device), which the host arrays take in host memory; load_or_compile, abstract: the
        runner's (see jaxpage.worker.kv_pool.KVPool)."""
        self.layout = layout
        if shardings is None:
            shardings = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(jax.devices()[0]), layout)
        self.shardings = jax.tree.map(lambda s: _named(s).with_memory_kind(HOST_MEMORY), shardings)
        self.num_slots = layout.num_pages - 1
        self.scratch_slot = self.num_slots
        self.load_or_compile = load_or_compile
        self.abstract = abstract
        self._programs: dict[str, jax.stages.Compiled] = {}
        self.cache: KVCache | None = None
        self.bytes_moved = {"offload": 0, "load": 0}

    def allocate(self) -> KVCache:
        """The host slots, zeroed, in host memory."""
        layout = self.layout
        zeros = jax.jit(
            lambda: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), layout), out_shardings=self.shardings
        )
        return zeros()

    def page_bytes(self) -> int:
        """Bytes of one page of every layer (what one transfer moves, over all devices)."""
        return sum(x.dtype.itemsize * x.size // x.shape[1] for x in jax.tree.leaves(self.layout))

    def transfer(self, pool: KVCache, transfers: list) -> KVCache:
        """Applies the transfers in order: the host slots updated here; returns the device pool (loads write it)."""
        if self.cache is None:
            self.cache = self.allocate()
        for kind, sources, destinations in transfer_calls(transfers, self.scratch_slot):
            program = self.program(kind, pool)
            if kind == "offload":
                self.cache = program(pool, self.cache, sources, destinations)
            else:
                pool = program(pool, self.cache, sources, destinations)
        page_bytes = self.page_bytes()
        for t in transfers:
            self.bytes_moved[t.kind] += page_bytes
        return pool

    def program(self, kind: str, pool: KVCache) -> jax.stages.Compiled:
        """The offload or load program (compiled at its first use), for a device pool like `pool`."""
        if kind not in self._programs:
            ids = np.zeros(TRANSFER_CHUNK, np.int32)
            host = self.cache if self.cache is not None else self.shapes()
            args = (pool, host, *self.abstract((ids, ids)))
            device = _shardings_of(pool)
            if kind == "offload":
                fn = functools.partial(offload_pages, host_pages=page_shardings(self.shardings))
                donated, out = 1, self.shardings
            else:
                fn = functools.partial(load_pages, device_pages=page_shardings(device))
                donated, out = 0, device
            # The arrays' places said, memory kinds included (a compile-only build's shapes carry them only here).
            places = (device, self.shardings, None, None)
            jitted = jax.jit(fn, in_shardings=places, donate_argnums=(donated,), out_shardings=out)
            self._programs[kind] = self.load_or_compile(
                CompiledShape(kind, TRANSFER_CHUNK), args, lambda: jitted.lower(*args).compile()
            )
        return self._programs[kind]

    def shapes(self) -> KVCache:
        """The host arrays as ShapeDtypeStructs in host memory (compile-only builds)."""
        return jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), self.layout, self.shardings
        )


def _named(sharding: jax.sharding.Sharding) -> jax.sharding.NamedSharding:
    """The sharding as a NamedSharding (one device: a mesh of it): jit gives an argument's memory kind to the traced
    array only from a NamedSharding, and a page moved between memories must meet its destination's kind."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        return sharding
    [device] = sharding.device_set
    return jax.sharding.NamedSharding(jax.sharding.Mesh(np.asarray([device]), ("page",)), jax.sharding.PartitionSpec())


def _shardings_of(pool: KVCache):
    return jax.tree.map(lambda x: x.sharding, pool)
