"""The KV page pool on the device (vLLM's cache engine): its arrays, made zeroed by a compiled program, the
copy-on-write page copies, and the prefix cache's host tier (jaxpage.worker.host_kv_pool) where there is one. The
layout is the attention backend's (jaxpage.attention); the pool is sized by jaxpage.worker.pool_sizing."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxpage.kv_cache import HybridKVCache, KVCache, copy_pool_pages, pool_groups
from jaxpage.worker.compilation_cache import CompiledShape
from jaxpage.worker.host_kv_pool import KINDS, TRANSFER_CHUNK, HostKVPool
from jaxpage.worker.step_broadcast import Message

logger = logging.getLogger("jaxpage")

POOL_BYTES_TOLERANCE = 0.02  # how far the compiled pool's bytes may stray from the budget arithmetic's
COPY_CHUNK = 8  # copy-on-write page copies per call of the (one) compiled copy program


def copy_chunks(groups: list[list[tuple[int, int]]]) -> list[tuple[np.ndarray, np.ndarray]]:
    """The copy-on-write copies (src, dst) of a step, a list per group of the pool's layers (jaxpage.kv_cache
    .pool_groups), as (sources, destinations) [groups, C] calls of the copy program, to apply as if all at once
    (every source read before any destination is written). COPY_CHUNK at a time, so that one compiled program serves
    any number, unless a destination is also a source (a page freed and reused within the step): then in one call,
    whose size may compile anew (rare)."""
    overlap = any(dst in {src for src, _ in copies} for copies in groups for _, dst in copies)
    longest = max(map(len, groups))
    chunk = COPY_CHUNK if not overlap else max(COPY_CHUNK, longest)
    calls = []
    for start in range(0, longest, chunk):
        parts = [copies[start : start + chunk] for copies in groups]
        size = COPY_CHUNK if chunk == COPY_CHUNK else 1 << (max(map(len, parts)) - 1).bit_length()
        src = np.zeros((len(groups), size), np.int32)  # padded with (0, 0): copies of the null page onto itself
        dst = np.zeros((len(groups), size), np.int32)
        for g, part in enumerate(parts):
            if part:
                src[g, : len(part)], dst[g, : len(part)] = zip(*part, strict=True)
        calls.append((src, dst))
    return calls


def pool_arrays(
    backend, config, num_pages: int, window_pages: int | None, replicas: int, page_size: int, dtype, tp: int
):
    """The pool's arrays as shapes (AttentionBackend.pool_layout) and their PartitionSpecs (.pool_specs), for
    `replicas` data-parallel replicas of num_pages pages each: for a hybrid model's grouped pool (window_pages not
    None), HybridKVCaches of num_pages pages for its full layers and window_pages for its sliding ones."""
    specs = backend.pool_specs()
    if window_pages is None:
        return backend.pool_layout(config, num_pages * replicas, page_size, dtype, tp), specs
    num_window_layers = sum(config.sliding_layers)
    layout = HybridKVCache(
        full=backend.pool_layout(
            config, num_pages * replicas, page_size, dtype, tp, config.num_layers - num_window_layers
        ),
        window=backend.pool_layout(config, window_pages * replicas, page_size, dtype, tp, num_window_layers),
    )
    return layout, HybridKVCache(specs, specs)


class KVPool:
    def __init__(
        self,
        layout: KVCache | HybridKVCache,
        specs: KVCache | HybridKVCache,
        mesh,
        replicated,
        abstract: Callable,
        load_or_compile,
    ):
        """layout: the pool's arrays' shapes and dtypes; specs: their PartitionSpecs over `mesh` (None: one
        device); replicated: the sharding of compile-only programs' arguments (None when the pool is real);
        abstract: host arrays as those programs take them; load_or_compile: the runner's compilation cache."""
        self.layout = layout
        self.specs = specs
        self.mesh = mesh
        self.replicated = replicated
        self.abstract = abstract
        self.load_or_compile = load_or_compile
        self._fill = None  # the program that makes a zeroed pool
        self._copy_jit = jax.jit(copy_pool_pages, donate_argnums=(0,))
        self._copy_chunk = None  # the copy of COPY_CHUNK pages, compiled at its first use
        self.cache: KVCache | None = None  # the arrays: allocate()'s, or (compile-only) shapes()
        self.host: HostKVPool | None = None  # the host tier's slots (add_host_tier)

    def add_host_tier(self, num_slots: tuple[int, ...]) -> None:
        """Slots in host memory for the prefix cache's host tier: num_slots per replica, per group of layers."""
        device = jax.devices()[0] if self.replicated is None else next(iter(self.replicated.device_set))
        device = device if self.mesh is None else self.mesh.devices.flat[0]
        kinds = [memory.kind for memory in device.addressable_memories()]
        if "pinned_host" not in kinds:  # a deviceless GPU client's devices list no memories
            raise ValueError(
                f"engine argument kv_offload_bytes: the {device.platform} devices here offer no pinned host memory "
                f"(memories: {', '.join(kinds) or 'none'}), where the host tier's slots live: leave kv_offload_bytes "
                "unset"
            )
        self.host = HostKVPool(
            self.layout, self.specs, num_slots, self.mesh, device, self.load_or_compile, self.abstract
        )

    def run(self, kind: Message, key: int, payload) -> None:
        """A message that changes the pool (jaxpage.worker.step_broadcast): RESET (a zeroed pool, after a failed step;
        the host slots are made anew at their next use), COPY (copy-on-write copies: sources, destinations), OFFLOAD
        and LOAD (a call of host_kv_pool.transfer_calls in the pool's group of layers `key`)."""
        if kind is Message.RESET:
            self.cache = self.allocate()
            if self.host is not None:
                self.host.cache = None
        elif kind is Message.COPY:
            self.copy(*payload)
        else:
            groups = list(pool_groups(self.cache))
            groups[key] = self.host.transfer(groups[key], key, kind.name.lower(), *payload)
            self.cache = HybridKVCache(*groups) if isinstance(self.cache, HybridKVCache) else groups[0]

    def allocate(self) -> KVCache:
        """A zeroed pool, made on the device by a program that the compilation cache keeps like the step's (got
        once: a reset after a failed step reuses it)."""
        return self.fill_program()()

    def shardings(self) -> KVCache | None:
        """Where the pool's arrays live: sharded over the mesh, on the parameters' device when compiling only for
        one, else None (jax's default device)."""
        if self.mesh is not None:
            return jax.tree.map(lambda spec: NamedSharding(self.mesh, spec), self.specs, is_leaf=_is_spec)
        if self.replicated is not None:
            return jax.tree.map(lambda _: self.replicated, self.layout)
        return None

    def shapes(self) -> KVCache:
        """The pool as ShapeDtypeStructs placed where it would live (compile_only: the pool no program fills)."""
        where = self.shardings()
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), self.layout, where)

    def fill_program(self) -> jax.stages.Compiled:
        """The program that makes a zeroed pool (its output bytes: the pool's as the chip lays it out)."""
        if self._fill is None:
            layout = self.layout
            zeros = jax.jit(
                lambda: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), layout),
                out_shardings=self.shardings(),
            )
            arrays = tuple((x.shape, x.dtype.name) for x in jax.tree.leaves(layout))
            self._fill = self.load_or_compile(
                CompiledShape("pool", pool_shape(layout)), (), lambda: zeros.lower().compile(), static=arrays
            )
            self._check_bytes(self._fill)
        return self._fill

    def _check_bytes(self, fill_pool: jax.stages.Compiled) -> None:
        if (undercount := self.bytes_undercount(fill_pool)) is not None:
            logger.warning("%s", undercount)

    def bytes_undercount(self, fill_pool: jax.stages.Compiled) -> str | None:
        """What is wrong when the chip lays the pool out >2% larger than its shape says (tiles that pad it): the
        budget arithmetic the engine sized the pool with then undercounts it. None otherwise (measured equal on TPU
        v5e/v6e/v5p and H100 for every KV format at page sizes 8, 16, 32; scripts/compile_for.py checks the same
        per target), or when the executable cannot describe itself."""
        try:
            compiled = fill_pool.memory_analysis().output_size_in_bytes
        except Exception:  # nothing to compare
            return None
        devices = 1 if self.mesh is None else self.mesh.size  # every pool array is split over every device
        shaped = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self.layout)) // devices
        if compiled <= (1 + POOL_BYTES_TOLERANCE) * shaped:
            return None
        return (
            f"the KV pool takes {compiled} bytes per device as compiled, {100 * (compiled / shaped - 1):.1f}% more "
            f"than the {shaped} its shape and the budget arithmetic say: the memory budget undercounts it; lower "
            "gpu_memory_utilization or num_pages"
        )

    def chunks(self, copies: list[tuple[int, int]], window_copies: list[tuple[int, int]] = ()) -> list:
        """A step's copy-on-write copies (src, dst) (and a grouped pool's window group's) as `copy` takes them, to be
        applied as if all at once (every source read before any destination is written): COPY_CHUNK at a time, so
        that one compiled program serves any number, unless a destination is also a source (a page freed and reused
        within the step): then in one call, whose size may compile anew (rare)."""
        groups = [list(copies), list(window_copies)][: len(pool_groups(self.layout))]
        assert len(groups) == 2 or not window_copies, "window copies for a pool without a window group"
        return list(copy_chunks(groups))

    def copy(self, src: np.ndarray, dst: np.ndarray) -> None:
        if src.shape[-1] != COPY_CHUNK:  # the rare copy that must run in one call: compiled for its size here
            self.cache = self._copy_jit(self.cache, src, dst)
            return
        self.cache = self.copy_program()(self.cache, src, dst)

    def copy_program(self) -> jax.stages.Compiled:
        """The copy of COPY_CHUNK pages (compiled at its first use or at warm-up)."""
        if self._copy_chunk is None:
            ids = np.zeros((len(pool_groups(self.layout)), COPY_CHUNK), np.int32)
            args = (self.cache, *self.abstract((ids, ids)))
            self._copy_chunk = self.load_or_compile(
                CompiledShape("copy", COPY_CHUNK), args, lambda: self._copy_jit.lower(*args).compile()
            )
        return self._copy_chunk

    def host_programs(self) -> list[tuple[CompiledShape, Callable[[], jax.stages.Compiled]]]:
        """The host tier's programs (warm-up's): each group's offload and load; none without a host tier."""
        if self.host is None:
            return []
        programs = []
        for group in range(len(self.host.num_slots)):
            for kind in KINDS:
                get = functools.partial(self._host_program, kind, group)
                programs.append((CompiledShape(kind, (group, TRANSFER_CHUNK)), get))
        return programs

    def _host_program(self, kind: str, group: int) -> jax.stages.Compiled:
        return self.host.program(kind, group, pool_groups(self.cache)[group])


def _is_spec(x) -> bool:
    return isinstance(x, PartitionSpec)


def pool_shape(layout: KVCache | HybridKVCache) -> tuple:
    """What names the pool's programs in the compilation log: K's shape (each group's, for a grouped pool)."""
    shapes = tuple(group.k.shape for group in pool_groups(layout))
    return shapes[0] if len(shapes) == 1 else shapes
