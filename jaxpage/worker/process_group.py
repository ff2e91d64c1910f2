"""Joining the processes of several hosts (one JAX process per host, joined by `jax.distributed`), and which of
them leads. The engine calls these; `jaxpage.entrypoints.distributed` is where users start the processes that follow.

`initialize(coordinator_address, num_processes, process_id)` calls `jax.distributed.initialize` when one of them is
given or JAX_COORDINATOR_ADDRESS is set. Each left out is for JAX to find, as it does on a TPU pod, under SLURM or
Open MPI (see jax.distributed.initialize). With none of them, nothing is joined: one process, or processes JAX
joined already (a TPU pod's runtime, or a caller of jax.distributed.initialize).
"""

from __future__ import annotations

import os

import jax

COORDINATOR_ENV = "JAX_COORDINATOR_ADDRESS"  # read by jax.distributed.initialize itself


def initialize(coordinator_address: str | None = None, num_processes: int | None = None, process_id: int | None = None):
    """Joins this process to the others (see the module's docstring); ValueError saying why it cannot."""
    given = {"coordinator_address": coordinator_address, "num_processes": num_processes, "process_id": process_id}
    if all(v is None for v in given.values()) and not os.environ.get(COORDINATOR_ENV):
        return
    if jax.distributed.is_initialized():
        if num_processes is not None and num_processes != jax.process_count():
            raise ValueError(
                f"engine argument num_processes {num_processes}: this process already runs with "
                f"{jax.process_count()} (jax.distributed was initialized before)"
            )
        return
    # Collectives between processes on CPU (tests, and hosts without accelerators) go over gloo; GPU and TPU
    # backends have their own and ignore this.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(coordinator_address, num_processes, process_id)
    except (RuntimeError, ValueError) as e:
        described = ", ".join(f"{k} {v}" for k, v in given.items() if v is not None) or f"${COORDINATOR_ENV}"
        raise ValueError(f"cannot join the other processes ({described}): {' '.join(str(e).split())}") from None


def is_leader() -> bool:
    """True on process 0 (and in a process on its own): the one that takes requests and schedules."""
    return jax.process_index() == 0
