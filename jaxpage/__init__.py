"""jaxpage: PagedAttention LLM serving on JAX/XLA."""

from jaxpage.config import ModelConfig
from jaxpage.errors import ModelLoadError

__version__ = "0.1.0"
__all__ = ["ModelConfig", "ModelLoadError", "__version__"]
