"""A pooling model's server (issue 57): /v1/embeddings through the openai client with every input form and both
encodings, /v1/score, /v1/rerank and /classify against LLM's own methods, and each hostile input a clear 400."""

from __future__ import annotations

import base64
import re

import httpx
import numpy as np
import openai
import pytest
from live_server import LiveServer, free_port, start_jaxpage_serve
from pooling_models import TEXTS

from jaxpage import LLM, PoolingParams
from jaxpage.entrypoints.async_pooling import AsyncPoolingEngine
from jaxpage.entrypoints.pooling_server import create_pooling_app

ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=64)


def serve(llm: LLM, name: str):
    engine = AsyncPoolingEngine(llm.engine, max_waiting_requests=64).start()
    server = LiveServer(create_pooling_app(engine, name, max_body_bytes=1 << 20))
    return server, engine


def served(directory, name: str):
    """(the LLM of the model in `directory`, its live server's URL), until the module's tests end: one engine, which
    the server steps in its own thread."""
    llm = LLM(str(directory), **ENGINE)
    server, engine = serve(llm, name)
    yield llm, server.url
    server.stop()
    engine.shutdown()


@pytest.fixture(scope="module")
def embedder(bert_st_dir):
    yield from served(bert_st_dir[0], "tiny-embedder")


@pytest.fixture(scope="module")
def cross_encoder(bert_classifiers):
    yield from served(bert_classifiers[1], "tiny-reranker")


def decode(text: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(text), "<f4")


def test_openai_client_embeddings_with_every_input_form(embedder):
    llm, url = embedder
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    tokenizer = llm.get_tokenizer()
    ids = [tokenizer(t).input_ids for t in TEXTS]
    expected = np.array([o.outputs.embedding for o in llm.embed(TEXTS)])
    forms = {"text": TEXTS[0], "texts": TEXTS, "token ids": ids[0], "lists of token ids": ids}
    for form, given in forms.items():
        for encoding in ("float", "base64"):
            response = client.embeddings.create(model="tiny-embedder", input=given, encoding_format=encoding)
            rows = expected[:1] if form in ("text", "token ids") else expected
            # (the client hands a base64 embedding over as it came when the caller asked for base64)
            got = np.array([decode(d.embedding) if encoding == "base64" else d.embedding for d in response.data])
            np.testing.assert_allclose(got, rows, atol=1e-5, err_msg=f"{form}, {encoding}")
            assert [d.index for d in response.data] == list(range(len(rows)))
            tokens = len(ids[0]) if form in ("text", "token ids") else sum(map(len, ids))
            assert response.usage.prompt_tokens == response.usage.total_tokens == tokens
    raw = httpx.post(f"{url}/v1/embeddings", json={"input": "a dog", "encoding_format": "base64"}).json()
    np.testing.assert_allclose(decode(raw["data"][0]["embedding"]), expected[1], atol=1e-5)
    assert raw["model"] == "tiny-embedder" and raw["object"] == "list"


def test_embedding_model_scores_and_reranks_by_cosine(embedder):
    llm, url = embedder
    expected = [o.outputs.score for o in llm.score(TEXTS[0], TEXTS[1:])]
    scored = httpx.post(f"{url}/v1/score", json={"text_1": TEXTS[0], "text_2": TEXTS[1:]}).json()
    np.testing.assert_allclose([d["score"] for d in scored["data"]], expected, atol=1e-5)
    reranked = httpx.post(f"{url}/v1/rerank", json={"query": TEXTS[0], "documents": TEXTS[1:], "top_n": 2}).json()
    best = np.argsort(expected)[::-1][:2].tolist()
    assert [r["index"] for r in reranked["results"]] == best
    assert [r["document"]["text"] for r in reranked["results"]] == [TEXTS[1:][i] for i in best]


def test_cross_encoder_scores_reranks_and_refuses_embeddings(cross_encoder):
    llm, url = cross_encoder
    expected = [o.outputs.score for o in llm.score(TEXTS[0], TEXTS[1:])]
    scored = httpx.post(f"{url}/v1/score", json={"model": "tiny-reranker", "text_1": TEXTS[0], "text_2": TEXTS[1:]})
    assert scored.status_code == 200, scored.text
    np.testing.assert_allclose([d["score"] for d in scored.json()["data"]], expected, atol=1e-5)
    reranked = httpx.post(f"{url}/v1/rerank", json={"query": TEXTS[0], "documents": TEXTS[1:]}).json()
    scores = [r["relevance_score"] for r in reranked["results"]]
    assert scores == sorted(scores, reverse=True) and sorted(scores) == pytest.approx(sorted(expected), abs=1e-5)
    refused = httpx.post(f"{url}/v1/embeddings", json={"input": "a dog"})
    assert refused.status_code == 400 and "needs a model that embeds" in refused.json()["error"]["message"]


