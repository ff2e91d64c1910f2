"""The one place that maps the engine argument `attention_impl` to an attention backend class:

    "auto"                  the kernels of the platform the programs are compiled for (TPU, GPU), else "xla"
    "pallas"                the platform's kernels, refused where there are none
    "xla"                   XlaAttention: the XLA implementation (pure JAX), any platform (on a TPU, XlaTpuAttention:
                            the pool in the TPU layout)
    "pallas_tpu"            PallasTpuAttention: the Mosaic kernels (TPU)
    "pallas_gpu"            PallasGpuAttention: the Triton kernels (GPU)
    "pallas_tpu_interpret"  the TPU kernels in Pallas' interpreter, on any platform (slow: for tests)
    "pallas_gpu_interpret"  the GPU kernels in Pallas' interpreter, on any platform (slow: for tests)

The platform is jax's default backend, or a target's when the engine's programs are built for chips this host does
not have (`jaxpage.aot`).
"""

from __future__ import annotations

import jax

from jaxpage.attention.backend import AttentionBackend
from jaxpage.attention.pallas_gpu import PallasGpuAttention
from jaxpage.attention.pallas_tpu import PallasTpuAttention
from jaxpage.attention.xla import XlaAttention, xla_backend_class
from jaxpage.config import EngineConfig, canonical_kv_cache_dtype

# attention_impl -> (class, its options) of the named backends
BACKENDS = {
    "xla": (XlaAttention, {}),
    "pallas_tpu": (PallasTpuAttention, {}),
    "pallas_gpu": (PallasGpuAttention, {}),
    "pallas_tpu_interpret": (PallasTpuAttention, {"interpret": True}),
    "pallas_gpu_interpret": (PallasGpuAttention, {"interpret": True}),
}
NATIVE = {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}  # each platform's own kernels
assert set(EngineConfig.ATTENTION_IMPLS) == {"auto", "pallas", *BACKENDS}, "the engine argument's choices"


def resolve_backend(
    attention_impl: str = "auto", kv_cache_dtype: str = "auto", platform: str | None = None, batch_invariant=False
) -> AttentionBackend:
    """The backend for the engine arguments, for programs built for `platform` (default: jax's default backend);
    ValueError where it cannot run there. batch_invariant: the XLA attention in its batch-invariant form, on every
    platform (EngineConfig refuses a Pallas attention_impl with it)."""
    platform = platform or jax.default_backend()
    kv_cache_dtype = canonical_kv_cache_dtype(kv_cache_dtype)
    if batch_invariant:
        return xla_backend_class(platform)(kv_cache_dtype, platform, batch_invariant=True)
    cls, options = BACKENDS[backend_name(attention_impl, platform)]
    cls = xla_backend_class(platform) if cls is XlaAttention else cls
    return cls(kv_cache_dtype, platform, **options)


def engine_backend(config: EngineConfig, platform: str | None = None) -> AttentionBackend:
    """resolve_backend for an engine's arguments (attention_impl, kv_cache_dtype, batch_invariant)."""
    return resolve_backend(config.attention_impl, config.kv_cache_dtype, platform, config.batch_invariant)


def backend_name(attention_impl: str, platform: str) -> str:
    """The backend `attention_impl` names on `platform` (one of BACKENDS); ValueError where it cannot run there."""
    native = NATIVE.get(platform)
    if attention_impl == "auto":
        return native or "xla"
    if attention_impl == "pallas":
        if native is None:
            raise ValueError(
                f"engine argument attention_impl='pallas' cannot run on {platform}: there are no Pallas kernels "
                "for it (use 'auto', 'xla', or 'pallas_tpu_interpret' / 'pallas_gpu_interpret' for tests)"
            )
        return native
    if attention_impl in NATIVE.values() and attention_impl != native:
        raise ValueError(
            f"engine argument attention_impl={attention_impl!r} cannot run on {platform} "
            f"(use {attention_impl}_interpret for Pallas' interpreter)"
        )
    if attention_impl not in BACKENDS:
        raise ValueError(f"engine argument attention_impl must be 'auto', 'pallas' or one of {tuple(BACKENDS)}")
    return attention_impl


__all__ = ["resolve_backend", "engine_backend", "backend_name", "BACKENDS"]
