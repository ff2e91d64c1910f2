"""The collectives a compiled program runs, read from its optimized HLO text (`jax.stages.Compiled.as_text()`).

A scanned model holds its layer once, in a while loop's body: an op there runs once per iteration. `executed`
counts each collective as many times as the program runs it, multiplying through the loops' trip counts: XLA's
`known_trip_count` where the compiler writes it (CPU, GPU), else the bound of a loop whose condition is `i < N` for
a constant N (a scan's loop as the TPU compiler leaves it); a loop of neither kind is counted once.
"""

from __future__ import annotations

import re

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_WHILE = re.compile(r"\bwhile\(.*?body=%?([\w.\-]+)")
_CONDITION = re.compile(r"\bcondition=%?([\w.\-]+)")
_CONSTANT = re.compile(r"^\s*%?([\w.\-]+) = s32\[\]\S* constant\((\d+)\)")
_LESS_THAN = re.compile(r"compare\(%?[\w.\-]+, %?([\w.\-]+)\), direction=LT")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CALLS = re.compile(
    r"\b(?:calls|to_apply|branch_computations|true_computation|false_computation)=\{?%?([\w.\-, %]+)\}?"
)


def computations(hlo: str) -> tuple[dict[str, list[str]], str]:
    """{name: its instruction lines}, and the entry computation's name (also jaxpage.benchmarks.hlo_copies')."""
    computations: dict[str, list[str]] = {}
    entry, current = "", None
    for line in hlo.splitlines():
        match = _COMPUTATION.match(line)
        if match and not line.startswith(" "):
            current = match.group(1)
            computations[current] = []
            if line.startswith("ENTRY"):
                entry = current
        elif current is not None and line.startswith(" "):
            computations[current].append(line)
    return computations, entry


def _kind(line: str) -> str | None:
    for kind in KINDS:
        if re.search(rf"\s{kind}(?:-start)?\(", line):
            return kind
    return None


def _trip_count(while_line: str, computations: dict[str, list[str]]) -> int:
    """The iterations of the while loop on `while_line` (1 where they cannot be told)."""
    known = _TRIP_COUNT.search(while_line)
    if known is not None:
        return int(known.group(1))
    condition = _CONDITION.search(while_line)
    lines = computations.get(condition.group(1), []) if condition else []
    constants = dict(m.groups() for m in map(_CONSTANT.match, lines) if m)
    bounds = [constants.get(m.group(1)) for line in lines if (m := _LESS_THAN.search(line))]
    return int(bounds[0]) if len(bounds) == 1 and bounds[0] is not None else 1


def executed(hlo: str) -> dict[str, int]:
    """{collective kind: how many times one run of the program executes it} (see the module docstring)."""
    bodies, entry = computations(hlo)
    memo: dict[str, dict[str, int]] = {}

    def count(name: str, depth: int = 0) -> dict[str, int]:
        if name in memo:
            return memo[name]
        totals = dict.fromkeys(KINDS, 0)
        if depth > 64 or name not in bodies:
            return totals
        for line in bodies[name]:
            kind = _kind(line)
            if kind is not None:
                totals[kind] += 1
            loop = _WHILE.search(line)
            if loop is not None:
                inner = count(loop.group(1), depth + 1)
                for k in KINDS:
                    totals[k] += inner[k] * _trip_count(line, bodies)
                continue
            for called in _CALLS.findall(line):
                for callee in (c.strip().lstrip("%") for c in called.split(",")):
                    inner = count(callee, depth + 1)
                    for k in KINDS:
                        totals[k] += inner[k]
        memo[name] = totals
        return totals

    return count(entry)
