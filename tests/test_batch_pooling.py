"""Batch jobs of pooling models (issue 57): /v1/embeddings lines (OpenAI's Batch API shape), /v1/score and /classify
lines, bad lines recorded without stopping the job, and an embeddings job killed and resumed to the same results."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from pooling_models import TEXTS, WORDS

from jaxpage.entrypoints.batch import BatchError, run_batch
from jaxpage.entrypoints.llm import LLM


def line(custom_id: str, url: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def write_lines(path, lines) -> None:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))


def read_records(path) -> dict[str, dict]:
    records = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(records) == len({r["custom_id"] for r in records}), "a custom_id appears twice"
    return {r["custom_id"]: r for r in records}


@pytest.fixture(scope="module")
def embedder(bert_st_dir):
    return LLM(str(bert_st_dir[0]), max_num_seqs=4, max_num_batched_tokens=32)


def test_embeddings_lines_are_embed_and_bad_lines_are_recorded(embedder, tmp_path):
    lines = [
        line("one", "/v1/embeddings", input=TEXTS[0]),
        line("many", "/v1/embeddings", input=TEXTS, model=embedder.engine.config.model),
        line("ids", "/v1/embeddings", input=[embedder.get_tokenizer()(TEXTS[1]).input_ids]),
        line("scored", "/v1/score", text_1=TEXTS[0], text_2=TEXTS[1:3]),
        line("empty", "/v1/embeddings", input=""),
        line("generate", "/v1/completions", prompt="a"),
        line("classify", "/classify", input="a"),
        line("other", "/v1/embeddings", input="a", model="gpt"),
        "{not json",
    ]
    write_lines(tmp_path / "in.jsonl", lines)
    summary = run_batch(tmp_path / "in.jsonl", tmp_path / "out.jsonl", embedder, quiet=True)
    records = read_records(tmp_path / "out.jsonl")
    expected = np.array([o.outputs.embedding for o in embedder.embed(TEXTS)])
    many = records["many"]["response"]["body"]
    np.testing.assert_allclose([d["embedding"] for d in many["data"]], expected, atol=1e-5)
    np.testing.assert_allclose(records["one"]["response"]["body"]["data"][0]["embedding"], expected[0], atol=1e-5)
    np.testing.assert_allclose(records["ids"]["response"]["body"]["data"][0]["embedding"], expected[1], atol=1e-5)
    scores = [d["score"] for d in records["scored"]["response"]["body"]["data"]]
    np.testing.assert_allclose(scores, [o.outputs.score for o in embedder.score(TEXTS[0], TEXTS[1:3])], atol=1e-5)
    assert records["empty"]["response"]["status_code"] == 400
    message = records["generate"]["response"]["body"]["error"]["message"]
    assert "needs a model run by the generate runner" in message
    assert "needs a model that classifies" in records["classify"]["response"]["body"]["error"]["message"]
    assert records["other"]["response"]["status_code"] == 404
    assert records["line-9"]["error"]["code"] == "invalid_json"
    assert (summary.succeeded, summary.failed, summary.inputs) == (4, 5, 1 + 5 + 1 + 2)
    assert "inputs/s" in summary.describe()


def test_cross_encoder_lines_score_and_rerank(bert_classifiers, tmp_path):
    llm = LLM(str(bert_classifiers[1]), max_num_seqs=4, max_num_batched_tokens=32)
    write_lines(tmp_path / "in.jsonl", [line("r", "/v1/rerank", query=TEXTS[0], documents=TEXTS[1:], top_n=2)])
    run_batch(tmp_path / "in.jsonl", tmp_path / "out.jsonl", llm, quiet=True)
    results = read_records(tmp_path / "out.jsonl")["r"]["response"]["body"]["results"]
    expected = [o.outputs.score for o in llm.score(TEXTS[0], TEXTS[1:])]
    assert [r["index"] for r in results] == np.argsort(expected)[::-1][:2].tolist()
    with pytest.raises(BatchError, match="lora_modules: not for a pooling model"):
        run_batch(tmp_path / "in.jsonl", tmp_path / "o2.jsonl", llm, quiet=True, lora_modules=["x"])


def test_a_killed_embeddings_job_resumes_to_the_same_results(embedder, bert_st_dir, tmp_path):
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(WORDS, rng.integers(1, 12))) for _ in range(600)]
    write_lines(tmp_path / "in.jsonl", [line(f"e{i}", "/v1/embeddings", input=t) for i, t in enumerate(texts)])
    out = tmp_path / "out.jsonl"
    command = [sys.executable, "-m", "jaxpage", "batch", str(tmp_path / "in.jsonl"), str(out), "--model",
               str(bert_st_dir[0]), "--max-num-seqs", "1", "--max-num-batched-tokens", "32"]  # fmt: skip
    job = subprocess.Popen(command, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while (not out.exists() or out.read_text().count("\n") < 8) and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(job.pid, signal.SIGKILL)
    job.wait()
    written = out.read_text().count("\n")
    assert 8 <= written < len(texts), "the job should have been killed in the middle"
    with open(out, "a") as f:
        f.write('{"id": "batch_req_cut", "custom_id": "e')  # a record cut short by the kill
    summary = run_batch(tmp_path / "in.jsonl", out, embedder, quiet=True)
    assert summary.resumed == written and summary.succeeded == len(texts) - written
    records = read_records(out)
    assert set(records) == {f"e{i}" for i in range(len(texts))}
    expected = [o.outputs.embedding for o in embedder.embed(texts)]
    got = [records[f"e{i}"]["response"]["body"]["data"][0]["embedding"] for i in range(len(texts))]
    np.testing.assert_allclose(got, expected, atol=1e-5)
