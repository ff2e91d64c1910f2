"""Scores of text pairs from a pooling model (LLM.score, the server's /v1/score and /v1/rerank): a cross-encoder (a
classification model of one label: rerankers) reads each pair as one input and gives its relevance (a sigmoid); an
embedding model embeds each text once and gives the cosine similarity of a pair's two embeddings."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from jaxpage.engine.pooling_engine import PoolingEngine, PoolingRequest
from jaxpage.outputs import PoolingRequestOutput
from jaxpage.pooling_params import PoolingParams


@dataclasses.dataclass(frozen=True)
class PairScoring:
    """The requests that score `pairs`, and `scores(outputs)`: each pair's (score, token ids) from those requests'
    outputs (in the requests' order)."""

    requests: list[PoolingRequest]
    scores: Callable[[list[PoolingRequestOutput]], list[tuple[float, list[int]]]]


def plan_pair_scoring(
    engine: PoolingEngine, pairs: list[tuple[str, str]], params: PoolingParams, new_id: Callable[[], str]
) -> PairScoring:
    """The requests (checked and tokenized: ValueError naming what is wrong) that score each (text_1, text_2)."""
    if engine.task == "classify":
        if engine.model.num_labels != 1:
            raise ValueError(
                f"scores need a cross-encoder (a classification model of one label) or an embedding model; this "
                f"model classifies into {engine.model.num_labels} labels"
            )
        requests = [engine.prepare_request(new_id(), a, dataclasses.replace(params), b) for a, b in pairs]
        return PairScoring(requests, lambda outputs: [(o.outputs.data[0], o.prompt_token_ids) for o in outputs])
    texts = list(dict.fromkeys(text for pair in pairs for text in pair))
    requests = [engine.prepare_request(new_id(), text, dataclasses.replace(params)) for text in texts]

    def cosines(outputs: list[PoolingRequestOutput]) -> list[tuple[float, list[int]]]:
        by_text = dict(zip(texts, outputs, strict=True))
        return [
            (
                cosine(by_text[a].outputs.data, by_text[b].outputs.data),
                by_text[a].prompt_token_ids + by_text[b].prompt_token_ids,
            )
            for a, b in pairs
        ]

    return PairScoring(requests, cosines)


def cosine(a: list[float], b: list[float]) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-12))
