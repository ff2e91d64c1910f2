"""Request bodies (and batch lines) parsed as strict JSON: what is not UTF-8 text or not JSON is refused by name.

Python's json raises RecursionError for deep nesting and ValueError for integers of over 4,300 digits (the
interpreter's int limit); neither says what was wrong and both are a server's 500 unless caught. No request this
server takes nests deeper than MAX_DEPTH or needs a number longer than MAX_NUMBER_DIGITS, so such bodies are refused
by name first, with a scan of the raw bytes (strings blanked out, in C by `re`; the depth by a numpy cumulative sum).

Python's json also takes what RFC 8259 does not: NaN and Infinity, numbers beyond a float (1e999 becomes inf), a key
twice in one object (the last wins), and strings that are not text: a JSON escape can spell half a surrogate pair
(`"\\ud800"`), which no UTF-8 encoder can write, so it fails far from where it entered (a tokenizer, a log line, the
error response that quotes it). All are refused here, where input enters: `parse_json` refuses the first ones,
`check_unicode` (for the server, in `parse_json_body`) lone surrogates, naming where in the value they are. Bytes that
are not UTF-8 are read as lone surrogates (Python's "surrogateescape"), so that they too are named by field.
"""

from __future__ import annotations

import codecs
import json
import math
import re

import numpy as np

from jaxpage.validation import describe

MAX_DEPTH = 100  # JSON schemas in response_format nest the deepest; real ones stay far below this
MAX_NUMBER_DIGITS = 1000

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_LONG_NUMBER = re.compile(rb"\d{%d}" % (MAX_NUMBER_DIGITS + 1))
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # in parsed strings, where a pair is one code point


class BodyError(ValueError):
    """A body (or batch line) that is not a JSON value of UTF-8 text: the message says what and where."""


def parse_json_body(raw: bytes) -> dict:
    """A request body as a JSON object; BodyError saying what is wrong with it (not UTF-8 text, not JSON, not an
    object, too deep, a number too long or beyond a float, a key twice in one object, a lone surrogate)."""
    body = parse_json(raw, "the body")
    if not isinstance(body, dict):
        raise BodyError(f"the body must be a JSON object, got {describe(body)}")
    check_unicode(body)
    return body


def parse_json(raw: bytes | str, what: str):
    """`raw`'s JSON value (`what` names it in errors: "the body", "line 3"). Strings are left as parsed: bytes that
    are not UTF-8 and escaped lone surrogates become lone surrogates, which `check_unicode` finds and names."""
    if isinstance(raw, str):
        text, raw = raw, raw.encode("utf-8", "surrogatepass")
    else:
        raw = raw.removeprefix(codecs.BOM_UTF8)
        text = raw.decode("utf-8", "surrogateescape")
    skeleton = _STRING.sub(b'""', raw)
    if _LONG_NUMBER.search(skeleton):
        raise BodyError(f"{what} has a number of over {MAX_NUMBER_DIGITS} digits")
    if nesting_depth(skeleton) > MAX_DEPTH:
        raise BodyError(f"{what} nests arrays and objects over {MAX_DEPTH} deep")

    def refuse_constant(name: str):
        raise BodyError(f"{what} has {name}, which is not JSON (numbers must be finite)")

    def finite_float(text: str) -> float:
        value = float(text)
        if not math.isfinite(value):
            raise BodyError(f"{what} has the number {describe(text)}, beyond the range of a float")
        return value

    def unique_keys(pairs: list) -> dict:
        value = dict(pairs)
        if len(value) < len(pairs):
            seen = set()
            key = next(k for k, _ in pairs if k in seen or seen.add(k))
            raise BodyError(f"{what} has the key {describe(key)} twice in one object")
        return value

    try:
        return json.loads(text, parse_constant=refuse_constant, parse_float=finite_float, object_pairs_hook=unique_keys)
    except BodyError:
        raise
    except json.JSONDecodeError as e:
        raise BodyError(f"{what} is not JSON ({e})") from None
    except (RecursionError, ValueError) as e:  # what the scan above should have caught already
        raise BodyError(f"{what} cannot be parsed ({type(e).__name__})") from None


def check_unicode(value, field: str = "", whole: str = "the body") -> None:
    """BodyError naming the first string or key in `value` (parsed JSON) that is not UTF-8 text: one with a lone
    surrogate, from an escape (`"\\udc00"`) or a byte that was not UTF-8. `field`: where `value` sits ("" for a
    whole body, whose keys are then named alone); `whole`: what a whole value is called ("the body", "line 3")."""
    # The walk, in Python, only when C's json.dumps finds one (it writes pairs as one character, lone ones as they are)
    if _LONE_SURROGATE.search(json.dumps(value, ensure_ascii=False)):
        _check_strings(value, field, whole)


def _check_strings(value, path: str, whole: str) -> None:
    if isinstance(value, str):
        _check_text(path or whole, value)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_text(f"the keys of {path or whole}", key)
            _check_strings(item, f"{path}.{key}" if path else key, whole)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_strings(item, f"{path}[{i}]", whole)


def _check_text(field: str, text: str) -> None:
    found = _LONE_SURROGATE.search(text)
    if found:
        raise BodyError(
            f"{field} must be valid UTF-8 text, got {describe(text)}, whose character {found.start()} is a lone "
            f"surrogate ({ascii(found.group())}: an unpaired \\ud800-\\udfff escape, or a byte that is not UTF-8)"
        )


def nesting_depth(skeleton: bytes) -> int:
    """The deepest nesting of [ and { in JSON text whose strings are blanked out."""
    chars = np.frombuffer(skeleton, dtype=np.uint8)
    opens = (chars == ord("[")) | (chars == ord("{"))
    closes = (chars == ord("]")) | (chars == ord("}"))
    steps = opens.astype(np.int32) - closes.astype(np.int32)
    return int(np.cumsum(steps).max(initial=0))
