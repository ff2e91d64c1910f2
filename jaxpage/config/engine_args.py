"""EngineConfig: the engine arguments, in vLLM's names, each checked when the config is built; every flag of the
CLI is generated from them (`arg`'s metadata, read by jaxpage.entrypoints.cli)."""

from __future__ import annotations

import dataclasses

from jaxpage.config.model import QUANTIZATIONS
from jaxpage.config.speculative import SpeculativeConfig
from jaxpage.config.sub_configs import SchedulerConfig
from jaxpage.validation import INT32_MAX, check_bool, check_int, check_number, check_path, check_text, fail, json_object

KV_CACHE_DTYPE_ALIASES = {"fp8": "fp8_e4m3"}  # vLLM's fp8 is e4m3

# The one list of each engine argument's choices (EngineConfig checks them, the CLI offers them).
DTYPES = ("float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")
ATTENTION_IMPLS = ("auto", "xla", "pallas", "pallas_tpu", "pallas_gpu", "pallas_tpu_interpret", "pallas_gpu_interpret")
LOAD_FORMATS = ("auto", "dummy")
RUNNERS = ("auto", "generate", "pooling")


def canonical_kv_cache_dtype(name: str) -> str:
    """kv_cache_dtype in its one name per format ("fp8" -> "fp8_e4m3")."""
    return KV_CACHE_DTYPE_ALIASES.get(name, name)


