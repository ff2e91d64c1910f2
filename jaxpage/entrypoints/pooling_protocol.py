"""The request and response bodies of a pooling model's endpoints, to jaxpage and back (the server's and `jaxpage
batch`'s):

    /v1/embeddings   OpenAI's: input (a text, texts, token ids, lists of token ids), encoding_format float or
                     base64 (little-endian float32), dimensions; vLLM's truncate_prompt_tokens and normalize
    /v1/score        vLLM's: text_1 against each of text_2 (or pairwise), the scores in order
    /v1/rerank       vLLM's (Jina's and Cohere's shape): query, documents, top_n; results by relevance, best first
    /classify        vLLM's: input (texts or token ids), each one's label and class probabilities

`parse_pooling_request(url, body)` gives the inputs and PoolingParams a body asks for (RequestError, a ValueError
naming the field, for anything invalid: a field these endpoints do not know included); `pooling_response_body` the
response of the outputs. Fields that change nothing (user, encoding of the response's id) are accepted.
"""

from __future__ import annotations

import base64
import dataclasses
import time

import numpy as np

from jaxpage.entrypoints.openai_api import RequestError
from jaxpage.outputs import PoolingRequestOutput
from jaxpage.pooling_params import PoolingParams
from jaxpage.validation import INT32_MAX, describe, is_int

EMBEDDINGS, SCORE, RERANK, CLASSIFY = "/v1/embeddings", "/v1/score", "/v1/rerank", "/classify"
POOLING_ENDPOINTS = (EMBEDDINGS, SCORE, RERANK, CLASSIFY)
MAX_INPUTS = 2048  # in one request (OpenAI's limit for /v1/embeddings)
FIELDS = {
    EMBEDDINGS: {"input", "encoding_format", "dimensions", "normalize"},
    SCORE: {"text_1", "text_2"},
    RERANK: {"query", "documents", "top_n", "return_documents"},
    CLASSIFY: {"input"},
}
COMMON_FIELDS = {"model", "user", "truncate_prompt_tokens"}
TASKS = {EMBEDDINGS: "embed", CLASSIFY: "classify", SCORE: None, RERANK: None}  # None: a cross-encoder or embedder


@dataclasses.dataclass(frozen=True)
class PoolingBody:
    """What a pooling endpoint's body asks for: `inputs` (prompts: texts or {"prompt_token_ids": ...}) for
    embeddings and classify, `pairs` (text, text) for score and rerank (rerank: the query with each document)."""

    url: str
    params: PoolingParams
    inputs: list = dataclasses.field(default_factory=list)
    pairs: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    encoding_format: str = "float"
    top_n: int | None = None
    return_documents: bool = True


def parse_pooling_request(url: str, body) -> PoolingBody:
    if url not in POOLING_ENDPOINTS:
        raise RequestError(f"url must be one of {', '.join(POOLING_ENDPOINTS)}, got {describe(url)}")
    if not isinstance(body, dict):
        raise RequestError(f"body must be a JSON object, got {describe(body)}")
    unknown = sorted(set(body) - FIELDS[url] - COMMON_FIELDS)
    if unknown:
        raise RequestError(f"{unknown[0]} is not a field of {url} (its fields: {', '.join(sorted(FIELDS[url]))})")
    truncate = body.get("truncate_prompt_tokens")
    try:
        params = PoolingParams(truncate_prompt_tokens=truncate)
        if url == EMBEDDINGS:
            params = PoolingParams(body.get("dimensions"), body.get("normalize"), truncate)
    except ValueError as e:
        raise RequestError(str(e).replace("PoolingParams.", "")) from None
    if url in (EMBEDDINGS, CLASSIFY):
        fmt = body.get("encoding_format", "float")
        if fmt not in ("float", "base64"):
            raise RequestError(f"encoding_format must be 'float' or 'base64', got {describe(fmt)}")
        return PoolingBody(url, params, inputs=_inputs(body.get("input")), encoding_format=fmt)
    if url == SCORE:
        first, second = _texts("text_1", body.get("text_1")), _texts("text_2", body.get("text_2"))
        if len(first) not in (1, len(second)):
            raise RequestError(f"text_1 has {len(first)} texts and text_2 {len(second)}: give one, or as many")
        pairs = [(first[0], t) for t in second] if len(first) == 1 else list(zip(first, second, strict=True))
        return PoolingBody(url, params, pairs=pairs)
    query = body.get("query")
    if not isinstance(query, str) or not query:
        raise RequestError(f"query must be a non-empty string, got {describe(query)}")
    documents = _texts("documents", body.get("documents"))
    top_n = body.get("top_n")
    if top_n is not None and (not is_int(top_n) or top_n < 1):
        raise RequestError(f"top_n must be a positive integer, got {describe(top_n)}")
    keep = body.get("return_documents", True)
    if not isinstance(keep, bool):
        raise RequestError(f"return_documents must be true or false, got {describe(keep)}")
    return PoolingBody(url, params, pairs=[(query, d) for d in documents], top_n=top_n, return_documents=keep)


