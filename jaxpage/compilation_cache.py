"""XLA's persistent compilation cache, as the engine argument `compilation_cache_dir`.

With it, every program jax compiles (the step of each shape bucket, the sampler, weight conversions) is written to
that directory, and a later process with the same model, engine arguments, jax version and device loads it instead
of compiling: a second start compiles nothing. jax's cache is process-wide; the last engine to set a directory
decides where later compilations go. Treat the directory as trusted code (jax's own warning): do not share it
with users you do not trust.
"""

from __future__ import annotations

import os

import jax
from jax.experimental.compilation_cache import compilation_cache


def enable_compilation_cache(path: str) -> str:
    """Points jax's persistent compilation cache at `path` (created if missing) and caches every compilation.

    Returns the absolute path; raises ValueError when the directory cannot be created or written."""
    path = os.path.abspath(os.path.expanduser(path))
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ValueError(f"engine argument compilation_cache_dir: cannot create {path}: {e.strerror}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"engine argument compilation_cache_dir: {path} is not writable")
    if jax.config.jax_compilation_cache_dir != path:
        compilation_cache.set_cache_dir(path)
        compilation_cache.reset_cache()  # jax decides once per process whether it caches: make it look again
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # the default (1 s) skips small programs
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path
