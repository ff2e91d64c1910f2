"""Fusions that join the ops of a named scope with the ops around it, read from a compiled program's optimized HLO
text (`jax.stages.Compiled.as_text()`).

The batch-invariant mode (jaxpage.models.batch_invariant) computes each row in tiles of one shape, in a loop whose
body is the scope ROW_TILE_SCOPE. A fusion that holds both a tile's arithmetic and arithmetic from outside it (a
norm's last multiply and the residual add after it) rounds differently than the same ops apart (one fused
multiply-add, not a product rounded and then added), and it exists only at some step sizes, so a row's bits would
depend on its step. `fusions_across_scope(hlo, ROW_TILE_SCOPE)` lists them: the mode's programs must have none.
"""

from __future__ import annotations

import re

from jaxpage.benchmarks import hlo_collectives

# Ops that move or name values without computing new ones: fused with anything, they change no bits.
DATA_MOVEMENT = {
    "parameter", "constant", "bitcast", "reshape", "broadcast", "slice", "dynamic-slice", "dynamic-update-slice",
    "pad", "concatenate", "transpose", "copy", "tuple", "get-tuple-element", "iota", "gather", "select", "fusion",
}  # fmt: skip

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\(?[a-z][\w]*)\[.*?\s([a-z][\w\-]*)\(")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CALLS = re.compile(r"\bcalls=%?([\w.\-]+)")
_FLOATING = re.compile(r"^\(?(f\d+|bf16|f8\w*)$")
_JAX_NAME_STACK = re.compile(r"^(jit|pmap)\(")


def fusions_across_scope(hlo: str, scope: str) -> list[str]:
    """The fusion instructions of `hlo` (their names) whose fused computations, nested ones included, compute
    floating-point values both inside `scope` (jax.named_scope: a part of the op_name metadata) and outside it (a
    whole jax name stack, "jit(...)/...", without it). Ops the compiler made, without metadata or with a name of its
    own ("reduce_window_sum": a cumulative sum it rewrote), count on neither side."""
    computations = hlo_collectives.computations(hlo)[0]
    found = []
    for lines in computations.values():
        for line in lines:
            match = _INSTRUCTION.match(line)
            if match and match.group(3) == "fusion":
                sides = set()
                for callee in _CALLS.findall(line):
                    sides |= _sides(computations, callee, scope)
                if len(sides) == 2:
                    found.append(match.group(1))
    return found


def _sides(computations: dict[str, list[str]], name: str, scope: str) -> set[bool]:
    """{True: a floating-point op inside `scope`, False: one outside} of computation `name` and those it fuses."""
    sides = set()
    for line in computations.get(name, ()):
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        for callee in _CALLS.findall(line) if match.group(3) == "fusion" else ():
            sides |= _sides(computations, callee, scope)
        op_name = _OP_NAME.search(line)
        if match.group(3) in DATA_MOVEMENT or not _FLOATING.match(match.group(2)) or not op_name:
            continue
        scopes = op_name.group(1).split("/")
        if scope in scopes or _JAX_NAME_STACK.match(scopes[0]):
            sides.add(scope in scopes)
    return sides