def test_classify_gives_each_inputs_label_and_probabilities(bert_classifiers):
    llm = LLM(str(bert_classifiers[3]), **ENGINE)
    server, engine = serve(llm, "tiny-classifier")
    try:
        expected = [o.outputs.probs for o in llm.classify(TEXTS[:2])]
        body = httpx.post(f"{server.url}/classify", json={"input": TEXTS[:2]}).json()
        np.testing.assert_allclose([d["probs"] for d in body["data"]], expected, atol=1e-5)
        labels = llm.engine.model.labels
        assert [d["label"] for d in body["data"]] == [labels[int(np.argmax(p))] for p in expected]
    finally:
        server.stop()
        engine.shutdown()


@pytest.mark.parametrize(
    "path, body, message",
    [
        ("/v1/embeddings", {"input": ""}, "input is an empty string"),
        ("/v1/embeddings", {"input": ["a", ""]}, r"input\[1\] is an empty string"),
        ("/v1/embeddings", {"input": []}, "input must be a text, or a non-empty list"),
        ("/v1/embeddings", {"input": [[]]}, r"input\[0\] must be a non-empty list of token ids"),
        ("/v1/embeddings", {"input": ["a"] * 10_000}, "input has 10000 items; at most 2048"),
        ("/v1/embeddings", {"input": [10**6]}, r"prompt_token_ids holds 1000000, not a token id in \[0, "),
        ("/v1/embeddings", {"input": [1, "a"]}, "input must be a text, a list of texts"),
        ("/v1/embeddings", {"input": "a", "dimensions": 0}, "dimensions must be an integer"),
        ("/v1/embeddings", {"input": "a", "dimensions": 4096}, "embeddings cannot be shortened"),
        ("/v1/embeddings", {"input": "a", "encoding_format": "int8"}, "encoding_format must be 'float' or 'base64'"),
        ("/v1/embeddings", {"input": "a", "temperature": 1}, "temperature is not a field of /v1/embeddings"),
        ("/v1/embeddings", {"input": "a", "model": "gpt-4"}, "model 'gpt-4' does not exist"),
        ("/v1/embeddings", {"input": "the sky " * 40}, "input is 82 tokens, more than the model's max_model_len of 48"),
        ("/v1/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_1 has 2 texts and text_2 3"),
        ("/v1/rerank", {"query": "", "documents": ["a"]}, "query must be a non-empty string"),
        ("/v1/rerank", {"query": "a", "documents": ["a"], "top_n": 0}, "top_n must be a positive integer"),
        ("/classify", {"input": "a"}, "/classify needs a model that classifies"),
        ("/v1/completions", {"prompt": "a"}, "needs a model run by the generate runner"),
        ("/v1/chat/completions", {"messages": []}, "needs a model run by the generate runner"),
    ],
)
def test_hostile_inputs_are_each_a_clear_400(embedder, path, body, message):
    _, url = embedder
    response = httpx.post(f"{url}{path}", json=body, timeout=60)
    status = 404 if "does not exist" in message else 400
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status
    assert re.search(message, error["message"]), error["message"]


def test_over_long_inputs_are_truncated_when_asked(embedder):
    llm, url = embedder
    text = "the sky " * 40
    response = httpx.post(f"{url}/v1/embeddings", json={"input": text, "truncate_prompt_tokens": 20}).json()
    (expected,) = llm.embed(text, PoolingParams(truncate_prompt_tokens=20))
    np.testing.assert_allclose(response["data"][0]["embedding"], expected.outputs.embedding, atol=1e-5)
    assert response["usage"]["prompt_tokens"] == 20


def test_jaxpage_serve_of_an_encoder_serves_embeddings(bert_st_dir):
    """The command line's way: `jaxpage serve DIR` sees a BertModel and serves it on the pooling runner."""
    port = free_port()
    process = start_jaxpage_serve([str(bert_st_dir[0]), "--port", str(port), "--max-num-batched-tokens", "64"], port)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        response = client.embeddings.create(model=str(bert_st_dir[0]), input=TEXTS[:2])
        expected = bert_st_dir[1].encode(TEXTS[:2])
        np.testing.assert_allclose([d.embedding for d in response.data], expected, atol=1e-5)
        with pytest.raises(openai.BadRequestError, match="needs a model run by the generate runner"):
            client.completions.create(model=str(bert_st_dir[0]), prompt="a")
    finally:
        process.terminate()
        process.wait(timeout=60)
