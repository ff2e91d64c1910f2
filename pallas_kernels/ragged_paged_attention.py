"""Ragged paged attention in pure JAX: the CPU path, and the reference the Pallas kernels are tested against.

One call attends every sequence of a mixed ("ragged") batch -- decodes and prefill chunks, their query tokens
back to back -- to that sequence's keys in the paged KV pool, read through its block table.

Work scales like the sum over sequences of q_len x kv_len (never T x max_kv), in tiles of q_block x kv_block, and
memory like one block of keys for all sequences ([S, kv_block, kv_heads, head_dim]):
  1. The LAST query row of every sequence, all sequences at once, runs an online softmax (flash attention) over
     key blocks of `kv_block` keys, up to the longest kv_len in the batch. For a decode row (q_len == 1) that is
     the whole job.
  2. The other rows of sequences with q_len > 1 go through a loop over just those sequences, `q_block` rows at a
     time, each block an online softmax over only the key blocks its rows see (causal mask, sliding window).
Each key block is gathered from the pool through the block table with positions >= kv_len ZEROED (jnp.where on
the values, not only masked in the logits): stale slots, the null page and freed pages may hold NaN/inf garbage,
and NaN times a zero probability is still NaN.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels.gpu_ragged_attention import gpu_ragged_attention
from pallas_kernels.impl import MASK_VALUE, kernel_operands, kernel_pool_view, padded_head_dim, resolve_impl
from pallas_kernels.tpu_ragged_attention import tpu_ragged_attention

Q_BLOCK = 64  # query rows per step of the prefill loop
KV_BLOCK = 128  # keys per step of the loops over key blocks (rounded down to whole pages, at least one page)
# Up to this many kv heads the products over many sequences pair every query head with every kv head (see
# `attend`): measured on CPU, still ~2x faster than per-kv-head products at 16 kv heads, slower at 32.
ALL_PAIRS_MAX_KV_HEADS = 16
# ... and only when their query rows times heads is a multiple of this: narrower pair products (SmolLM2's 9 heads
# decoding) run several times slower, and per kv head is then ~15% faster.
PAIR_ROWS_MULTIPLE = 8
DECODE_ROW_GROUP = 16  # sequences whose last query rows are attended together
GPU_Q_BLOCK = 16  # query rows of one program of the GPU kernel
GPU_PAGES_PER_BLOCK = 8  # pages it reads per step
TPU_Q_BLOCK = 32  # query rows of one program of the TPU kernel (times the query heads of a kv head)
TPU_BLOCK_KEYS = 128  # keys it fetches per step: this many over the page size, whole pages (at least one)


def tpu_pages_per_block(page_size: int) -> int:
    """Pages the TPU kernels fetch per step: TPU_BLOCK_KEYS keys in whole pages, at least one."""
    return max(1, TPU_BLOCK_KEYS // page_size)


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "sliding_window", "impl", "interpret", "backend"))
def ragged_paged_attention(
    q: jax.Array,  # [T, num_heads, head_dim]  query tokens of all sequences, back to back (padding at the end)
    k_pages: jax.Array,  # [num_pages, page_size, num_kv_heads, head_dim]  one layer's K pool
    v_pages: jax.Array,  # [num_pages, page_size, num_kv_heads, head_dim]  one layer's V pool
    kv_lens: jax.Array,  # [S] int32  tokens in the cache for each sequence, including this step's new tokens
    block_tables: jax.Array,  # [S, pages_per_seq] int32  page ids; unused entries point at page 0 (the null page)
    cu_q_lens: jax.Array,  # [S + 1] int32  sequence s owns query rows [cu_q_lens[s], cu_q_lens[s + 1])
    num_seqs: jax.Array,  # [] int32  rows s >= num_seqs are padding (their q_len and kv_len are 0)
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    layer: jax.Array | None = None,
    impl: str = "reference",
    interpret=False,
    backend: str | None = None,
) -> jax.Array:
    """Causal attention of each sequence's query rows to its cached keys, through the block tables.

    `impl`, `interpret` and `backend` pick the implementation as `pallas_kernels.impl` says ("reference" by
    default here; the Pallas kernels are `tpu_ragged_attention` and `gpu_ragged_attention`).

    The pool's head_dim is q's, or q's padded with zeros to a multiple of 128: the layout the TPU kernels need
    (given an unpadded pool they pad it, a copy per call). The result has q's head_dim.

    With `layer` ([] int32), k_pages and v_pages are the whole stacked pool [num_layers, num_pages, page_size,
    num_kv_heads, head_dim] and the pages of that layer are read in place: slicing one layer out of a pool that
    is carried through a layer loop would make XLA copy the layer's pages on every call.

    Query row i of sequence s (q_len = cu_q_lens[s + 1] - cu_q_lens[s]) sits at position kv_lens[s] - q_len + i
    and sees the keys at positions 0..that position, or only the last `sliding_window` of them. Position p of
    sequence s lives at `k_pages[block_tables[s, p // page_size], p % page_size]`. Query head h reads kv head
    h // (num_heads // num_kv_heads). Logits are `sm_scale * q.k`, then `soft_cap * tanh(logits / soft_cap)` when
    `soft_cap` is given; softmax and accumulation are in float32.

    Rows past cu_q_lens[num_seqs] and rows that see no key come out as 0. K/V at positions >= kv_len are never
    read into the result, even when they hold NaN. The metadata must be consistent (not checkable on traced
    values): cu_q_lens nondecreasing from cu_q_lens[0] == 0 with cu_q_lens[num_seqs] <= T, and
    q_len <= kv_len <= pages_per_seq * page_size for every live sequence.

    Returns [T, num_heads, head_dim] in q's dtype. Raises ValueError for inconsistent shapes or dtypes.
    """
    check_inputs(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, soft_cap, sliding_window, layer)
    kernel = resolve_impl(impl, interpret, backend)
    head_dim = q.shape[-1]
    q, k_pages, v_pages = kernel_operands(q, k_pages, v_pages, kernel)
    options = dict(sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window)
    if kernel == "reference":
        all_pairs = k_pages.shape[-2] <= ALL_PAIRS_MAX_KV_HEADS
        out = _ragged_paged_attention(
            *(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, layer),
            **options,
            q_block=Q_BLOCK,
            kv_block=KV_BLOCK,
            all_pairs=all_pairs,
        )
        return out[..., :head_dim]
    live = jnp.arange(kv_lens.shape[0]) < num_seqs
    kv_lens = jnp.where(live, kv_lens, 0)
    cu_q_lens = jnp.minimum(cu_q_lens, cu_q_lens[num_seqs])  # padding rows: q_len 0
    if kernel == "tpu":
        pages_per_block = tpu_pages_per_block(k_pages.shape[-3])
        k, v, tables = kernel_pool_view(k_pages, v_pages, block_tables, layer, pages_per_block)
        out = tpu_ragged_attention(
            *(q, k, v, kv_lens, tables, cu_q_lens),
            **options,
            q_block=TPU_Q_BLOCK,
            pages_per_block=pages_per_block,
            interpret=interpret,
        )
    else:
        k, v, tables = kernel_pool_view(k_pages, v_pages, block_tables, layer, GPU_PAGES_PER_BLOCK)
        out = gpu_ragged_attention(
            *(q, k, v, kv_lens, tables, cu_q_lens),
            **options,
            q_block=GPU_Q_BLOCK,
            pages_per_block=GPU_PAGES_PER_BLOCK,
            interpret=interpret,
        )
    return out[..., :head_dim]


def check_inputs(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, soft_cap, sliding_window, layer):
    """Raises ValueError for the arguments of `ragged_paged_attention` (shapes, dtypes, options) that are wrong."""
    if layer is not None:
        if k_pages.ndim != 5 or v_pages.ndim != 5 or jnp.shape(layer) != ():
            raise ValueError(
                "with layer, k_pages and v_pages must be [num_layers, num_pages, page_size, num_kv_heads, head_dim] "
                f"and layer a scalar; got {k_pages.shape}, {v_pages.shape} and {jnp.shape(layer)}"
            )
        if k_pages.shape[0] != v_pages.shape[0]:
            raise ValueError(f"k_pages and v_pages must have the same shape, got {k_pages.shape} and {v_pages.shape}")
        k_pages = jax.ShapeDtypeStruct(k_pages.shape[1:], k_pages.dtype)
        v_pages = jax.ShapeDtypeStruct(v_pages.shape[1:], v_pages.dtype)
    _check_inputs(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, soft_cap, sliding_window)


def _check_inputs(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, soft_cap, sliding_window):
    for name, x in (("q", q), ("k_pages", k_pages), ("v_pages", v_pages)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name} must be a floating-point array, got dtype {x.dtype}")
    if q.ndim != 3:
        raise ValueError(f"q must be [T, num_heads, head_dim], got shape {q.shape}")
    if k_pages.ndim != 4:
        raise ValueError(f"k_pages must be [num_pages, page_size, num_kv_heads, head_dim], got shape {k_pages.shape}")
    if k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages and v_pages must have the same shape, got {k_pages.shape} and {v_pages.shape}")
    if k_pages.dtype != v_pages.dtype:
        raise ValueError(f"k_pages and v_pages must have the same dtype, got {k_pages.dtype} and {v_pages.dtype}")
    num_heads, head_dim = q.shape[1:]
    num_kv_heads, kv_head_dim = k_pages.shape[2:]
    if kv_head_dim not in (head_dim, padded_head_dim(head_dim)):
        raise ValueError(
            f"head_dim of the KV pages ({kv_head_dim}) must be q's ({head_dim}) or q's padded to a multiple of 128 "
            f"({padded_head_dim(head_dim)})"
        )
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    for name, x in (("kv_lens", kv_lens), ("block_tables", block_tables), ("cu_q_lens", cu_q_lens)):
        if x.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32, got dtype {x.dtype}")
    if getattr(num_seqs, "dtype", None) != jnp.int32 or num_seqs.shape != ():
        raise ValueError(f"num_seqs must be an int32 scalar array (shape []), got {num_seqs!r}")
    if kv_lens.ndim != 1:
        raise ValueError(f"kv_lens must be [S], got shape {kv_lens.shape}")
    num_seq_rows = kv_lens.shape[0]
    if block_tables.ndim != 2 or block_tables.shape[0] != num_seq_rows:
        raise ValueError(f"block_tables must be [S, pages_per_seq] with S = {num_seq_rows}, got {block_tables.shape}")
    if cu_q_lens.shape != (num_seq_rows + 1,):
        raise ValueError(f"cu_q_lens must be [S + 1] = [{num_seq_rows + 1}], got shape {cu_q_lens.shape}")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"soft_cap must be positive or None, got {soft_cap}")
    if sliding_window is not None and not sliding_window > 0:
        raise ValueError(f"sliding_window must be positive or None, got {sliding_window}")


@functools.partial(
    jax.jit, static_argnames=("sm_scale", "soft_cap", "sliding_window", "q_block", "kv_block", "all_pairs")
)
def _ragged_paged_attention(
    q,  # [T, num_heads, head_dim]
    k_pages,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_pages,  # [num_pages, page_size, num_kv_heads, head_dim]
    kv_lens,  # [S] int32
    block_tables,  # [S, pages_per_seq] int32
    cu_q_lens,  # [S + 1] int32
    num_seqs,  # [] int32
    layer,  # [] int32 or None: with it, k_pages and v_pages have a leading num_layers axis
    *,
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    q_block: int,
    kv_block: int,
    all_pairs: bool,
) -> jax.Array:
    """The implementation, with its tuning as arguments: tests shrink the blocks to cross block boundaries."""
    num_tokens, num_heads, head_dim = q.shape
    page_size, num_kv_heads = k_pages.shape[-3:-1]
    num_seq_rows, pages_per_seq = block_tables.shape
    group = num_heads // num_kv_heads
    if num_tokens == 0 or num_seq_rows == 0 or pages_per_seq == 0:
        return jnp.zeros_like(q)

    # Keys are read kv_block at a time, in whole pages; the tables get null-page columns so that blocks tile them.
    pages_per_kv_block = max(1, min(pages_per_seq, kv_block // page_size))
    kv_block = pages_per_kv_block * page_size
    padded_pages = -(-pages_per_seq // pages_per_kv_block) * pages_per_kv_block
    tables = jnp.pad(block_tables, ((0, 0), (0, padded_pages - pages_per_seq)))

    live = jnp.arange(num_seq_rows) < num_seqs
    kv_lens = jnp.where(live, kv_lens, 0)
    q_lens = jnp.where(live, cu_q_lens[1:] - cu_q_lens[:-1], 0)

    def attend(q_rows, query_pos, seq_tables, seq_kv_lens, first_block, last_block):
        """Online softmax (flash attention) of n sequences' query rows over their key blocks first..last_block.

        q_rows [n, rows, kv_heads, group, head_dim], query_pos [n, rows], seq_tables [n, padded_pages],
        seq_kv_lens [n] -> [n, rows, num_heads, head_dim] float32; a row that sees no key gives 0.
        """
        n, rows = query_pos.shape
        # Two ways to batch the products. Per kv head is the plain one, but over many sequences XLA then gathers
        # K/V into a transposed layout, which on CPU costs several times the products themselves. With few kv
        # heads it is cheaper to pair every query head with every kv head, batched over sequences only with K/V
        # in the pool's own layout, and keep the matching pairs: kv_heads times the (cheap) flops.
        pairs = all_pairs and n > 1 and (rows * num_heads) % PAIR_ROWS_MULTIPLE == 0
        q_rows = q_rows.astype(jnp.float32).transpose(0, 2, 1, 3, 4)  # [n, kv_heads, rows, group, head_dim]
        q_rows = q_rows.reshape(n, num_kv_heads, rows * group, head_dim)
        same_head = jnp.eye(num_kv_heads, dtype=bool)[:, None, :, None]  # [kv_heads, 1, kv_heads, 1]

        def scores(keys):  # [n, kv_block, kv_heads, head_dim] -> [n, kv_heads, rows * group, kv_block]
            if not pairs:
                return jnp.einsum("nlkd,nkhd->nkhl", keys, q_rows)
            s = jnp.einsum(
                "nmd,nhd->nmh",
                keys.reshape(n, kv_block * num_kv_heads, head_dim),
                q_rows.reshape(n, num_heads * rows, head_dim),
            )
            # [n, kv_block, kv_head x query's kv_head, rows * group]: keep the diagonal, every (kv_heads + 1)-th.
            s = s.reshape(n, kv_block, num_kv_heads**2, rows * group)[:, :, :: num_kv_heads + 1]
            return s.transpose(0, 2, 3, 1)

        def weighted_values(p, values):  # [n, kv_heads, rows * group, kv_block] -> [n, kv_heads, rows * group, d]
            if not pairs:
                return jnp.einsum("nkhl,nlkd->nkhd", p, values)
            pv = jnp.einsum("nhl,nlm->nhm", p.reshape(n, -1, kv_block), values.reshape(n, kv_block, -1))
            pv = pv.reshape(n, num_kv_heads, rows * group, num_kv_heads, head_dim)
            return jnp.where(same_head, pv, 0.0).sum(axis=3)

        def load(pages, page_ids, in_cache):  # -> [n, kv_block, kv_heads, head_dim], zero where not in_cache
            x = (pages[page_ids] if layer is None else pages[layer, page_ids]).reshape(
                n, kv_block, num_kv_heads, head_dim
            )
            # jnp.where, not a mask on the logits alone: NaN garbage times a zero probability is still NaN.
            return jnp.where(in_cache[:, :, None, None], x, jnp.zeros((), x.dtype)).astype(jnp.float32)

        def kv_step(j, carry):
            row_max, row_sum, acc = carry  # [n, kv_heads, rows, group] twice, [n, kv_heads, rows, group, head_dim]
            key_pos = j * kv_block + jnp.arange(kv_block)
            in_cache = key_pos[None, :] < seq_kv_lens[:, None]  # [n, kv_block]
            page_ids = lax.dynamic_slice_in_dim(seq_tables, j * pages_per_kv_block, pages_per_kv_block, axis=1)
            keys, values = load(k_pages, page_ids, in_cache), load(v_pages, page_ids, in_cache)
            # Keys on the minor axis: the softmax reductions run along contiguous memory.
            s = scores(keys).reshape(n, num_kv_heads, rows, group, kv_block) * sm_scale
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            mask = in_cache[:, None, :] & (key_pos[None, None, :] <= query_pos[:, :, None])  # [n, rows, kv_block]
            if sliding_window is not None:
                mask &= key_pos[None, None, :] > query_pos[:, :, None] - sliding_window
            mask = mask[:, None, :, None, :]
            s = jnp.where(mask, s, MASK_VALUE)
            new_max = jnp.maximum(row_max, s.max(axis=-1))
            alpha = jnp.exp(row_max - new_max)
            p = jnp.where(mask, jnp.exp(s - new_max[..., None]), 0.0)
            pv = weighted_values(p.reshape(n, num_kv_heads, rows * group, kv_block), values)
            return new_max, alpha * row_sum + p.sum(axis=-1), alpha[..., None] * acc + pv.reshape(acc.shape)

        row_max = jnp.full((n, num_kv_heads, rows, group), MASK_VALUE, jnp.float32)
        init = (row_max, jnp.zeros_like(row_max), jnp.zeros((*row_max.shape, head_dim), jnp.float32))
        _, row_sum, acc = lax.fori_loop(first_block, last_block + 1, kv_step, init)
        o = acc / jnp.where(row_sum > 0, row_sum, 1.0)[..., None]
        return o.transpose(0, 2, 1, 3, 4).reshape(n, rows, num_heads, head_dim)

    def first_block_for(query_pos):  # the first key block within the sliding window of the earliest query
        return 0 if sliding_window is None else jnp.maximum(query_pos - sliding_window + 1, 0) // kv_block

    # 1. The last row of every sequence, all at once. It sits at position kv_len - 1 and sees the whole cache (or
    # window); for a decode row (q_len == 1) that is the whole job.
    # Sequences go longest first in groups of DECODE_ROW_GROUP, each group reading only as many key blocks as its
    # own longest sequence needs: with mixed lengths, one batch-wide loop would read the longest length for all.
    last_row = cu_q_lens[1:] - 1  # [S]
    q_last = q[jnp.clip(last_row, 0, num_tokens - 1)].reshape(num_seq_rows, 1, num_kv_heads, group, head_dim)
    last_pos = kv_lens - 1
    rows_per_group = min(DECODE_ROW_GROUP, num_seq_rows)
    num_groups = -(-num_seq_rows // rows_per_group)
    order = jnp.argsort(-kv_lens)  # live sequences (kv_len >= 1) first, padding rows (kv_len 0) last
    order = jnp.pad(order, (0, num_groups * rows_per_group - num_seq_rows), mode="edge")  # repeats: same result

    def group_step(g, out_last):
        rows = lax.dynamic_slice_in_dim(order, g * rows_per_group, rows_per_group)
        pos, lens = last_pos[rows], kv_lens[rows]
        o = attend(
            q_last[rows],
            pos[:, None],
            tables[rows],
            lens,
            first_block_for(jnp.min(jnp.where(lens > 0, pos, jnp.iinfo(jnp.int32).max))),
            jnp.max(pos) // kv_block,
        )[:, 0]
        return out_last.at[rows].set(o)

    live_groups = -(-jnp.sum(kv_lens > 0) // rows_per_group)
    out_last = lax.fori_loop(0, live_groups, group_step, jnp.zeros((num_seq_rows, num_heads, head_dim), jnp.float32))

    # 2. The other rows of sequences with q_len > 1, q_block rows at a time. q and out get q_block extra rows so
    # that a block starting at any row in [0, T) fits: dynamic_slice would otherwise clamp its start.
    q_padded = jnp.pad(q, ((0, q_block), (0, 0), (0, 0)))
    out = jnp.zeros((num_tokens + q_block, num_heads, head_dim), jnp.float32)
    chunked = q_lens > 1
    chunked_seqs = jnp.nonzero(chunked, size=num_seq_rows, fill_value=0)[0]

    def seq_step(i, out):
        seq = chunked_seqs[i]
        q_len, kv_len = q_lens[seq], kv_lens[seq]
        num_rows = q_len - 1  # the last row came from step 1
        seq_tables = lax.dynamic_slice_in_dim(tables, seq, 1)

        def block_step(b, out):
            local = b * q_block + jnp.arange(q_block)
            query_pos = kv_len - q_len + local
            row0 = cu_q_lens[seq] + b * q_block
            q_rows = lax.dynamic_slice_in_dim(q_padded, row0, q_block)
            q_rows = q_rows.reshape(1, q_block, num_kv_heads, group, head_dim)
            last_block = jnp.minimum(query_pos[-1], kv_len - 1) // kv_block
            o = attend(q_rows, query_pos[None], seq_tables, kv_len[None], first_block_for(query_pos[0]), last_block)
            # Rows past this sequence's own belong to a neighbour (or padding): keep what is there.
            old = lax.dynamic_slice_in_dim(out, row0, q_block)
            new = jnp.where((local < num_rows)[:, None, None], o[0], old)
            return lax.dynamic_update_slice_in_dim(out, new, row0, axis=0)

        return lax.fori_loop(0, -(-num_rows // q_block), block_step, out)

    out = lax.fori_loop(0, chunked.sum(), seq_step, out)

    # Each live sequence's last row gets step 1's result; sequences without rows write out of range (dropped).
    last_row = jnp.where(q_lens > 0, last_row, num_tokens + q_block)
    out = out.at[last_row].set(out_last, mode="drop")
    return out[:num_tokens].astype(q.dtype)


def ragged_paged_attention_dense_reference(
    q,  # [T, num_heads, head_dim]
    k_pages,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_pages,  # [num_pages, page_size, num_kv_heads, head_dim]
    kv_lens,  # [S] int32
    block_tables,  # [S, pages_per_seq] int32
    cu_q_lens,  # [S + 1] int32
    num_seqs,  # [] int32
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
) -> jax.Array:
    """The same attention written plainly: Python loops over concrete values, float64 numpy. Tests only."""
    out_dtype = q.dtype
    q = np.asarray(q).astype(np.float64)
    k_pages = np.asarray(k_pages).astype(np.float64)
    v_pages = np.asarray(v_pages).astype(np.float64)
    kv_lens, block_tables, cu_q_lens = np.asarray(kv_lens), np.asarray(block_tables), np.asarray(cu_q_lens)
    page_size = k_pages.shape[1]
    group = q.shape[1] // k_pages.shape[2]
    out = np.zeros(q.shape, np.float64)
    for s in range(int(num_seqs)):
        kv_len, q_start, q_end = int(kv_lens[s]), int(cu_q_lens[s]), int(cu_q_lens[s + 1])
        # Contiguous K/V of this sequence: only positions < kv_len are ever read.
        keys = np.array([k_pages[block_tables[s, p // page_size], p % page_size] for p in range(kv_len)])
        values = np.array([v_pages[block_tables[s, p // page_size], p % page_size] for p in range(kv_len)])
        for i, row in enumerate(range(q_start, q_end)):
            pos = kv_len - (q_end - q_start) + i
            lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            seen = np.arange(lo, pos + 1)
            if seen.size == 0:
                continue
            for h in range(q.shape[1]):
                logits = sm_scale * keys[seen, h // group] @ q[row, h]
                if soft_cap is not None:
                    logits = soft_cap * np.tanh(logits / soft_cap)
                weights = np.exp(logits - logits.max())
                out[row, h] = weights @ values[seen, h // group] / weights.sum()
    return jnp.asarray(out.astype(out_dtype))
