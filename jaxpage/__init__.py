"""jaxpage: PagedAttention LLM serving on JAX/XLA."""

import logging

from jaxpage.config import ModelConfig
from jaxpage.errors import ModelLoadError

__version__ = "0.1.0"
__all__ = ["ModelConfig", "ModelLoadError", "__version__"]

# Like vLLM, jaxpage reports its start-up facts (KV cache size, ...) at INFO level unless the application
# configured the "jaxpage" logger itself.
_logger = logging.getLogger("jaxpage")
if not _logger.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("%(levelname)s jaxpage: %(message)s"))
    _logger.addHandler(_handler)
    _logger.setLevel(logging.INFO)
    _logger.propagate = False
