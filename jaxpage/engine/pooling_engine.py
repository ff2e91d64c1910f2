"""PoolingEngine: a pooling model's engine (vLLM's runner "pooling"): inputs in, packed steps, one vector per input
out. No KV pool: each input is one forward pass, whole, in a step of inputs laid end to end
(jaxpage.worker.packed_steps)."""

from __future__ import annotations

import collections
import dataclasses
import logging
import math

import numpy as np

from jaxpage.config import EngineConfig, LoadConfig
from jaxpage.config.pooler import PoolerConfig, read_pooler_config
from jaxpage.engine.prompt_tokens import prompt_tokens
from jaxpage.errors import ModelLoadError
from jaxpage.models.hf_loader import read_config_json
from jaxpage.models.loader import resolve_source, source_format
from jaxpage.models.pooling_model import load_pooling_model
from jaxpage.outputs import EmbeddingOutput, EmbeddingRequestOutput
from jaxpage.pooling_params import PoolingParams
from jaxpage.sources import HubDownload
from jaxpage.tokenizers.tokenizer import load_tokenizer
from jaxpage.validation import fail
from jaxpage.worker.packed_steps import pack, rows_for, take, token_buckets
from jaxpage.worker.pooling_runner import PoolingRunner

logger = logging.getLogger("jaxpage")

# Engine arguments that would change a pooling model's outputs and that the pooling engine does not implement:
# refused by name when set, never ignored.
GENERATION_ONLY_ARGS = ("quantization", "speculative_config", "enable_lora", "batch_invariant", "hf_overrides")


@dataclasses.dataclass
class PoolingRequest:
    request_id: str
    token_ids: list[int]
    params: PoolingParams


class PoolingEngine:
    """`add_request` checks and tokenizes an input; `step` runs the next packed step and gives back the outputs of
    the inputs it ran."""

    def __init__(self, config: EngineConfig):
        for name in GENERATION_ONLY_ARGS:
            if getattr(config, name) != EngineConfig.__dataclass_fields__[name].default:
                raise ValueError(
                    f"engine argument {name} is not supported by the pooling runner (got {getattr(config, name)!r})"
                )
        load = config.part(LoadConfig)
        path = resolve_source(load.model, HubDownload(load.revision, load.download_dir), load.load_format != "dummy")
        if source_format(path) != "hf":
            raise ModelLoadError(f"{path}: a pooling model is read from a Hugging Face directory (config.json)")
        hf = read_config_json(path)
        self.model = load_pooling_model(path, hf, load.dtype, load.load_format)
        self.pooler: PoolerConfig = read_pooler_config(path, self.model.is_encoder, hf)
        self.vocab_size = int(hf["vocab_size"])
        self.tokenizer = None
        if not load.skip_tokenizer_init:
            source, revision = load.tokenizer_source
            self.tokenizer = load_tokenizer(source, HubDownload(revision, load.download_dir))
        limit = min(self.model.max_positions, self.pooler.max_seq_length or math.inf)
        if config.max_model_len is not None and config.max_model_len > limit:
            raise ValueError(f"engine argument max_model_len {config.max_model_len} exceeds the model's {limit} tokens")
        self.max_model_len = config.max_model_len or int(limit)
        self.max_num_seqs = config.max_num_seqs
        self.buckets = token_buckets(max(config.max_num_batched_tokens, self.max_model_len))
        self.runner = PoolingRunner(self.model, self.pooler.pooling_type)
        self.prompt_prefix = dict(self.pooler.prompts).get(self.pooler.default_prompt_name, "")
        self.waiting: collections.deque[PoolingRequest] = collections.deque()
        self._queued_ids: set[str] = set()
        logger.info(
            "pooling model: %s pooling%s, max_model_len %d, steps of up to %d tokens",
            self.pooler.pooling_type,
            ", normalized" if self.pooler.normalize else "",
            self.max_model_len,
            self.buckets[-1],
        )

    @property
    def hidden_size(self) -> int:
        return self.model.hidden_size

    def prepare_request(self, request_id: str, prompt, params: PoolingParams | None = None) -> PoolingRequest:
        """The checked, tokenized input (not queued): ValueError naming what is wrong."""
        if not isinstance(request_id, str) or not request_id:
            fail("request_id", "a non-empty string", request_id, wrong_type=not isinstance(request_id, str))
        params = PoolingParams() if params is None else params
        if not isinstance(params, PoolingParams):
            fail("pooling_params", "a PoolingParams or None", params, wrong_type=True)
        params.validate()
        if params.dimensions is not None:
            self.pooler.check_dimensions(params.dimensions, self.hidden_size)
        _, token_ids = prompt_tokens(prompt, self.tokenizer, self.vocab_size, self.prompt_prefix)
        keep = params.truncate_prompt_tokens
        if keep is not None:
            token_ids = token_ids[-min(self.max_model_len if keep == -1 else keep, self.max_model_len) :]
        if len(token_ids) > self.max_model_len:
            raise ValueError(
                f"input is {len(token_ids)} tokens, more than the model's max_model_len of {self.max_model_len}; "
                "shorten it, or set truncate_prompt_tokens to keep its last tokens"
            )
        return PoolingRequest(request_id, token_ids, params)

    def add_prepared_requests(self, requests: list[PoolingRequest]) -> None:
        """Queues the requests, all or none: ValueError when an id is already queued, or given twice."""
        ids = [r.request_id for r in requests]
        taken = sorted(set(ids) & self._queued_ids) or sorted({i for i in ids if ids.count(i) > 1})
        if taken:
            raise ValueError(f"request_id {taken[0]!r} is already in use")
        self.waiting.extend(requests)
        self._queued_ids.update(ids)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._queued_ids

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting)

    def step(self) -> list[EmbeddingRequestOutput]:
        """Runs the next step: the oldest waiting inputs and every later one that fits beside them."""
        if not self.waiting:
            return []
        max_tokens, max_rows = self.buckets[-1], rows_for(self.buckets[-1], self.max_num_seqs)
        chosen = take([len(r.token_ids) for r in self.waiting], max_tokens, max_rows)
        requests = [self.waiting[i] for i in chosen]
        for index in reversed(chosen):
            del self.waiting[index]
        self._queued_ids.difference_update(r.request_id for r in requests)
        step = pack([r.token_ids for r in requests], self.buckets, self.max_num_seqs)
        pooled = self.runner.run(step)
        return [self._output(r, vector) for r, vector in zip(requests, pooled, strict=True)]

    def _output(self, request: PoolingRequest, vector: np.ndarray) -> EmbeddingRequestOutput:
        params = request.params
        if params.dimensions is not None:
            vector = vector[: params.dimensions]
        if self.pooler.normalize if params.normalize is None else params.normalize:
            vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
        return EmbeddingRequestOutput(request.request_id, EmbeddingOutput(vector.tolist()), request.token_ids)
