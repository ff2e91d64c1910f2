"""A request as it enters the engine: checked, tokenized and made into its sequences (LLMEngine.prepare_request).
Everything a caller sends is checked here, never inside a step: ValueError (ArgumentTypeError for a wrong type),
naming the field and the value, and nothing is queued."""

from __future__ import annotations

import itertools
import math
import threading
import time

import numpy as np

from jaxpage.config import EngineConfig
from jaxpage.engine.lora_adapters import LoRAAdapters
from jaxpage.engine.output_processor import Request
from jaxpage.engine.prompt_tokens import prompt_tokens
from jaxpage.lora_request import LoRARequest
from jaxpage.outputs import CompletionOutput, RequestMetrics
from jaxpage.sample.logits_controls import LogitsControls
from jaxpage.sampling_params import SamplingParams
from jaxpage.sequence import Sequence
from jaxpage.structured.grammar import GrammarCompiler
from jaxpage.tokenizers.tokenizer import IncrementalDetokenizer
from jaxpage.validation import check_number, fail


class InputProcessor:
    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        max_model_len: int,
        num_pages: int,
        config: EngineConfig,
        eos_token_ids: frozenset[int] = frozenset(),
        lora_adapters: LoRAAdapters | None = None,
        default_params: SamplingParams | None = None,
    ):
        """num_pages: a replica's pool, the null page included; config: the engine's (its page_size, and the seed
        of the seeds drawn for requests that bring none); eos_token_ids: what min_tokens holds back and grammars
        end with; lora_adapters: the LoRA adapters requests name (None: a request that names one is refused);
        default_params: what a request without sampling params gets (the model's generation config's defaults)."""
        self.default_params = default_params or SamplingParams()
        self.lora_adapters = lora_adapters or LoRAAdapters(None, 0, enabled=False)
        self.tokenizer = tokenizer  # None with skip_tokenizer_init
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.grammars = GrammarCompiler(tokenizer, vocab_size, list(eos_token_ids)) if tokenizer else None
        self.max_model_len = max_model_len
        self.page_size = config.page_size
        self.num_pages = num_pages
        self._seq_ids = itertools.count()
        self._seed_rng = np.random.default_rng(config.seed)
        self._ids_lock = threading.Lock()  # sequence ids and seeds: prepare may run on several threads at once

    def prepare(
        self,
        request_id: str,
        prompt: str | dict,
        sampling_params: SamplingParams | None = None,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> Request:
        """The checked and tokenized request (see LLMEngine.add_request for what is checked), not yet queued; its
        LoRA adapter read (on the caller's thread) the first time its id comes."""
        if not isinstance(request_id, str) or not request_id:
            fail("request_id", "a non-empty string", request_id, wrong_type=not isinstance(request_id, str))
        params = self.default_params if sampling_params is None else sampling_params
        if not isinstance(params, SamplingParams):
            fail("sampling_params", "a SamplingParams or None", params, wrong_type=True)
        bad_words, grammar = self._check_params(params)
        if arrival_time is not None:
            arrival_time = check_number("arrival_time", arrival_time, "a finite time in seconds", lambda t: t >= 0)
        text, token_ids = self._prompt_tokens(prompt)
        max_len = self.max_model_len
        if len(token_ids) >= max_len:
            raise ValueError(f"prompt is {len(token_ids)} tokens; max_model_len {max_len} leaves no room to generate")
        # One sequence's pages: the n samples share the prompt's pages and need not run at the same time.
        longest = min(len(token_ids) + (params.max_tokens or max_len), max_len)
        pages = math.ceil(longest / self.page_size)
        if pages > self.num_pages - 1:
            raise ValueError(
                f"request needs up to {pages} pages ({longest} tokens) but the KV pool has "
                f"{self.num_pages - 1}; lower max_tokens or enlarge the pool"
            )
        with self._ids_lock:
            seeds = [
                params.seed + index if params.seed is not None else int(self._seed_rng.integers(0, 2**31 - 1))
                for index in range(params.n)
            ]
            seqs = [
                Sequence(
                    next(self._seq_ids),
                    token_ids,
                    sampling_params=params,
                    seed=seed,
                    controls=LogitsControls.of(
                        params, self.vocab_size, self.eos_token_ids, bad_words, grammar.deep_copy() if grammar else None
                    ),
                )
                for seed in seeds
            ]
        self.lora_adapters.attach(seqs, lora_request)
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
            prompt_logprobs=None if params.prompt_logprobs is None else [None] * len(token_ids),
            lora_request=lora_request,
        )

    def _check_params(self, params: SamplingParams) -> tuple[list[list[int]], object | None]:
        """Checks the sampling params against this model and tokenizer: (the bad words' spellings as token ids, the
        grammar's compiled matcher or None)."""
        params.validate()
        vocab = self.vocab_size
        if params.top_k > vocab:
            fail("SamplingParams.top_k", f"at most the vocabulary size {vocab} (0 or -1: all tokens)", params.top_k)
        if any(t >= vocab for t in params.stop_token_ids):
            fail("SamplingParams.stop_token_ids", f"token ids in [0, {vocab})", params.stop_token_ids)
        for field, ids in (("allowed_token_ids", params.allowed_token_ids), ("logit_bias", params.logit_bias)):
            if ids and max(ids) >= vocab:
                fail(f"SamplingParams.{field}", f"token ids in [0, {vocab})", sorted(t for t in ids if t >= vocab))
        if self.tokenizer is None and params.stop:
            raise ValueError(
                "stop strings need the tokenizer, which skip_tokenizer_init leaves out: use stop_token_ids"
            )
        for field, used in (("bad_words", params.bad_words), ("structured_outputs", params.structured_outputs)):
            if self.tokenizer is None and used:
                raise ValueError(f"SamplingParams.{field} needs the tokenizer, which skip_tokenizer_init leaves out")
        bad_words = self._bad_word_token_ids(params.bad_words)
        # Compiles the grammar here, in the caller's thread (cached by spec): a spec that does not compile is
        # refused before anything is queued, and a slow one delays only its own request.
        grammar = self.grammars.matcher(params.structured_outputs) if params.structured_outputs else None
        return bad_words, grammar

    def _bad_word_token_ids(self, bad_words: list[str]) -> list[list[int]]:
        """Each bad word's spellings as token ids, as vLLM makes them: the word as it is and after a space (the
        same word mid-sentence), without special tokens; a spelling beyond the vocabulary is dropped."""
        spellings = []
        for word in bad_words:
            for text in dict.fromkeys((word, " " + word.lstrip())):
                ids = list(self.tokenizer(text, add_special_tokens=False).input_ids)
                if ids and max(ids) < self.vocab_size and ids not in spellings:
                    spellings.append(ids)
        return spellings

    def _prompt_tokens(self, prompt) -> tuple[str | None, list[int]]:
        return prompt_tokens(prompt, self.tokenizer, self.vocab_size)
