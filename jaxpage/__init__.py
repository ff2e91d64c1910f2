"""jaxpage: PagedAttention LLM serving on JAX/XLA.

vLLM's names are importable from here (`from jaxpage import LLM, SamplingParams`). They are imported on first use
(PEP 562), so `import jaxpage` stays light: it imports neither jax nor transformers, nor any module of jaxpage.

This module is the package's public face, the top of its layers (tests/test_import_layers.py): it names what every
layer below defines, and no module of jaxpage imports it (`import jaxpage.engine` runs it, but imports nothing more).
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what the lazy names below resolve to, for type checkers and IDEs
    from jaxpage.config import EngineConfig, ModelConfig
    from jaxpage.engine.llm_engine import LLMEngine
    from jaxpage.entrypoints.llm import LLM
    from jaxpage.errors import ModelLoadError
    from jaxpage.lora_request import LoRARequest
    from jaxpage.outputs import CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
    from jaxpage.pooling_params import PoolingParams
    from jaxpage.sampling_params import SamplingParams, StructuredOutputsParams

# name -> the module that defines it; imported when the name is first looked up.
_LAZY_NAMES = {
    "LLM": "jaxpage.entrypoints.llm",
    "LLMEngine": "jaxpage.engine.llm_engine",
    "SamplingParams": "jaxpage.sampling_params",
    "StructuredOutputsParams": "jaxpage.sampling_params",
    "LoRARequest": "jaxpage.lora_request",
    "EngineConfig": "jaxpage.config",
    "ModelConfig": "jaxpage.config",
    "ModelLoadError": "jaxpage.errors",
    "RequestOutput": "jaxpage.outputs",
    "CompletionOutput": "jaxpage.outputs",
    "PoolingParams": "jaxpage.pooling_params",
    "EmbeddingOutput": "jaxpage.outputs",
    "EmbeddingRequestOutput": "jaxpage.outputs",
}

__all__ = [
    "LLM",
    "LLMEngine",
    "SamplingParams",
    "StructuredOutputsParams",
    "LoRARequest",
    "EngineConfig",
    "RequestOutput",
    "CompletionOutput",
    "PoolingParams",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "ModelConfig",
    "ModelLoadError",
    "__version__",
]


def __getattr__(name: str):
    if name == "__version__":
        from jaxpage.version import installed_version

        value = installed_version()
    elif name in _LAZY_NAMES:
        value = getattr(importlib.import_module(_LAZY_NAMES[name]), name)
    else:
        raise AttributeError(f"module 'jaxpage' has no attribute {name!r}")
    globals()[name] = value  # later look-ups find it without coming here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


# Like vLLM, jaxpage reports its start-up facts (KV cache size, ...) at INFO level unless the application
# configured the "jaxpage" logger itself.
_logger = logging.getLogger("jaxpage")
if not _logger.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("%(levelname)s jaxpage: %(message)s"))
    _logger.addHandler(_handler)
    _logger.setLevel(logging.INFO)
    _logger.propagate = False
