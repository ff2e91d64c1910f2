"""The attention backend: resolved once, at engine start, from the engine argument `attention_impl`.

It owns what only attention should know -- the KV pool's shape (head_dim padded where a kernel needs it), writing
a step's new K/V into the pool, and attending through the block tables -- so that the engine, the runner and the
config never branch on backends:

    "xla"                   the XLA implementation (pure JAX): the CPU path, and any backend's fallback
    "pallas_tpu"            the Pallas Mosaic kernels (TPU)
    "pallas_gpu"            the Pallas GPU kernels
    "pallas_tpu_interpret"  the TPU kernels in Pallas' interpreter, on any backend (slow: for tests)
    "pallas_gpu_interpret"  the GPU kernels in Pallas' interpreter, on any backend (slow: for tests)

`attention_impl` "auto" is the kernels of the platform the programs are compiled for (TPU, GPU), else "xla";
"pallas" is the platform's kernels, refused where there are none. That platform is jax's default backend, or a
target's when the engine's programs are built for chips this host does not have (`jaxpage.aot`).

The pool's format is the engine argument `kv_cache_dtype`, in vLLM's names: "auto" (the model's compute dtype),
"int8", "fp8" (= "fp8_e4m3") or "fp8_e5m2": 8-bit pages with one bfloat16 scale per token per KV head beside them
(`pallas_kernels.kv_quantization`). The step quantizes each token's K/V as it writes them; every attention
implementation applies the scales to the tiles it reads, never to the pool.

The TPU backends keep the pool in the layout the Mosaic kernels read in place (`pallas_kernels.tpu_page_pipeline`):
K and V [num_layers, num_pages, page_size, num_kv_heads * head_dim] and the 8-bit pages' scales one [rows, 128]
block per page. XLA lays such arrays out row-major by default, as Mosaic does, so the step's pool argument reaches
the kernels without a copy; with kv heads as a dimension of their own it would be relaid out (copied whole) on every
call, and its second-minor dimension padded. `pool_specs` says how the pool is sharded over the mesh.

The most query rows any sequence of a step has is known on the host and passed as a static argument `max_q_len`:
1 for a decode-only step (it compiles only the decode attention), k + 1 for a step that verifies k speculative
tokens per sequence (the ragged attention, told that no sequence has more rows), None for a mixed step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxpage.config import ModelConfig
from jaxpage.kv_cache import KVCache
from jaxpage.parallel import DATA_AXIS, POOL_SPEC, SCALE_SPEC, TP_AXIS
from pallas_kernels import kv_quantization
from pallas_kernels.impl import (
    LANES,
    kernel_pool_view,
    pad_head_dim,
    padded_head_dim,
    tpu_scale_rows,
    tpu_write_scales,
    triton_misaddresses,
)
from pallas_kernels.paged_attention import paged_attention
from pallas_kernels.ragged_paged_attention import ragged_paged_attention

BACKENDS = ("xla", "pallas_tpu", "pallas_gpu", "pallas_tpu_interpret", "pallas_gpu_interpret")
# kv_cache_dtype -> the pages' dtype ("auto": the compute dtype); vLLM's "fp8" is "fp8_e4m3"
QUANTIZED_KV_CACHE_DTYPES = {"int8": jnp.int8, "fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2}
KV_CACHE_DTYPE_ALIASES = {"fp8": "fp8_e4m3"}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedBatch:
    """Attention metadata of one ragged step (T tokens of S sequences, padded to the step's shape)."""

    slot_mapping: jax.Array  # [T] int32, page * page_size + offset where each token's K/V goes (0 for padding)
    block_tables: jax.Array  # [S, P] int32, pages of each sequence (0 past its end)
    kv_lens: jax.Array  # [S] int32, cached tokens of each sequence after this step (0 for padding rows)
    cu_q_lens: jax.Array  # [S + 1] int32, sequence s owns tokens [cu_q_lens[s], cu_q_lens[s + 1])
    num_seqs: jax.Array  # [] int32, real sequences; rows past it are padding


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
    """One of BACKENDS, with the pool's kv_cache_dtype; hashable (it is part of the jitted step's static
    structure)."""

    name: str
    kv_cache_dtype: str = "auto"
    platform: str = dataclasses.field(default_factory=lambda: jax.default_backend())  # what programs are built for

    def __post_init__(self):
        assert self.name in BACKENDS, self.name
        assert self.kv_cache_dtype == "auto" or self.kv_cache_dtype in QUANTIZED_KV_CACHE_DTYPES, self.kv_cache_dtype

    @classmethod
    def resolve(
        cls, attention_impl: str = "auto", kv_cache_dtype: str = "auto", platform: str | None = None
    ) -> AttentionBackend:
        """The backend for the engine arguments, for programs built for `platform` (default: jax's default
        backend); ValueError where it cannot run there (EngineConfig checks kv_cache_dtype)."""
        platform = platform or jax.default_backend()
        kv_cache_dtype = KV_CACHE_DTYPE_ALIASES.get(kv_cache_dtype, kv_cache_dtype)
        return cls(cls._resolve_name(attention_impl, platform), kv_cache_dtype, platform)

    @staticmethod
    def _resolve_name(attention_impl: str, platform: str) -> str:
        native = {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}.get(platform)
        if attention_impl == "auto":
            return native or "xla"
        if attention_impl == "pallas":
            if native is None:
                raise ValueError(
                    f"engine argument attention_impl='pallas' cannot run on {platform}: there are no Pallas kernels "
                    "for it (use 'auto', 'xla', or 'pallas_tpu_interpret' / 'pallas_gpu_interpret' for tests)"
                )
            return native
        if attention_impl in ("pallas_tpu", "pallas_gpu") and attention_impl != native:
            raise ValueError(
                f"engine argument attention_impl={attention_impl!r} cannot run on {platform} "
                f"(use {attention_impl}_interpret for Pallas' interpreter)"
            )
        if attention_impl not in BACKENDS:
            raise ValueError(f"engine argument attention_impl must be 'auto', 'pallas' or one of {BACKENDS}")
        return attention_impl

    @property
    def _kernel_args(self) -> dict:
        """The attention functions' impl / interpret / backend arguments."""
        if self.name == "xla":
            return dict(impl="xla")
        kernel = self.name.split("_")[1]  # "tpu" or "gpu"
        return dict(impl="pallas", interpret=self._interpret, backend=kernel, platform=self.platform)

    @property
    def tpu_layout(self) -> bool:
        """The pool is in the TPU kernels' layout (see the module's docstring)."""
        return self.name.startswith("pallas_tpu")

    def pool_head_dim(self, head_dim: int) -> int:
        """The pool's head_dim: the TPU kernels need it padded with zeros to a multiple of 128 (the lane width)."""
        return padded_head_dim(head_dim) if self.tpu_layout else head_dim

    @property
    def quantized(self) -> bool:
        return self.kv_cache_dtype != "auto"

    def pool_dtype(self, compute_dtype) -> jnp.dtype:
        """The pages' dtype: the compute dtype, or the 8-bit format of kv_cache_dtype."""
        return jnp.dtype(QUANTIZED_KV_CACHE_DTYPES.get(self.kv_cache_dtype, compute_dtype))

    def kv_bytes_per_token(
        self, config: ModelConfig, dtype_bytes: int, page_size: int | None = None, tensor_parallel_size: int = 1
    ) -> int:
        """2 * layers * kv_heads * (head_dim * bytes per value + bytes per scale), with the pool's (padded)
        head_dim; dtype_bytes: the compute dtype's (what "auto" stores).

        The TPU layout's 8-bit scales take whole [rows, 128] blocks per page (and per tensor-parallel shard): given
        page_size (and tensor_parallel_size), their bytes are those blocks' over the page's tokens, rounded up;
        without, the scales' own 2 bytes (the pool then takes a little more than the figure says)."""
        if not self.quantized:
            return config.kv_bytes_per_token(dtype_bytes) // config.head_dim * self.pool_head_dim(config.head_dim)
        values = config.num_kv_heads * self.pool_head_dim(config.head_dim)  # 1-byte values
        scales = config.num_kv_heads * kv_quantization.SCALE_DTYPE.itemsize
        if self.tpu_layout and page_size is not None:
            rows = tpu_scale_rows(page_size, config.num_kv_heads // tensor_parallel_size)
            block_bytes = tensor_parallel_size * rows * LANES * kv_quantization.SCALE_DTYPE.itemsize
            scales = -(-block_bytes // page_size)
        return 2 * config.num_layers * (values + scales)

    def addressable_pages(self, config: ModelConfig, num_pages: int, page_size: int, tensor_parallel_size: int = 1):
        """num_pages, or the most pages below it the kernels can address: the GPU kernels read a whole stacked
        8-bit pool as one array, which their Triton lowering misaddresses between 2 and 4 GiB per device
        (`impl.triton_misaddresses`); such a pool is cut to 2 GiB."""
        if not (self.name.startswith("pallas_gpu") and self.quantized):
            return num_pages
        kv_heads = config.num_kv_heads // tensor_parallel_size
        page_bytes = config.num_layers * page_size * kv_heads * self.pool_head_dim(config.head_dim)  # 1 byte each
        return 2**31 // page_bytes if triton_misaddresses(num_pages * page_bytes, 1) else num_pages

    def kv_head_bytes(self, config: ModelConfig, dtype_bytes: int) -> str:
        """What one token of one KV head takes, for the start-up log: "64 dims * 4 bytes", or for 8-bit pages
        "(64 dims * 1 byte int8 + 2 bytes scale)" (dims: the pool's head_dim, padded ones said so)."""
        head_dim = self.pool_head_dim(config.head_dim)
        dims = f"{head_dim} dims" + ("" if head_dim == config.head_dim else f" (head_dim {config.head_dim} padded)")
        if not self.quantized:
            return f"{dims} * {dtype_bytes} bytes"
        return f"({dims} * 1 byte {self.kv_cache_dtype} + {kv_quantization.SCALE_DTYPE.itemsize} bytes scale)"

    def pool_layout(
        self, config: ModelConfig, num_pages: int, page_size: int, compute_dtype, tensor_parallel_size: int = 1
    ) -> KVCache:
        """The pool's arrays as shapes and dtypes: K and V [num_layers, num_pages, page_size, num_kv_heads,
        head_dim] (the pool's head_dim), and for 8-bit pages their scales [num_layers, num_pages, page_size,
        num_kv_heads].

        The TPU layout: K and V [num_layers, num_pages, page_size, num_kv_heads * head_dim], scales [num_layers,
        num_pages, tensor_parallel_size * rows, 128]: each shard's kv heads' scales of a page in a block of
        `impl.tpu_scale_rows` rows (`impl.tpu_scale_positions`), so that sharding the rows over the mesh's model
        axis gives every shard the scales of its own kv heads (`pool_specs`)."""
        layers, kv_heads, head_dim = config.num_layers, config.num_kv_heads, self.pool_head_dim(config.head_dim)
        if self.tpu_layout:
            pages = (layers, num_pages, page_size, kv_heads * head_dim)
            rows = tpu_scale_rows(page_size, kv_heads // tensor_parallel_size)
            scales = (layers, num_pages, tensor_parallel_size * rows, LANES)
        else:
            pages = (layers, num_pages, page_size, kv_heads, head_dim)
            scales = pages[:-1]
        values = jax.ShapeDtypeStruct(pages, self.pool_dtype(compute_dtype))
        if not self.quantized:
            return KVCache(k=values, v=values)
        scales = jax.ShapeDtypeStruct(scales, kv_quantization.SCALE_DTYPE)
        return KVCache(k=values, v=values, k_scales=scales, v_scales=scales)

    def pool_specs(self) -> KVCache:
        """The PartitionSpecs of the pool's arrays over a mesh of axes ("data", "model"): pages split over the
        data-parallel replicas and kv heads over the model axis (None for absent scales)."""
        if self.tpu_layout:
            pages, scales = P(None, DATA_AXIS, None, TP_AXIS), P(None, DATA_AXIS, TP_AXIS, None)
        else:
            pages, scales = POOL_SPEC, SCALE_SPEC
        scales = scales if self.quantized else None
        return KVCache(k=pages, v=pages, k_scales=scales, v_scales=scales)

    def write_kv(self, kv_cache: KVCache, k, v, slot_mapping, layer) -> KVCache:
        """The step's new K/V ([T, kv_heads, head_dim] each) into layer `layer` of the pool at slot_mapping [T]
        (8-bit pages: quantized per token and KV head, their scales beside them)."""
        num_tokens, num_kv_heads = k.shape[:2]
        page_size, head_dim = kv_cache.page_size, self.pool_head_dim(k.shape[-1])
        pages, offsets = slot_mapping // page_size, slot_mapping % page_size
        k, v = pad_head_dim(k, head_dim), pad_head_dim(v, head_dim)
        scales = None, None
        if kv_cache.k_scales is not None:
            (k, k_scales), (v, v_scales) = (kv_quantization.quantize(x, kv_cache.k.dtype) for x in (k, v))
            scales = k_scales, v_scales  # [T, kv_heads] each
        if self.tpu_layout:  # kv heads side by side in a token's row; scales at their places in each page's block
            k, v = k.reshape(num_tokens, num_kv_heads * head_dim), v.reshape(num_tokens, num_kv_heads * head_dim)

            def write_scales(pool_scales, values):
                return tpu_write_scales(pool_scales, layer, pages, offsets, values, page_size)
        else:

            def write_scales(pool_scales, values):
                return pool_scales.at[layer, pages, offsets].set(values)

        return KVCache(
            k=kv_cache.k.at[layer, pages, offsets].set(k.astype(kv_cache.k.dtype)),
            v=kv_cache.v.at[layer, pages, offsets].set(v.astype(kv_cache.v.dtype)),
            k_scales=None if scales[0] is None else write_scales(kv_cache.k_scales, scales[0]),
            v_scales=None if scales[1] is None else write_scales(kv_cache.v_scales, scales[1]),
        )

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
    ) -> jax.Array:  # [T, num_heads, head_dim]
        """Causal attention of the step's query tokens to their sequences' cached keys (this step's included).

        max_q_len (static): no live sequence has more query tokens than this (None: any number). With 1, every
        live sequence has one query token, token s being sequence s's, and T == S."""
        if self.tpu_layout:
            return self._tpu_attend(q, kv_cache, batch, layer, sm_scale, sliding_window, max_q_len)
        options = dict(sm_scale=sm_scale, sliding_window=sliding_window, layer=layer, **self._kernel_args)
        options |= dict(k_scales=kv_cache.k_scales, v_scales=kv_cache.v_scales)
        if max_q_len == 1:
            assert q.shape[0] == batch.kv_lens.shape[0], (q.shape, batch.kv_lens.shape)
            live = jnp.arange(batch.kv_lens.shape[0]) < batch.num_seqs
            kv_lens = jnp.where(live, batch.kv_lens, 0)
            return paged_attention(q, kv_cache.k, kv_cache.v, kv_lens, batch.block_tables, **options)
        metadata = (batch.kv_lens, batch.block_tables, batch.cu_q_lens, batch.num_seqs)
        return ragged_paged_attention(q, kv_cache.k, kv_cache.v, *metadata, **options, max_q_len=max_q_len)

    def _tpu_attend(self, q, kv_cache: KVCache, batch: PagedBatch, layer, sm_scale, sliding_window, max_q_len):
        """`attend` with the TPU kernels, on the pool in their layout (the public attention functions take the pool
        in their own view). What those functions do besides: q's head_dim padded to the pool's, padding rows
        emptied, the block tables offset to the layer (`kernel_pool_view`)."""
        from pallas_kernels.tpu_page_pipeline import tpu_pages_per_kv_tile  # Pallas: imported when used

        head_dim = q.shape[-1]
        q = pad_head_dim(q, self.pool_head_dim(head_dim))
        pages_per_kv_tile = tpu_pages_per_kv_tile(kv_cache.page_size)
        pools, tables = kernel_pool_view(dataclasses.astuple(kv_cache), batch.block_tables, layer, pages_per_kv_tile)
        live = jnp.arange(batch.kv_lens.shape[0]) < batch.num_seqs
        kv_lens = jnp.where(live, batch.kv_lens, 0)
        k, v, k_scales, v_scales = pools
        options = dict(k_scales=k_scales, v_scales=v_scales, sm_scale=sm_scale, soft_cap=None)
        options |= dict(sliding_window=sliding_window, pages_per_kv_tile=pages_per_kv_tile, interpret=self._interpret)
        if max_q_len == 1:
            from pallas_kernels.tpu_decode_attention import tpu_decode_attention

            assert q.shape[0] == kv_lens.shape[0], (q.shape, kv_lens.shape)
            out = tpu_decode_attention(q, k, v, kv_lens, tables, **options)
        else:
            from pallas_kernels.tpu_ragged_attention import TPU_Q_TILE, tpu_ragged_attention

            cu_q_lens = jnp.minimum(batch.cu_q_lens, batch.cu_q_lens[batch.num_seqs])  # padding rows: q_len 0
            out = tpu_ragged_attention(q, k, v, kv_lens, tables, cu_q_lens, **options, q_tile=TPU_Q_TILE)
        return out[..., :head_dim]

    @property
    def _interpret(self) -> bool:
        return self.name.endswith("_interpret")


@dataclasses.dataclass(frozen=True)
class PagedAttention:
    """What the model's layers call (see jaxpage.models.attention): write K/V into the pool, then attend."""

    backend: AttentionBackend
    sm_scale: float
    sliding_window: int | None = None
    max_q_len: int | None = None  # see AttentionBackend.attend

    def __call__(self, q, k, v, batch: PagedBatch, kv_cache: KVCache, layer):
        # q [T, H, d]; k, v [T, K, d]
        kv_cache = self.backend.write_kv(kv_cache, k, v, batch.slot_mapping, layer)
        out = self.backend.attend(
            q,
            kv_cache,
            batch,
            layer,
            sm_scale=self.sm_scale,
            sliding_window=self.sliding_window,
            max_q_len=self.max_q_len,
        )
        return out, kv_cache
