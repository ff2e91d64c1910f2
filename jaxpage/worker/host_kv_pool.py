"""The prefix cache's host tier on the device side (jaxpage.engine.host_page_cache keeps its bookkeeping): slots for
pages in host memory, in the device pool's layout, as jax arrays of memory kind "pinned_host", and the two copies
between the tiers, compiled like the step's programs: `offload_pages` (device pages into host slots) and `load_pages`
(host slots into device pages). JAX moves the bytes itself (inside jit, across memory kinds): on a GPU or TPU each
copy is a DMA between host and device memory, queued on the device's stream in order with the steps, so a step reads
a page only after its load, and the host goes on meanwhile.

The copies run on each device's shard (shard_map over the pool's mesh): a tensor-parallel shard moves its own KV heads
into its own host slots, a data-parallel replica its own pages (each replica has num_slots slots of its own, and its
ids are its own: a copy never crosses devices). A hybrid model's grouped pool (jaxpage.kv_cache.HybridKVCache) has
host slots per group of layers, as its block managers have pages per group.

The block manager's transfers must be applied in their order (HostPageCache.take_transfers): `transfer_calls` cuts
them into runs of one kind, TRANSFER_CHUNK at a time, and each program copies its pages one after the other (a loop
of dynamic slices, which also keeps the arrays updated in place, see jaxpage.kv_cache.copy_pages), so a slot or page
written twice in one call ends as the later copy left it. Each replica's host arrays have one slot more than its
tier, the scratch slot, where a call's padding goes (the null page's garbage, never read).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpage.kv_cache import HybridKVCache, KVCache, pool_groups
from jaxpage.mesh_axes import DATA_AXIS, TP_AXIS
from jaxpage.worker.compilation_cache import CompiledShape

TRANSFER_CHUNK = 8  # pages per call of the offload or load program, per replica
HOST_MEMORY = "pinned_host"
KINDS = ("offload", "load")


def _copy_in_order(src_tree, dst_tree, src_ids, dst_ids, space):
    """dst_tree's arrays with page src_ids[i] of src_tree's written at dst_ids[i], for i = 0, 1, ... in turn (the
    page axis: 1), each page moved into memory `space` (the destination's) on the way."""

    def copy(src, dst):
        def one(i, dst):
            page = jax.device_put(jax.lax.dynamic_slice_in_dim(src, src_ids[i], 1, axis=1), space)
            return jax.lax.dynamic_update_slice_in_dim(dst, page, dst_ids[i], axis=1)

        return jax.lax.fori_loop(0, src_ids.shape[0], one, dst)

    return jax.tree.map(copy, src_tree, dst_tree)


def offload_pages(pool: KVCache, host: KVCache, pages: jax.Array, slots: jax.Array) -> KVCache:
    """One device's host slots with its pool's pages `pages` [1, C] of every layer copied into slots `slots` [1, C],
    in order (ids: this device's replica's own)."""
    return _copy_in_order(pool, host, pages[0], slots[0], jax.memory.Space.Host)


def load_pages(pool: KVCache, host: KVCache, slots: jax.Array, pages: jax.Array) -> KVCache:
    """One device's pool with its host slots `slots` [1, C] of every layer copied into pages `pages` [1, C], in
    order."""
    return _copy_in_order(host, pool, slots[0], pages[0], jax.memory.Space.Device)


def _runs(transfers: list) -> list[tuple[str, list[int], list[int]]]:
    """One replica's transfers (PageTransfer: kind, page, slot) as runs of one kind, at most TRANSFER_CHUNK each:
    (kind, source ids, destination ids)."""
    runs = []
    for t in transfers:
        if not runs or runs[-1][0] != t.kind or len(runs[-1][1]) == TRANSFER_CHUNK:
            runs.append((t.kind, [], []))
        _, sources, destinations = runs[-1]
        sources.append(t.page if t.kind == "offload" else t.slot)
        destinations.append(t.slot if t.kind == "offload" else t.page)
    return runs


def transfer_calls(transfers: list[list], scratch_slot: int) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """Each replica's transfers (jaxpage.engine.host_page_cache.PageTransfer: kind, page, slot), in order, as calls
    (kind, source ids, destination ids) [replicas, TRANSFER_CHUNK] of offload_pages ("offload": device pages, host
    slots) or load_pages ("load": host slots, device pages): each replica's runs of one kind, in its order, a run of
    each replica whose next run is of the call's kind; a replica's row is padded with copies of the null page into
    the scratch slot or of the scratch slot into the null page."""
    queues = [_runs(replica) for replica in transfers]
    calls = []
    while any(queues):
        kind = next(queue[0][0] for queue in queues if queue)
        padding = (0, scratch_slot) if kind == "offload" else (scratch_slot, 0)
        sources = np.full((len(queues), TRANSFER_CHUNK), padding[0], np.int32)
        destinations = np.full((len(queues), TRANSFER_CHUNK), padding[1], np.int32)
        for r, queue in enumerate(queues):
            if queue and queue[0][0] == kind:
                _, src, dst = queue.pop(0)
                sources[r, : len(src)], destinations[r, : len(dst)] = src, dst
        calls.append((kind, sources, destinations))
    return calls


def _with_pages(layout: KVCache, num_pages: int) -> KVCache:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct((x.shape[0], num_pages, *x.shape[2:]), x.dtype), layout)


