"""The KV page pool on the device (vLLM's cache engine): its arrays, made zeroed by a compiled program, and the
copy-on-write page copies. The layout is the attention backend's (jaxpage.attention); the pool is sized by
jaxpage.worker.pool_sizing."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jaxpage.kv_cache import KVCache, copy_pages
from jaxpage.worker.compilation_cache import CompiledShape

logger = logging.getLogger("jaxpage")

POOL_BYTES_TOLERANCE = 0.02  # how far the compiled pool's bytes may stray from the budget arithmetic's
COPY_CHUNK = 8  # copy-on-write page copies per call of the (one) compiled copy program


def copy_chunks(copies: list[tuple[int, int]]) -> list[tuple[np.ndarray, np.ndarray]]:
    """The copy-on-write copies (src, dst) of a step as (sources, destinations) calls of the copy program, to apply
    as if all at once (every source read before any destination is written). COPY_CHUNK at a time, so that one
    compiled program serves any number, unless a destination is also a source (a page freed and reused within the
    step): then in one call, whose size may compile anew (rare)."""
    sources = {src for src, _ in copies}
    chunk = COPY_CHUNK if not any(dst in sources for _, dst in copies) else max(COPY_CHUNK, len(copies))
    calls = []
    for start in range(0, len(copies), chunk):
        part = copies[start : start + chunk]
        size = COPY_CHUNK if chunk == COPY_CHUNK else 1 << (len(part) - 1).bit_length()
        src = np.zeros(size, np.int32)  # padded with (0, 0): copies of the null page onto itself
        dst = np.zeros(size, np.int32)
        src[: len(part)], dst[: len(part)] = zip(*part, strict=True)
        calls.append((src, dst))
    return calls


class KVPool:
    def __init__(self, layout: KVCache, specs: KVCache, mesh, replicated, abstract: Callable, load_or_compile):
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
        self._copy_jit = jax.jit(copy_pages, donate_argnums=(0,))
        self._copy_chunk = None  # the copy of COPY_CHUNK pages, compiled at its first use
        self.cache: KVCache | None = None  # the arrays: allocate()'s, or (compile-only) shapes()

    def allocate(self) -> KVCache:
        """A zeroed pool, made on the device by a program that the compilation cache keeps like the step's (got
        once: a reset after a failed step reuses it)."""
        return self.fill_program()()

    def shardings(self) -> KVCache | None:
        """Where the pool's arrays live: sharded over the mesh, on the parameters' device when compiling only for
        one, else None (jax's default device)."""
        if self.mesh is not None:
            specs = dataclasses.astuple(self.specs)
            return KVCache(*(None if spec is None else NamedSharding(self.mesh, spec) for spec in specs))
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
                CompiledShape("pool", layout.k.shape), (), lambda: zeros.lower().compile(), static=arrays
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

    def copy(self, src: np.ndarray, dst: np.ndarray) -> None:
        if len(src) != COPY_CHUNK:  # the rare copy that must run in one call: compiled for its size here
            self.cache = self._copy_jit(self.cache, src, dst)
            return
        self.cache = self.copy_program()(self.cache, src, dst)

    def copy_program(self) -> jax.stages.Compiled:
        """The copy of COPY_CHUNK pages (compiled at its first use or at warm-up)."""
        if self._copy_chunk is None:
            ids = np.zeros(COPY_CHUNK, np.int32)
            args = (self.cache, *self.abstract((ids, ids)))
            self._copy_chunk = self.load_or_compile(
                CompiledShape("copy", COPY_CHUNK), args, lambda: self._copy_jit.lower(*args).compile()
            )
        return self._copy_chunk
