"""LLMEngine: requests in, one scheduled + jitted step at a time, RequestOutputs out (vLLM's engine API)."""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import contextlib
import dataclasses
import itertools
import logging
import math
import os
import threading
import time
from collections.abc import Iterable

import jax
import numpy as np

from jaxpage import parallel, process_group
from jaxpage.attention import AttentionBackend, resolve_backend
from jaxpage.block_manager import BlockManager
from jaxpage.compilation_cache import CompilationCache
from jaxpage.config import EngineConfig, ModelConfig
from jaxpage.model_runner import CompiledShape, ModelRunner
from jaxpage.models.llama import params_dtype
from jaxpage.models.loader import load_model
from jaxpage.output_processor import OutputProcessor, Request
from jaxpage.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxpage.replica import Replica, choose_replica
from jaxpage.sampling_params import SamplingParams
from jaxpage.scheduler import ScheduledSequence, Scheduler, SchedulerConfig, SchedulerOutput
from jaxpage.sequence import Sequence, SequenceStatus
from jaxpage.spec_decode.decoder import SpeculativeDecoder
from jaxpage.spec_decode.draft_model import check_draft_tokenizer, load_draft_model
from jaxpage.spec_decode.draft_runner import DraftModelRunner
from jaxpage.step_broadcast import Message, StepBroadcast
from jaxpage.tokenizer import IncrementalDetokenizer, load_tokenizer
from jaxpage.validation import INT32_MAX, ArgumentTypeError, check_number, check_text, describe, fail, is_int

logger = logging.getLogger("jaxpage")


