"""Progress lines of a benchmark run, on stderr (stdout keeps the results)."""

from __future__ import annotations

import sys
import time


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)
