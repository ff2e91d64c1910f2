"""Model definition and weight loading."""

from jaxpage.models.llama import Llama, forward, init_params, param_shapes
from jaxpage.models.loader import load_model

__all__ = ["Llama", "forward", "init_params", "load_model", "param_shapes"]