def kv_pool_pages(
    engine: EngineConfig, token_bytes: int, max_model_len: int, device_memory: tuple[int, int] | None = None
) -> int:
    """Pages in the pool (the null page included), from the engine's size arguments (see EngineConfig) and the
    bytes of K and V one token takes in the pool. Raises ValueError for a pool the memory cannot hold.

    device_memory: (bytes the device has, bytes in use) of the device the pool is for: a target chip's when the
    engine is built for one (jaxpage.aot); None: this host's first device (on CPU, the host's memory)."""
    page_bytes = engine.page_size * token_bytes
    on_cpu = device_memory is None and jax.default_backend() == "cpu"
    if device_memory is None and not on_cpu:
        stats = jax.local_devices()[0].memory_stats() or {}
        device_memory = (stats.get("bytes_limit", 0), stats.get("bytes_in_use", 0))
    if on_cpu:
        available = available_memory_bytes()
    else:
        limit, in_use = device_memory
        available = limit - in_use if limit else None
    if engine.num_pages is not None:
        pages = engine.num_pages
    else:
        if engine.kv_cache_memory_bytes is not None:
            budget = engine.kv_cache_memory_bytes
        elif on_cpu:
            budget = EngineConfig.CPU_KV_CACHE_BYTES
            if available is not None and available < 2 * budget:  # a small machine: half of what is left
                budget = available // 2
        else:
            budget = int(limit * engine.gpu_memory_utilization) - in_use
        useful = engine.max_num_seqs * math.ceil(max_model_len / engine.page_size) + 1  # more would never be used
        pages = min(budget // page_bytes, useful, INT32_MAX // engine.page_size)
        if pages < 2:
            why = f"the KV cache budget of {budget} bytes holds no page ({page_bytes} bytes each)"
            if device_memory is not None and engine.kv_cache_memory_bytes is None:
                why += (
                    f": {limit} bytes of device memory x gpu_memory_utilization {engine.gpu_memory_utilization}, less "
                    f"{in_use} in use (the weights); raise gpu_memory_utilization or split the model over more devices "
                    "(tensor_parallel_size)"
                )
            raise ValueError(why)
    if available is not None and pages * page_bytes > available:
        raise ValueError(
            f"a KV pool of {pages} pages ({pages * page_bytes} bytes, {page_bytes} per page) does not fit in the "
            f"{available} bytes of memory available; lower num_pages or kv_cache_memory_bytes"
        )
    return pages


def available_memory_bytes() -> int | None:
    """The host's available memory (None where it cannot be told): what a KV pool on CPU can still take."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def addressable_pages(backend: AttentionBackend, model: ModelConfig, num_pages: int, engine: EngineConfig) -> int:
    """num_pages, or fewer where the attention kernels cannot address that pool (AttentionBackend.addressable_pages):
    then with a warning, or ValueError for an explicit num_pages."""
    usable = backend.addressable_pages(model, num_pages, engine.page_size, engine.tensor_parallel_size)
    if usable < num_pages:
        if engine.num_pages is not None:
            raise ValueError(
                f"engine argument num_pages {num_pages}: the {backend.name} kernels cannot address an "
                f"{backend.kv_cache_dtype} pool of that size; take at most {usable} pages, or more pages"
            )
        logger.warning(
            "the KV pool takes %d pages, not %d: the %s kernels cannot address it", usable, num_pages, backend.name
        )
    return usable


def fit_max_model_len(max_model_len: int, pool_tokens: int, explicit: bool) -> int:
    """max_model_len, lowered to the pool's `pool_tokens` when the model's default does not fit (with a warning);
    ValueError when an explicit max_model_len does not fit."""
    if max_model_len <= pool_tokens:
        return max_model_len
    if explicit:
        raise ValueError(
            f"engine argument max_model_len {max_model_len} does not fit in the KV pool, which holds {pool_tokens} "
            "tokens: lower max_model_len, or raise num_pages or kv_cache_memory_bytes"
        )
    logger.warning(
        "the KV pool holds %d tokens, fewer than the model's context length %d: max_model_len lowered to %d",
        pool_tokens,
        max_model_len,
        pool_tokens,
    )
    return pool_tokens


@dataclasses.dataclass(frozen=True)
class StepStats:
    """What one engine step held and where its time went (seconds, wall clock)."""

    num_seqs: int
    num_tokens: int  # scheduled tokens (before padding to the bucket)
    num_decodes: int  # sequences with one new token
    num_draft_tokens: int  # speculative tokens verified (0 without speculative decoding)
    num_accepted_tokens: int  # ... and accepted
    num_sampled: int  # sequences whose logits give a token this step (the rows of the LM head)
    num_attended_keys: int  # query-key pairs of the step's causal attention (sum over its tokens of keys seen)
    shape: str  # the step shape it was padded to, e.g. "decode(T=8, S=8, R=16)"
    schedule_s: float  # host: the scheduler
    prepare_s: float  # host: the step's arrays
    device_s: float  # dispatch until the sampled tokens are on the host
    postprocess_s: float  # host: commit, appending tokens, detokenizing, stop checks, outputs

    @property
    def host_s(self) -> float:
        return self.schedule_s + self.prepare_s + self.postprocess_s


def attended_keys(item: ScheduledSequence, sliding_window: int | None) -> int:
    """Keys the step's new tokens of one sequence attend to: token i (0-based) of q sees computed + i + 1 keys."""
    computed, q = item.num_computed_tokens, item.num_new_tokens
    if sliding_window is None:
        return q * computed + q * (q + 1) // 2
    return sum(min(computed + i + 1, sliding_window) for i in range(q))


class LLMEngine:
    """The serving engine: `add_request`, then `step` until `has_unfinished_requests` is False."""

    def __init__(self, config: EngineConfig):
        # Several hosts (jaxpage.process_group): every process builds process 0's engine; the others then `follow`.
        process_group.initialize(config.coordinator_address, config.num_processes, config.process_id)
        self.channel = StepBroadcast() if jax.process_count() > 1 else None
        if self.channel is not None:
            config = self.channel.share_config(config)
        self.is_leader = process_group.is_leader()
        self._stopped = False
        self.config = config
        self.attention_backend = resolve_backend(config.attention_impl, config.kv_cache_dtype)
        self.compilation_cache = None
        if config.compilation_cache_dir is not None:
            self.compilation_cache = CompilationCache.open(config.compilation_cache_dir)
        # Tensor parallelism: each device receives its shards of the weights as they load (jaxpage.parallel).
        tp, dp = config.tensor_parallel_size, config.data_parallel_size
        self.mesh = parallel.make_mesh(tp, dp) if tp * dp > 1 else None
        placement = None if self.mesh is None else parallel.placement(self.mesh)
        self.model_config, params = load_model(
            config.model,
            dtype=config.dtype,
            load_format=config.load_format,
            sharding=placement,
            quantization=config.quantization,
        )
        target = parallel.as_run(self.model_config, params, self.mesh)
        spec = config.speculative_config
        draft = None
        if spec is not None and spec.method == "draft_model":
            draft = load_draft_model(spec.model, config.dtype, self.model_config, sharding=placement)
            draft = parallel.as_run(*draft, self.mesh)
        # The tokenizer loads (importing transformers: most of a second) while the device zero-fills the KV pool.
        with concurrent.futures.ThreadPoolExecutor(1) as background:
            # A follower never sees a request: it needs no tokenizer.
            wanted = self.is_leader and not config.skip_tokenizer_init
            tokenizer = background.submit(load_tokenizer, config.model) if wanted else None
            self._start(config, target, draft)
            self.tokenizer = tokenizer.result() if tokenizer else None
        if draft is not None and self.tokenizer is not None:
            check_draft_tokenizer(spec.model, self.tokenizer)
        eos_token_ids = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos_token_ids.add(self.tokenizer.eos_token_id)
        self._scheduler_config = SchedulerConfig(
            config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len, frozenset(eos_token_ids)
        )
        self.replicas: list[Replica] = []  # one per data-parallel replica: its pages and scheduler state
        self._new_replicas()
        self.output_processor = OutputProcessor(self.tokenizer)
        self._seq_ids = itertools.count()
        self._seed_rng = np.random.default_rng(config.seed)
        self._lock = threading.RLock()  # add, abort and step may come from different threads
        self._ids_lock = threading.Lock()  # sequence ids and seeds, drawn by prepare_request outside the step's lock
        self.last_step_stats: StepStats | None = None  # of the latest step that ran anything
        if self.channel is not None and self.is_leader:  # the followers must hear that it ends, at exit if not before
            atexit.register(self.channel.stop)

    def _start(self, config: EngineConfig, target: tuple, draft: tuple | None = None) -> None:
        """Sizes and allocates the KV pool (and a draft model's), builds the runner(s). `target` and `draft`:
        (config, params) as they run (jaxpage.parallel.as_run)."""
        target_config, params = target
        model_max = self.model_config.max_position_embeddings
        self.max_model_len = config.max_model_len or model_max
        if self.max_model_len > model_max:
            raise ValueError(f"engine argument max_model_len {self.max_model_len} exceeds the model's {model_max}")
        self._num_pages = num_pages = self._pool_pages(config, target_config, params_dtype(params).itemsize, draft)
        pool_tokens = (num_pages - 1) * config.page_size  # page 0 is the null page
        self.max_model_len = fit_max_model_len(self.max_model_len, pool_tokens, config.max_model_len is not None)
        spec = config.speculative_config
        runner_args = dict(
            num_pages=num_pages,
            page_size=config.page_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            compilation_cache=self.compilation_cache,
            num_speculative_tokens=0 if spec is None else spec.num_speculative_tokens,
            max_verify_rows=0 if spec is None else config.max_num_seqs,
            mesh=self.mesh,
            channel=self.channel,
        )
        self.runner = ModelRunner(
            target_config, params, self.attention_backend, **runner_args, draft_probs=draft is not None
        )
        draft_runner = None if draft is None else DraftModelRunner(*draft, self.attention_backend, **runner_args)
        self.spec_decoder = None
        if spec is not None:
            self.spec_decoder = SpeculativeDecoder(spec, self.max_model_len, self.runner, draft_runner)

    def _pool_pages(self, config: EngineConfig, target_config: ModelConfig, dtype_bytes: int, draft) -> int:
        """The pages of the KV pool (jaxpage.llm_engine.kv_pool_pages), agreed by every host, logged."""
        tp = config.tensor_parallel_size
        layout = dict(page_size=config.page_size, tensor_parallel_size=tp)
        token_bytes = self.attention_backend.kv_bytes_per_token(target_config, dtype_bytes, **layout)
        if draft is not None:  # the draft model's pool has the same pages: the budget pays for both
            token_bytes += self.attention_backend.kv_bytes_per_token(draft[0], dtype_bytes, **layout)
        device_token_bytes = token_bytes // tp  # each device holds its shard's KV heads
        # A device's budget and memory are its own, but simulated CPU devices share the host's: every shard of every
        # data-parallel replica (each replica has num_pages pages).
        cpu = jax.default_backend() == "cpu"
        budget_token_bytes = token_bytes * config.data_parallel_size if cpu else device_token_bytes
        if self.channel is None:
            num_pages = kv_pool_pages(config, budget_token_bytes, self.max_model_len)
        else:  # each host measures its own memory: every process takes the smallest pool, or refuses with all
            try:
                num_pages, refused = kv_pool_pages(config, budget_token_bytes, self.max_model_len), None
            except ValueError as e:
                num_pages, refused = 0, e
            num_pages = self.channel.agree_min(num_pages)
            if refused is not None:
                raise refused
            if num_pages == 0:
                raise ValueError("another process's memory cannot hold the KV pool (see its log)")
        num_pages = addressable_pages(self.attention_backend, target_config, num_pages, config)
        copies = target_config.num_kv_heads // self.model_config.num_kv_heads
        logger.info(
            "KV cache: %d bytes per token (2 * %d layers * %d kv heads%s * %s)%s; %d pages of %d tokens, %.2f GiB",
            token_bytes,
            self.model_config.num_layers,
            target_config.num_kv_heads,
            f" ({self.model_config.num_kv_heads} copied {copies}x)" if copies > 1 else "",
            self.attention_backend.kv_head_bytes(self.model_config, dtype_bytes),
            f", {device_token_bytes} per device on {tp} devices" if tp > 1 else "",
            num_pages,
            config.page_size,
            num_pages * config.page_size * token_bytes / 2**30,
        )
        return num_pages

    @property
    def draft_runner(self) -> DraftModelRunner | None:
        """The draft model's runner (speculative decoding with method "draft_model"), else None."""
        return None if self.spec_decoder is None else self.spec_decoder.draft_runner

    @property
    def spec_decoding_stats(self):
        """vLLM's speculative decoding counters (jaxpage.spec_decode.stats), None without speculative decoding."""
        return None if self.spec_decoder is None else self.spec_decoder.stats

    @classmethod
    def from_engine_args(cls, **engine_args) -> LLMEngine:
        return cls(EngineConfig(**engine_args))

    # ----- requests -----

    def add_request(
        self,
        request_id: str,
        prompt: str | dict,
        sampling_params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Queues a request. `prompt` is a string, {"prompt_token_ids": [...]} or {"prompt": "..."} (a dict may give
        both, the text then only labels the output).

        Everything is checked here, never inside `step()`: ValueError (ArgumentTypeError for a wrong type; both
        name the field and the value), and nothing is queued, for a request_id that is not a non-empty string or
        is in use, an empty or malformed prompt, text the tokenizer cannot take, token ids outside the vocabulary,
        bad sampling params (checked again, in case they changed since they were built), top_k or stop token ids
        beyond the vocabulary, or a request that can never fit max_model_len or the page pool.
        """
        self.add_prepared_requests([self.prepare_request(request_id, prompt, sampling_params, arrival_time)])

    def prepare_request(
        self,
        request_id: str,
        prompt: str | dict,
        sampling_params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> Request:
        """The checked and tokenized request, not yet queued: add_request's checks (but for a request_id in use,
        which add_prepared_requests checks), without waiting for a step in progress."""
        self._check_leader("add_request")
        if not isinstance(request_id, str) or not request_id:
            fail("request_id", "a non-empty string", request_id, wrong_type=not isinstance(request_id, str))
        params = SamplingParams() if sampling_params is None else sampling_params
        if not isinstance(params, SamplingParams):
            fail("sampling_params", "a SamplingParams or None", params, wrong_type=True)
        params.validate()
        vocab = self.model_config.vocab_size
        if params.top_k > vocab:
            fail("SamplingParams.top_k", f"at most the vocabulary size {vocab} (0 or -1: all tokens)", params.top_k)
        if any(t >= vocab for t in params.stop_token_ids):
            fail("SamplingParams.stop_token_ids", f"token ids in [0, {vocab})", params.stop_token_ids)
        if self.tokenizer is None and params.stop:
            raise ValueError(
                "stop strings need the tokenizer, which skip_tokenizer_init leaves out: use stop_token_ids"
            )
        if arrival_time is not None:
            arrival_time = check_number("arrival_time", arrival_time, "a finite time in seconds", lambda t: t >= 0)
        text, token_ids = self._prompt_tokens(prompt)
        max_len = self.max_model_len
        if len(token_ids) >= max_len:
            raise ValueError(f"prompt is {len(token_ids)} tokens; max_model_len {max_len} leaves no room to generate")
        # One sequence's pages: the n samples share the prompt's pages and need not run at the same time.
        longest = min(len(token_ids) + (params.max_tokens or max_len), max_len)
        pages = math.ceil(longest / self.block_manager.page_size)
        if pages > self.block_manager.num_pages - 1:
            raise ValueError(
                f"request needs up to {pages} pages ({longest} tokens) but the KV pool has "
                f"{self.block_manager.num_pages - 1}; lower max_tokens or enlarge the pool"
            )
        with self._ids_lock:
            seeds = [
                params.seed + index if params.seed is not None else int(self._seed_rng.integers(0, 2**31 - 1))
                for index in range(params.n)
            ]
            seqs = [Sequence(next(self._seq_ids), token_ids, sampling_params=params, seed=seed) for seed in seeds]
        if len(seqs) > 1:  # the n samples compute the prompt once and share its pages (see Scheduler)
            for seq in seqs:
                seq.group = tuple(seqs)
        logprobs = params.logprobs is not None
        return Request(
            request_id,
            text,
            token_ids,
            params,
            seqs,
            [
                IncrementalDetokenizer(self.tokenizer, token_ids, params.skip_special_tokens)
                if self.tokenizer
                else None
                for _ in seqs
            ],
            [CompletionOutput(i, "", [], 0.0 if logprobs else None, [] if logprobs else None) for i in range(params.n)],
            RequestMetrics(arrival_time or time.time()),
        )

    def add_prepared_requests(self, requests: list[Request]) -> None:
        """Queues prepared requests, all or none: ValueError, and nothing queued, if a request_id is in use (or
        given twice)."""
        with self._lock:
            counts = collections.Counter(r.request_id for r in requests)
            taken = sorted(i for i, n in counts.items() if n > 1 or self.has_request(i))
            if taken:
                raise ValueError(f"request_id {', '.join(map(describe, taken))} is already in use; nothing was queued")
            for request in requests:
                request.replica = choose_replica(self.replicas, request.prompt_token_ids)
                self.output_processor.add(request)
                for seq in request.seqs:
                    self.replicas[request.replica].scheduler.add(seq)

    def _prompt_tokens(self, prompt) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a prompt; ValueError naming what is wrong with it."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty (got '')")
            check_text("prompt", prompt)
            if self.tokenizer is None:
                raise ValueError(
                    "a text prompt needs the tokenizer, which skip_tokenizer_init leaves out: pass "
                    "{'prompt_token_ids': [...]}"
                )
            try:
                ids = list(self.tokenizer(prompt).input_ids)
            except Exception as e:  # the tokenizer's own failure on this text: refuse the prompt, keep serving
                raise ValueError(f"prompt {describe(prompt)} cannot be tokenized ({type(e).__name__}: {e})") from None
            if not ids:
                fail("prompt", "text with at least one token", prompt)
            if max(ids) >= self.model_config.vocab_size:
                raise ValueError(
                    f"the tokenizer gives token id {max(ids)}, outside the model's vocabulary of "
                    f"{self.model_config.vocab_size}: the tokenizer does not belong to this model"
                )
            return prompt, ids
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids"}
            if unknown:
                fail("prompt", "a dict with the keys prompt and/or prompt_token_ids only", sorted(unknown))
            if "prompt_token_ids" in prompt:
                ids = self._token_ids(prompt["prompt_token_ids"])
                text = prompt.get("prompt")
                if text is not None:
                    check_text("prompt", text, allow_empty=True)
                return text, ids
            if "prompt" in prompt:
                return self._prompt_tokens(check_text("prompt", prompt["prompt"]))
        fail("prompt", "a string or a dict with prompt_token_ids or prompt", prompt, wrong_type=True)

    def _token_ids(self, ids) -> list[int]:
        vocab = self.model_config.vocab_size
        if not isinstance(ids, list | tuple | np.ndarray) or isinstance(ids, np.ndarray) and ids.ndim != 1:
            fail("prompt_token_ids", "a non-empty list of token ids", ids, wrong_type=True)
        if len(ids) == 0:
            fail("prompt_token_ids", "a non-empty list of token ids", ids)
        bad = [t for t in ids if not is_int(t) or not 0 <= t < vocab][:1]  # a list: the bad id may be None
        if bad:
            raise (ArgumentTypeError if not is_int(bad[0]) else ValueError)(
                f"prompt_token_ids holds {describe(bad[0])}, not a token id in [0, {vocab})"
            )
        return [int(t) for t in ids]

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Ends the request(s) now with finish_reason "abort" and frees their pages; unknown ids are ignored. The
        next `step()` returns each one's final output (finished, "abort"), so a stream over it ends."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        with self._lock:
            for rid in ids:
                request = self.output_processor.requests.get(rid) if isinstance(rid, str) else None
                if request is not None:
                    self._end_request(request, "abort")

    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor.requests)

    def has_request(self, request_id: str) -> bool:
        """Whether request_id is an unfinished request of this engine (an id add_request would refuse)."""
        return request_id in self.output_processor.requests

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.requests)

    def warmup(self) -> list[CompiledShape]:
        """Compiles the step for every shape a workload can reach, so that serving compiles nothing; returns the
        shapes compiled and the seconds each took (a shape already compiled is not compiled again)."""
        self._check_leader("warmup")
        if self.channel is not None:
            self.channel.send(Message.WARMUP)
        return self._warmup()

    def _warmup(self) -> list[CompiledShape]:
        with self._lockstep():
            compiled = self.runner.warmup()
            if self.draft_runner is not None:
                compiled += self.draft_runner.warmup()
            if self.channel is not None:
                runners = [r for r in (self.runner, self.draft_runner) if r is not None]
                self.channel.warmup(set().union(*(r.payload_sizes() for r in runners)))
        return compiled

    # ----- several hosts -----

    def _lockstep(self):
        """A section every process runs by itself, in the same order (see StepBroadcast.lockstep)."""
        return contextlib.nullcontext() if self.channel is None else self.channel.lockstep()

    def _check_leader(self, what: str) -> None:
        """Raises unless this process leads (process 0, or the only one): `what` is the leader's to call, or
        after it shuts down."""
        if self._stopped:
            raise RuntimeError(f"{what}: the engine has shut down")
        if not self.is_leader:
            raise RuntimeError(
                f"{what}: process {jax.process_index()} of {jax.process_count()} follows process 0, which takes the "
                "requests; call follow() here"
            )

    def follow(self) -> None:
        """On a process other than 0: runs every program process 0's engine launches, as it tells them (see
        jaxpage.step_broadcast), until it shuts down."""
        if self.is_leader:
            raise RuntimeError("follow: this is process 0, which leads; the other processes follow it")
        runners = (self.runner, self.draft_runner)
        draft_probs = None
        while True:
            header, data = self.channel.receive()
            if header.kind is Message.STOP:
                self._stopped = True
                return
            if header.kind is Message.WARMUP:
                self._warmup()
            else:
                try:
                    draft_probs = runners[header.runner].replay(header, data, draft_probs)
                except Exception:  # the leader's launch fails too, and it resets the pool next
                    logger.exception("following process 0: %s failed", header.kind.name)

    def shutdown(self) -> None:
        """Ends the engine: step and add_request refuse after it. With several hosts, process 0's shutdown tells the
        others, whose `follow` returns (at exit, if not called before)."""
        with self._lock:
            if self.channel is not None:
                self.channel.stop()
            self._stopped = True

    # ----- the step -----

    def step(self) -> list[RequestOutput]:
        """Runs one step, schedule -> execute -> update; returns the outputs of the requests that progressed or ended
        (aborted ones included).

        A request whose own post-processing fails (its detokenization, say) ends with finish_reason "error" and
        RequestOutput.error saying why; the others go on. If the device step itself fails, no request can be
        blamed: every unfinished request ends with that error, the pool is made anew, and the engine serves on.
        """
        with self._lock:
            self._check_leader("step")
            start = time.perf_counter()
            # Speculative decoding runs without data parallelism: on the one replica.
            drafts = self.spec_decoder.propose(self.scheduler) if self.spec_decoder is not None else None
            steps = [r.scheduler.schedule(drafts if i == 0 else None) for i, r in enumerate(self.replicas)]
            if not any(o.scheduled for o in steps):
                return self.output_processor.take_ended()
            scheduled = time.perf_counter()
            every = [item for o in steps for item in o.scheduled]
            num_sampled = sum(item.samples for item in every)  # before the new tokens are appended
            self.output_processor.mark_scheduled(every, time.time())
            try:
                results, draft_computed = self._execute(steps)
            except Exception as e:  # not a request's fault: every request was checked when it was added
                logger.exception("engine step failed; every unfinished request ends with this error")
                self._fail_all(f"engine step failed ({type(e).__name__}: {e})")
                return self.output_processor.take_ended()
            updates = [
                (update, result)
                for replica, output, result in zip(self.replicas, steps, results, strict=True)
                for update in replica.scheduler.update_from_output(
                    output, result.token_ids, result.num_accepted, draft_computed
                )
            ]
            if self.spec_decoder is not None:
                self.spec_decoder.observe(results[0].shape, results[0].device_s, [u for u, _ in updates])
                for update, _ in updates:
                    if update.finish_reason is not None:
                        self.spec_decoder.forget(update.seq.seq_id)
            outputs, ended = self.output_processor.process(updates, time.time())
            for replica, seq in ended:  # ended by a stop string or their request's failure
                self._finish_seq(replica, seq)
            host_s = (scheduled - start, time.perf_counter() - scheduled)  # scheduling; the rest, the device's included
            self.last_step_stats = self._step_stats(steps, results, [u for u, _ in updates], num_sampled, *host_s)
            return outputs

    def _execute(self, steps: list[SchedulerOutput]) -> tuple[list, dict[int, int] | None]:
        """Runs the scheduled step of every replica on the device (a draft model's drafts first, where it drafts):
        (each replica's StepOutput, the draft model's computed tokens by seq_id or None)."""
        started = time.perf_counter()
        draft_probs = draft_computed = None
        if self.spec_decoder is not None:
            steps[0], draft_probs, draft_computed = self.spec_decoder.draft(steps[0])
        results = self.runner.execute_replicas(steps, draft_probs)
        if draft_probs is not None:  # the step's seconds include the draft model's
            results[0] = dataclasses.replace(results[0], device_s=time.perf_counter() - started - results[0].prepare_s)
        return results, draft_computed

    def _step_stats(
        self, steps: list[SchedulerOutput], results: list, updates: list, num_sampled: int, schedule_s, after_s
    ) -> StepStats:
        """What the step held and where its time went (after_s: from the schedule's end to the outputs)."""
        every = [item for o in steps for item in o.scheduled]
        return StepStats(
            num_seqs=len(every),
            num_tokens=sum(o.num_batched_tokens for o in steps),
            num_decodes=sum(item.num_new_tokens == 1 for item in every),
            num_draft_tokens=sum(len(item.draft_token_ids) for item in every),
            num_accepted_tokens=sum(update.num_accepted for update in updates),
            num_sampled=num_sampled,
            num_attended_keys=sum(attended_keys(item, self.model_config.sliding_window) for item in every),
            shape=str(results[0].shape),
            schedule_s=schedule_s,
            prepare_s=results[0].prepare_s,
            device_s=results[0].device_s,
            postprocess_s=after_s - results[0].prepare_s - results[0].device_s,
        )

    def _end_request(self, request: Request, finish_reason: str, error: str | None = None) -> None:
        """Ends a request outside the normal flow ("abort" or "error"): its unfinished samples stop, its pages are
        freed, and its final output waits for the next `step()` to return it."""
        for seq in self.output_processor.end(request, finish_reason, error):
            self._finish_seq(request.replica, seq)

    def _fail_all(self, error: str) -> None:
        """After a failed device step: every unfinished request ends with `error`, and the page pool and its
        bookkeeping start afresh (the failed step may have consumed the donated pool)."""
        for request in list(self.output_processor.requests.values()):
            self._end_request(request, "error", error)
        self._new_replicas()
        self.runner.reset_kv_cache()
        if self.spec_decoder is not None:
            self.spec_decoder.reset()

    def _new_replicas(self) -> None:
        """Every replica's bookkeeping afresh (at start, and after a failed step), in the same list."""
        c = self.config
        self.replicas[:] = [
            Replica.new(self._num_pages, c.page_size, c.enable_prefix_caching, self._scheduler_config)
            for _ in range(c.data_parallel_size)
        ]

    @property
    def scheduler(self) -> Scheduler:
        """The scheduler (with data parallelism, the first replica's: see `replicas`)."""
        return self.replicas[0].scheduler

    @property
    def block_manager(self) -> BlockManager:
        """The page bookkeeping (with data parallelism, the first replica's: see `replicas`)."""
        return self.replicas[0].block_manager

    def num_running(self) -> int:
        return sum(len(r.scheduler.running) for r in self.replicas)

    def num_waiting(self) -> int:
        return sum(len(r.scheduler.waiting) for r in self.replicas)

    def kv_cache_usage(self) -> float:
        """The share of the KV pages in use (the null pages not counted), over every replica."""
        used = sum(r.block_manager.num_used_pages for r in self.replicas)
        return used / max(sum(r.block_manager.num_pages - 1 for r in self.replicas), 1)

    def prefix_cache_counts(self) -> tuple[int, int]:
        """(prompt tokens looked up in the prefix cache, tokens found there), over every replica."""
        return (
            sum(r.scheduler.num_prefix_query_tokens for r in self.replicas),
            sum(r.scheduler.num_prefix_hit_tokens for r in self.replicas),
        )

    def _finish_seq(self, replica: int, seq: Sequence) -> None:
        """Ends a sequence the scheduler did not end itself (a stop string, an abort, a failure)."""
        if seq.status is not SequenceStatus.FINISHED:
            self.replicas[replica].scheduler.finish(seq)
        if self.spec_decoder is not None:
            self.spec_decoder.forget(seq.seq_id)
