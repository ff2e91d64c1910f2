"""XLA's persistent compilation cache, on by default: the engine argument `compilation_cache_dir`.

Every program jax compiles (the step of each shape, weight conversions) is written to that directory, and a later
process with the same model, engine arguments, jax version and device loads it instead of compiling: a second
start compiles nothing. As vLLM keeps its compile cache under its own cache directory, the default ("auto") is
the folder `compilation-cache` of jaxpage's cache directory ($JAXPAGE_CACHE, else ~/.cache/jaxpage); None turns it
off. The cache keeps at most MAX_CACHE_BYTES, dropping the least recently used programs first. jax's cache is
process-wide: the last engine to set a directory decides where later compilations go. Treat the directory as
trusted code (jax's own warning): do not share it with users you do not trust.
"""

from __future__ import annotations

import os

import jax
from jax.experimental.compilation_cache import compilation_cache

from jaxpage.models.default_model import cache_dir

MAX_CACHE_BYTES = 4 << 30


def compilation_cache_path(setting: str) -> str:
    """The directory for the engine argument's value ("auto" or a path), absolute."""
    path = str(cache_dir() / "compilation-cache") if setting == "auto" else setting
    return os.path.abspath(os.path.expanduser(path))


def enable_compilation_cache(setting: str) -> str:
    """Points jax's persistent compilation cache at the directory for `setting` (created if missing) and caches
    every compilation. Returns the directory; raises ValueError when it cannot be created or written."""
    path = compilation_cache_path(setting)
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
    jax.config.update("jax_compilation_cache_max_size", MAX_CACHE_BYTES)
    return path


def disable_compilation_cache() -> None:
    """Later compilations in this process neither read nor write a persistent cache."""
    if jax.config.jax_compilation_cache_dir is not None:
        jax.config.update("jax_compilation_cache_dir", None)
        compilation_cache.reset_cache()
