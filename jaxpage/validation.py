"""Checks for the values callers hand jaxpage (engine arguments, sampling parameters, requests).

Every refusal reads `{field} must be {requirement}, got {value!r}`: the field and the value, before anything runs.
A value of the wrong type raises `ArgumentTypeError`, which is both a TypeError and a ValueError, so
`except ValueError` catches every refusal jaxpage makes at its boundary.

No jax here: the host bookkeeping imports this.
"""

from __future__ import annotations

import math
import numbers
import os
from typing import NoReturn

INT32_MAX = 2**31 - 1  # token ids, positions, slots, top-k: the step's arrays are int32
FLOAT32_MAX = 3.4028234663852886e38  # temperature and the probability thresholds travel as float32


class ArgumentTypeError(TypeError, ValueError):
    """A value of the wrong type (a bool or a float where an integer belongs, a dict where a list does, ...)."""


def describe(value, limit: int = 80) -> str:
    """repr(value), cut to `limit` characters: refusals quote what they got without flooding a log."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 5]}...{text[-2:]}"


def fail(field: str, requirement: str, value, wrong_type: bool = False) -> NoReturn:
    error = ArgumentTypeError if wrong_type else ValueError
    raise error(f"{field} must be {requirement}, got {describe(value)}")


def is_int(value) -> bool:
    """An integer (Python or numpy), and not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(field: str, value, minimum: int | None = None, maximum: int | None = None) -> int:
    """`value` as a Python int; refused unless it is an integer in [minimum, maximum]."""
    if minimum is not None and maximum is not None:
        requirement = f"an integer in [{minimum}, {maximum}]"
    elif minimum is not None:
        requirement = f"an integer >= {minimum}"
    else:
        requirement = "an integer" if maximum is None else f"an integer <= {maximum}"
    if not is_int(value):
        fail(field, requirement, value, wrong_type=True)
    value = int(value)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        fail(field, requirement, value)
    return value


def check_number(field: str, value, requirement: str, accept) -> float:
    """`value` as a float; refused unless it is a finite real number (not a bool) for which `accept` holds."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        fail(field, requirement, value, wrong_type=True)
    try:
        number = float(value)
    except OverflowError:  # an int beyond any float: 10**400
        fail(field, requirement, value)
    if not math.isfinite(number) or abs(number) > FLOAT32_MAX or not accept(number):
        fail(field, requirement, value)
    return number


def check_bool(field: str, value) -> bool:
    if not isinstance(value, bool):
        fail(field, "True or False", value, wrong_type=True)
    return value


def check_path(field: str, value) -> str:
    """A non-empty path (str or os.PathLike) as a str."""
    if not isinstance(value, str | os.PathLike):
        fail(field, "a path (str or os.PathLike)", value, wrong_type=True)
    path = os.fspath(value)
    if not isinstance(path, str) or not path or "\0" in path:
        fail(field, "a non-empty path", value)
    return path


def check_text(field: str, value, allow_empty: bool = False) -> str:
    """A str that can be encoded as UTF-8 (no lone surrogates): what a tokenizer and a JSON file can hold."""
    if not isinstance(value, str):
        fail(field, "a string", value, wrong_type=True)
    if not value and not allow_empty:
        fail(field, "a non-empty string", value)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        fail(field, f"valid text (it holds an unpaired surrogate at index {e.start})", value)
    return value


def json_object(field: str, value) -> dict | None:
    """A dict from a dict or a JSON object as a string (a command line's JSON flag); None stays None."""
    if value is None:
        return None
    if isinstance(value, str):
        import json

        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{field} must be a JSON object, got {describe(value)} ({e.msg})") from None
    if not isinstance(value, dict):
        fail(field, "a JSON object", value, wrong_type=True)
    return dict(value)
