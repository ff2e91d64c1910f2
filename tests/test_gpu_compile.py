"""The GPU kernels through XLA's real GPU compiler (Pallas' Triton lowering, Triton, ptxas), for an H200 this host
lacks: compiled the engine's way -- the stacked pool donated and carried through a scan over layers that writes each
layer's new K/V, then attends with `layer` -- each program must compile (shared memory, registers, fp8 conversions
are checked here, not at export), hold no copy of a pool and no temporary as large as one.

Needs jax's CUDA plugin (`pip install 'jaxpage[cuda]'`); skipped without it. Run it with JAX_PLATFORMS=cpu.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import SingleDeviceSharding

from jaxpage.benchmarks.hlo_copies import large_copies
from jaxpage.targets import TARGETS, available
from pallas_kernels.gpu_decode_attention import gpu_decode_tiling
from pallas_kernels.kv_quantization import SCALE_DTYPE, quantize
from pallas_kernels.paged_attention import paged_attention
from pallas_kernels.ragged_paged_attention import ragged_paged_attention

H200 = TARGETS["gpu-h200"]
needs_cuda_plugin = pytest.mark.skipif(
    not available(H200), reason="compiling for gpu-h200 needs jax's CUDA plugin: pip install 'jaxpage[compile]'"
)
TRITON_CALLS = ("__gpu$xla.gpu.triton", "triton_kernel_call")  # a Triton kernel's custom call (by jaxlib)
LAYERS, PAGES, PAGE_SIZE, PAGES_PER_SEQ = 2, 4096, 16, 16  # the scales' 512 KiB dwarf the activations


def engine_step(program: str, pool_dtype, q_dtype, *, heads: int, kv_heads: int, head_dim: int):
    """(step, args): a jitted step over a stacked pool [LAYERS, PAGES, PAGE_SIZE, kv_heads, head_dim] (and its
    scales for 8-bit pages) as the engine runs it, and its arguments as ShapeDtypeStructs on an H200."""
    sharding = SingleDeviceSharding(H200.devices(1)[0])
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)  # noqa: E731
    quantized = jnp.dtype(pool_dtype).itemsize == 1
    seqs, tokens = (4, 4) if program == "decode" else (4, 64)
    pages = spec((LAYERS, PAGES, PAGE_SIZE, kv_heads, head_dim), pool_dtype)
    scales = spec((LAYERS, PAGES, PAGE_SIZE, kv_heads), SCALE_DTYPE)
    pool = (pages, pages, scales, scales) if quantized else (pages, pages)

    def step(
        pool,  # (k, v[, k_scales, v_scales]) [LAYERS, PAGES, PAGE_SIZE, kv_heads(, head_dim)]
        x,  # [T, heads, head_dim]
        kv_lens,  # [S] int32
        tables,  # [S, PAGES_PER_SEQ] int32
        cu_q_lens,  # [S + 1] int32
        slots,  # [T] int32
        num_seqs,  # [] int32
    ):
        def layer_step(carry, layer):
            pool, x = carry
            page, offset = slots // PAGE_SIZE, slots % PAGE_SIZE
            new = x[:, :kv_heads]
            if quantized:
                values, new_scales = quantize(new, pool_dtype)
                updates = (values, values, new_scales, new_scales)
            else:
                updates = (new.astype(pool_dtype),) * 2
            pool = tuple(p.at[layer, page, offset].set(u) for p, u in zip(pool, updates, strict=True))
            scale_args = dict(k_scales=pool[2], v_scales=pool[3]) if quantized else {}
            options = dict(sm_scale=head_dim**-0.5, layer=layer, impl="pallas", backend="gpu", platform="gpu")
            if program == "decode":
                out = paged_attention(x, pool[0], pool[1], kv_lens, tables, **scale_args, **options)
            else:
                out = ragged_paged_attention(
                    x, pool[0], pool[1], kv_lens, tables, cu_q_lens, num_seqs, **scale_args, **options
                )
            return (pool, x + out), None

        (pool, x), _ = lax.scan(layer_step, (pool, x), jnp.arange(LAYERS, dtype=jnp.int32))
        return pool, x

    int32 = jnp.int32
    args = (pool, spec((tokens, heads, head_dim), q_dtype), spec((seqs,), int32), spec((seqs, PAGES_PER_SEQ), int32))
    args += (spec((seqs + 1,), int32), spec((tokens,), int32), spec((), int32))
    return jax.jit(step, donate_argnums=0), args


@needs_cuda_plugin
@pytest.mark.parametrize(
    "program, pool_dtype, q_dtype, head_dim",
    [
        ("decode", "bfloat16", "bfloat16", 64),
        ("decode", "int8", "bfloat16", 64),
        # Llama-3-8B's head_dim in float32: a kv tile of 128 keys asked for more shared memory than a block has.
        ("decode", "float32", "float32", 128),
        ("ragged", "bfloat16", "bfloat16", 64),
        ("ragged", "int8", "bfloat16", 64),
    ],
)
def test_kernels_compile_for_h200_without_pool_copies(program, pool_dtype, q_dtype, head_dim):
    heads, kv_heads = 6, 2
    if program == "decode":  # the decode kernel splits these block tables (split-K, merged outside the kernel)
        assert gpu_decode_tiling(4 * kv_heads, PAGES_PER_SEQ)[0] > 1
    step, args = engine_step(program, pool_dtype, q_dtype, heads=heads, kv_heads=kv_heads, head_dim=head_dim)
    compiled = step.lower(*args).compile()
    hlo = compiled.as_text()
    assert any(target in hlo for target in TRITON_CALLS)
    smallest_pool_array = min(x.size * x.dtype.itemsize for x in args[0])  # the scales of 8-bit pages
    assert large_copies(hlo, smallest_pool_array) == []
    pages = args[0][0]
    assert compiled.memory_analysis().temp_size_in_bytes < pages.size * pages.dtype.itemsize


def test_8bit_pools_the_triton_lowering_would_misaddress_are_refused():
    # 3 GiB of int8 per K / V array: element offsets past 2**31 in the lowering's int32 arithmetic.
    pages = jax.ShapeDtypeStruct((3 << 19, PAGE_SIZE, 2, 64), jnp.int8)  # 2 KiB pages
    scales = jax.ShapeDtypeStruct(pages.shape[:-1], SCALE_DTYPE)
    q = jax.ShapeDtypeStruct((4, 4, 64), jnp.bfloat16)
    kv_lens, tables = jax.ShapeDtypeStruct((4,), jnp.int32), jax.ShapeDtypeStruct((4, PAGES_PER_SEQ), jnp.int32)
    options = dict(sm_scale=0.125, k_scales=scales, v_scales=scales, impl="pallas", interpret=True, backend="gpu")
    with pytest.raises(ValueError, match="int32 offsets overflow"):
        jax.eval_shape(lambda *a: paged_attention(*a, **options), q, pages, pages, kv_lens, tables)
