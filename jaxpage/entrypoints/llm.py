"""LLM: offline generation over the engine, in vLLM's API (`LLM(model).generate(prompts, params)`), and a pooling
model's embeddings (`LLM(model, runner="pooling").embed(prompts)`)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Sequence

from tqdm import tqdm

from jaxpage.config import EngineConfig
from jaxpage.engine.llm_engine import LLMEngine
from jaxpage.engine.pooling_engine import PoolingEngine
from jaxpage.entrypoints.llm_pooling import PoolingMethods, per_prompt, prompt_list
from jaxpage.lora_request import LoRARequest
from jaxpage.models.pooling_model import engine_runner
from jaxpage.outputs import RequestOutput
from jaxpage.sampling_params import RequestOutputKind, SamplingParams
from jaxpage.sources import HubDownload
from jaxpage.tokenizers.tokenizer import encode_chat
from jaxpage.validation import fail

Prompt = str | dict


class LLM(PoolingMethods):
    """An engine with the convenience API: `generate`, `chat`, `generate_stream`.

    `LLM(model=None, **engine_args)`: model is an HF directory, a .gguf file, a jaxpage checkpoint or a Hugging Face
    Hub id (org/name, org/name:Q4_K_M, org/name/file.gguf; None: SmolLM2-135M-Instruct); engine_args are
    EngineConfig's fields (max_num_seqs, page_size, revision, ...). Prompts given no sampling params get the model's
    generation config's defaults (get_default_sampling_params).

    A pooling model (engine argument runner="pooling", or "auto" and an encoder or base-model architecture) gives
    embeddings instead: `embed`; its engine is a PoolingEngine, and generate and chat are refused.
    """

    def __init__(self, model: str | None = None, **engine_args):
        config = EngineConfig(model=model, **engine_args)
        self.runner = engine_runner(config.model, config.runner, HubDownload(config.revision, config.download_dir))
        self.engine = PoolingEngine(config) if self.runner == "pooling" else LLMEngine(config)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def _engine_for(self, method: str, runner: str):
        if self.runner != runner:
            raise ValueError(
                f"{method} needs a model run by the {runner} runner; this LLM's model runs on the {self.runner} runner "
                f"(engine argument runner={self.runner!r})"
            )
        return self.engine

    def get_default_sampling_params(self) -> SamplingParams:
        """What a prompt without sampling params gets (vLLM's name): the model's generation config's defaults
        (engine argument generation_config; jaxpage.models.generation_config), SamplingParams' own for the rest."""
        return self._engine_for("get_default_sampling_params", "generate").generation_defaults.sampling_params()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generates for every prompt (strings or {"prompt_token_ids": [...]}); outputs in prompt order.
        `lora_request`: the LoRA adapter of every prompt, or one per prompt (None: the base model), as vLLM's.

        All prompts are validated before any runs: a bad one raises ValueError and nothing is queued. A request
        that fails at run time comes back with finish_reason "error" and `error` set; the others are unharmed.
        """
        request_ids = self._add(prompts, sampling_params, lora_request, final_only=True)
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(request_ids), disable=not use_tqdm, desc="generate") as bar:
            for output in self._run(request_ids):
                if output.finished:
                    finished[output.request_id] = output
                    bar.update(1)
        return [finished[rid] for rid in request_ids]

    def generate_stream(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> Iterator[RequestOutput]:
        """Yields a RequestOutput (cumulative text and tokens) each time a request progresses; the last one of
        each request has finished=True. Closing the iterator early aborts what is still running."""
        request_ids = self._add(prompts, sampling_params, lora_request)
        yield from self._run(request_ids)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generates replies to one conversation ([{"role": ..., "content": ...}, ...]) or a list of them. Content
        is a string or OpenAI content parts ([{"type": "text", "text": ...}, ...]). Every conversation is checked
        and rendered before any runs: a bad one raises ValueError naming the message and field."""
        self._engine_for("chat", "generate")
        if self.engine.tokenizer is None:
            raise ValueError("chat needs the tokenizer, which skip_tokenizer_init leaves out")
        if isinstance(messages, list | tuple) and messages and all(isinstance(m, list | tuple) for m in messages):
            conversations = list(messages)
        else:
            conversations = [messages]
        prompts = [{"prompt_token_ids": encode_chat(self.engine.tokenizer, c)} for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def _add(self, prompts, sampling_params, lora_request=None, final_only: bool = False) -> list[str]:
        """Queues the prompts (all checked first), returning their request ids; final_only: the caller reads only
        final outputs (RequestOutputKind.FINAL_ONLY), so the engine builds no other."""
        self._engine_for("generate", "generate")
        prompts = prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        elif isinstance(sampling_params, list | tuple):
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling_params for {len(prompts)} prompts")
        else:
            fail("sampling_params", "a SamplingParams, a list of them, or None", sampling_params, wrong_type=True)
        loras = per_prompt("lora_request", lora_request, LoRARequest, len(prompts))
        if final_only:
            kind, default = RequestOutputKind.FINAL_ONLY, self.get_default_sampling_params()
            params = [  # (a p of another type is refused by name when its request is prepared)
                dataclasses.replace(default if p is None else p, output_kind=kind)
                if isinstance(p, SamplingParams | None)
                else p
                for p in params
            ]
        # Check (and tokenize) every request before queueing any: a bad one must not leave others queued.
        requests = [
            self.engine.prepare_request(self._next_id(), prompt, p, lora_request=lora)
            for prompt, p, lora in zip(prompts, params, loras, strict=True)
        ]
        self.engine.add_prepared_requests(requests)  # all or none (an id an engine user added meanwhile: none)
        return [request.request_id for request in requests]

    def _next_id(self) -> str:
        while self.engine.has_request(request_id := str(next(self._ids))):  # ids an engine user added
            pass
        return request_id

    def _run(self, request_ids: list[str]) -> Iterator[RequestOutput]:
        pending = set(request_ids)
        try:
            while pending:
                for output in self.engine.step():
                    if output.request_id in pending:
                        if output.finished:
                            pending.discard(output.request_id)
                        yield output
        finally:
            if pending:
                self.engine.abort_request(list(pending))
