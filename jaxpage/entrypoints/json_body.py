"""A request body parsed as JSON, with its nesting depth and number lengths checked before the parser sees it.

Python's json raises RecursionError for deep nesting and ValueError for integers of over 4,300 digits (the
interpreter's int limit); neither says what was wrong and both are a server's 500 unless caught. No request this
server takes nests deeper than MAX_DEPTH or needs a number longer than MAX_NUMBER_DIGITS, so such bodies are refused
by name first, with a scan of the raw bytes (strings blanked out, in C by `re`; the depth by a numpy cumulative sum).
"""

from __future__ import annotations

import json
import re

import numpy as np

MAX_DEPTH = 100  # JSON schemas in response_format nest the deepest; real ones stay far below this
MAX_NUMBER_DIGITS = 1000

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_LONG_NUMBER = re.compile(rb"\d{%d}" % (MAX_NUMBER_DIGITS + 1))


def parse_json_body(raw: bytes):
    """The body's JSON value; ValueError saying what is wrong with it (not JSON, too deep, a number too long)."""
    skeleton = _STRING.sub(b'""', raw)
    if _LONG_NUMBER.search(skeleton):
        raise ValueError(f"the body has a number of over {MAX_NUMBER_DIGITS} digits")
    if nesting_depth(skeleton) > MAX_DEPTH:
        raise ValueError(f"the body nests arrays and objects over {MAX_DEPTH} deep")
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"the body is not JSON ({e})") from None
    except (RecursionError, ValueError) as e:  # what the scan above should have caught already
        raise ValueError(f"the body cannot be parsed ({type(e).__name__})") from None


def nesting_depth(skeleton: bytes) -> int:
    """The deepest nesting of [ and { in JSON text whose strings are blanked out."""
    chars = np.frombuffer(skeleton, dtype=np.uint8)
    opens = (chars == ord("[")) | (chars == ord("{"))
    closes = (chars == ord("]")) | (chars == ord("}"))
    steps = opens.astype(np.int32) - closes.astype(np.int32)
    return int(np.cumsum(steps).max(initial=0))
