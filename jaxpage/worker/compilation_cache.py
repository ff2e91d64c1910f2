"""The persistent compilation cache, on by default: compiled step programs kept on disk, so that a later start
with the same model and arguments neither traces, lowers nor compiles them.

Entries are keyed by what determines a program -- the source code of jaxpage and pallas_kernels, the jax and
jaxlib versions, the devices, XLA_FLAGS, jax's x64 and matmul-precision options, the program's name and static
arguments (model config, attention backend, shape) and the tree, shapes and dtypes of its arguments -- and hold it
as jax.experimental.serialize_executable writes it (donation included). jax's own persistent cache would save the
compiling but not the tracing and lowering, which it needs to compute its keys: most of a second per program on
CPU, on the path to the first token. (jaxpage does not use both: on XLA CPU a process that loads one program from
both fails to run it.)

The engine argument `compilation_cache_dir` places it: "auto" (the default) is the folder `compilation-cache` of
jaxpage's cache directory ($JAXPAGE_CACHE, else ~/.cache/jaxpage), as vLLM keeps its compile cache under its own
cache directory; None turns it off. It keeps MAX_PROGRAMS entries, the least recently used leaving first. An entry
that cannot be read is ignored (the program compiles as usual, and is written again). Entries are pickles: trust
the directory as you would your code.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import os
import pickle
import time
from pathlib import Path

import jax
import jaxlib
from jax.experimental import serialize_executable

from jaxpage.models.default_model import cache_dir
from jaxpage.worker.step_shapes import StepShape

logger = logging.getLogger("jaxpage")

MAX_PROGRAMS = 256


def compilation_cache_path(setting: str) -> str:
    """The directory for the engine argument's value ("auto" or a path), absolute."""
    path = str(cache_dir() / "compilation-cache") if setting == "auto" else setting
    return os.path.abspath(os.path.expanduser(path))


@functools.cache
def source_hash() -> str:
    """A hash of every Python file of jaxpage and pallas_kernels: a change to either makes every key new."""
    import pallas_kernels

    digest = hashlib.sha256()
    for root in (Path(__file__).resolve().parent, Path(pallas_kernels.__file__).resolve().parent):  # jaxpage's, then
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def program_key(name: str, static: tuple, args: tuple) -> str:
    """The key of the program `name` with these static arguments (hashable, with a faithful repr) and dynamic
    arguments (a pytree of arrays: their tree, shapes and dtypes count, not their values)."""
    leaves, tree = jax.tree.flatten(args)
    devices = jax.devices()
    parts = (
        source_hash(),
        jax.__version__,
        jaxlib.__version__,
        devices[0].platform,
        devices[0].device_kind,
        len(devices),
        os.environ.get("XLA_FLAGS", ""),
        jax.config.jax_enable_x64,
        jax.config.jax_default_matmul_precision,
        name,
        repr(static),
        str(tree),
        [(tuple(x.shape), str(x.dtype)) for x in leaves],
    )
    return hashlib.sha256(repr(parts).encode()).hexdigest()


class CompilationCache:
    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)

    @classmethod
    def open(cls, setting: str) -> CompilationCache:
        """The cache for the engine argument's value, its directory created if missing; ValueError when it cannot
        be created or written."""
        path = compilation_cache_path(setting)
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            raise ValueError(f"engine argument compilation_cache_dir: cannot create {path}: {e.strerror}") from None
        if not os.access(path, os.W_OK | os.X_OK):
            raise ValueError(f"engine argument compilation_cache_dir: {path} is not writable")
        return cls(path)

    def _path(self, key: str) -> Path:
        return self.directory / f"{key}.program"

    def load(self, key: str, devices: list) -> jax.stages.Compiled | None:
        """The program stored under `key`, to run on `devices` (those it was compiled for, in its order), or None
        (absent, or unreadable: then it is left to be written again)."""
        path = self._path(key)
        try:
            payload, in_tree, out_tree = pickle.loads(path.read_bytes())
            program = serialize_executable.deserialize_and_load(payload, in_tree, out_tree, execution_devices=devices)
            os.utime(path)  # recently used
            return program
        except FileNotFoundError:
            return None
        except Exception as e:  # a truncated or foreign entry: compile instead
            logger.warning("ignoring the cached program %s (%s: %s)", path, type(e).__name__, e)
            return None

    def store(self, key: str, compiled: jax.stages.Compiled) -> None:
        """Writes `compiled` under `key` (atomically); a failure to write is logged, never raised."""
        path = self._path(key)
        try:
            data = pickle.dumps(serialize_executable.serialize(compiled))
            partial = path.with_suffix(f".{os.getpid()}.partial")
            partial.write_bytes(data)
            os.replace(partial, path)
            self._prune()
        except Exception as e:  # a full disk, a directory gone read-only, a program jax cannot serialize
            logger.warning("cannot keep the compiled program in %s (%s: %s)", path, type(e).__name__, e)

    def _prune(self) -> None:
        entries = sorted(self.directory.glob("*.program"), key=lambda p: p.stat().st_mtime)
        for path in entries[: max(0, len(entries) - MAX_PROGRAMS)]:
            path.unlink(missing_ok=True)


@dataclasses.dataclass(frozen=True)
class CompiledShape:
    program: str  # "forward" (the model, for a StepShape), "sample" (LM head and sampler, for R rows), "verify"
    # (LM head and verification, for (R rows, k draft tokens)), "pool", "copy"
    shape: StepShape | int | tuple
    seconds: float = 0.0  # lowering and compiling (or loading from a cache)
    loaded: bool = False  # from the compilation cache: neither traced, lowered nor compiled

    def __str__(self) -> str:
        shape = self.shape
        if self.program == "sample":
            shape = f"rows={self.shape}"
        elif self.program in ("verify", "propose"):
            shape = "rows={}, k={}".format(*self.shape)
        return f"{self.program} {shape}: {'loaded' if self.loaded else 'compiled'} in {self.seconds:.2f}s"


def load_or_compile(
    cache: CompilationCache | None, what: CompiledShape, static: tuple, args: tuple, devices: list, compile_it
) -> tuple[jax.stages.Compiled, CompiledShape]:
    """(the program `what` from `cache`, else compile_it() (kept in the cache), and `what` with its seconds and
    whether it was loaded). Its key (program_key): `static` and the arguments' shapes and dtypes; with several
    processes, this one's index too (each compiles its own part of the program)."""
    start = time.perf_counter()
    key = None
    if cache is not None:
        if jax.process_count() > 1:
            static = (*static, "process", jax.process_index(), jax.process_count())
        key = program_key(what.program, static, args)
        executable = cache.load(key, devices)
        if executable is not None:
            return executable, dataclasses.replace(what, seconds=time.perf_counter() - start, loaded=True)
    executable = compile_it()
    if key is not None:
        cache.store(key, executable)
    return executable, dataclasses.replace(what, seconds=time.perf_counter() - start)
