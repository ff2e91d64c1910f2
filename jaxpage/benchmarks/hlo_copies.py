"""Copies of large arrays in a compiled program, read from its optimized HLO text (`jax.stages.Compiled.as_text()`).

A KV pool must never be copied: a step reads and updates it in place (donated). A chip's compiler can still insert
a copy where a kernel asks for a layout the pool does not have (a relayout of the whole pool on every call).
`large_copies` finds the instructions that copy or transpose at least `min_bytes`: give it the bytes of the smallest
pool array and it lists every copy of a pool, whatever its shape after reshapes. Moves into or out of a TPU's on-chip
memory (memory space 1, `S(1)` in a layout) are not counted: XLA prefetches an array that fits there (a small test
pool), which no pool of a real size does.
"""

from __future__ import annotations

import math
import re

from jaxpage.benchmarks import hlo_collectives

# Bytes of HLO's element types (those a pool or its scales can have, and the usual others).
ELEMENT_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1,
    "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8,
}  # fmt: skip
COPY_OPS = ("copy", "copy-start", "transpose")

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s+([a-z][\w\-]*)\(")
_ARRAY = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]")


def array_bytes(shape_text: str) -> int:
    """Bytes of the largest array in an HLO shape ("bf16[2,3]{1,0}", or a tuple of them)."""
    largest = 0
    for dtype, dims in _ARRAY.findall(shape_text):
        if dtype in ELEMENT_BYTES:
            count = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
            largest = max(largest, count * ELEMENT_BYTES[dtype])
    return largest


def large_copies(hlo: str, min_bytes: int) -> list[str]:
    """The instructions of `hlo` that materialize a copy or transpose of an array of at least min_bytes, as their
    HLO lines (stripped): such ops in every computation that runs as it is written (the entry, loop bodies,
    called computations), and fusions there whose fused computation is a copy or transpose. Not the ops inside a
    fused computation: a fusion materializes only its own output (a relayout fused with a dynamic slice of one
    layer's weights reads that slice, not the whole array)."""
    computations = hlo_collectives.computations(hlo)[0]
    fused = {callee for lines in computations.values() for line in lines for callee in _fusion_callees(line)}
    found = []
    for name, lines in computations.items():
        if name in fused:
            continue
        for line in lines:
            match = _INSTRUCTION.match(line)
            if not match or "S(1)" in match.group(1) or array_bytes(match.group(1)) < min_bytes:
                continue
            op = match.group(2)
            if op in COPY_OPS or (
                op == "fusion" and any(_root_op(computations, c) in COPY_OPS for c in _fusion_callees(line))
            ):
                found.append(line.strip())
    return found


def sliced_copies(hlo: str, min_bytes: int) -> list[str]:
    """The copies of at least min_bytes that `large_copies` finds and that copy a dynamic slice (a fusion that slices
    and copies, or a copy of a dynamic-slice): one layer's weights copied out of the arrays a scan over layers
    stacks, as XLA's GPU compiler does before each of that layer's matrix products."""
    computations = hlo_collectives.computations(hlo)[0]
    slices = {_name(line) for lines in computations.values() for line in lines if _op(line) == "dynamic-slice"}
    found = []
    for line in large_copies(hlo, min_bytes):
        callees = _fusion_callees(line)
        if any(_op(inner) == "dynamic-slice" for callee in callees for inner in computations.get(callee, ())):
            found.append(line)
        elif not callees and any(f"%{name})" in line or f"%{name}," in line for name in slices):
            found.append(line)
    return found


def _op(line: str) -> str | None:
    match = _INSTRUCTION.match(line)
    return match.group(2) if match else None


def _name(line: str) -> str:
    return line.split("=")[0].replace("ROOT", "").strip().lstrip("%")


_CALLS = re.compile(r"\bcalls=%?([\w.\-]+)")


def _fusion_callees(line: str) -> list[str]:
    match = _INSTRUCTION.match(line)
    return _CALLS.findall(line) if match and match.group(2) == "fusion" else []


def _root_op(computations: dict[str, list[str]], name: str) -> str | None:
    for line in computations.get(name, ()):
        if line.lstrip().startswith("ROOT"):
            match = _INSTRUCTION.match(line)
            return match.group(2) if match else None
    return None
