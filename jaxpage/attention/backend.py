"""The attention backend's interface: what the engine, the runner and the model ask of attention, whatever kernel
does it. One class per implementation (`jaxpage.attention.xla`, `.pallas_tpu`, `.pallas_gpu`), made once, at engine
start, by `jaxpage.attention.resolve_backend` from the engine argument `attention_impl` (`jaxpage.attention.factory`).

A backend owns what only attention should know -- the KV pool's layout (its arrays' shapes, head_dim padded where
a kernel needs it, how they are sharded), writing a step's new K/V into the pool, and attending through the block
tables -- so that the engine, the runner and the config never branch on backends.

The pool's format is the engine argument `kv_cache_dtype`, in vLLM's names: "auto" (the model's compute dtype),
"int8", "fp8" (= "fp8_e4m3") or "fp8_e5m2": 8-bit pages with one bfloat16 scale per token per KV head beside them
(`pallas_kernels.kv_quantization`). The step quantizes each token's K/V as it writes them; every implementation
applies the scales to the tiles it reads, never to the pool.

The base class lays the pool out as `jaxpage.kv_cache` describes (K and V [num_layers, num_pages, page_size,
num_kv_heads, head_dim], scales [num_layers, num_pages, page_size, num_kv_heads]); the TPU backend has a layout of
its own.

The most query rows any sequence of a step has is known on the host and passed as a static argument `max_q_len`:
1 for a decode-only step (it compiles only the decode attention), k + 1 for a step that verifies k speculative
tokens per sequence (the ragged attention, told that no sequence has more rows), None for a mixed step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxpage.config import ModelConfig
from jaxpage.kv_cache import HybridKVCache, KVCache, group_layer_index
from jaxpage.mesh_axes import POOL_SPEC, SCALE_SPEC
from pallas_kernels import kv_quantization
from pallas_kernels.impl import pad_head_dim

# kv_cache_dtype (canonical: jaxpage.config.canonical_kv_cache_dtype) -> the pages' dtype ("auto": the compute dtype)
QUANTIZED_KV_CACHE_DTYPES = {"int8": jnp.int8, "fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedBatch:
    """Attention metadata of one ragged step (T tokens of S sequences, padded to the step's shape)."""

    slot_mapping: jax.Array  # [T] int32, page * page_size + offset where each token's K/V goes (0 for padding)
    block_tables: jax.Array  # [S, P] int32, pages of each sequence (0 past its end)
    kv_lens: jax.Array  # [S] int32, cached tokens of each sequence after this step (0 for padding rows)
    cu_q_lens: jax.Array  # [S + 1] int32, sequence s owns tokens [cu_q_lens[s], cu_q_lens[s + 1])
    num_seqs: jax.Array  # [] int32, real sequences; rows past it are padding
    # A hybrid model's window group of layers (jaxpage.kv_cache.HybridKVCache), whose pages are its own: where each
    # token's K/V goes in it and each sequence's pages there (None for other models).
    window_slot_mapping: jax.Array | None = None  # [T] int32
    window_block_tables: jax.Array | None = None  # [S, P] int32, the null page before the window

    def window_batch(self) -> PagedBatch:
        """The batch as the window group's layers see it: its slot mapping and block tables."""
        return dataclasses.replace(
            self,
            slot_mapping=self.window_slot_mapping,
            block_tables=self.window_block_tables,
            window_slot_mapping=None,
            window_block_tables=None,
        )

    def live_kv_lens(self) -> jax.Array:
        """kv_lens with padding rows' (rows past num_seqs) set to 0."""
        return jnp.where(jnp.arange(self.kv_lens.shape[0]) < self.num_seqs, self.kv_lens, 0)

    def live_cu_q_lens(self) -> jax.Array:
        """cu_q_lens with padding rows' (rows past num_seqs) q_len 0."""
        return jnp.minimum(self.cu_q_lens, self.cu_q_lens[self.num_seqs])


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
    """An attention implementation with the pool's kv_cache_dtype, for programs built for `platform`; hashable (it
    is part of the jitted step's static structure)."""

    kv_cache_dtype: str = "auto"
    platform: str = dataclasses.field(default_factory=lambda: jax.default_backend())  # what programs are built for

    tpu_layout = False  # the pool is in the TPU kernels' layout (jaxpage.attention.pallas_tpu)

    def __post_init__(self):
        assert self.kv_cache_dtype == "auto" or self.kv_cache_dtype in QUANTIZED_KV_CACHE_DTYPES, self.kv_cache_dtype

    @property
    def name(self) -> str:
        """The attention_impl that names this backend ("xla", "pallas_tpu", "pallas_gpu_interpret", ...)."""
        raise NotImplementedError

    @property
    def quantized(self) -> bool:
        return self.kv_cache_dtype != "auto"

    def pool_head_dim(self, head_dim: int) -> int:
        """The pool's head_dim for the model's: the same, unless a kernel needs it padded."""
        return head_dim

    def pool_dtype(self, compute_dtype) -> jnp.dtype:
        """The pages' dtype: the compute dtype, or the 8-bit format of kv_cache_dtype."""
        return jnp.dtype(QUANTIZED_KV_CACHE_DTYPES.get(self.kv_cache_dtype, compute_dtype))

    def kv_bytes_per_token(
        self, config: ModelConfig, dtype_bytes: int, page_size: int | None = None, tensor_parallel_size: int = 1
    ) -> int:
        """2 * layers * kv_heads * (head_dim * bytes per value + bytes per scale), with the pool's (padded)
        head_dim; dtype_bytes: the compute dtype's (what "auto" stores). page_size and tensor_parallel_size matter
        to layouts that store scales by the page (the TPU backend's)."""
        if not self.quantized:
            return config.kv_bytes_per_token(dtype_bytes) // config.head_dim * self.pool_head_dim(config.head_dim)
        values = config.num_kv_heads * self.pool_head_dim(config.head_dim)  # 1-byte values
        return 2 * config.num_layers * (values + self._scale_bytes_per_token(config, page_size, tensor_parallel_size))

    def _scale_bytes_per_token(self, config: ModelConfig, page_size: int | None, tensor_parallel_size: int) -> int:
        return config.num_kv_heads * kv_quantization.SCALE_DTYPE.itemsize

    def addressable_pages(self, config: ModelConfig, num_pages: int, page_size: int, tensor_parallel_size: int = 1):
        """num_pages, or the most pages below it the kernels can address."""
        return num_pages

    def kv_head_bytes(self, config: ModelConfig, dtype_bytes: int) -> str:
        """What one token of one KV head takes, for the start-up log: "64 dims * 4 bytes", or for 8-bit pages
        "(64 dims * 1 byte int8 + 2 bytes scale)" (dims: the pool's head_dim, padded ones said so)."""
        head_dim = self.pool_head_dim(config.head_dim)
        dims = f"{head_dim} dims" + ("" if head_dim == config.head_dim else f" (head_dim {config.head_dim} padded)")
        if not self.quantized:
            return f"{dims} * {dtype_bytes} bytes"
        return f"({dims} * 1 byte {self.kv_cache_dtype} + {kv_quantization.SCALE_DTYPE.itemsize} bytes scale)"

    def pool_layout(
        self,
        config: ModelConfig,
        num_pages: int,
        page_size: int,
        compute_dtype,
        tensor_parallel_size: int = 1,
        num_layers: int | None = None,
    ) -> KVCache:
        """The pool's arrays as shapes and dtypes: K and V [num_layers, num_pages, page_size, num_kv_heads,
        head_dim] (the pool's head_dim), and for 8-bit pages their scales [num_layers, num_pages, page_size,
        num_kv_heads]. num_layers: the layers of a group (jaxpage.kv_cache.HybridKVCache); None: the model's."""
        head_dim = self.pool_head_dim(config.head_dim)
        pages = (num_layers or config.num_layers, num_pages, page_size, config.num_kv_heads, head_dim)
        return self._pool_arrays(pages, pages[:-1], compute_dtype)

    def _pool_arrays(self, pages: tuple, scales: tuple, compute_dtype) -> KVCache:
        values = jax.ShapeDtypeStruct(pages, self.pool_dtype(compute_dtype))
        if not self.quantized:
            return KVCache(k=values, v=values)
        scales = jax.ShapeDtypeStruct(scales, kv_quantization.SCALE_DTYPE)
        return KVCache(k=values, v=values, k_scales=scales, v_scales=scales)

    def pool_specs(self) -> KVCache:
        """The PartitionSpecs of the pool's arrays over a mesh of axes ("data", "model"): pages split over the
        data-parallel replicas and kv heads over the model axis (None for absent scales)."""
        scales = SCALE_SPEC if self.quantized else None
        return KVCache(k=POOL_SPEC, v=POOL_SPEC, k_scales=scales, v_scales=scales)

    def write_kv(self, kv_cache: KVCache, k, v, slot_mapping, layer) -> KVCache:
        """The step's new K/V ([T, kv_heads, head_dim] each) into layer `layer` of the pool at slot_mapping [T]
        (8-bit pages: quantized per token and KV head, their scales beside them)."""
        page_size = kv_cache.page_size
        pages, offsets = slot_mapping // page_size, slot_mapping % page_size
        (k, k_scales), (v, v_scales) = self._values_and_scales(kv_cache, k), self._values_and_scales(kv_cache, v)
        return KVCache(
            k=kv_cache.k.at[layer, pages, offsets].set(k),
            v=kv_cache.v.at[layer, pages, offsets].set(v),
            k_scales=None if k_scales is None else kv_cache.k_scales.at[layer, pages, offsets].set(k_scales),
            v_scales=None if v_scales is None else kv_cache.v_scales.at[layer, pages, offsets].set(v_scales),
        )

    def _values_and_scales(self, kv_cache: KVCache, x: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        """x [T, kv_heads, head_dim] as the pool stores it (head_dim padded to the pool's; 8-bit: quantized per
        token and KV head) and its scales [T, kv_heads] (None for pages in the compute dtype)."""
        x = pad_head_dim(x, self.pool_head_dim(x.shape[-1]))
        if kv_cache.k_scales is None:
            return x.astype(kv_cache.k.dtype), None
        return kv_quantization.quantize(x, kv_cache.k.dtype)

    def attend(
        self,
        q: jax.Array,  # [T, num_heads, head_dim]
        kv_cache: KVCache,
        batch: PagedBatch,
        layer: jax.Array,  # [] int32
        *,
        sm_scale: float,
        sliding_window: int | None,
        max_q_len: int | None,
        soft_cap: float | None = None,
    ) -> jax.Array:  # [T, num_heads, head_dim]
        """Causal attention of the step's query tokens to their sequences' cached keys (this step's included).

        max_q_len (static): no live sequence has more query tokens than this (None: any number). With 1, every
        live sequence has one query token, token s being sequence s's, and T == S. soft_cap (Gemma 2): logits
        become soft_cap * tanh(logits / soft_cap) before the mask and softmax."""
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class PagedAttention:
    """What the model's layers call (see jaxpage.models.attention): write K/V into the pool, then attend.

    A hybrid model's pool (jaxpage.kv_cache.HybridKVCache) has a group of layers per kind of attention, each with
    pages and block tables of its own: a layer writes into its group (and, so that no lax.cond has the pool pass
    through it, into the other group's null page), and attends in the group its window says: through the window in
    the window group, else in the full one."""

    backend: AttentionBackend
    sm_scale: float
    sliding_window: int | None = None
    max_q_len: int | None = None  # see AttentionBackend.attend
    soft_cap: float | None = None  # see AttentionBackend.attend
    sliding_layers: tuple[bool, ...] = ()  # per layer, whether it is in the window group of a hybrid pool

    def __call__(self, q, k, v, batch: PagedBatch, kv_cache: KVCache | HybridKVCache, layer):
        # q [T, H, d]; k, v [T, K, d]
        kv_cache = self.store(k, v, batch, kv_cache, layer)
        return self.attend(q, k, v, batch, kv_cache, layer), kv_cache

    def store(self, k, v, batch: PagedBatch, kv_cache: KVCache | HybridKVCache, layer) -> KVCache | HybridKVCache:
        """The step's K/V written into the pool."""
        if not isinstance(kv_cache, HybridKVCache):
            return self.backend.write_kv(kv_cache, k, v, batch.slot_mapping, layer)
        sliding = jnp.asarray(self.sliding_layers)[layer]
        full_layer, window_layer = self._group_layers(layer)
        full_slots = jnp.where(sliding, 0, batch.slot_mapping)  # slot 0: the null page
        window_slots = jnp.where(sliding, batch.window_slot_mapping, 0)
        return HybridKVCache(
            full=self.backend.write_kv(kv_cache.full, k, v, full_slots, full_layer),
            window=self.backend.write_kv(kv_cache.window, k, v, window_slots, window_layer),
        )

    def attend(self, q, k, v, batch: PagedBatch, kv_cache: KVCache | HybridKVCache, layer) -> jax.Array:
        """The attention of q to the pool (which holds this step's K/V already: k and v are not read)."""
        if isinstance(kv_cache, HybridKVCache):
            full_layer, window_layer = self._group_layers(layer)
            if self.sliding_window is None:
                kv_cache, layer = kv_cache.full, full_layer
            else:
                kv_cache, batch, layer = kv_cache.window, batch.window_batch(), window_layer
        return self.backend.attend(
            q,
            kv_cache,
            batch,
            layer,
            sm_scale=self.sm_scale,
            sliding_window=self.sliding_window,
            max_q_len=self.max_q_len,
            soft_cap=self.soft_cap,
        )

    def _group_layers(self, layer: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The layer's index in the full group and in the window group (0 in the group it is not in)."""
        return tuple(jnp.asarray(index, jnp.int32)[layer] for index in group_layer_index(self.sliding_layers))
