"""LLMEngine: requests in, one scheduled + jitted step at a time, RequestOutputs out (vLLM's engine API)."""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import Iterable

import jax

from jaxpage.attention import engine_backend
from jaxpage.config import CacheConfig, EngineConfig, LoadConfig, ModelConfig, ParallelConfig
from jaxpage.engine.block_manager import BlockManager
from jaxpage.engine.input_processor import InputProcessor
from jaxpage.engine.lora_adapters import LoRAAdapters
from jaxpage.engine.lora_slots import LoRASlots
from jaxpage.engine.output_processor import OutputProcessor, Request
from jaxpage.engine.replica import Replica, Replicas, choose_replica
from jaxpage.engine.scheduler import Scheduler
from jaxpage.engine.spec_decoder import SpeculativeDecoder
from jaxpage.engine.step_pipeline import InFlightStep, StepPipeline, use_async_scheduling
from jaxpage.engine.step_stats import StepStats
from jaxpage.lora_request import LoRARequest
from jaxpage.models.batch_invariant import batch_invariant_config
from jaxpage.models.generation_config import GenerationDefaults, generation_defaults
from jaxpage.models.llama import params_dtype
from jaxpage.models.loader import load_model, resolve_source
from jaxpage.outputs import RequestOutput
from jaxpage.sampling_params import SamplingParams
from jaxpage.sequence import Sequence, SequenceStatus
from jaxpage.sources import HubDownload
from jaxpage.spec_decode.draft_model import check_draft_tokenizer, load_draft_model
from jaxpage.tokenizers.tokenizer import load_tokenizer
from jaxpage.validation import describe, fail
from jaxpage.worker import parallel, process_group
from jaxpage.worker.compilation_cache import CompilationCache, CompiledShape
from jaxpage.worker.draft_runner import DraftModelRunner
from jaxpage.worker.executor import Executor, make_runners
from jaxpage.worker.pool_sizing import engine_pool_pages, fit_max_model_len
from jaxpage.worker.step_broadcast import Message, StepBroadcast

logger = logging.getLogger("jaxpage")


def load_models(config: EngineConfig, mesh) -> tuple[ModelConfig, tuple, tuple | None]:
    """(the model's config, the target's (config, params) as they run, a draft model's or None): loaded as the
    engine arguments say, each device receiving its shards of the weights as they load (jaxpage.worker.parallel; a
    mixture of experts' experts whole with enable_expert_parallel)."""
    load, spec, expert_parallel = config.part(LoadConfig), config.speculative_config, config.enable_expert_parallel
    placement = None if mesh is None else parallel.placement(mesh, expert_parallel)
    model_config, params = load_target_model(config, placement)
    draft = None
    if spec is not None and spec.method == "draft_model":
        draft = load_draft_model(spec.model, load.dtype, model_config, placement, HubDownload(None, load.download_dir))
        draft = as_run(config, *draft, mesh)
    return model_config, as_run(config, model_config, params, mesh, expert_parallel), draft


def load_target_model(config: EngineConfig, sharding=None) -> tuple[ModelConfig, dict]:
    """(config, params) of the model as the engine arguments say (its source, revision and download folder, dtype,
    quantization, load format and hf_overrides); sharding: load_model's."""
    load = config.part(LoadConfig)
    download = HubDownload(load.revision, load.download_dir)
    options = dict(dtype=load.dtype, quantization=load.quantization, load_format=load.load_format)
    return load_model(load.model, sharding=sharding, download=download, hf_overrides=load.hf_overrides, **options)


def engine_tokenizer(config: EngineConfig):
    """The engine's tokenizer: the engine argument tokenizer's, else the model's, with chat_template's template."""
    load = config.part(LoadConfig)
    source, revision = load.tokenizer_source
    return load_tokenizer(source, HubDownload(revision, load.download_dir), load.chat_template)


def model_generation_defaults(config: EngineConfig) -> GenerationDefaults:
    """The model's generation config (jaxpage.models.generation_config) as the engine arguments say to read it."""
    load = config.part(LoadConfig)
    model_path = None
    if load.generation_config == "auto" and load.model is not None:
        model_path = resolve_source(load.model, HubDownload(load.revision, load.download_dir), weights=False)
    return generation_defaults(load.generation_config, model_path, load.override_generation_config)


def eos_token_ids(model: ModelConfig, tokenizer, generation: GenerationDefaults) -> frozenset[int]:
    """The ids a sequence ends on: config.json's, the tokenizer's and the generation config's EOS."""
    tokenizer_eos = getattr(tokenizer, "eos_token_id", None)
    return frozenset({*model.eos_token_ids, *generation.eos_token_ids, tokenizer_eos} - {None})


