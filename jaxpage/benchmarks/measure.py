"""Measurements of the machine a benchmark runs on: CPU time, load, a device program's time per call, the matmul
rate, the device's copy bandwidth."""

from __future__ import annotations

import os
import resource
import statistics
import time


def cpu_seconds() -> float:
    """User + system CPU time of this process, all threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def machine_load(cpu_s: float, wall_s: float) -> dict:
    """This process's mean busy cores over a run and the 1-minute load average after it: a load well above the
    process's own cores means other work shared the machine and the figures are low."""
    return {"process_cores_busy": round(cpu_s / wall_s, 2), "loadavg_1m_after": round(os.getloadavg()[0], 2)}


def device_seconds(fn, *args, repeats: int = 10, rounds: int = 5) -> float:
    """Seconds per call of fn(*args) on the device: fn runs once untimed (compiling it), then `rounds` times
    `repeats` calls back to back, each round timed until the device has finished; the median round's mean.
    (Launches are asynchronous: the host queues the next call while the device runs one, so a call that takes
    longer on the device than its launch on the host is timed by the device.)"""
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(repeats):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / repeats)
    return statistics.median(times)


def matmul_flops_per_s(n: int = 2048, repeats: int = 10, dtype: str = "float32") -> float:
    """FLOPs per second of an n x n x n jnp.dot of random `dtype` matrices on the default device (a bfloat16
    product accumulates in float32 on a GPU or TPU)."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), dtype)
    return 2 * n**3 / device_seconds(jax.jit(jnp.dot), a, b, repeats=repeats)


def copy_bandwidth(num_bytes: int, repeats: int = 10) -> float:
    """Bytes per second of a large copy of random data on the default device (it reads and writes each byte)."""
    import jax
    import jax.numpy as jnp

    x = jax.random.normal(jax.random.key(0), (num_bytes // 4,), jnp.float32)
    return 2 * num_bytes / device_seconds(jax.jit(lambda a: a * 1.0), x, repeats=repeats)


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


def time_attention_impls(attention, inputs: dict, impls: dict, repeats: int) -> tuple[dict[str, float], float]:
    """({name: seconds per call} of jax.jit(attention(**inputs, **how)) for each name, how of impls (device_seconds),
    and the relative error (L2) of the first impl's output against the last's."""
    import jax
    import numpy as np

    seconds, outputs = {}, []
    for name, how in impls.items():
        fn = jax.jit(lambda inputs, how=how: attention(**inputs, **how))
        seconds[name] = device_seconds(fn, inputs, repeats=repeats)
        outputs.append(np.asarray(fn(inputs), np.float64))
    error = np.linalg.norm(outputs[0] - outputs[-1]) / np.linalg.norm(outputs[-1])
    return seconds, float(f"{error:.3g}")
