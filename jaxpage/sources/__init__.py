"""Where a model comes from: a local path, or a Hugging Face Hub id downloaded into the Hub's cache (huggingface_hub).

`resolve_model`, `resolve_tokenizer` and `resolve_adapter` turn what a user names (a path, `org/name`,
`org/name:Q4_K_M`, `org/name/file.gguf`) into a local path; every loader reads only local paths.
"""

from jaxpage.sources.model_source import (
    DEFAULT_DOWNLOAD,
    HubDownload,
    is_hub_id,
    resolve_adapter,
    resolve_model,
    resolve_tokenizer,
)

__all__ = ["DEFAULT_DOWNLOAD", "HubDownload", "is_hub_id", "resolve_adapter", "resolve_model", "resolve_tokenizer"]