def as_run(config: EngineConfig, model_config: ModelConfig, params, mesh, expert_parallel: bool = False) -> tuple:
    """(config, params) of a model as the engine runs it: on the mesh (jaxpage.worker.parallel.as_run), and
    batch-invariant with the engine argument (a mixture of experts refused: its products group tokens by expert)."""
    model_config, params = parallel.as_run(model_config, params, mesh, expert_parallel)
    return batch_invariant_config(model_config, config.batch_invariant), params


def _request_ids(request_id) -> list[str]:
    """abort_request's argument as a list: a str or an iterable of them, else ValueError naming request_id."""
    if isinstance(request_id, str):
        return [request_id]
    ids = list(request_id) if isinstance(request_id, Iterable) else None
    if ids is None or not all(isinstance(rid, str) for rid in ids):
        fail("request_id", "a string or an iterable of strings", request_id, wrong_type=True)
    return ids


class LLMEngine:
    """The serving engine: `add_request`, then `step` until `has_unfinished_requests` is False."""

    def __init__(self, config: EngineConfig):
        # Several hosts (jaxpage.worker.process_group): every process builds process 0's engine; the others then
        # `follow`.
        hosts = config.part(ParallelConfig)
        process_group.initialize(hosts.coordinator_address, hosts.num_processes, hosts.process_id)
        self.channel = StepBroadcast() if jax.process_count() > 1 else None
        if self.channel is not None:
            config = self.channel.share_config(config)
        self.is_leader = process_group.is_leader()
        self._stopped = False
        self.config = config
        self.attention_backend = engine_backend(config)
        self.compilation_cache = None
        if config.compilation_cache_dir is not None:
            self.compilation_cache = CompilationCache.open(config.compilation_cache_dir)
        tp, dp = config.tensor_parallel_size, config.data_parallel_size
        self.mesh = parallel.make_mesh(tp, dp) if tp * dp > 1 else None
        self.generation_defaults = model_generation_defaults(config)  # before the weights: a bad file fails fast
        self.model_config, target, draft = load_models(config, self.mesh)
        # The tokenizer loads (importing transformers: most of a second) while the device zero-fills the KV pool.
        with concurrent.futures.ThreadPoolExecutor(1) as background:
            wanted = self.is_leader and not config.skip_tokenizer_init  # a follower never sees a request
            tokenizer = background.submit(engine_tokenizer, config) if wanted else None
            self._start(config, target, draft)
            self.tokenizer = tokenizer.result() if tokenizer else None
        if draft is not None and self.tokenizer is not None:
            check_draft_tokenizer(config.speculative_config.model, self.tokenizer, config.download_dir)
        eos = eos_token_ids(self.model_config, self.tokenizer, self.generation_defaults)
        self._scheduler_config = config.scheduler_config(self.max_model_len, eos)
        self.replicas = Replicas()  # one per data-parallel replica: its pages and scheduler state
        self._new_replicas()
        self.output_processor = OutputProcessor(self.tokenizer)
        sizes = (self.model_config.vocab_size, self.max_model_len, self._num_pages)
        lora, defaults = LoRAAdapters.for_engine(self.model_config, config), self.generation_defaults.sampling_params()
        self.input_processor = InputProcessor(self.tokenizer, *sizes, config, eos, lora, defaults)
        self._lock = threading.RLock()  # add, abort and step may come from different threads
        self.last_step_stats: StepStats | None = None  # of the latest step that ran anything
        asynchronous = use_async_scheduling(config, self.attention_backend.platform, jax.process_count())
        marked = self.output_processor.mark_scheduled
        self.pipeline = StepPipeline(self.replicas, self.executor, self.spec_decoder, asynchronous, marked)
        if self.channel is not None and self.is_leader:  # the followers must hear that it ends, at exit if not before
            atexit.register(self.channel.stop)

    def _start(self, config: EngineConfig, target: tuple, draft: tuple | None = None) -> None:
        """Sizes the KV pools and builds the runners; target, draft: (config, params) as they run (parallel.as_run)."""
        target_config, params = target
        model_max = self.model_config.max_position_embeddings
        self.max_model_len = config.max_model_len or model_max
        if self.max_model_len > model_max:
            raise ValueError(f"engine argument max_model_len {self.max_model_len} exceeds the model's {model_max}")
        dtype_bytes = params_dtype(params).itemsize
        args = (config, self.attention_backend, self.model_config, target_config, dtype_bytes, draft, self.channel)
        self._num_pages, self._window_pages = engine_pool_pages(*args, self.max_model_len)
        pool_tokens = (self._num_pages - 1) * config.page_size  # page 0 is the null page
        self.max_model_len = fit_max_model_len(self.max_model_len, pool_tokens, config.max_model_len is not None)
        spec = config.speculative_config
        k = 0 if spec is None else spec.num_speculative_tokens
        sized = (self._num_pages, self.max_model_len, self.mesh, k, self.compilation_cache)
        runners = make_runners(config, self.attention_backend, target, draft, *sized, window_pages=self._window_pages)
        self.executor = Executor(runners, self.channel)
        self.runner = self.executor.runners[0]
        self.spec_decoder = None
        if spec is not None:  # a draft model's runner follows the target's
            self.spec_decoder = SpeculativeDecoder(spec, self.max_model_len, *self.executor.runners)

    @property
    def async_scheduling(self) -> bool:
        """Whether steps are scheduled asynchronously (jaxpage.engine.step_pipeline)."""
        return self.pipeline.asynchronous

    @property
    def draft_runner(self) -> DraftModelRunner | None:
        """The draft model's runner (speculative decoding with method "draft_model"), else None."""
        return None if self.spec_decoder is None else self.spec_decoder.draft_runner

    @property
    def spec_decoding_stats(self):
        """vLLM's speculative decoding counters (jaxpage.spec_decode.stats), None without speculative decoding."""
        return None if self.spec_decoder is None else self.spec_decoder.stats

    @property
    def spec_decoding_policy(self):
        """What the speculation policy decides now and why (jaxpage.spec_decode.policy.PolicyState), None without
        speculative decoding."""
        return None if self.spec_decoder is None else self.spec_decoder.policy.state()

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
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queues a request, through LoRA adapter `lora_request` if given. `prompt` is a string, {"prompt_token_ids":
        [...]} or {"prompt": "..."} (a dict may give both, the text then only labels the output).

        Everything is checked here, never inside `step()`: ValueError (ArgumentTypeError for a wrong type; both
        name the field and the value), and nothing is queued, for a request_id that is not a non-empty string or
        is in use, an empty or malformed prompt, text the tokenizer cannot take, token ids outside the vocabulary,
        bad sampling params (checked again, in case they changed since they were built), top_k or stop token ids
        beyond the vocabulary, or a request that can never fit max_model_len or the page pool.
        """
        request = self.prepare_request(request_id, prompt, sampling_params, arrival_time, lora_request)
        self.add_prepared_requests([request])

    def prepare_request(
        self,
        request_id: str,
        prompt: str | dict,
        sampling_params: SamplingParams | None = None,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> Request:
        """The checked and tokenized request, not yet queued: add_request's checks (but for a request_id in use,
        which add_prepared_requests checks), without waiting for a step in progress."""
        self._check_leader("add_request")
        return self.input_processor.prepare(request_id, prompt, sampling_params, arrival_time, lora_request)

    def add_prepared_requests(self, requests: list[Request]) -> None:
        """Queues prepared requests, all or none: ValueError, and nothing queued, if a request_id is in use (or
        given twice)."""
        with self._lock:
            counts = collections.Counter(r.request_id for r in requests)
            taken = sorted(i for i, n in counts.items() if n > 1 or self.has_request(i))
            if taken:
                raise ValueError(f"request_id {', '.join(map(describe, taken))} is already in use; nothing was queued")
            for request in requests:
                request.replica = choose_replica(self.replicas, request.prompt_token_ids, request.seqs[0].prefix_root)
                self.output_processor.add(request)
                for seq in request.seqs:
                    self.replicas[request.replica].scheduler.add(seq)

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Ends the request(s) now with finish_reason "abort" and frees their pages; unknown ids are ignored. The
        next `step()` returns each one's final output (finished, "abort"), so a stream over it ends."""
        with self._lock:
            for rid in _request_ids(request_id):  # all checked (ValueError) before any request ends
                request = self.output_processor.requests.get(rid)
                if request is not None:
                    self._end_request(request, "abort")

    def stop_samples(self, request_id: str, samples: list[int]) -> None:
        """Ends samples (indexes) of a request now, "stop": a stop string found where the text is made (the engine
        process's server: jaxpage.engine.output_texts). Unknown ids and ended samples are passed over."""
        with self._lock:
            if request_id in self.output_processor.requests:
                self._end_request(self.output_processor.requests[request_id], "stop", samples=samples)

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
        return self.executor.warmup()

    # ----- several hosts -----

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
        jaxpage.worker.step_broadcast), until it shuts down."""
        if self.is_leader:
            raise RuntimeError("follow: this is process 0, which leads; the other processes follow it")
        self.executor.follow()
        self._stopped = True

    def shutdown(self) -> None:
        """Ends the engine: step and add_request refuse after it. With several hosts, process 0's shutdown tells the
        others, whose `follow` returns (at exit, if not called before)."""
        with self._lock:
            if self.channel is not None:
                self.channel.stop()
            self._stopped = True

    # ----- the step -----

    def step(self) -> list[RequestOutput]:
        """Runs one step (schedule, execute, update); returns the outputs of the requests that progressed or ended
        (aborted ones too; an engine process's as Request.token_deltas says, with StepTokens). With asynchronous
        scheduling (`async_scheduling`) it launches the next step before it waits for the one the call before
        launched, whose outputs it returns: the host works while the device does (the first call returns none). A
        request whose own post-processing fails (its detokenization, say) ends with finish_reason "error" and
        RequestOutput.error saying why; if the device step fails, no request can be blamed: every unfinished request
        ends with that error, the pool is made anew, and the engine serves on."""
        with self._lock:
            self._check_leader("step")
            try:
                done = self.pipeline.advance()
                if done is None:
                    return self.output_processor.take_ended()
                results = self.pipeline.results(done)
            except Exception as e:  # not a request's fault: every request was checked when it was added
                logger.exception("engine step failed; every unfinished request ends with this error")
                self._fail_all(f"engine step failed ({type(e).__name__}: {e})")
                return self.output_processor.take_ended()
            return self._outputs(done, results)

    def _outputs(self, step: InFlightStep, results: list) -> list[RequestOutput]:
        """A step's results into its sequences (the schedulers' update) and its requests' outputs, which it
        returns."""
        start = time.perf_counter()
        for output, result in zip(step.steps, results, strict=True):
            self.output_processor.record_prompt_logprobs(output.scheduled, result)
        updates = self.pipeline.update(step, results)
        outputs, ended = self.output_processor.process(updates, time.time())
        for replica, seq in ended:  # ended by a stop string or their request's failure
            self._finish_seq(replica, seq)
        postprocess_s = time.perf_counter() - start
        parts = (step.steps, results, updates, step.schedule_s, postprocess_s, self.model_config)
        self.last_step_stats = StepStats(*parts)  # (its counts worked out only if read)
        return outputs

    def _end_request(self, request: Request, finish_reason: str, error: str | None = None, samples=None) -> None:
        """Ends a request (or its `samples`) outside the normal flow ("abort", "error", "stop"): its unfinished samples
        stop, their pages are freed, and its final output waits for the next `step()` to return it."""
        for seq in self.output_processor.end(request, finish_reason, error, samples):
            self._finish_seq(request.replica, seq)

    def _fail_all(self, error: str) -> None:
        """After a failed device step: every unfinished request ends with `error`, and the page pool and its
        bookkeeping start afresh (the failed step may have consumed the donated pool)."""
        self.pipeline.drop()
        for request in list(self.output_processor.requests.values()):
            self._end_request(request, "error", error)
        self._new_replicas()
        self.executor.reset()

    def _new_replicas(self) -> None:
        """Every replica's bookkeeping afresh (at start, and after a failed step), in the same list."""
        c, readers = self.config, [runner.config for runner in self.executor.runners]  # the models reading the pages
        lora_slots = LoRASlots(c.max_loras) if c.enable_lora else None  # (after a failed step: each refilled anew)
        host = self.runner.pool.host  # the prefix cache's host tier: its slots per group of layers
        sizes = (self._num_pages, c.part(CacheConfig), self._scheduler_config, readers, self._window_pages)
        pages = (*sizes, lora_slots, host.num_slots if host else (0, 0))
        self.replicas[:] = [Replica.new(*pages) for _ in range(c.data_parallel_size)]

    @property
    def scheduler(self) -> Scheduler:
        """The scheduler (with data parallelism, the first replica's: see `replicas`)."""
        return self.replicas[0].scheduler

    @property
    def block_manager(self) -> BlockManager:
        """The page bookkeeping (with data parallelism, the first replica's: see `replicas`)."""
        return self.replicas[0].block_manager

    def num_running(self) -> int:
        return self.replicas.num_running()

    def num_waiting(self) -> int:
        return self.replicas.num_waiting()

    def num_waiting_requests(self) -> int:
        return self.replicas.num_waiting_requests()

    def kv_cache_usage(self) -> float:
        """The share of the KV pages in use (the null pages not counted), over every replica."""
        return self.replicas.kv_cache_usage()

    def prefix_cache_counts(self) -> tuple[int, int]:
        """(prompt tokens looked up in the prefix cache, tokens found there), over every replica."""
        return self.replicas.prefix_cache_counts()

    def _finish_seq(self, replica: int, seq: Sequence) -> None:
        """Ends a sequence the scheduler did not end itself (a stop string, an abort, a failure)."""
        if seq.status is not SequenceStatus.FINISHED:
            self.replicas[replica].scheduler.finish(seq)
        if self.spec_decoder is not None:
            self.spec_decoder.forget(seq.seq_id)
