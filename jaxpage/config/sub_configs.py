"""The configs made of the engine arguments, one per part of the engine that reads them (EngineConfig.part,
EngineConfig.scheduler_config)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class LoadConfig:
    """What is loaded, and how (jaxpage.engine.llm_engine.load_models, the tokenizer): EngineConfig's arguments of
    it."""

    model: str | None
    revision: str | None
    download_dir: str | None
    tokenizer: str | None
    tokenizer_revision: str | None
    chat_template: str | None
    hf_overrides: dict | None
    dtype: str | None
    quantization: str | None
    load_format: str
    skip_tokenizer_init: bool
    generation_config: str
    override_generation_config: dict | None

    @property
    def tokenizer_source(self) -> tuple[str | None, str | None]:
        """(the tokenizer's source, its revision): the tokenizer's own, else the model's at the model's revision."""
        if self.tokenizer is None:
            return self.model, self.tokenizer_revision or self.revision
        return self.tokenizer, self.tokenizer_revision


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """The KV pool: its size (jaxpage.worker.pool_sizing), its pages (the block managers), its format (the attention
    backend)."""

    page_size: int
    num_pages: int | None
    kv_cache_memory_bytes: int | None
    gpu_memory_utilization: float
    kv_cache_dtype: str
    enable_prefix_caching: bool


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """Devices and hosts: the mesh (jaxpage.worker.parallel) and the processes joined (jaxpage.worker.process_group)."""

    tensor_parallel_size: int
    data_parallel_size: int
    enable_expert_parallel: bool
    coordinator_address: str | None
    num_processes: int | None
    process_id: int | None


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """A step's budgets and when a sequence ends (jaxpage.engine.scheduler)."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None  # a sequence ends ("length") when it has this many tokens; None: no limit
    eos_token_ids: frozenset[int] = frozenset()  # tokens that end a sequence ("stop") unless it ignores EOS

    def __post_init__(self):
        assert self.max_num_seqs >= 1, self.max_num_seqs
        assert self.max_num_batched_tokens >= 1, self.max_num_batched_tokens