def arg(
    default, help: str, *, choices: tuple | None = None, metavar: str | None = None, cli="engine", off=None, gib=False
):
    """An engine argument: its default, and what the CLI makes of it (jaxpage.entrypoints.cli generates every flag from
    these). cli: the group of commands that take it as a flag ("model": every command that loads a model; "engine":
    those that run an engine; "hosts": those, in the several-hosts group; None: no flag); off: (flag, help) of a second
    flag that sets it to None; gib: a size in bytes that the flag takes in GiB (--name-gib for name_bytes)."""
    metadata = dict(help=help, choices=choices, metavar=metavar, cli=cli, off=off, gib=gib)
    return dataclasses.field(default=default, metadata=metadata)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Engine arguments, in vLLM's names where vLLM has one. Each is checked when the config is built: a bad one
    raises ValueError naming the argument and its value (ArgumentTypeError, a TypeError too, for a wrong type).

    KV pool size, first match wins: `num_pages`; `kv_cache_memory_bytes`; on GPU/TPU
    `gpu_memory_utilization` of the device memory left after the weights; on CPU 2 GiB. The engine refuses a pool
    larger than the memory it can have, and one that cannot hold a single max_model_len sequence (when
    max_model_len is left to the model's default, it is lowered to what the pool holds instead, with a warning).
    """

    model: str | None = arg(
        None, "HF model directory, .gguf file or jaxpage checkpoint (default: SmolLM2-135M-Instruct)", cli="model"
    )
    # A Hub id (jaxpage.sources): the revision downloaded, and where to (None: the Hugging Face cache, $HF_HUB_CACHE).
    revision: str | None = arg(
        None, "the model's revision on the Hub: a branch, tag or commit (default: main)", cli="model"
    )
    download_dir: str | None = arg(
        None, "where Hub downloads go (default: the Hugging Face cache, $HF_HUB_CACHE)", metavar="DIR", cli="model"
    )
    # The tokenizer: another directory, GGUF file or Hub id than the model's (None: the model's own), at its revision
    # (None: the model's revision when it is the model's tokenizer, else main).
    tokenizer: str | None = arg(None, "a tokenizer other than the model's: a directory or Hub id", cli="model")
    tokenizer_revision: str | None = arg(
        None, "the tokenizer's revision on the Hub (default: --revision for the model's own)", cli="model"
    )
    # The chat template: a file, or the template itself (a Jinja text); None: the tokenizer's.
    chat_template: str | None = arg(
        None, "the chat template: a file, or the template itself (default: the tokenizer's)", cli="model"
    )
    # Config fields set over the model's config.json (vLLM's hf_overrides): a dict, or one as a JSON string.
    hf_overrides: dict | str | None = arg(
        None,
        "fields set over the model's config.json, e.g. '{\"max_position_embeddings\": 4096}'",
        metavar="JSON",
        cli="model",
    )
    # vLLM's runner: "generate" (an LLMEngine), "pooling" (embeddings: a PoolingEngine), "auto" by the model's
    # architecture (jaxpage.models.pooling_model.runner_of).
    runner: str = arg(
        "auto", "generate, or pooling (embeddings); default auto: by the architecture", choices=RUNNERS, cli="model"
    )
    # vLLM's flag for running a repo's own Python code; jaxpage runs none, so True is refused.
    trust_remote_code: bool = arg(False, "refused: jaxpage runs no code from a model repo", cli="model")
    dtype: str | None = arg(
        None, "parameter dtype (default: float32 on CPU, bfloat16 on GPU/TPU)", choices=DTYPES, cli="model"
    )
    # "int8": the model's projections and embedding in int8 with a float32 scale per output channel, quantized as
    # they load (jaxpage.models.int8); None: the weights as stored (a jaxpage checkpoint keeps its own).
    quantization: str | None = arg(
        None,
        "int8: weights in int8 with a scale per output channel, quantized as they load (default: off)",
        choices=QUANTIZATIONS,
        cli="model",
    )
    # The KV pool's format, in vLLM's names: "auto" (the compute dtype), "int8", "fp8" (same as "fp8_e4m3") or
    # "fp8_e5m2": 8-bit pages with a bfloat16 scale per token per KV head, applied inside the attention kernels
    # (jaxpage.attention). Kept canonical: "fp8" becomes "fp8_e4m3".
    kv_cache_dtype: str = arg(
        "auto",
        "the KV pages: auto (the model's dtype), or 8 bits with a scale per token per KV head, applied inside the "
        "attention kernels: int8, fp8 (= fp8_e4m3), fp8_e5m2 (default: auto)",
        choices=KV_CACHE_DTYPES,
    )
    # The model's generation_config.json (vLLM's generation_config; jaxpage.config.generation_config): "auto" reads it
    # from the model, a directory reads it from there, "vllm" reads none. Its eos_token_id ends sequences; its sampling
    # fields are the defaults of requests that leave them unset; override_generation_config (a dict or JSON) sets
    # fields over it (with "vllm", over nothing).
    generation_config: str = arg(
        "auto",
        "sampling defaults and EOS ids: auto (the model's generation_config.json), vllm (none), or a directory "
        "holding one (default auto)",
        metavar="auto|vllm|DIR",
    )
    override_generation_config: dict | str | None = arg(
        None, "generation config fields set over it, e.g. '{\"temperature\": 0.5}'", metavar="JSON"
    )
    max_model_len: int | None = arg(None, "default: the model's context length")  # the model's max_position_embeddings
    page_size: int = arg(16, "tokens per KV page, 1 to 1024 (default 16)")
    num_pages: int | None = arg(None, "pages in the KV pool, the null page included (default: from the budget)")
    kv_cache_memory_bytes: int | None = arg(None, "the KV pool's memory budget in bytes (default: see README)")
    gpu_memory_utilization: float = arg(
        0.9, "share of a GPU/TPU's memory for the weights and the KV pool (default 0.9)"
    )
    max_num_seqs: int = arg(64, "sequences per step (default 64)")  # 1 to MAX_NUM_SEQS
    max_num_batched_tokens: int = arg(512, "tokens per step (default 512)")  # 1 to MAX_NUM_BATCHED_TOKENS
    enable_prefix_caching: bool = arg(True, "requests that share a prompt prefix share its pages (default: on)")
    # The prefix cache's host tier (jaxpage.engine.host_page_cache; vLLM's KV offloading to CPU): this many bytes of
    # host memory, over every replica and shard, keep the full pages evicted from the device's prefix cache, which a
    # later prompt with their prefix copies back instead of recomputing them. None (or 0): no host tier.
    kv_offload_bytes: int | None = arg(
        None,
        "host memory that keeps KV pages evicted from the device's prefix cache, copied back when a prompt reuses "
        "them, in GiB (default: none)",
        gib=True,
    )
    seed: int = arg(0, "seeds the requests that bring none; >= 0 (default 0)")
    # The attention backend (jaxpage.attention): "auto" (the Pallas kernels on TPU and GPU, the XLA
    # implementation elsewhere), "xla", "pallas" (this platform's kernels), "pallas_tpu", "pallas_gpu", or
    # "pallas_tpu_interpret" / "pallas_gpu_interpret" (those kernels in Pallas' interpreter, any platform: for tests).
    attention_impl: str = arg(
        "auto", "the attention kernels (default auto: Pallas on TPU and GPU, XLA elsewhere)", choices=ATTENTION_IMPLS
    )
    # The persistent compilation cache (see jaxpage.worker.compilation_cache): a later start with the same model and
    # arguments loads its compiled steps from this directory instead of compiling them. "auto": the folder
    # "compilation-cache" of jaxpage's cache directory ($JAXPAGE_CACHE, else ~/.cache/jaxpage). None: no cache.
    compilation_cache_dir: str | None = arg(
        "auto",
        "the persistent compilation cache: a later run with the same model loads its compiled steps from here "
        "(default: compilation-cache in $JAXPAGE_CACHE, else ~/.cache/jaxpage)",
        metavar="DIR",
        off=("--no-compilation-cache", "compile everything in this process; read and write no compilation cache"),
    )
    # "auto": the weights of `model`; "dummy": random weights, the config of `model`
    load_format: str = arg(
        "auto", "auto: the model's weights; dummy: random weights (default auto)", choices=LOAD_FORMATS
    )
    skip_tokenizer_init: bool = arg(False, "no tokenizer: prompts and outputs are token ids", cli=None)
    # Speculative decoding (jaxpage.spec_decode): None (off), a SpeculativeConfig, a dict in vLLM's keys such as
    # {"method": "ngram", "num_speculative_tokens": 3}, or that dict as a JSON string. Kept as a SpeculativeConfig.
    speculative_config: SpeculativeConfig | dict | str | None = arg(
        None,
        'speculative decoding, in vLLM\'s keys: \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\' (default: off)',
        metavar="JSON",
    )
    # LoRA adapters (vLLM's names; jaxpage.models.lora): requests may name an adapter (LoRARequest; the server's and
    # batch jobs' `model` field); max_loras of them sit in device slots at once (the others wait), each of rank at most
    # max_lora_rank (zero-padded to it); max_cpu_loras stay read in host memory (the others are read again when a
    # request names them).
    enable_lora: bool = arg(False, "serve LoRA adapters chosen per request (default: off)")
    max_loras: int = arg(1, "LoRA adapters in one step at most: their device slots (default 1)")
    max_lora_rank: int = arg(16, "the largest LoRA rank served (default 16)")
    max_cpu_loras: int | None = arg(None, "LoRA adapters kept read in host memory (default: max_loras)")
    # Tensor parallelism (jaxpage.worker.parallel): the model split over this many devices, Megatron-style; 1: one
    # device.
    tensor_parallel_size: int = arg(1, "devices to split the model over, as Megatron (default 1)")
    # Data parallelism: this many replicas of the model (each tensor_parallel_size devices), each with its own pages
    # and scheduler state, stepping together; new requests go where their prefix is cached, else to the least loaded.
    data_parallel_size: int = arg(1, "replicas of the model, each its own pages (default 1)")
    # Expert parallelism (vLLM's name; jaxpage.worker.parallel): a mixture of experts' routed experts split whole over
    # the tensor_parallel_size shards (E / tp experts each) instead of every expert by its features. No effect on a
    # dense model or on one device.
    enable_expert_parallel: bool = arg(
        False, "split a mixture of experts' experts over the tensor-parallel devices, whole (default: off)"
    )
    # Batch invariance (jaxpage.models.batch_invariant): a request's tokens and log-probs bit for bit the same whatever
    # runs beside it (batch size and place, chunked prefill, prefix-cache hits, preemption), at some cost in speed.
    batch_invariant: bool = arg(
        False, "a request's tokens and log-probs bit for bit the same whatever runs beside it (default: off)"
    )
    # Asynchronous scheduling (LLMEngine.step): the host schedules and prepares step n + 1 while the device runs step
    # n, which feeds its sampled tokens to step n + 1 on the device; the same tokens as synchronous scheduling.
    # None: on for GPU and TPU, off on CPU; not with speculative decoding or several hosts.
    async_scheduling: bool | None = arg(
        None, "schedule the next step while the device runs this one (default: on GPU and TPU, off on CPU)"
    )
    # Several hosts (jaxpage.entrypoints.distributed): one process per host, joined by jax.distributed.initialize with
    # these (None: for JAX to find, e.g. on a TPU pod; JAX reads $JAX_COORDINATOR_ADDRESS itself). Process 0 serves; the
    # others follow it (LLMEngine.follow). All None and no $JAX_COORDINATOR_ADDRESS: one process.
    coordinator_address: str | None = arg(  # host:port of process 0's coordination service
        None, "process 0's address, reachable by all", metavar="HOST:PORT", cli="hosts"
    )
    num_processes: int | None = arg(None, "processes in all, one per host", cli="hosts")
    process_id: int | None = arg(None, "this process's index, 0 to --num-processes - 1", cli="hosts")

    CPU_KV_CACHE_BYTES = 2 << 30
    ATTENTION_IMPLS = ATTENTION_IMPLS
    DTYPES = DTYPES
    QUANTIZATIONS = QUANTIZATIONS
    KV_CACHE_DTYPES = KV_CACHE_DTYPES
    MAX_PAGE_SIZE = 1024
    MAX_NUM_SEQS = 1 << 16
    MAX_NUM_BATCHED_TOKENS = 1 << 20

    def part(self, cls):
        """The config `cls` (LoadConfig, CacheConfig, ParallelConfig) made of these arguments of the same names."""
        return cls(**{field.name: getattr(self, field.name) for field in dataclasses.fields(cls)})

    def scheduler_config(self, max_model_len: int, eos_token_ids: frozenset[int]) -> SchedulerConfig:
        """The scheduler's config, once the engine knows max_model_len (the pool may lower it) and EOS."""
        return SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens, max_model_len, eos_token_ids)

    def _check_lora(self) -> None:
        """The LoRA arguments (see their fields), checked and made canonical."""
        for field, maximum in (("max_loras", 1024), ("max_lora_rank", 1024), ("max_cpu_loras", None)):
            value = getattr(self, field)
            if value is not None:
                object.__setattr__(self, field, check_int(f"engine argument {field}", value, 1, maximum))
        check_bool("engine argument enable_lora", self.enable_lora)
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"engine argument max_cpu_loras {self.max_cpu_loras} must be >= max_loras {self.max_loras}: every "
                "adapter in a device slot is kept in host memory too"
            )

    def _check_kv_offload(self) -> None:
        """kv_offload_bytes: bytes >= 0 (0: None), and only with the prefix cache whose pages it keeps."""
        if self.kv_offload_bytes is not None:
            offload = check_int("engine argument kv_offload_bytes", self.kv_offload_bytes, 0) or None
            object.__setattr__(self, "kv_offload_bytes", offload)
        if self.kv_offload_bytes and not self.enable_prefix_caching:
            raise ValueError(
                "engine argument kv_offload_bytes: the host tier keeps the prefix cache's pages; it needs "
                "enable_prefix_caching"
            )

    def _check_batch_invariant(self) -> None:
        """batch_invariant, and what it cannot run with (each refused by name)."""
        check_bool("engine argument batch_invariant", self.batch_invariant)
        if not self.batch_invariant:
            return
        if self.quantization is not None:
            raise ValueError(
                f"engine argument batch_invariant: quantization {self.quantization!r} is not batch-invariant yet (its "
                "products are not in fixed row tiles); leave quantization unset"
            )
        if self.attention_impl not in ("auto", "xla"):
            raise ValueError(
                f"engine argument batch_invariant: attention_impl {self.attention_impl!r}: the Pallas kernels split "
                "their work by the batch; use 'auto' or 'xla' (the XLA attention, on every platform)"
            )

    def __post_init__(self):
        def arg(field: str) -> str:
            return f"engine argument {field}"

        def choose(field: str, choices: tuple) -> None:
            value = getattr(self, field)
            if not isinstance(value, str) or value not in choices:
                fail(arg(field), " or ".join(choices), value, wrong_type=not isinstance(value, str))

        def put(field: str, value) -> None:
            object.__setattr__(self, field, value)  # frozen: the checked, canonical value

        if self.model is not None:
            put("model", check_path(arg("model"), self.model))
        check_sources(self)
        if self.dtype == "auto":
            put("dtype", None)
        if self.dtype is not None:
            choose("dtype", self.DTYPES)
        put("page_size", check_int(arg("page_size"), self.page_size, 1, self.MAX_PAGE_SIZE))
        put("max_num_seqs", check_int(arg("max_num_seqs"), self.max_num_seqs, 1, self.MAX_NUM_SEQS))
        put(
            "max_num_batched_tokens",
            check_int(arg("max_num_batched_tokens"), self.max_num_batched_tokens, 1, self.MAX_NUM_BATCHED_TOKENS),
        )
        if self.max_model_len is not None:
            put("max_model_len", check_int(arg("max_model_len"), self.max_model_len, 2, INT32_MAX))
        if self.num_pages is not None:
            # Slots (page * page_size + offset) are int32.
            put("num_pages", check_int(arg("num_pages"), self.num_pages, 2, INT32_MAX // self.page_size))
        if self.kv_cache_memory_bytes is not None:
            put("kv_cache_memory_bytes", check_int(arg("kv_cache_memory_bytes"), self.kv_cache_memory_bytes, 1))
        put(
            "gpu_memory_utilization",
            check_number(arg("gpu_memory_utilization"), self.gpu_memory_utilization, "in (0, 1]", lambda u: 0 < u <= 1),
        )
        check_bool(arg("enable_prefix_caching"), self.enable_prefix_caching)
        self._check_kv_offload()
        put("seed", check_int(arg("seed"), self.seed, 0))
        choose("attention_impl", self.ATTENTION_IMPLS)
        if self.compilation_cache_dir not in (None, "auto"):
            put("compilation_cache_dir", check_path(arg("compilation_cache_dir"), self.compilation_cache_dir))
        choose("load_format", LOAD_FORMATS)
        choose("runner", RUNNERS)
        if self.quantization is not None:
            choose("quantization", self.QUANTIZATIONS)
        choose("kv_cache_dtype", self.KV_CACHE_DTYPES)
        put("kv_cache_dtype", canonical_kv_cache_dtype(self.kv_cache_dtype))
        check_bool(arg("skip_tokenizer_init"), self.skip_tokenizer_init)
        put("speculative_config", SpeculativeConfig.from_value(self.speculative_config))
        self._check_lora()
        self._check_batch_invariant()
        put("tensor_parallel_size", check_int(arg("tensor_parallel_size"), self.tensor_parallel_size, 1))
        put("data_parallel_size", check_int(arg("data_parallel_size"), self.data_parallel_size, 1))
        check_bool(arg("enable_expert_parallel"), self.enable_expert_parallel)
        if self.async_scheduling is not None:
            check_bool(arg("async_scheduling"), self.async_scheduling)
        if self.coordinator_address is not None:
            address = self.coordinator_address
            host, _, port = address.rpartition(":") if isinstance(address, str) else ("", "", "")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                fail(arg("coordinator_address"), "host:port", address, wrong_type=not isinstance(address, str))
        if self.num_processes is not None:
            put("num_processes", check_int(arg("num_processes"), self.num_processes, 1))
        if self.process_id is not None:
            limit = None if self.num_processes is None else self.num_processes - 1
            put("process_id", check_int(arg("process_id"), self.process_id, 0, limit))
        if self.async_scheduling and self.speculative_config is not None:
            raise ValueError(
                "engine argument async_scheduling: speculative decoding proposes its drafts from the tokens of the "
                "step before on the host; leave async_scheduling unset (or False) with speculative_config"
            )
        if self.data_parallel_size > 1 and self.speculative_config is not None:
            raise ValueError(
                "engine argument speculative_config: speculative decoding runs without data parallelism "
                f"(data_parallel_size is {self.data_parallel_size})"
            )


def check_sources(config: EngineConfig) -> None:
    """Where the model, tokenizer and generation config come from, and what is set over their files: the engine
    arguments of them checked, and made canonical, in `config`."""

    def put(field: str, value) -> None:
        object.__setattr__(config, field, value)  # frozen: the checked, canonical value

    for field in ("revision", "tokenizer_revision"):
        value = getattr(config, field)
        if value is not None and (not isinstance(value, str) or not value or not value.isprintable()):
            wrong_type = not isinstance(value, str)
            fail(f"engine argument {field}", "a branch, tag or commit name", value, wrong_type=wrong_type)
    for field in ("download_dir", "tokenizer"):
        if getattr(config, field) is not None:
            put(field, check_path(f"engine argument {field}", getattr(config, field)))
    if config.chat_template is not None:
        check_text("engine argument chat_template", config.chat_template)
    check_bool("engine argument trust_remote_code", config.trust_remote_code)
    if config.trust_remote_code:
        raise ValueError(
            "engine argument trust_remote_code: jaxpage runs no code from a model repo; it serves the "
            "architectures it implements itself (leave trust_remote_code off)"
        )
    put("hf_overrides", json_object("engine argument hf_overrides", config.hf_overrides))
    if not isinstance(config.generation_config, str) or not config.generation_config:
        fail("engine argument generation_config", "'auto', 'vllm' or a directory", config.generation_config, True)
    override = json_object("engine argument override_generation_config", config.override_generation_config)
    put("override_generation_config", override)
