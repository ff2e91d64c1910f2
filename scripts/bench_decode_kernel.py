"""Decode paged attention: the KV read bandwidth of the Pallas kernel and of the XLA implementation, case by case.

    python scripts/bench_decode_kernel.py           # on a GPU or TPU: a Llama-3-8B-shaped layer, 3 shapes x 2 formats
    python scripts/bench_decode_kernel.py --shapes 64x2048 --kv-dtypes bfloat16     # one case
    python scripts/bench_decode_kernel.py --interpret [--backend tpu|gpu]  # anywhere: tiny sizes, interpreted

Cases (sequences x tokens each): 64 x 2,048; 8 x 8,192 (few long sequences: the GPU kernel splits each sequence's
pages over several programs); 256 x 512 -- each with bfloat16 pages and with int8 pages (per-token bfloat16 scales,
pallas_kernels.kv_quantization). 32 query / 8 KV heads of 128, page size 16, pages in a random order.

KV bytes per call = what a decode step must read: sequences x kv_len x kv_heads x 2 (K and V) x (head_dim x the page
format's bytes, + 2 for an 8-bit token's scale). They are compared with the device's copy bandwidth, measured once at
the start (a large device-to-device copy reads and writes each byte: 2 x bytes / time). Each implementation's time is
the median of 5 rounds of back-to-back calls (jaxpage.benchmarks.measure.device_seconds). The kernel's output is
compared with the XLA implementation's (relative error, ||pallas - xla|| / ||xla||). One JSON line per case,
{"check": "decode_kernel", ...}, printed as each case ends; a case that fails is logged, the others still run, and the
exit status is 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from jaxpage.benchmarks.measure import copy_bandwidth, time_attention_impls
from jaxpage.benchmarks.progress import log
from pallas_kernels.kv_quantization import SCALE_DTYPE, is_quantized, quantize
from pallas_kernels.paged_attention import paged_attention

PAGE_SIZE = 16
DEVICE = dict(shapes="64x2048,8x8192,256x512", kv_dtypes="bfloat16,int8", heads=32, kv_heads=8, head_dim=128)
DEVICE |= dict(dtype="bfloat16", repeats=10)
TINY = dict(shapes="4x100,2x300", kv_dtypes="float32,int8", heads=8, kv_heads=2, head_dim=64, dtype="float32")
TINY |= dict(repeats=2)


def decode_inputs(num_seqs: int, kv_len: int, heads: int, kv_heads: int, head_dim: int, dtype, kv_dtype) -> dict:
    """q, the pools (with their scales for 8-bit pages), kv_lens and block tables of pages in a random order."""
    pages_per_seq = -(-kv_len // PAGE_SIZE)
    num_pages = 1 + num_seqs * pages_per_seq  # page 0: the null page
    tables = np.random.default_rng(0).permutation(np.arange(1, num_pages)).reshape(num_seqs, pages_per_seq)
    key = jax.random.key(0)
    k = jax.random.normal(key, (num_pages, PAGE_SIZE, kv_heads, head_dim), dtype)
    v = jax.random.normal(jax.random.fold_in(key, 1), k.shape, dtype)
    scales = {}
    if is_quantized(kv_dtype):
        (k, scales["k_scales"]), (v, scales["v_scales"]) = quantize(k, kv_dtype), quantize(v, kv_dtype)
    else:
        k, v = k.astype(kv_dtype), v.astype(kv_dtype)
    q = jax.random.normal(jax.random.fold_in(key, 2), (num_seqs, heads, head_dim), dtype)
    kv_lens = jnp.full((num_seqs,), kv_len, jnp.int32)
    return dict(q=q, k_pages=k, v_pages=v, kv_lens=kv_lens, block_tables=jnp.asarray(tables, jnp.int32), **scales)


def kv_bytes(num_seqs: int, kv_len: int, kv_heads: int, head_dim: int, kv_dtype) -> int:
    """The bytes of K and V a decode call must read (8-bit pages: with their scales)."""
    per_head = head_dim * jnp.dtype(kv_dtype).itemsize + (SCALE_DTYPE.itemsize if is_quantized(kv_dtype) else 0)
    return num_seqs * kv_len * kv_heads * 2 * per_head


def run_case(sizes: dict, num_seqs: int, kv_len: int, kv_dtype: str, kernel: dict, copy_gb_per_s: float) -> dict:
    heads, kv_heads, head_dim = sizes["heads"], sizes["kv_heads"], sizes["head_dim"]
    inputs = decode_inputs(num_seqs, kv_len, heads, kv_heads, head_dim, jnp.dtype(sizes["dtype"]), jnp.dtype(kv_dtype))
    read = kv_bytes(num_seqs, kv_len, kv_heads, head_dim, kv_dtype)
    record = {"check": "decode_kernel", "device": str(jax.devices()[0]), "num_seqs": num_seqs, "kv_len": kv_len}
    record |= {"heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "page_size": PAGE_SIZE}
    record |= {"dtype": sizes["dtype"], "kv_dtype": kv_dtype, "kv_bytes_per_call": int(read)}
    impls = {name: how | dict(sm_scale=head_dim**-0.5) for name, how in (("pallas", kernel), ("xla", dict(impl="xla")))}
    times, error = time_attention_impls(paged_attention, inputs, impls, sizes["repeats"])
    record["rel_err_pallas_vs_xla"] = error
    for impl, seconds in times.items():
        record[f"{impl}_ms"] = round(seconds * 1e3, 4)
        record[f"{impl}_kv_gb_per_s"] = round(read / seconds / 1e9, 2)
        record[f"{impl}_fraction_of_copy"] = round(read / seconds / 1e9 / copy_gb_per_s, 3)
    record["copy_gb_per_s"] = copy_gb_per_s
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--interpret", action="store_true", help="tiny sizes, the kernel in Pallas' interpreter")
    parser.add_argument("--backend", choices=("tpu", "gpu"), default="gpu", help="whose kernel --interpret runs")
    parser.add_argument("--shapes", help="sequences x tokens, comma-separated (default 64x2048,8x8192,256x512)")
    parser.add_argument("--kv-dtypes", help="page formats, comma-separated (default bfloat16,int8)")
    parser.add_argument("--repeats", type=int, help="calls per timed round")
    args = parser.parse_args()
    sizes = dict(TINY if args.interpret else DEVICE)
    sizes |= {k: v for k, v in vars(args).items() if k in sizes and v is not None}
    shapes = [tuple(int(n) for n in shape.split("x")) for shape in sizes["shapes"].split(",")]
    kv_dtypes = sizes["kv_dtypes"].split(",")
    kernel = dict(impl="pallas", interpret=True, backend=args.backend) if args.interpret else dict(impl="pallas")
    largest = max(kv_bytes(s, n, sizes["kv_heads"], sizes["head_dim"], d) for s, n in shapes for d in kv_dtypes)
    copy_gb_per_s = round(copy_bandwidth(min(2 << 30, 8 * largest), sizes["repeats"]) / 1e9, 1)
    log(f"{jax.devices()[0]}: copy bandwidth {copy_gb_per_s} GB/s")
    failures = 0
    for num_seqs, kv_len in shapes:
        for kv_dtype in kv_dtypes:
            try:
                record = run_case(sizes, num_seqs, kv_len, kv_dtype, kernel, copy_gb_per_s)
            except Exception:  # the other cases still run: one format's failure must not hide another's figures
                log(f"{num_seqs} x {kv_len} {kv_dtype} failed:\n{traceback.format_exc()}")
                failures += 1
                continue
            log(
                f"{num_seqs} x {kv_len} {kv_dtype}: pallas {record['pallas_ms']} ms "
                f"({record['pallas_fraction_of_copy']:.0%} of copy), xla {record['xla_ms']} ms "
                f"({record['xla_fraction_of_copy']:.0%}); rel. error {record['rel_err_pallas_vs_xla']}"
            )
            print(json.dumps(record), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
