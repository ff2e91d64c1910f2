"""How many pages the KV pool takes: from the engine's size arguments, the memory of the device (or, on CPU, the
host), and the bytes one token's K and V take (EngineConfig documents the arguments)."""

from __future__ import annotations

import logging
import math
import os

import jax

from jaxpage.attention import AttentionBackend
from jaxpage.config import CacheConfig, EngineConfig, ModelConfig
from jaxpage.kv_cache import pool_groups
from jaxpage.models.lora import slots_device_bytes
from jaxpage.validation import INT32_MAX
from jaxpage.worker.host_kv_pool import group_page_bytes
from jaxpage.worker.step_broadcast import StepBroadcast

logger = logging.getLogger("jaxpage")


def kv_pool_pages(
    cache: CacheConfig,
    max_num_seqs: int,
    token_bytes: int,
    max_model_len: int,
    device_memory: tuple[int, int] | None = None,
    reserved_bytes: int = 0,
    unpooled_bytes: int = 0,
) -> int:
    """Pages in the pool (the null page included), from the cache's size arguments (see EngineConfig) and the
    bytes of K and V one token takes in the pool; never more than max_num_seqs sequences of max_model_len tokens
    could use. Raises ValueError for a pool the memory cannot hold. reserved_bytes: what the KV budget pays for
    beside these pages (a hybrid's window group: window_group_pages); unpooled_bytes: what the engine puts on the
    device after the pool, not KV (LoRA slots), which the device's budget (gpu_memory_utilization) and memory pay
    for.

    device_memory: (bytes the device has, bytes in use) of the device the pool is for: a target chip's when the
    engine is built for one (jaxpage.aot); None: this host's first device (on CPU, the host's memory)."""
    page_bytes = cache.page_size * token_bytes
    on_cpu = device_memory is None and jax.default_backend() == "cpu"
    if device_memory is None and not on_cpu:
        stats = jax.local_devices()[0].memory_stats() or {}
        device_memory = (stats.get("bytes_limit", 0), stats.get("bytes_in_use", 0))
    if on_cpu:
        available = available_memory_bytes()
    else:
        limit, in_use = device_memory
        available = limit - in_use if limit else None
    if cache.num_pages is not None:
        pages = cache.num_pages
    else:
        if cache.kv_cache_memory_bytes is not None:
            budget = cache.kv_cache_memory_bytes
        elif on_cpu:
            budget = EngineConfig.CPU_KV_CACHE_BYTES
            if available is not None and available < 2 * budget:  # a small machine: half of what is left
                budget = available // 2
        else:
            budget = int(limit * cache.gpu_memory_utilization) - in_use - unpooled_bytes
        budget -= reserved_bytes
        useful = max_num_seqs * math.ceil(max_model_len / cache.page_size) + 1  # more would never be used
        pages = min(budget // page_bytes, useful, INT32_MAX // cache.page_size)
        if pages < 2:
            why = f"the KV cache budget of {budget} bytes holds no page ({page_bytes} bytes each)"
            if device_memory is not None and cache.kv_cache_memory_bytes is None:
                why += (
                    f": {limit} bytes of device memory x gpu_memory_utilization {cache.gpu_memory_utilization}, less "
                    f"{in_use} in use (the weights)"
                    + (f" and {unpooled_bytes} for LoRA slots" if unpooled_bytes else "")
                    + "; raise gpu_memory_utilization or split the model over more devices (tensor_parallel_size)"
                )
            raise ValueError(why)
    if available is not None and pages * page_bytes + reserved_bytes + unpooled_bytes > available:
        reserved = f" and {reserved_bytes} bytes of the window group's pages" if reserved_bytes else ""
        reserved += f" and {unpooled_bytes} bytes of LoRA slots" if unpooled_bytes else ""
        raise ValueError(
            f"a KV pool of {pages} pages ({pages * page_bytes} bytes, {page_bytes} per page){reserved} does not fit "
            f"in the {available} bytes of memory available; lower num_pages or kv_cache_memory_bytes"
        )
    return pages


def window_group_pages(
    num_pages: int, sliding_window: int, page_size: int, max_num_seqs: int, max_num_batched_tokens: int
) -> int:
    """The pages of a hybrid model's window group (jaxpage.engine.kv_cache_groups), the null page included: as many
    as its running sequences can hold at once -- each the pages of its window between steps (the sliding_window - 1
    keys before its next token, which may straddle one page more than they fill) and one page its step's tokens may
    start, plus the pages of a step's tokens -- and never more than the full group's num_pages."""
    window = window_pages_held(sliding_window, page_size)
    held = max_num_seqs * (window + 1) + -(-max_num_batched_tokens // page_size) + 1
    return min(num_pages, held)


def engine_window_pages(config: EngineConfig, model_config: ModelConfig, num_pages: int) -> int | None:
    """window_group_pages for an engine's arguments and a hybrid model whose full group has num_pages pages; None for
    a model that is not hybrid (its pool has one group)."""
    if not model_config.hybrid_attention:
        return None
    sizes = (model_config.sliding_window, config.page_size, config.max_num_seqs, config.max_num_batched_tokens)
    return window_group_pages(num_pages, *sizes)


def window_share(model_config: ModelConfig, token_bytes: int) -> int:
    """Of a model's KV bytes per token, what its window group takes (a hybrid's sliding layers'; 0 for a model
    that is not hybrid)."""
    if not model_config.hybrid_attention:
        return 0
    return token_bytes * sum(model_config.sliding_layers) // model_config.num_layers


def window_pages_held(sliding_window: int, page_size: int) -> int:
    """The most pages a running sequence holds between steps in a window group: those of the sliding_window - 1
    keys before its next token (BlockManager.free_outside_window gives back the pages wholly before them)."""
    return -(-max(sliding_window - 2, 0) // page_size) + 1


def available_memory_bytes() -> int | None:
    """The host's available memory (None where it cannot be told): what a KV pool on CPU can still take."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def addressable_pages(
    backend: AttentionBackend, model: ModelConfig, num_pages: int, cache: CacheConfig, tensor_parallel_size: int
) -> int:
    """num_pages, or fewer where the attention kernels cannot address that pool (AttentionBackend.addressable_pages):
    then with a warning, or ValueError for an explicit num_pages."""
    usable = backend.addressable_pages(model, num_pages, cache.page_size, tensor_parallel_size)
    if usable < num_pages:
        if cache.num_pages is not None:
            raise ValueError(
                f"engine argument num_pages {num_pages}: the {backend.name} kernels cannot address an "
                f"{backend.kv_cache_dtype} pool of that size; take at most {usable} pages, or more pages"
            )
        logger.warning(
            "the KV pool takes %d pages, not %d: the %s kernels cannot address it", usable, num_pages, backend.name
        )
    return usable


def fit_max_model_len(max_model_len: int, pool_tokens: int, explicit: bool) -> int:
    """max_model_len, lowered to the pool's `pool_tokens` when the model's default does not fit (with a warning);
    ValueError when an explicit max_model_len does not fit."""
    if max_model_len <= pool_tokens:
        return max_model_len
    if explicit:
        raise ValueError(
            f"engine argument max_model_len {max_model_len} does not fit in the KV pool, which holds {pool_tokens} "
            "tokens: lower max_model_len, or raise num_pages or kv_cache_memory_bytes"
        )
    logger.warning(
        "the KV pool holds %d tokens, fewer than the model's context length %d: max_model_len lowered to %d",
        pool_tokens,
        max_model_len,
        pool_tokens,
    )
    return pool_tokens


def engine_pool_pages(
    config: EngineConfig,
    backend: AttentionBackend,
    model_config: ModelConfig,
    target_config: ModelConfig,
    dtype_bytes: int,
    draft: tuple | None,
    channel: StepBroadcast | None,
    max_model_len: int,
) -> tuple[int, int | None]:
    """The pages of an engine's KV pool (kv_pool_pages), agreed by every host (channel), logged: (pages, None), or
    for a hybrid model's grouped pool (full group's pages, window group's: window_group_pages). target_config: the
    model as it runs (KV heads copied for tensor parallelism); draft: a draft model's (config, params), whose pool
    (on the full group's pages) the budget pays for too; the device's budget pays for the LoRA slots (enable_lora)
    too."""
    tp = config.tensor_parallel_size
    layout = dict(page_size=config.page_size, tensor_parallel_size=tp)
    token_bytes = backend.kv_bytes_per_token(target_config, dtype_bytes, **layout)
    window_token_bytes = window_share(model_config, token_bytes)  # a grouped pool's window group's
    if draft is not None:  # the draft model's pool has the same pages: the budget pays for both
        token_bytes += backend.kv_bytes_per_token(draft[0], dtype_bytes, **layout)
    # A device's budget and memory are its own, but simulated CPU devices share the host's: every shard of every
    # data-parallel replica (each replica has num_pages pages).
    cpu = jax.default_backend() == "cpu"

    def budgeted(nbytes: int) -> int:
        return nbytes * config.data_parallel_size if cpu else nbytes // tp

    slots = 0  # the LoRA slots on each device (on CPU, every simulated device's in the host's memory)
    if config.enable_lora:
        slots = slots_device_bytes(target_config, config.max_loras, config.max_lora_rank, dtype_bytes, tp)
        slots *= config.data_parallel_size * tp if cpu else 1
    held = engine_window_pages(config, model_config, INT32_MAX)  # the most pages a window group can need
    num_pages = 0
    if held is not None:  # the window group's pages first, the full group's from the rest of the budget
        reserved = budgeted(held * config.page_size * window_token_bytes)
        try:
            num_pages = _agreed_pages(
                config, budgeted(token_bytes - window_token_bytes), max_model_len, channel, reserved, slots
            )
        except ValueError:  # the budget holds fewer pages than the window group would take
            pass
    if held is None or num_pages < held:  # one group, or a small pool: both groups as large, as if one
        num_pages = _agreed_pages(config, budgeted(token_bytes), max_model_len, channel, unpooled=slots)
    num_pages = addressable_pages(backend, target_config, num_pages, config.part(CacheConfig), tp)
    window_pages = engine_window_pages(config, model_config, num_pages)
    pool_bytes = num_pages * config.page_size * (token_bytes - window_token_bytes)
    if window_pages is not None:
        pool_bytes += window_pages * config.page_size * window_token_bytes
    _log_pool(config, backend, model_config, target_config, dtype_bytes, token_bytes, num_pages, pool_bytes)
    if window_pages is not None:
        window_layers = sum(model_config.sliding_layers)
        logger.info(
            "KV cache groups: %d full-attention layers on all %d pages; %d sliding-window layers (window %d) on %d "
            "pages of their own, as many as %d running sequences' windows take",
            model_config.num_layers - window_layers,
            num_pages,
            window_layers,
            model_config.sliding_window,
            window_pages,
            config.max_num_seqs,
        )
    return num_pages, window_pages


def _agreed_pages(
    config: EngineConfig, token_bytes: float, max_model_len: int, channel, reserved: int = 0, unpooled: int = 0
) -> int:
    """kv_pool_pages for pages of token_bytes per token (as the budget counts them), the same on every host."""
    sizing = (config.part(CacheConfig), config.max_num_seqs, int(token_bytes), max_model_len)
    if channel is None:
        return kv_pool_pages(*sizing, reserved_bytes=reserved, unpooled_bytes=unpooled)
    # Each host measures its own memory: every process takes the smallest pool, or refuses with all.
    try:
        num_pages, refused = kv_pool_pages(*sizing, reserved_bytes=reserved, unpooled_bytes=unpooled), None
    except ValueError as e:
        num_pages, refused = 0, e
    num_pages = channel.agree_min(num_pages)
    if refused is not None:
        raise refused
    if num_pages == 0:
        raise ValueError("another process's memory cannot hold the KV pool (see its log)")
    return num_pages


def _log_pool(config, backend, model_config, target_config, dtype_bytes, token_bytes, num_pages, pool_bytes):
    tp = config.tensor_parallel_size
    copies = target_config.num_kv_heads // model_config.num_kv_heads
    device_token_bytes = token_bytes // tp  # each device holds its shard's KV heads
    logger.info(
        "KV cache: %d bytes per token (2 * %d layers * %d kv heads%s * %s)%s; %d pages of %d tokens, %.2f GiB",
        token_bytes,
        model_config.num_layers,
        target_config.num_kv_heads,
        f" ({model_config.num_kv_heads} copied {copies}x)" if copies > 1 else "",
        backend.kv_head_bytes(model_config, dtype_bytes),
        f", {device_token_bytes} per device on {tp} devices" if tp > 1 else "",
        num_pages,
        config.page_size,
        pool_bytes / 2**30,
    )


def host_tier_slots(offload_bytes: int, layout, replicas: int) -> tuple[int, ...]:
    """Each replica's slots in the prefix cache's host tier, per group of the pool's layers (layout: the target's
    pool's), for kv_offload_bytes of host memory (the whole engine's, over every replica and tensor-parallel shard, as
    vLLM's kv_offloading_size counts it). The groups share the bytes as their device pages do. ValueError naming
    kv_offload_bytes where a group would get no slot, or where the host's memory cannot hold them."""
    page_bytes = group_page_bytes(layout)
    pages = [g.k.shape[1] // replicas for g in pool_groups(layout)]
    device_bytes = sum(n * b for n, b in zip(pages, page_bytes, strict=True))
    slots = tuple(offload_bytes * n // (device_bytes * replicas) for n in pages)
    if min(slots) < 1:
        need = max(-(-device_bytes * replicas // n) for n in pages)
        raise ValueError(
            f"engine argument kv_offload_bytes {offload_bytes} holds no page of the host tier: one page of every layer "
            f"takes {sum(page_bytes)} bytes ({replicas} replica(s)); give at least {need} bytes (--kv-offload-gib "
            f"{need / 2**30:.4f}), or leave it unset"
        )
    available = available_memory_bytes()
    if available is not None and offload_bytes > available:
        raise ValueError(
            f"engine argument kv_offload_bytes {offload_bytes} exceeds the host's available memory ({available} "
            "bytes); give less"
        )
    return slots
