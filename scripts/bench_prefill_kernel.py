"""Prefill (ragged) paged attention: the FLOP rate of the Pallas kernel and of the XLA implementation on one prompt,
against the device's bfloat16 matmul rate measured in the same run.

    python scripts/bench_prefill_kernel.py                # on a GPU or TPU: one 4,096-token prompt, Llama-3-8B's layer
    python scripts/bench_prefill_kernel.py --prompt-len 8192
    python scripts/bench_prefill_kernel.py --interpret [--backend tpu|gpu]  # anywhere: tiny sizes, interpreted

One sequence whose whole prompt is this step's query (causal: query i sees keys 0..i), its K/V already in the pool
(bfloat16 pages of 16 tokens in a random order), 32 query / 8 KV heads of 128. FLOPs per call = the causal (query,
key) pairs, n (n + 1) / 2, x 4 x head_dim x query heads (q.k and p.v, a multiply and an add each); the matmul rate is
that of an 8192 x 8192 x 8192 jnp.dot of random bfloat16 matrices (2 n^3 FLOPs). Times are the median of 5 rounds of
back-to-back calls (jaxpage.benchmarks.measure.device_seconds). The kernel's output is compared with the XLA
implementation's (||pallas - xla|| / ||xla||). One JSON line, {"check": "prefill_kernel", ...}.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from jaxpage.benchmarks.measure import matmul_flops_per_s, time_attention_impls
from jaxpage.benchmarks.progress import log
from pallas_kernels.ragged_paged_attention import ragged_paged_attention

PAGE_SIZE = 16
DEVICE = dict(prompt_len=4096, heads=32, kv_heads=8, head_dim=128, dtype="bfloat16", matmul_n=8192, repeats=10)
TINY = dict(prompt_len=80, heads=4, kv_heads=2, head_dim=32, dtype="float32", matmul_n=256, repeats=2)


def prefill_inputs(prompt_len: int, heads: int, kv_heads: int, head_dim: int, dtype) -> dict:
    """One sequence of prompt_len query rows and as many keys, its pages in a random order after the null page."""
    pages = -(-prompt_len // PAGE_SIZE)
    table = np.random.default_rng(0).permutation(np.arange(1, pages + 1))[None, :]
    key = jax.random.key(0)
    k = jax.random.normal(key, (pages + 1, PAGE_SIZE, kv_heads, head_dim), dtype)
    v = jax.random.normal(jax.random.fold_in(key, 1), k.shape, dtype)
    q = jax.random.normal(jax.random.fold_in(key, 2), (prompt_len, heads, head_dim), dtype)
    metadata = dict(kv_lens=jnp.array([prompt_len], jnp.int32), block_tables=jnp.asarray(table, jnp.int32))
    metadata |= dict(cu_q_lens=jnp.array([0, prompt_len], jnp.int32), num_seqs=jnp.int32(1))
    return dict(q=q, k_pages=k, v_pages=v, **metadata)


def causal_flops(prompt_len: int, heads: int, head_dim: int) -> int:
    """FLOPs of causal attention over one prompt: its (query, key) pairs x 4 x head_dim x heads."""
    return prompt_len * (prompt_len + 1) // 2 * 4 * head_dim * heads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--interpret", action="store_true", help="tiny sizes, the kernel in Pallas' interpreter")
    parser.add_argument("--backend", choices=("tpu", "gpu"), default="gpu", help="whose kernel --interpret runs")
    parser.add_argument("--prompt-len", type=int)
    parser.add_argument("--repeats", type=int, help="calls per timed round")
    args = parser.parse_args()
    sizes = dict(TINY if args.interpret else DEVICE)
    sizes |= {k: v for k, v in vars(args).items() if k in sizes and v is not None}
    prompt_len, heads, head_dim = sizes["prompt_len"], sizes["heads"], sizes["head_dim"]
    kernel = dict(impl="pallas", interpret=True, backend=args.backend) if args.interpret else dict(impl="pallas")
    matmul = matmul_flops_per_s(sizes["matmul_n"], sizes["repeats"], "bfloat16")
    log(f"{jax.devices()[0]}: bfloat16 matmul {matmul / 1e12:.1f} TFLOP/s")
    inputs = prefill_inputs(prompt_len, heads, sizes["kv_heads"], head_dim, jnp.dtype(sizes["dtype"]))
    flops = causal_flops(prompt_len, heads, head_dim)
    record = {"check": "prefill_kernel", "device": str(jax.devices()[0]), "prompt_len": prompt_len, "heads": heads}
    record |= {"kv_heads": sizes["kv_heads"], "head_dim": head_dim, "page_size": PAGE_SIZE, "dtype": sizes["dtype"]}
    record |= {"flops_per_call": flops, "matmul_tflop_per_s": round(matmul / 1e12, 2)}
    impls = {name: how | dict(sm_scale=head_dim**-0.5) for name, how in (("pallas", kernel), ("xla", dict(impl="xla")))}
    times, record["rel_err_pallas_vs_xla"] = time_attention_impls(
        ragged_paged_attention, inputs, impls, sizes["repeats"]
    )
    for impl, seconds in times.items():
        record[f"{impl}_ms"] = round(seconds * 1e3, 4)
        record[f"{impl}_tflop_per_s"] = round(flops / seconds / 1e12, 3)
        record[f"{impl}_fraction_of_matmul"] = round(flops / seconds / matmul, 3)
        log(f"{impl}: {seconds * 1e3:.3f} ms, {flops / seconds / 1e12:.2f} TFLOP/s ({flops / seconds / matmul:.0%})")
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
