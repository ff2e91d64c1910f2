"""LLM's methods for pooling models, in vLLM's API: `embed`, `classify` and `score` (jaxpage.entrypoints.llm.LLM has
them; its engine is then a PoolingEngine), and the prompt-list checks LLM's methods share."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from tqdm import tqdm

from jaxpage.engine.pair_scoring import plan_pair_scoring
from jaxpage.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from jaxpage.pooling_params import PoolingParams
from jaxpage.validation import fail

Prompt = str | dict


class PoolingMethods:
    """embed, classify and score over `self.engine` (a PoolingEngine, which `self._engine_for` checks)."""

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = False,
    ) -> list[EmbeddingRequestOutput]:
        """An embedding of every prompt (strings or {"prompt_token_ids": [...]}), in prompt order (vLLM's LLM.embed).
        `pooling_params`: one for every prompt, or one each (dimensions, normalize, truncate_prompt_tokens);
        `truncate_prompt_tokens` sets theirs where they leave it unset. All prompts are checked before any runs: a bad
        one raises ValueError and nothing is queued."""
        self._pooling_engine("embed", "embed")
        outputs = self._pool(prompt_list(prompts), pooling_params, truncate_prompt_tokens, use_tqdm, "embed")
        return [EmbeddingRequestOutput.from_base(output) for output in outputs]

    def classify(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = False,
    ) -> list[ClassificationRequestOutput]:
        """A sequence classification model's class probabilities for every prompt, in the order of its labels
        (`LLM.engine.model.labels`), in prompt order (vLLM's LLM.classify). PoolingParams(activation=False): the
        logits instead."""
        self._pooling_engine("classify", "classify")
        outputs = self._pool(prompt_list(prompts), pooling_params, truncate_prompt_tokens, use_tqdm, "classify")
        return [ClassificationRequestOutput.from_base(output) for output in outputs]

    def score(
        self,
        data_1: str | Sequence[str],
        data_2: str | Sequence[str],
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = False,
        pooling_params: PoolingParams | None = None,
    ) -> list[ScoringRequestOutput]:
        """Scores of text pairs (vLLM's LLM.score): data_1's one text against each of data_2's, or data_1[i] against
        data_2[i]. A cross-encoder (a classification model of one label: rerankers) reads each pair as one input and
        gives its relevance (a sigmoid); an embedding model gives the cosine similarity of the two texts'
        embeddings."""
        engine = self._pooling_engine("score", None)
        params = _with_truncation(pooling_params or PoolingParams(), truncate_prompt_tokens)
        plan = plan_pair_scoring(engine, score_pairs(data_1, data_2), params, self._next_id)
        outputs = self._run_pooling(plan.requests, use_tqdm, "score")
        return [
            ScoringRequestOutput(self._next_id(), ScoringOutput(float(score)), tokens)
            for score, tokens in plan.scores(outputs)
        ]

    def _pooling_engine(self, method: str, task: str | None):
        """The PoolingEngine, when this LLM's model is a pooling model of `task` (None: either)."""
        engine = self._engine_for(method, "pooling")
        if task is not None and engine.task != task:
            does = "classifies (use classify or score)" if engine.task == "classify" else "embeds (use embed or score)"
            wanted = {"embed": "embeds", "classify": "classifies"}[task]
            raise ValueError(f"{method} needs a model that {wanted}; this model {does}")
        return engine

    def _pool(self, prompts, pooling_params, truncate_prompt_tokens, use_tqdm, desc) -> list[PoolingRequestOutput]:
        engine = self.engine
        params = per_prompt("pooling_params", pooling_params, PoolingParams, len(prompts))
        params = [_with_truncation(p or PoolingParams(), truncate_prompt_tokens) for p in params]
        requests = [engine.prepare_request(self._next_id(), pr, p) for pr, p in zip(prompts, params, strict=True)]
        return self._run_pooling(requests, use_tqdm, desc)

    def _run_pooling(self, requests, use_tqdm: bool, desc: str) -> list[PoolingRequestOutput]:
        """Queues the prepared requests and steps until each has its output; outputs in the requests' order."""
        engine = self.engine
        engine.add_prepared_requests(requests)
        finished: dict[str, PoolingRequestOutput] = {}
        with tqdm(total=len(requests), disable=not use_tqdm, desc=desc, unit="input") as bar:
            while engine.has_unfinished_requests():
                outputs = engine.step()
                finished.update((output.request_id, output) for output in outputs)
                bar.update(len(outputs))
        failed = next((o for o in finished.values() if o.error is not None), None)
        if failed is not None:
            raise RuntimeError(f"request {failed.request_id} failed in its step: {failed.error}")
        return [finished[request.request_id] for request in requests]


def _with_truncation(params: PoolingParams, truncate_prompt_tokens: int | None) -> PoolingParams:
    """A copy of params whose truncate_prompt_tokens is the call's where params leave it unset."""
    params = dataclasses.replace(params)
    if params.truncate_prompt_tokens is None:
        params.truncate_prompt_tokens = truncate_prompt_tokens
        params.validate()
    return params


def score_pairs(data_1, data_2) -> list[tuple[str, str]]:
    """(text_1, text_2) pairs as vLLM's LLM.score makes them: one text of data_1 against each of data_2, else
    data_1[i] against data_2[i] (of the same length)."""
    first = [data_1] if isinstance(data_1, str) else data_1
    second = [data_2] if isinstance(data_2, str) else data_2
    for name, texts in (("data_1", first), ("data_2", second)):
        if not isinstance(texts, list | tuple) or not texts or not all(isinstance(t, str) for t in texts):
            fail(name, "a text or a non-empty list of texts", texts, wrong_type=not isinstance(texts, list | tuple))
    if len(first) == 1:
        return [(first[0], text) for text in second]
    if len(first) != len(second):
        raise ValueError(f"data_1 has {len(first)} texts and data_2 {len(second)}: give one text, or as many as data_2")
    return list(zip(first, second, strict=True))


def prompt_list(prompts) -> list:
    """A prompt or a list of prompts as a non-empty list."""
    if isinstance(prompts, str | dict):
        return [prompts]
    if not isinstance(prompts, list | tuple):
        fail("prompts", "a prompt or a list of prompts", prompts, wrong_type=True)
    if not prompts:
        raise ValueError("no prompts given")
    return list(prompts)


def per_prompt(name: str, value, kind: type, num_prompts: int) -> list:
    """An argument given once for every prompt, or as a list of one per prompt (None items allowed), as a list."""
    if value is None or isinstance(value, kind):
        return [value] * num_prompts
    if not isinstance(value, list | tuple) or not all(v is None or isinstance(v, kind) for v in value):
        fail(name, f"a {kind.__name__}, a list of them (or None), or None", value, wrong_type=True)
    if len(value) != num_prompts:
        raise ValueError(f"{len(value)} {name}s for {num_prompts} prompts")
    return list(value)
