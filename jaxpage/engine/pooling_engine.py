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
from jaxpage.engine.prompt_tokens import token_ids as token_ids_of
from jaxpage.errors import ModelLoadError
from jaxpage.models.hf_loader import read_config_json
from jaxpage.models.loader import resolve_source, source_format
from jaxpage.models.pooling_model import load_pooling_model
from jaxpage.outputs import PoolingOutput, PoolingRequestOutput
from jaxpage.pooling_params import PoolingParams
from jaxpage.sources import HubDownload
from jaxpage.tokenizers.tokenizer import load_tokenizer
from jaxpage.validation import check_text, fail
from jaxpage.worker.packed_steps import WaitingInputs, max_step_tokens, pack
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
    token_type_ids: list[int] | None = None  # a text pair's, where the model reads token types (BERT)


class PoolingEngine:
    """`prepare_request` checks and tokenizes an input (`add_prepared_requests` queues them); `step` runs the next
    packed step and gives back the outputs of the inputs it ran. Its task is the model's: "embed" (an embedding per
    input) or "classify" (a sequence classification model: class probabilities per input; with one label, the
    relevance score of a cross-encoder's text pair)."""

    def __init__(self, config: EngineConfig):
        for name in GENERATION_ONLY_ARGS:
            if getattr(config, name) != EngineConfig.__dataclass_fields__[name].default:
                raise ValueError(
                    f"engine argument {name} is not supported by the pooling runner (got {getattr(config, name)!r})"
                )
        self.config = config
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
        self.max_step_tokens = max_step_tokens(config.max_num_batched_tokens, self.max_model_len)
        self.runner = PoolingRunner(self.model, self.pooler.pooling_type)
        self.task = "classify" if self.model.classify is not None else "embed"
        self.prompt_prefix = dict(self.pooler.prompts).get(self.pooler.default_prompt_name, "")
        self.waiting: WaitingInputs[PoolingRequest] = WaitingInputs()
        self._queued_ids: set[str] = set()
        logger.info(
            "pooling model: %s pooling%s, max_model_len %d, steps of up to %d tokens",
            self.pooler.pooling_type,
            ", normalized" if self.pooler.normalize else "",
            self.max_model_len,
            self.max_step_tokens,
        )

    @property
    def hidden_size(self) -> int:
        return self.model.hidden_size

    def prepare_request(
        self, request_id: str, prompt, params: PoolingParams | None = None, text_pair: str | None = None
    ) -> PoolingRequest:
        """The checked, tokenized input (not queued): ValueError naming what is wrong. text_pair: the second text of
        a cross-encoder's pair (prompt the first), tokenized together as the model's tokenizer pairs texts."""
        if not isinstance(request_id, str) or not request_id:
            fail("request_id", "a non-empty string", request_id, wrong_type=not isinstance(request_id, str))
        params = PoolingParams() if params is None else params
        if not isinstance(params, PoolingParams):
            fail("pooling_params", "a PoolingParams or None", params, wrong_type=True)
        params.validate()
        self._check_params_fit_task(params)
        keep = params.truncate_prompt_tokens
        keep = None if keep is None else min(self.max_model_len if keep == -1 else keep, self.max_model_len)
        token_types = None
        if text_pair is not None:
            token_ids, token_types = self._pair_tokens(prompt, text_pair, keep)
        else:
            _, token_ids = prompt_tokens(prompt, self.tokenizer, self.vocab_size, self.prompt_prefix)
            if keep is not None:
                token_ids = token_ids[-keep:]
        if len(token_ids) > self.max_model_len:
            raise ValueError(
                f"input is {len(token_ids)} tokens, more than the model's max_model_len of {self.max_model_len}; "
                "shorten it, or set truncate_prompt_tokens to keep its last tokens"
            )
        return PoolingRequest(request_id, token_ids, params, token_types)

    def _check_params_fit_task(self, params: PoolingParams) -> None:
        fields = ("dimensions", "normalize") if self.task == "classify" else ("activation",)
        for field in fields:
            if getattr(params, field) is not None:
                kind = "classifies" if self.task == "classify" else "embeds"
                raise ValueError(f"PoolingParams.{field} does not apply to this model, which {kind}; leave it unset")
        if params.dimensions is not None:
            self.pooler.check_dimensions(params.dimensions, self.hidden_size)

    def _pair_tokens(self, text: str, text_pair: str, keep: int | None) -> tuple[list[int], list[int] | None]:
        """A text pair's token ids and (where the model reads them) token type ids, cut to `keep` tokens by the
        tokenizer's longest-first truncation when asked."""
        if self.tokenizer is None:
            raise ValueError("a text pair needs the tokenizer, which skip_tokenizer_init leaves out")
        for name, value in (("text_1", text), ("text_2", text_pair)):
            if not isinstance(value, str) or not value:
                fail(name, "a non-empty string", value, wrong_type=not isinstance(value, str))
            check_text(name, value)
        truncation = dict(truncation="longest_first", max_length=keep) if keep is not None else {}
        try:
            encoded = self.tokenizer(text, text_pair, **truncation)
        except Exception as e:  # the tokenizer's own failure on these texts: refuse the pair, keep serving
            raise ValueError(f"the pair cannot be tokenized ({type(e).__name__}: {e})") from None
        token_ids = token_ids_of(list(encoded["input_ids"]), self.vocab_size)
        types = encoded.get("token_type_ids") if self.model.is_encoder else None
        return token_ids, None if types is None else [int(t) for t in types]

    def add_prepared_requests(self, requests: list[PoolingRequest]) -> None:
        """Queues the requests, all or none: ValueError when an id is already queued, or given twice."""
        ids = [r.request_id for r in requests]
        counts = collections.Counter(ids)
        taken = sorted(set(ids) & self._queued_ids) or sorted(i for i, n in counts.items() if n > 1)
        if taken:
            raise ValueError(f"request_id {taken[0]!r} is already in use")
        for request in requests:
            self.waiting.add(request, len(request.token_ids))
        self._queued_ids.update(ids)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._queued_ids

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting)

    def step(self) -> list[PoolingRequestOutput]:
        """Runs the next step: the oldest waiting input and those that fit beside it (packed_steps.WaitingInputs)."""
        if not self.waiting:
            return []
        requests, plan = self.waiting.take(self.max_step_tokens, self.max_num_seqs)
        self._queued_ids.difference_update(r.request_id for r in requests)
        token_types = [r.token_type_ids for r in requests]
        try:
            step = pack([r.token_ids for r in requests], plan, self.max_num_seqs, token_types)
            pooled = self.runner.run(step)
        except Exception as e:  # the step's requests fail with it; the engine goes on
            logger.exception("a pooling step of %d inputs failed", len(requests))
            error = f"{type(e).__name__}: {e}"
            return [PoolingRequestOutput(r.request_id, PoolingOutput([]), r.token_ids, error=error) for r in requests]
        return [self._output(r, vector) for r, vector in zip(requests, pooled, strict=True)]

    def abort_request(self, request_ids) -> None:
        """Drops the waiting requests of these ids (unknown ids: nothing to do)."""
        ids = {request_ids} if isinstance(request_ids, str) else set(request_ids)
        if ids & self._queued_ids:
            self.waiting.remove(lambda r: r.request_id in ids)
            self._queued_ids -= ids

    @property
    def num_waiting_requests(self) -> int:
        return len(self.waiting)

    def _output(self, request: PoolingRequest, vector: np.ndarray) -> PoolingRequestOutput:
        """An input's output from its row of the step: an embedding cut to its dimensions and normalized as asked,
        or a classifier's logits through its activation."""
        params = request.params
        if self.task == "classify":
            if params.activation is not False:
                vector = class_probabilities(vector, self.model.problem_type)
        else:
            if params.dimensions is not None:
                vector = vector[: params.dimensions]
            if self.pooler.normalize if params.normalize is None else params.normalize:
                vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
        return PoolingRequestOutput(request.request_id, PoolingOutput(vector.tolist()), request.token_ids)


def class_probabilities(logits: np.ndarray, problem_type: str | None) -> np.ndarray:
    """A classifier's logits [num_labels] as probabilities, as vLLM and sentence-transformers' CrossEncoder take them:
    a sigmoid for one label (a relevance score) or a multi-label model, else a softmax over the labels."""
    logits = logits.astype(np.float64)
    if len(logits) == 1 or problem_type == "multi_label_classification":
        return (1 / (1 + np.exp(-logits))).astype(np.float32)
    exp = np.exp(logits - logits.max())
    return (exp / exp.sum()).astype(np.float32)
