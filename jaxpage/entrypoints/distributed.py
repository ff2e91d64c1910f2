"""Several hosts: one JAX process per host, joined by `jax.distributed`, all running the same SPMD programs.

Process 0 leads: it takes the requests, schedules, and tells the others what to run next
(jaxpage.worker.step_broadcast). The others follow (`LLMEngine.follow`): they load the same model, place their shards
on their own devices, and run each step's programs with the step's arrays as process 0 made them, so that the
collectives of tensor parallelism meet across the hosts.

Joining: `initialize(coordinator_address, num_processes, process_id)` calls `jax.distributed.initialize` when one
of them is given or JAX_COORDINATOR_ADDRESS is set. Each left out is for JAX to find, as it does on a TPU pod,
under SLURM or Open MPI (see jax.distributed.initialize). With none of them, nothing is joined: one process, or
processes JAX joined already (a TPU pod's runtime, or a caller of jax.distributed.initialize).
"""

from __future__ import annotations

from jaxpage.config import EngineConfig
from jaxpage.engine.llm_engine import LLMEngine
from jaxpage.worker.process_group import COORDINATOR_ENV, initialize, is_leader

__all__ = ["COORDINATOR_ENV", "follow", "initialize", "is_leader"]


def follow(**distributed_args) -> None:
    """On a process other than 0: joins the others (initialize's arguments), builds process 0's engine as it
    tells (its engine arguments, its model from this host's disk), and runs its steps until it shuts down."""
    LLMEngine(EngineConfig(**distributed_args)).follow()