def _inputs(value) -> list:
    """OpenAI's `input`: a text, a list of texts, a list of token ids, or a list of lists of token ids."""
    if isinstance(value, str):
        return [_text("input", value)]
    if not isinstance(value, list) or not value:
        raise RequestError(f"input must be a text, or a non-empty list of texts or token ids, got {describe(value)}")
    if len(value) > MAX_INPUTS:
        raise RequestError(f"input has {len(value)} items; at most {MAX_INPUTS} in one request")
    if all(is_int(t) for t in value):
        return [{"prompt_token_ids": _token_ids("input", value)}]
    if all(isinstance(t, str) for t in value):
        return [_text(f"input[{i}]", t) for i, t in enumerate(value)]
    if all(isinstance(t, list) for t in value):
        return [{"prompt_token_ids": _token_ids(f"input[{i}]", t)} for i, t in enumerate(value)]
    raise RequestError("input must be a text, a list of texts, a list of token ids or a list of lists of token ids")


def _token_ids(field: str, ids: list) -> list[int]:
    if not ids or not all(is_int(t) and 0 <= t <= INT32_MAX for t in ids):
        raise RequestError(f"{field} must be a non-empty list of token ids, got {describe(ids)}")
    return [int(t) for t in ids]


def _text(field: str, text: str) -> str:
    if not text:
        raise RequestError(f"{field} is an empty string; every input needs at least one token")
    return text


def _texts(field: str, value) -> list[str]:
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise RequestError(f"{field} must be a text or a non-empty list of texts, got {describe(value)}")
    if len(texts) > MAX_INPUTS:
        raise RequestError(f"{field} has {len(texts)} texts; at most {MAX_INPUTS} in one request")
    return [_text(f"{field}[{i}]", t) for i, t in enumerate(texts)]


def _usage(tokens: int) -> dict:
    return {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}


def embeddings_body(request: PoolingBody, outputs: list[PoolingRequestOutput], model: str) -> dict:
    def encode(vector: list[float]):
        if request.encoding_format == "float":
            return vector
        return base64.b64encode(np.asarray(vector, "<f4").tobytes()).decode()

    data = [{"object": "embedding", "index": i, "embedding": encode(o.outputs.data)} for i, o in enumerate(outputs)]
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return {"object": "list", "data": data, "model": model, "usage": _usage(tokens)}


def classify_body(request_id: str, outputs: list[PoolingRequestOutput], model: str, labels: tuple[str, ...]) -> dict:
    data = [
        {
            "index": i,
            "label": labels[int(np.argmax(o.outputs.data))],
            "probs": o.outputs.data,
            "num_classes": len(o.outputs.data),
        }
        for i, o in enumerate(outputs)
    ]
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return {"id": request_id, "object": "list", "created": int(time.time()), "model": model, "data": data,
            "usage": _usage(tokens)}  # fmt: skip


def score_body(request_id: str, scores: list[float], tokens: int, model: str) -> dict:
    data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
    return {"id": request_id, "object": "list", "created": int(time.time()), "model": model, "data": data,
            "usage": _usage(tokens)}  # fmt: skip


def rerank_body(request_id: str, request: PoolingBody, scores: list[float], tokens: int, model: str) -> dict:
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[: request.top_n]
    results = [
        {"index": i, "relevance_score": scores[i]}
        | ({"document": {"text": request.pairs[i][1]}} if request.return_documents else {})
        for i in order
    ]
    return {"id": request_id, "model": model, "usage": {"total_tokens": tokens}, "results": results}


def check_task(url: str, task: str) -> None:
    """RequestError unless a model of `task` ("embed" or "classify") serves `url`."""
    wanted = TASKS[url]
    if wanted is not None and wanted != task:
        use = "/classify, /v1/score or /v1/rerank" if task == "classify" else "/v1/embeddings, /v1/score or /v1/rerank"
        raise RequestError(
            f"{url} needs a model that {'embeds' if wanted == 'embed' else 'classifies'}; this model "
            f"{'classifies' if task == 'classify' else 'embeds'} (use {use})"
        )


def response_of(
    request: PoolingBody,
    request_id: str,
    outputs: list[PoolingRequestOutput],
    scores: list[tuple[float, list[int]]] | None,
    model: str,
    labels: tuple[str, ...],
) -> dict:
    """The response body of a pooling request: of its inputs' outputs, or for score and rerank of its pairs'
    (score, token ids)."""
    if request.url == EMBEDDINGS:
        return embeddings_body(request, outputs, model)
    if request.url == CLASSIFY:
        return classify_body(request_id, outputs, model, labels)
    values, tokens = [float(s) for s, _ in scores], sum(len(t) for _, t in scores)
    if request.url == SCORE:
        return score_body(request_id, values, tokens, model)
    return rerank_body(request_id, request, values, tokens, model)
