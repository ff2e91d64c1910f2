"""Decode paged attention: achieved KV read bandwidth of the Pallas kernel (and of the XLA implementation).

    python scripts/bench_decode_kernel.py                     # on a GPU or TPU: a Llama-3-8B-shaped layer, bfloat16
    python scripts/bench_decode_kernel.py --interpret [--backend tpu|gpu]  # anywhere: tiny sizes, interpreted

KV bytes per call = sum over sequences of kv_len x kv_heads x head_dim x 2 (K and V) x dtype bytes: what a
decode step must read. It is compared with the device's copy bandwidth, measured in the same run (a large
device-to-device copy reads and writes each byte: 2 x bytes / time). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxpage.benchmarks.measure import copy_bandwidth
from pallas_kernels.paged_attention import paged_attention


def timed(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile
    start = time.perf_counter()
    for _ in range(repeats):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--interpret", action="store_true", help="tiny sizes, the kernel in Pallas' interpreter")
    parser.add_argument("--backend", choices=("tpu", "gpu"), default="gpu", help="whose kernel --interpret runs")
    parser.add_argument("--num-seqs", type=int)
    parser.add_argument("--kv-len", type=int)
    parser.add_argument("--repeats", type=int)
    args = parser.parse_args()
    if args.interpret:
        num_seqs, kv_len, heads, kv_heads, head_dim, dtype, repeats = 4, 100, 8, 2, 64, jnp.float32, 2
    else:
        num_seqs, kv_len, heads, kv_heads, head_dim, dtype, repeats = 64, 2048, 32, 8, 128, jnp.bfloat16, 20
    num_seqs, kv_len = args.num_seqs or num_seqs, args.kv_len or kv_len
    repeats = args.repeats or repeats
    page_size = 16
    pages_per_seq = -(-kv_len // page_size)
    num_pages = 1 + num_seqs * pages_per_seq
    rng = np.random.default_rng(0)
    tables = rng.permutation(np.arange(1, num_pages)).reshape(num_seqs, pages_per_seq).astype(np.int32)
    key = jax.random.key(0)
    k_pages = jax.random.normal(key, (num_pages, page_size, kv_heads, head_dim), dtype)
    v_pages = jax.random.normal(jax.random.fold_in(key, 1), k_pages.shape, dtype)
    q = jax.random.normal(jax.random.fold_in(key, 2), (num_seqs, heads, head_dim), dtype)
    kv_lens = jnp.full((num_seqs,), kv_len, jnp.int32)
    kv_bytes = num_seqs * kv_len * kv_heads * head_dim * 2 * jnp.dtype(dtype).itemsize

    results = {"backend": jax.default_backend(), "device": str(jax.devices()[0]), "num_seqs": num_seqs}
    results |= {"kv_len": kv_len, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim}
    results |= {"dtype": jnp.dtype(dtype).name, "kv_bytes_per_call": int(kv_bytes)}
    outputs = {}
    kernel = dict(impl="pallas", interpret=True, backend=args.backend) if args.interpret else dict(impl="pallas")
    for impl, how in (("pallas", kernel), ("xla", dict(impl="xla"))):
        fn = jax.jit(lambda *a, how=how: paged_attention(*a, sm_scale=head_dim**-0.5, **how))
        seconds = timed(fn, q, k_pages, v_pages, kv_lens, jnp.asarray(tables), repeats=repeats)
        outputs[impl] = np.asarray(fn(q, k_pages, v_pages, kv_lens, jnp.asarray(tables)), np.float32)
        results[f"{impl}_ms"] = round(seconds * 1e3, 4)
        results[f"{impl}_kv_gb_per_s"] = round(kv_bytes / seconds / 1e9, 2)
        print(f"{impl:9s}: {seconds * 1e3:9.3f} ms per call, KV read {kv_bytes / seconds / 1e9:8.1f} GB/s", flush=True)
    results["max_abs_diff_pallas_vs_xla"] = float(np.abs(outputs["pallas"] - outputs["xla"]).max())
    bandwidth = copy_bandwidth(min(4 << 30, 8 * int(kv_bytes)), repeats)
    results["copy_gb_per_s"] = round(bandwidth / 1e9, 1)
    results["pallas_fraction_of_copy_bandwidth"] = round(results["pallas_kv_gb_per_s"] / results["copy_gb_per_s"], 3)
    fraction = results["pallas_fraction_of_copy_bandwidth"]
    print(f"device copy bandwidth {bandwidth / 1e9:.1f} GB/s; kernel at {fraction:.0%}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