def group_page_bytes(layout: KVCache | HybridKVCache) -> list[int]:
    """Bytes of one page of every layer, over every tensor-parallel shard, per group of the pool's layers (what one
    transfer of that group moves)."""
    return [sum(x.dtype.itemsize * x.size // x.shape[1] for x in jax.tree.leaves(g)) for g in pool_groups(layout)]


class HostKVPool:
    def __init__(
        self,
        layout: KVCache | HybridKVCache,
        specs: KVCache | HybridKVCache,
        num_slots: tuple[int, ...],
        mesh: Mesh | None,
        device,
        load_or_compile,
        abstract,
    ):
        """layout, specs: the device pool's arrays (with the pages of every replica) and their PartitionSpecs over
        `mesh` (None: the one device `device`); num_slots: each replica's slots per group of the pool's layers;
        load_or_compile, abstract: the runner's (see jaxpage.worker.kv_pool.KVPool)."""
        self.mesh = mesh if mesh is not None else Mesh(np.asarray([device]).reshape(1, 1), (DATA_AXIS, TP_AXIS))
        self.replicas = self.mesh.shape[DATA_AXIS]
        self.specs = pool_groups(specs)
        self.num_slots = tuple(num_slots)
        assert len(self.num_slots) == len(self.specs) and min(self.num_slots) >= 1, num_slots
        groups = zip(pool_groups(layout), self.num_slots, strict=True)
        self.layouts = [_with_pages(group, (n + 1) * self.replicas) for group, n in groups]
        self.page_bytes = group_page_bytes(layout)
        self.load_or_compile = load_or_compile
        self.abstract = abstract
        self._programs: dict[tuple[str, int], jax.stages.Compiled] = {}
        self.cache: list[KVCache] | None = None  # each group's slots, made at the first transfer
        self.bytes_moved = {kind: 0 for kind in KINDS}

    def shardings(self, group: int, memory_kind: str | None = HOST_MEMORY) -> KVCache:
        """Where group's host arrays live (memory_kind None: the device pool's group, on the devices)."""
        return jax.tree.map(lambda spec: NamedSharding(self.mesh, spec, memory_kind=memory_kind), self.specs[group])

    def allocate(self) -> list[KVCache]:
        """Every group's host slots, zeroed, in host memory."""

        def zeros(layout, shardings):
            return jax.jit(lambda: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), layout), out_shardings=shardings)

        return [zeros(layout, self.shardings(g))() for g, layout in enumerate(self.layouts)]

    def transfer(self, pool_group: KVCache, group: int, kind: str, sources, destinations) -> KVCache:
        """One call of transfer_calls on the pool's group `group`: the host slots updated here; returns the group's
        device arrays (a load writes them)."""
        if self.cache is None:
            self.cache = self.allocate()
        program = self.program(kind, group, pool_group)
        if kind == "offload":
            self.cache[group] = program(pool_group, self.cache[group], sources, destinations)
        else:
            pool_group = program(pool_group, self.cache[group], sources, destinations)
        self.bytes_moved[kind] += (
            int(np.sum(sources != (0 if kind == "offload" else self.num_slots[group]))) * (self.page_bytes[group])
        )
        return pool_group

    def program(self, kind: str, group: int, pool_group: KVCache) -> jax.stages.Compiled:
        """The offload or load program of a group (compiled at its first use), for device arrays like pool_group."""
        if (kind, group) not in self._programs:
            ids = np.zeros((self.replicas, TRANSFER_CHUNK), np.int32)
            host = self.cache[group] if self.cache is not None else self.shapes(group)
            args = (pool_group, host, *self.abstract((ids, ids)))
            specs = self.specs[group]
            copy = offload_pages if kind == "offload" else load_pages
            on_shards = jax.shard_map(
                copy, mesh=self.mesh, in_specs=(specs, specs, P(DATA_AXIS), P(DATA_AXIS)), out_specs=specs
            )
            device, host_places = self.shardings(group, None), self.shardings(group)
            # The arrays' places said, memory kinds included (a compile-only build's shapes carry them only here).
            jitted = jax.jit(
                on_shards,
                in_shardings=(device, host_places, None, None),
                out_shardings=host_places if kind == "offload" else device,
                donate_argnums=(1 if kind == "offload" else 0,),
            )
            what = CompiledShape(kind, (group, TRANSFER_CHUNK))
            self._programs[kind, group] = self.load_or_compile(what, args, lambda: jitted.lower(*args).compile())
        return self._programs[kind, group]

    def shapes(self, group: int) -> KVCache:
        """A group's host arrays as ShapeDtypeStructs in host memory (compile-only builds)."""
        return jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), self.layouts[group], self.shardings(group)
        )
