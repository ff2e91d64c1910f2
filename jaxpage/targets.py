"""Chips jaxpage compiles for without having them: TPU v5e, v6e, v5p and NVIDIA H100, H200.

A `Target` names a chip, its published figures (HBM per device, HBM bandwidth, peak bfloat16 FLOP/s: what the
budget arithmetic and the roofline estimates use) and how to get compile-only devices of it on this host:

- TPU: `jax.experimental.topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2")`, which needs libtpu
  (`pip install 'jaxpage[tpu]'` or `'jaxpage[compile]'`). The devices compile with the real TPU compiler, Mosaic
  included; nothing runs. libtpu serves one process at a time (its lock file): compile for a TPU from one process.
- GPU: the same call with platform "cuda" and a GpuTargetConfigProto (this package's `gpu_targets/*.txtpb`, the
  chip's figures as data), which needs jax's CUDA plugin (`pip install 'jaxpage[compile]'`, without CUDA's
  libraries, or `'jaxpage[cuda]'`). XLA's GPU compiler and Pallas' Triton lowering then run deviceless.

`jaxpage.aot` builds the engine's programs for such devices; `scripts/compile_for.py` reports on them.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
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
    device_kind: str  # jax's Device.device_kind of the chip (GPU: a part of it, as in "NVIDIA H200")
    # TPU topologies by device count: get_topology_desc has no single-chip topology for every generation, so a
    # program for fewer devices takes the first ones of the smallest topology that holds them.
    tpu_topologies: tuple[tuple[int, str], ...] = ()
    fixed_topology: str | None = None  # "2x4": the topology to take devices from, whatever their number

    def topology_name(self, num_devices: int) -> str:
        """The topology whose compile-only devices hold `num_devices`: "v5e:2x4", or "1x1x8" for a GPU target."""
        if self.fixed_topology is not None:
            return self.fixed_topology if self.platform == "gpu" else f"{self.topology}:{self.fixed_topology}"
        if self.platform == "gpu":
            return f"1x1x{num_devices}"
        for count, shape in self.tpu_topologies:
            if count >= num_devices:
                return f"{self.topology}:{shape}"
        most = self.tpu_topologies[-1][0]
        raise ValueError(f"target {self.name}: jaxpage compiles for at most {most} devices, not {num_devices}")

    def devices(self, num_devices: int = 1) -> list:
        """`num_devices` compile-only devices of this chip (ImportError naming the extra to install when the
        compiler is missing; the compiler's own error when it cannot start)."""
        devices = _topology_devices(self, self.topology_name(num_devices))
        if len(devices) < num_devices:
            raise ValueError(
                f"target {self.name}: topology {self.fixed_topology} has {len(devices)} devices, not {num_devices}"
            )
        return devices[:num_devices]

    def gpu_target_config(self) -> str:
        """The GpuTargetConfigProto (text format) of a GPU target."""
        assert self.platform == "gpu", self.name
        return (GPU_TARGET_CONFIGS / f"{self.topology}.txtpb").read_text()


_TPU_TOPOLOGIES = ((4, "2x2"), (8, "2x4"))
TARGETS = {
    t.name: t
    for t in (
        # Google's published per-chip figures (Cloud TPU system architecture pages).
        Target("tpu-v5e", "tpu", "v5e", 16 << 30, 819e9, 197e12, False, "TPU v5 lite", _TPU_TOPOLOGIES),
        Target("tpu-v6e", "tpu", "v6e", 32 << 30, 1640e9, 918e12, False, "TPU v6 lite", _TPU_TOPOLOGIES),
        Target("tpu-v5p", "tpu", "v5p", 95 << 30, 2765e9, 459e12, False, "TPU v5", ((4, "2x2x1"), (8, "2x2x2"))),
        # NVIDIA's datasheets (SXM parts; dense bfloat16, no sparsity).
        Target("gpu-h100", "gpu", "h100", 85_520_809_984, 3.35e12, 989e12, True, "H100"),
        Target("gpu-h200", "gpu", "h200", 150_754_820_096, 4.8e12, 989e12, True, "H200"),
    )
}


def get_target(name: str) -> Target:
    """The target of that name; ValueError listing them otherwise."""
    try:
        return TARGETS[name]
    except KeyError:
        raise ValueError(f"unknown target {name!r}: jaxpage compiles for {', '.join(TARGETS)}") from None


def target_of(device) -> Target | None:
    """The target a (real) device is, by its device_kind; None for a chip jaxpage has no figures of."""
    kind = device.device_kind
    for target in TARGETS.values():
        if (kind == target.device_kind) if target.platform == "tpu" else (target.device_kind in kind):
            return target
    return None


@functools.cache
def _topology_devices(target: Target, topology_name: str) -> list:
    if not available(target):
        extra = "tpu" if target.platform == "tpu" else "compile"
        raise ImportError(f"compiling for {target.name} needs its compiler: pip install 'jaxpage[{extra}]'")
    import jax  # noqa: F401  (jax's plugins must be discovered before a topology is asked for)
    from jax.experimental import topologies

    if target.platform == "tpu":
        topology = topologies.get_topology_desc(platform="tpu", topology_name=topology_name)
    else:
        config = target.gpu_target_config()
        topology = topologies.get_topology_desc(target.topology, "cuda", target_config=config, topology=topology_name)
    return list(topology.devices)


def available(target: Target) -> bool:
    """Whether this host has the compiler of `target`: libtpu, or jax's CUDA plugin (which compiles for NVIDIA GPUs
    without one). Installed but failing to start (libtpu held by another process, say) still counts: building the
    target's devices then raises that failure."""
    modules = ("libtpu",) if target.platform == "tpu" else ("jax_cuda12_plugin", "jax_cuda13_plugin")
    return any(importlib.util.find_spec(name) is not None for name in modules)
