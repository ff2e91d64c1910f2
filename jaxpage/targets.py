"""Chips jaxpage compiles for without having them: TPU v5e, v6e, v5p and NVIDIA H100, H200.

A `Target` names a chip, its published figures (HBM per device, HBM bandwidth, peak bfloat16 FLOP/s: what the
budget arithmetic and the roofline estimates use) and how to get compile-only devices of it on this host:

- TPU: `jax.experimental.topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2")`, which needs libtpu
  (`pip install 'jaxpage[tpu]'`). The devices compile with the real TPU compiler, Mosaic included; nothing runs.
- GPU: the same call with platform "cuda" and a GpuTargetConfigProto (this package's `gpu_targets/*.txtpb`, the
  chip's figures as data), which needs jax's CUDA plugin (`pip install 'jaxpage[cuda]'`). XLA's GPU compiler and
  Pallas' Triton lowering then run deviceless.

`jaxpage.aot` builds the engine's programs for such devices; `scripts/compile_for.py` reports on them.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

GPU_TARGET_CONFIGS = Path(__file__).parent / "gpu_targets"


@dataclasses.dataclass(frozen=True)
class Target:
    name: str  # "tpu-v5e", "gpu-h200", ...
    platform: str  # jax's name of the platform: "tpu" or "gpu"
    topology: str  # "v5e" (TPU: the generation in get_topology_desc's names) or the GPU target config's file stem
    hbm_bytes: int  # memory of one device (chip)
    hbm_bandwidth: float  # bytes/s of one device
    peak_flops: float  # dense bfloat16 FLOP/s of one device
    fp8_matmul: bool  # the chip multiplies fp8 natively (else fp8 data is converted before it is multiplied)
    # TPU topologies by device count: get_topology_desc has no single-chip topology for every generation, so a
    # program for fewer devices takes the first ones of the smallest topology that holds them.
    tpu_topologies: tuple[tuple[int, str], ...] = ()

    def topology_name(self, num_devices: int) -> str:
        """The topology whose compile-only devices hold `num_devices`: "v5e:2x4", or "1x1x8" for a GPU target."""
        if self.platform == "gpu":
            return f"1x1x{num_devices}"
        for count, shape in self.tpu_topologies:
            if count >= num_devices:
                return f"{self.topology}:{shape}"
        most = self.tpu_topologies[-1][0]
        raise ValueError(f"target {self.name}: jaxpage compiles for at most {most} devices, not {num_devices}")

    def devices(self, num_devices: int = 1) -> list:
        """`num_devices` compile-only devices of this chip (ImportError naming the extra to install when the
        compiler is missing)."""
        return _topology_devices(self, self.topology_name(num_devices))[:num_devices]

    def gpu_target_config(self) -> str:
        """The GpuTargetConfigProto (text format) of a GPU target."""
        assert self.platform == "gpu", self.name
        return (GPU_TARGET_CONFIGS / f"{self.topology}.txtpb").read_text()


_TPU_TOPOLOGIES = ((4, "2x2"), (8, "2x4"))
TARGETS = {
    t.name: t
    for t in (
        # Google's published per-chip figures (Cloud TPU system architecture pages).
        Target("tpu-v5e", "tpu", "v5e", 16 << 30, 819e9, 197e12, False, _TPU_TOPOLOGIES),
        Target("tpu-v6e", "tpu", "v6e", 32 << 30, 1640e9, 918e12, False, _TPU_TOPOLOGIES),
        Target("tpu-v5p", "tpu", "v5p", 95 << 30, 2765e9, 459e12, False, ((4, "2x2x1"), (8, "2x2x2"))),
        # NVIDIA's datasheets (SXM parts; dense bfloat16, no sparsity).
        Target("gpu-h100", "gpu", "h100", 85_520_809_984, 3.35e12, 989e12, True),
        Target("gpu-h200", "gpu", "h200", 150_754_820_096, 4.8e12, 989e12, True),
    )
}


def get_target(name: str) -> Target:
    """The target of that name; ValueError listing them otherwise."""
    try:
        return TARGETS[name]
    except KeyError:
        raise ValueError(f"unknown target {name!r}: jaxpage compiles for {', '.join(TARGETS)}") from None


@functools.cache
def _topology_devices(target: Target, topology_name: str) -> list:
    import jax  # noqa: F401  (jax's plugins must be discovered before a topology is asked for)
    from jax.experimental import topologies

    try:
        if target.platform == "tpu":
            topology = topologies.get_topology_desc(platform="tpu", topology_name=topology_name)
        else:
            topology = topologies.get_topology_desc(
                target.topology, "cuda", target_config=target.gpu_target_config(), topology=topology_name
            )
    except Exception as e:  # jax raises RuntimeError / JaxRuntimeError / ValueError for a missing plugin
        extra = "tpu" if target.platform == "tpu" else "cuda"
        raise ImportError(
            f"compiling for {target.name} needs its compiler: pip install 'jaxpage[{extra}]' ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''})"
        ) from e
    return list(topology.devices)


def available(target: Target) -> bool:
    """Whether this host has the compiler of `target` (libtpu, or jax's CUDA plugin)."""
    try:
        target.devices(1)
    except ImportError:
        return False
    return True
