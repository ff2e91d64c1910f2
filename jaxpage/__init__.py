"""jaxpage: PagedAttention LLM serving on JAX/XLA.

vLLM's names are importable from here (`from jaxpage import LLM, SamplingParams`). They are imported on first use
(PEP 562), so `import jaxpage` stays light: it imports neither jax nor transformers.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING

from jaxpage.config import ModelConfig
from jaxpage.errors import ModelLoadError

if TYPE_CHECKING:  # what the lazy names below resolve to, for type checkers and IDEs
    from jaxpage.config import EngineConfig
    from jaxpage.engine.llm_engine import LLMEngine
    from jaxpage.entrypoints.llm import LLM
    from jaxpage.outputs import CompletionOutput, RequestOutput
    from jaxpage.sampling_params import SamplingParams, StructuredOutputsParams

# name -> the module that defines it; imported when the name is first looked up.
_LAZY_NAMES = {
    "LLM": "jaxpage.entrypoints.llm",
    "LLMEngine": "jaxpage.engine.llm_engine",
    "SamplingParams": "jaxpage.sampling_params",
    "StructuredOutputsParams": "jaxpage.sampling_params",
    "EngineConfig": "jaxpage.config",
    "RequestOutput": "jaxpage.outputs",
    "CompletionOutput": "jaxpage.outputs",
}

__all__ = [
    "LLM",
    "LLMEngine",
    "SamplingParams",
    "StructuredOutputsParams",
    "EngineConfig",
    "RequestOutput",
    "CompletionOutput",
    "ModelConfig",
    "ModelLoadError",
    "__version__",
]


def __getattr__(name: str):
    if name == "__version__":
        value = _installed_version()  # read on first use: importlib.metadata alone costs more than this package
    elif name in _LAZY_NAMES:
        value = getattr(importlib.import_module(_LAZY_NAMES[name]), name)
    else:
        raise AttributeError(f"module 'jaxpage' has no attribute {name!r}")
    globals()[name] = value  # later look-ups find it without coming here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def _installed_version() -> str:
    """The version pyproject.toml gave the installed distribution (the one source of the version number)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("jaxpage")
    except PackageNotFoundError:  # imported from a source tree that was never installed
        return "0+unknown"


# Like vLLM, jaxpage reports its start-up facts (KV cache size, ...) at INFO level unless the application
# configured the "jaxpage" logger itself.
_logger = logging.getLogger("jaxpage")
if not _logger.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("%(levelname)s jaxpage: %(message)s"))
    _logger.addHandler(_handler)
    _logger.setLevel(logging.INFO)
    _logger.propagate = False
