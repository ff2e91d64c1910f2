"""Measurements of the machine a benchmark runs on: CPU time, load, float32 matmul rate, device copy bandwidth."""

from __future__ import annotations

import os
import resource
import time


def cpu_seconds() -> float:
    """User + system CPU time of this process, all threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def machine_load(cpu_s: float, wall_s: float) -> dict:
    """This process's mean busy cores over a run and the 1-minute load average after it: a load well above the
    process's own cores means other work shared the machine and the figures are low."""
    return {"process_cores_busy": round(cpu_s / wall_s, 2), "loadavg_1m_after": round(os.getloadavg()[0], 2)}


def matmul_flops_per_s(n: int = 2048, repeats: int = 10) -> float:
    """FLOPs per second of an n x n x n float32 jnp.dot on the default device."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    dot = jax.jit(jnp.dot)
    dot(a, a).block_until_ready()
    start = time.perf_counter()
    for _ in range(repeats):
        out = dot(a, a)
    out.block_until_ready()
    return 2 * n**3 * repeats / (time.perf_counter() - start)


def copy_bandwidth(num_bytes: int, repeats: int = 10) -> float:
    """Bytes per second of a large copy on the default device (it reads and writes each byte)."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones(num_bytes // 4, jnp.float32)
    copy = jax.jit(lambda a: a * 1.0)
    jax.block_until_ready(copy(x))
    start = time.perf_counter()
    for _ in range(repeats):
        y = copy(x)
    jax.block_until_ready(y)
    return 2 * num_bytes * repeats / (time.perf_counter() - start)


def record_decode_steps(engine, num_seqs: int | None = None) -> list[float]:
    """The device seconds of each decode-only step `engine` runs from now on (of exactly `num_seqs` sequences, when
    given), appended to the list returned; engine.step is wrapped for the rest of the engine's life."""
    seconds: list[float] = []
    step = engine.step

    def timed_step():
        outputs = step()
        stats = engine.last_step_stats
        if stats is not None and stats.num_decodes == stats.num_seqs and num_seqs in (None, stats.num_seqs):
            seconds.append(stats.device_s)
        return outputs

    engine.step = timed_step
    return seconds
