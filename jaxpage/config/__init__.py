"""The engine's configuration, one module per concern:

engine_args.py   EngineConfig: the engine arguments (vLLM's names), checked when built; the CLI's flags are generated
                 from them (`arg`)
sub_configs.py   the configs made of them for each part of the engine: LoadConfig, CacheConfig, ParallelConfig,
                 SchedulerConfig
speculative.py   SpeculativeConfig, the `speculative_config` argument (plain data: jaxpage.spec_decode reads it)
model.py         ModelConfig, the frozen description of a model (a static argument of jax.jit), and RopeScaling
hf_config.py     the model config readers: ModelConfig from a Hugging Face config dict or GGUF metadata

No jax here: every layer of jaxpage reads its configs from this package, the lowest but errors and validation.
"""

from jaxpage.config.engine_args import (
    ATTENTION_IMPLS,
    DTYPES,
    KV_CACHE_DTYPE_ALIASES,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    EngineConfig,
    arg,
    canonical_kv_cache_dtype,
)
from jaxpage.config.hf_config import model_config_from_hf
from jaxpage.config.model import QUANTIZATIONS, SUPPORTED_ARCHITECTURES, ModelConfig, RopeScaling
from jaxpage.config.speculative import SpeculativeConfig
from jaxpage.config.sub_configs import CacheConfig, LoadConfig, ParallelConfig, SchedulerConfig

__all__ = [
    "ATTENTION_IMPLS",
    "DTYPES",
    "KV_CACHE_DTYPES",
    "KV_CACHE_DTYPE_ALIASES",
    "LOAD_FORMATS",
    "QUANTIZATIONS",
    "SUPPORTED_ARCHITECTURES",
    "CacheConfig",
    "EngineConfig",
    "LoadConfig",
    "ModelConfig",
    "ParallelConfig",
    "RopeScaling",
    "SchedulerConfig",
    "SpeculativeConfig",
    "arg",
    "canonical_kv_cache_dtype",
    "model_config_from_hf",
]
