"""Ragged paged attention in plain JAX, compiled by XLA: the CPU path (`impl="xla"`), a production path.

One call attends every sequence of a mixed ("ragged") batch -- decodes and prefill chunks, their query tokens
back to back -- to that sequence's keys in the paged KV pool, read through its block table.

Work scales like the sum over sequences of q_len x kv_len (never T x max_kv), in query tiles of `q_tile` rows by
kv tiles of `kv_tile` keys, and memory like one kv tile for all sequences ([S, kv_tile, kv_heads, head_dim]):
  1. The LAST query row of every sequence, all sequences at once, runs an online softmax (flash attention) over
     kv tiles up to the longest kv_len in the batch. For a decode row (q_len == 1) that is the whole job. With
     `max_q_len=R` the caller promises that no sequence has more than R rows, and this part takes the last R rows
     of every sequence (a decode step: R = 1; verifying k speculative tokens: R = k + 1).
  2. Without `max_q_len`, the other rows of sequences with q_len > 1 go through a loop over just those sequences,
     one query tile at a time, each tile an online softmax over only the kv tiles its rows see (causal mask,
     sliding window). With `max_q_len` this loop is not built at all: a decode step compiles only what it runs.
Each kv tile is gathered from the pool through the block table with positions >= kv_len ZEROED (jnp.where on the
values, not only masked in the logits): stale slots, the null page and freed pages may hold NaN/inf garbage, and
NaN times a zero probability is still NaN. 8-bit pages (int8, fp8) are dequantized as their tiles are gathered,
with their per-token scales: the pool itself is never dequantized.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.impl import MASK_VALUE, tpu_block_scales
from pallas_kernels.kv_quantization import dequantize

Q_TILE = 64  # query rows per step of the prefill loop
KV_TILE = 128  # keys per step of the loops over kv tiles (rounded down to whole pages, at least one page)
# Up to this many kv heads the products over many sequences pair every query head with every kv head (see
# `attend`): measured on CPU, still ~2x faster than per-kv-head products at 16 kv heads, slower at 32.
ALL_PAIRS_MAX_KV_HEADS = 16
# ... and only when their query rows times heads is a multiple of this: narrower pair products (SmolLM2's 9 heads
# decoding) run several times slower, and per kv head is then ~15% faster.
PAIR_ROWS_MULTIPLE = 8
LAST_ROW_TILE = 16  # sequences whose last query rows are attended together (part 1's query tile)


def platform_tuning(platform: str) -> dict:
    """xla_ragged_attention's tuning for programs built for `platform`. The defaults were measured on CPU. On a GPU
    (or TPU) each step of the loops is a handful of kernel launches, and the defaults made a decode of 64 sequences
    of 2,048 tokens 64 steps of ~11 small kernels each (170 GB/s of KV on an H200, ~1% of the chip, in 3.2 ms; the
    CPU's all-pairs products 8x the FLOPs, every kv tile widened to float32 in memory): there, all the sequences of
    a step at once (up to 64), 256 keys a step, products per kv head, and tiles in the query's dtype (bfloat16
    products with float32 logits and accumulator; a float32 model's stay float32): 8 steps for that decode."""
    if platform == "cpu":
        return {}
    return dict(kv_tile=256, last_row_tile=64, all_pairs=False, tiles_in_query_dtype=True)


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "soft_cap",
        "sliding_window",
        "max_q_len",
        "q_tile",
        "kv_tile",
        "all_pairs",
        "last_row_tile",
        "tiles_in_query_dtype",
        "fixed_order",
        "tpu_layout",
    ),
)
def xla_ragged_attention(
    q: jax.Array,  # [T, num_heads, head_dim]
    k_pages: jax.Array,  # [num_pages, page_size, num_kv_heads, head_dim], or with `layer` [L, num_pages, ...]
    v_pages: jax.Array,  # same shape as k_pages
    kv_lens: jax.Array,  # [S] int32
    block_tables: jax.Array,  # [S, pages_per_seq] int32
    cu_q_lens: jax.Array,  # [S + 1] int32
    num_seqs: jax.Array,  # [] int32
    layer: jax.Array | None = None,  # [] int32: read this layer of a stacked pool in place
    k_scales: jax.Array | None = None,  # [num_pages, page_size, num_kv_heads] (8-bit pages), or [L, ...] with layer
    v_scales: jax.Array | None = None,
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    max_q_len: int | None = None,
    q_tile: int = Q_TILE,
    kv_tile: int = KV_TILE,
    all_pairs: bool | None = None,
    last_row_tile: int = LAST_ROW_TILE,
    tiles_in_query_dtype: bool = False,
    fixed_order: bool = False,
    tpu_layout: bool = False,
) -> jax.Array:  # [T, num_heads, head_dim] in q's dtype
    """The attention of `ragged_paged_attention`; arguments are checked there (and by `paged_attention`).

    The pool's head_dim must be q's; 8-bit pages come with their scales (`pallas_kernels.kv_quantization`). With
    `max_q_len`, every live sequence must have q_len <= max_q_len (rows of longer sequences before their last
    max_q_len come out as 0). The tuning is an argument so that tests can shrink
    the tiles to cross tile boundaries, and pick either product form (`all_pairs`; None: by the number of kv heads).

    tpu_layout: the pool in the TPU layout (`jaxpage.attention.tpu_pool`: each token's kv heads side by side in one
    row, [..., page_size, num_kv_heads * head_dim], q's head_dim the pool's padded one; 8-bit scales one [rows, 128]
    block per page): each kv tile is gathered whole, then rearranged.

    fixed_order (batch invariance): every query row computed in the same order whatever else the call holds: the
    products per kv head (all_pairs picks its form by the batch), and each kv tile's sum of probabilities taken by
    the probabilities-times-values product itself (a ones column beside the values) rather than a reduction, whose
    order XLA picks by the number of rows. Tiles past a row's own keys change nothing (alpha 1, p 0), and the
    batched products give a row the same bits whatever their batch (measured on CPU, and checked by the tests).
    """
    num_tokens, num_heads, head_dim = q.shape
    if fixed_order and max_q_len != 1 and num_tokens:
        # Every query row as a sequence of its own (its sequence's pages, its position + 1 keys: the causal mask),
        # all in the decode form: one row's work is one shape, whether it is a decode, a chunk's last row or a row
        # inside a prefill chunk (the prefill loop's query tiles would give it other bits).
        options = dict(sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window, kv_tile=kv_tile)
        options |= dict(last_row_tile=last_row_tile, tiles_in_query_dtype=tiles_in_query_dtype, fixed_order=True)
        options |= dict(tpu_layout=tpu_layout)
        return xla_ragged_attention(
            q, k_pages, v_pages, *_rows_as_sequences(kv_lens, block_tables, cu_q_lens, num_seqs, num_tokens), layer,
            k_scales, v_scales, max_q_len=1, **options,
        )  # fmt: skip
    page_size = k_pages.shape[-2 if tpu_layout else -3]
    num_kv_heads = k_pages.shape[-1] // head_dim if tpu_layout else k_pages.shape[-2]
    num_seq_rows, pages_per_seq = block_tables.shape
    group = num_heads // num_kv_heads
    tile_dtype = q.dtype if tiles_in_query_dtype else jnp.float32
    if all_pairs is None:
        all_pairs = num_kv_heads <= ALL_PAIRS_MAX_KV_HEADS
    all_pairs = all_pairs and not fixed_order
    if num_tokens == 0 or num_seq_rows == 0 or pages_per_seq == 0:
        return jnp.zeros_like(q)

    # Keys are read kv_tile at a time, in whole pages; the tables get null-page columns so that kv tiles tile them.
    pages_per_kv_tile = max(1, min(pages_per_seq, kv_tile // page_size))
    kv_tile = pages_per_kv_tile * page_size
    padded_pages = -(-pages_per_seq // pages_per_kv_tile) * pages_per_kv_tile
    tables = jnp.pad(block_tables, ((0, 0), (0, padded_pages - pages_per_seq)))

    live = jnp.arange(num_seq_rows) < num_seqs
    kv_lens = jnp.where(live, kv_lens, 0)
    q_lens = jnp.where(live, cu_q_lens[1:] - cu_q_lens[:-1], 0)

    def attend(q_rows, query_pos, seq_tables, seq_kv_lens, first_kv_tile, last_kv_tile):
        """Online softmax (flash attention) of n sequences' query rows over their kv tiles first..last_kv_tile.

        q_rows [n, rows, kv_heads, group, head_dim], query_pos [n, rows], seq_tables [n, padded_pages],
        seq_kv_lens [n] -> [n, rows, num_heads, head_dim] float32; a row that sees no key gives 0.
        """
        n, rows = query_pos.shape
        # Two ways to batch the products. Per kv head is the plain one, but over many sequences XLA then gathers
        # K/V into a transposed layout, which on CPU costs several times the products themselves. With few kv
        # heads it is cheaper to pair every query head with every kv head, batched over sequences only with K/V
        # in the pool's own layout, and keep the matching pairs: kv_heads times the (cheap) flops.
        pairs = all_pairs and n > 1 and (rows * num_heads) % PAIR_ROWS_MULTIPLE == 0
        q_rows = q_rows.astype(tile_dtype).transpose(0, 2, 1, 3, 4)  # [n, kv_heads, rows, group, head_dim]
        q_rows = q_rows.reshape(n, num_kv_heads, rows * group, head_dim)
        same_head = jnp.eye(num_kv_heads, dtype=bool)[:, None, :, None]  # [kv_heads, 1, kv_heads, 1]

        def scores(keys):  # [n, kv_tile, kv_heads, head_dim] -> [n, kv_heads, rows * group, kv_tile]
            if not pairs:
                return jnp.einsum("nlkd,nkhd->nkhl", keys, q_rows, preferred_element_type=jnp.float32)
            s = jnp.einsum(
                "nmd,nhd->nmh",
                keys.reshape(n, kv_tile * num_kv_heads, head_dim),
                q_rows.reshape(n, num_heads * rows, head_dim),
                preferred_element_type=jnp.float32,
            )
            # [n, kv_tile, kv_head x query's kv_head, rows * group]: keep the diagonal, every (kv_heads + 1)-th.
            s = s.reshape(n, kv_tile, num_kv_heads**2, rows * group)[:, :, :: num_kv_heads + 1]
            return s.transpose(0, 2, 3, 1)

        def weighted_values(p, values):  # [n, kv_heads, rows * group, kv_tile] -> [n, kv_heads, rows * group, d]
            p = p.astype(tile_dtype)
            if not pairs:
                return jnp.einsum("nkhl,nlkd->nkhd", p, values, preferred_element_type=jnp.float32)
            pv = jnp.einsum(
                "nhl,nlm->nhm",
                p.reshape(n, -1, kv_tile),
                values.reshape(n, kv_tile, -1),
                preferred_element_type=jnp.float32,
            )
            pv = pv.reshape(n, num_kv_heads, rows * group, num_kv_heads, head_dim)
            return jnp.where(same_head, pv, 0.0).sum(axis=3)

        def load(pages, scales, page_ids, in_cache):  # -> [n, kv_tile, kv_heads, head_dim], zero where not in_cache
            def gather(x):  # the tile's pages [n, pages_per_kv_tile, ...]
                return x[page_ids] if layer is None else x[layer, page_ids]

            def tile_scales(x):  # -> [n, kv_tile, kv_heads]
                if tpu_layout:  # a page's scales in its [rows, 128] block
                    x = tpu_block_scales(x, num_kv_heads, page_size)
                return x.reshape(n, kv_tile, num_kv_heads)

            # 8-bit pages: the gathered tile is dequantized, never the pool.
            values = gather(pages).reshape(n, kv_tile, num_kv_heads, head_dim)
            x = dequantize(values, None if scales is None else tile_scales(gather(scales)), tile_dtype)
            # jnp.where, not a mask on the logits alone: NaN garbage times a zero probability is still NaN.
            return jnp.where(in_cache[:, :, None, None], x, jnp.zeros((), tile_dtype))

        def kv_step(j, carry):
            row_max, row_sum, acc = carry  # [n, kv_heads, rows, group] twice, [n, kv_heads, rows, group, head_dim]
            key_pos = j * kv_tile + jnp.arange(kv_tile)
            in_cache = key_pos[None, :] < seq_kv_lens[:, None]  # [n, kv_tile]
            page_ids = lax.dynamic_slice_in_dim(seq_tables, j * pages_per_kv_tile, pages_per_kv_tile, axis=1)
            keys, values = load(k_pages, k_scales, page_ids, in_cache), load(v_pages, v_scales, page_ids, in_cache)
            # Keys on the minor axis: the softmax reductions run along contiguous memory.
            s = scores(keys).reshape(n, num_kv_heads, rows, group, kv_tile) * sm_scale
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            mask = in_cache[:, None, :] & (key_pos[None, None, :] <= query_pos[:, :, None])  # [n, rows, kv_tile]
            if sliding_window is not None:
                mask &= key_pos[None, None, :] > query_pos[:, :, None] - sliding_window
            mask = mask[:, None, :, None, :]
            s = jnp.where(mask, s, MASK_VALUE)
            new_max = jnp.maximum(row_max, s.max(axis=-1))
            alpha = jnp.exp(row_max - new_max)
            p = jnp.where(mask, jnp.exp(s - new_max[..., None]), 0.0)
            p = p.reshape(n, num_kv_heads, rows * group, kv_tile)
            if fixed_order:  # the tile's sum of p as one more column of the product
                pv = weighted_values(p, jnp.concatenate([values, jnp.ones_like(values[..., :1])], axis=-1))
                tile_sum, pv = pv[..., -1].reshape(row_sum.shape), pv[..., :-1]
            else:
                tile_sum, pv = p.sum(axis=-1).reshape(row_sum.shape), weighted_values(p, values)
            return new_max, alpha * row_sum + tile_sum, alpha[..., None] * acc + pv.reshape(acc.shape)

        row_max = jnp.full((n, num_kv_heads, rows, group), MASK_VALUE, jnp.float32)
        init = (row_max, jnp.zeros_like(row_max), jnp.zeros((*row_max.shape, head_dim), jnp.float32))
        _, row_sum, acc = lax.fori_loop(first_kv_tile, last_kv_tile + 1, kv_step, init)
        o = acc / jnp.where(row_sum > 0, row_sum, 1.0)[..., None]
        return o.transpose(0, 2, 1, 3, 4).reshape(n, rows, num_heads, head_dim)

    def first_kv_tile_for(query_pos):  # the first kv tile within the sliding window of the earliest query
        return 0 if sliding_window is None else jnp.maximum(query_pos - sliding_window + 1, 0) // kv_tile

    # 1. The last row (or last max_q_len rows) of every sequence, all at once. The last row sits at position
    # kv_len - 1 and sees the whole cache (or window); for a decode row (q_len == 1) that is the whole job.
    # Sequences go longest first, last_row_tile at a time, each tile reading only as many kv tiles as its own
    # longest sequence needs: with mixed lengths, one batch-wide loop would read the longest length for all.
    last_rows = 1 if max_q_len is None else max_q_len  # R
    offsets = jnp.arange(last_rows) - (last_rows - 1)  # -(R - 1) .. 0: the rows before each sequence's last
    rows_of_seq = (cu_q_lens[1:] - 1)[:, None] + offsets  # [S, R] token rows
    own_rows = offsets > -q_lens[:, None]  # [S, R]: rows of the sequence itself (not a neighbour's, not padding)
    q_last = q[jnp.clip(rows_of_seq, 0, num_tokens - 1)].reshape(num_seq_rows, last_rows, num_kv_heads, group, head_dim)
    last_pos = (kv_lens - 1)[:, None] + offsets  # [S, R]
    seqs_per_tile = min(last_row_tile, num_seq_rows)
    num_last_row_tiles = -(-num_seq_rows // seqs_per_tile)
    order = jnp.argsort(-kv_lens)  # live sequences (kv_len >= 1) first, padding rows (kv_len 0) last
    order = jnp.pad(order, (0, num_last_row_tiles * seqs_per_tile - num_seq_rows), mode="edge")  # repeats: same result

    def last_row_tile_step(t, out_last):
        seqs = lax.dynamic_slice_in_dim(order, t * seqs_per_tile, seqs_per_tile)
        pos, lens = last_pos[seqs], kv_lens[seqs]
        earliest = jnp.min(jnp.where(own_rows[seqs] & (lens > 0)[:, None], pos, jnp.iinfo(jnp.int32).max))
        o = attend(q_last[seqs], pos, tables[seqs], lens, first_kv_tile_for(earliest), jnp.max(pos) // kv_tile)
        return out_last.at[seqs].set(o)

    live_tiles = -(-jnp.sum(kv_lens > 0) // seqs_per_tile)
    out_last = jnp.zeros((num_seq_rows, last_rows, num_heads, head_dim), jnp.float32)
    out_last = lax.fori_loop(0, live_tiles, last_row_tile_step, out_last)

    # 2. The other rows of sequences with q_len > 1, a query tile of q_tile rows at a time. q and out get q_tile
    # extra rows so that a tile starting at any row in [0, T) fits: dynamic_slice would otherwise clamp its start.
    # Not built at all with max_q_len.
    extra_rows = 0 if max_q_len is not None else q_tile
    out = jnp.zeros((num_tokens + extra_rows, num_heads, head_dim), jnp.float32)
    if max_q_len is None:
        q_padded = jnp.pad(q, ((0, q_tile), (0, 0), (0, 0)))
        chunked = q_lens > 1
        chunked_seqs = jnp.nonzero(chunked, size=num_seq_rows, fill_value=0)[0]

        def seq_step(i, out):
            seq = chunked_seqs[i]
            q_len, kv_len = q_lens[seq], kv_lens[seq]
            num_rows = q_len - 1  # the last row came from step 1
            seq_tables = lax.dynamic_slice_in_dim(tables, seq, 1)

            def q_tile_step(b, out):
                local = b * q_tile + jnp.arange(q_tile)
                query_pos = kv_len - q_len + local
                row0 = cu_q_lens[seq] + b * q_tile
                q_rows = lax.dynamic_slice_in_dim(q_padded, row0, q_tile)
                q_rows = q_rows.reshape(1, q_tile, num_kv_heads, group, head_dim)
                last_kv_tile = jnp.minimum(query_pos[-1], kv_len - 1) // kv_tile
                first_kv_tile = first_kv_tile_for(query_pos[0])
                o = attend(q_rows, query_pos[None], seq_tables, kv_len[None], first_kv_tile, last_kv_tile)
                # Rows past this sequence's own belong to a neighbour (or padding): keep what is there.
                old = lax.dynamic_slice_in_dim(out, row0, q_tile)
                new = jnp.where((local < num_rows)[:, None, None], o[0], old)
                return lax.dynamic_update_slice_in_dim(out, new, row0, axis=0)

            return lax.fori_loop(0, -(-num_rows // q_tile), q_tile_step, out)

        out = lax.fori_loop(0, chunked.sum(), seq_step, out)

    # Each sequence's own rows of step 1 get its result; other rows write out of range (dropped).
    rows_of_seq = jnp.where(own_rows, rows_of_seq, num_tokens + extra_rows)
    out = out.at[rows_of_seq.reshape(-1)].set(out_last.reshape(-1, num_heads, head_dim), mode="drop")
    return out[:num_tokens].astype(q.dtype)


def _rows_as_sequences(kv_lens, block_tables, cu_q_lens, num_seqs, num_tokens: int) -> tuple:
    """(kv_lens, block_tables, cu_q_lens, num_seqs) of the T query rows, each a sequence of one row: its sequence's
    block table, and its position + 1 keys (rows past the live sequences': none)."""
    rows = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cu_q_lens[1:], rows, side="right"), 0, block_tables.shape[0] - 1)
    live = rows < cu_q_lens[num_seqs]
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    position = kv_lens[seq] - q_lens[seq] + (rows - cu_q_lens[seq])
    row_kv_lens = jnp.where(live, position + 1, 0).astype(jnp.int32)
    return row_kv_lens, block_tables[seq], jnp.arange(num_tokens + 1, dtype=jnp.int32), jnp.int32(num_tokens)
