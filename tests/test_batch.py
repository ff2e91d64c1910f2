"""Batch jobs (`jaxpage batch`, `jaxpage.entrypoints.batch.run_batch`): OpenAI batch lines in, one record per request
out, bad lines recorded without stopping the job, and a killed job resumed to the same results."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from tiny_models import TINY_ENGINE, cli_options

from jaxpage.entrypoints.batch import BatchError, run_batch
from jaxpage.entrypoints.cli import main
from jaxpage.entrypoints.llm import LLM
from jaxpage.sampling_params import SamplingParams


def completion_line(custom_id: str, prompt, **body) -> dict:
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0} | body
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body}


def write_lines(path, lines) -> None:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))


def read_records(path) -> dict[str, dict]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    ids = [r["custom_id"] for r in records]
    assert len(ids) == len(set(ids)), "a custom_id appears twice"
    return {r["custom_id"]: r for r in records}


def choices(record: dict) -> list:
    return [(c["text"], c["finish_reason"]) for c in record["response"]["body"]["choices"]]


@pytest.fixture(scope="module")
def tiny_llm(tiny_dir):
    return LLM(tiny_dir, **TINY_ENGINE)


PROMPTS = [[5, 9, 13], list(range(10, 40)), [77], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]]


def test_completions_match_generate(tiny_llm, tmp_path):
    lines = [completion_line(f"req-{i}", p) for i, p in enumerate(PROMPTS)]
    lines.append(completion_line("two", PROMPTS[0], n=2, temperature=0.8, seed=3, logprobs=2))
    write_lines(tmp_path / "in.jsonl", lines)
    summary = run_batch(tmp_path / "in.jsonl", tmp_path / "out.jsonl", tiny_llm, quiet=True)
    assert (summary.requests, summary.succeeded, summary.failed, summary.resumed) == (5, 5, 0, 0)
    records = read_records(tmp_path / "out.jsonl")
    assert set(records) == {f"req-{i}" for i in range(4)} | {"two"}
    greedy = tiny_llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=6))
    for i, expected in enumerate(greedy):
        record = records[f"req-{i}"]
        assert record["error"] is None and record["response"]["status_code"] == 200
        body = record["response"]["body"]
        assert body["object"] == "text_completion"
        assert choices(record) == [(expected.outputs[0].text, expected.outputs[0].finish_reason)]
        usage = body["usage"]
        completion_tokens = len(expected.outputs[0].token_ids)  # 6, or fewer where the random model emits EOS
        assert usage["prompt_tokens"] == len(PROMPTS[i]) and usage["completion_tokens"] == completion_tokens
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    two = records["two"]["response"]["body"]["choices"]
    assert [c["index"] for c in two] == [0, 1]
    logprobs = two[0]["logprobs"]
    num_tokens = len(logprobs["tokens"])  # 6, or fewer where the random model emits EOS
    assert num_tokens == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"])
    assert num_tokens == 6 or (1 <= num_tokens < 6 and two[0]["finish_reason"] == "stop")
    assert all(len(top) <= 2 for top in logprobs["top_logprobs"]) and all(lp <= 0 for lp in logprobs["token_logprobs"])


BAD_LINES = {
    "not-json": ('{"custom_id": "x", "url": ', "line-1", None, "invalid_json"),
    "no-custom-id": ({"method": "POST", "url": "/v1/completions", "body": {"prompt": [1]}}, "line-2", None, None),
    "unknown-url": ({"custom_id": "u", "method": "POST", "url": "/v1/images", "body": {}}, "u", 400, "url"),
    "pooling-url": (
        {"custom_id": "pool", "method": "POST", "url": "/v1/embeddings", "body": {"input": "a"}},
        "pool",
        400,
        "needs a model run by the pooling runner",
    ),
    "method": ({**completion_line("m", [1]), "method": "GET"}, "m", 400, "method must be POST"),
    "temperature": (completion_line("t", [1], temperature="hot"), "t", 400, "temperature must be a number"),
    "n": (completion_line("n", [1], n=0), "n", 400, "n must be an integer >= 1"),
    "prompt-type": (completion_line("p", {"text": "hi"}), "p", 400, "prompt must be"),
    "too-long": (completion_line("long", list(range(1, 90)) * 2), "long", 400, "max_model_len 128"),
    "token-id": (completion_line("vocab", [1, 500]), "vocab", 400, "not a token id"),
    "messages": (
        {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": "hi"}},
        "c",
        400,
        "messages must be",
    ),
    "stream": (completion_line("s", [1], stream=True), "s", 400, "stream"),
}


def test_bad_lines_get_error_records_and_the_job_goes_on(tiny_llm, tmp_path):
    lines = [line for line, *_ in BAD_LINES.values()]
    lines += [completion_line("good", [5, 9, 13]), completion_line("good", [7]), ""]  # a repeat, an empty line
    write_lines(tmp_path / "in.jsonl", lines)
    summary = run_batch(tmp_path / "in.jsonl", tmp_path / "out.jsonl", tiny_llm, quiet=True)
    assert (summary.requests, summary.succeeded, summary.failed) == (len(BAD_LINES) + 2, 1, len(BAD_LINES) + 1)
    records = read_records(tmp_path / "out.jsonl")
    for name, (_, custom_id, status, message) in BAD_LINES.items():
        record = records[custom_id]
        if status is None:  # not a request at all: the record's error says why
            assert record["response"] is None and record["error"]["message"], name
            assert message is None or record["error"]["code"] == message, name
        else:
            assert record["error"] is None and record["response"]["status_code"] == status, name
            assert message in record["response"]["body"]["error"]["message"], name
    assert records["good"]["response"]["status_code"] == 200
    repeat = records[f"line-{len(BAD_LINES) + 2}"]
    assert repeat["error"]["code"] == "duplicate_custom_id" and "'good'" in repeat["error"]["message"]


def test_a_rerun_skips_what_is_done_and_repairs_a_cut_line(tiny_llm, tmp_path):
    write_lines(tmp_path / "in.jsonl", [completion_line(f"r{i}", p) for i, p in enumerate(PROMPTS)] + ["{bad"])
    run_batch(tmp_path / "in.jsonl", tmp_path / "full.jsonl", tiny_llm, quiet=True)
    full = (tmp_path / "full.jsonl").read_text().splitlines()
    # A job that wrote two records and was cut off in the middle of the third.
    (tmp_path / "out.jsonl").write_text(full[0] + "\n" + full[1] + "\n" + full[2][:40])
    summary = run_batch(tmp_path / "in.jsonl", tmp_path / "out.jsonl", tiny_llm, quiet=True)
    assert (summary.resumed, summary.succeeded + summary.failed) == (2, 3)
    records, expected = read_records(tmp_path / "out.jsonl"), read_records(tmp_path / "full.jsonl")
    assert set(records) == set(expected) == {"r0", "r1", "r2", "r3", "line-5"}
    for custom_id, record in records.items():
        if record["response"] is not None:
            assert choices(record) == choices(expected[custom_id])
    assert run_batch(tmp_path / "in.jsonl", tmp_path / "out.jsonl", tiny_llm, quiet=True).resumed == 5


def test_the_job_itself_failing_is_a_batch_error(tiny_llm, tmp_path):
    with pytest.raises(BatchError, match="cannot read the input"):
        run_batch(tmp_path / "missing.jsonl", tmp_path / "out.jsonl", tiny_llm, quiet=True)
    write_lines(tmp_path / "in.jsonl", [completion_line("a", [1])])
    (tmp_path / "out.jsonl").write_text("not a record\n")
    with pytest.raises(BatchError, match="not a batch output record"):
        run_batch(tmp_path / "in.jsonl", tmp_path / "out.jsonl", tiny_llm, quiet=True)


def batch_command(tiny_dir, input_path, output_path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "jaxpage",
        "batch",
        str(input_path),
        str(output_path),
        "--model",
        tiny_dir,
        *cli_options(TINY_ENGINE),
        "--quiet",
    ]


def test_a_killed_job_resumes_to_the_same_results(tiny_dir, tmp_path):
    lines = [
        completion_line(f"k{i}", [(7 * i + j) % 90 + 1 for j in range(5 + i % 7)], max_tokens=24) for i in range(40)
    ]
    write_lines(tmp_path / "in.jsonl", lines)
    subprocess.run(batch_command(tiny_dir, tmp_path / "in.jsonl", tmp_path / "whole.jsonl"), check=True, timeout=600)
    out = tmp_path / "out.jsonl"
    job = subprocess.Popen(batch_command(tiny_dir, tmp_path / "in.jsonl", out), stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while (not out.exists() or out.read_text().count("\n") < 8) and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(job.pid, signal.SIGKILL)
    job.wait()
    written = out.read_text().count("\n")
    assert 8 <= written < 40, "the job should have been killed in the middle"
    result = subprocess.run(batch_command(tiny_dir, tmp_path / "in.jsonl", out), capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert f"{written} already done" in result.stderr
    records, whole = read_records(out), read_records(tmp_path / "whole.jsonl")
    assert set(records) == set(whole) == {f"k{i}" for i in range(40)}
    assert all(choices(records[k]) == choices(whole[k]) for k in whole)


def run_cli(command: list[str], capsys) -> tuple[int, str]:
    """`jaxpage ...` (batch_command's arguments) run in this process, as the command does: (exit status, stderr)."""
    status = main(command[3:])
    return status, capsys.readouterr().err


def test_cli_exit_code_is_nonzero_only_when_the_job_cannot_run(tiny_dir, tmp_path, capsys):
    status, stderr = run_cli(batch_command(tiny_dir, tmp_path / "none.jsonl", tmp_path / "o.jsonl"), capsys)
    assert status == 2 and "cannot read the input" in stderr
    write_lines(tmp_path / "in.jsonl", ["{", completion_line("ok", [1, 2])])
    status, stderr = run_cli(batch_command(tiny_dir, tmp_path / "in.jsonl", tmp_path / "o.jsonl"), capsys)
    assert status == 0 and "1 succeeded, 1 failed" in stderr


def test_cli_speculative_config_gives_the_same_greedy_results(tiny_dir, tmp_path, capsys):
    """`jaxpage batch --speculative-config JSON`: the same greedy completions as without, and the speculative
    counters in the summary line."""
    lines = [completion_line(f"r{i}", (p * 8)[:24], max_tokens=24) for i, p in enumerate(PROMPTS)]
    write_lines(tmp_path / "in.jsonl", lines)
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
    results = {}
    for name, extra in (("plain", []), ("spec", ["--speculative-config", spec])):
        out = tmp_path / f"{name}.jsonl"
        status, stderr = run_cli(batch_command(tiny_dir, tmp_path / "in.jsonl", out) + extra, capsys)
        assert status == 0, stderr
        assert ("speculative decoding:" in stderr) == (name == "spec"), stderr
        results[name] = {k: choices(r) for k, r in read_records(out).items()}
    assert results["spec"] == results["plain"] and len(results["plain"]) == len(PROMPTS)


def test_cli_parallel_layouts_give_the_same_greedy_results(tiny_dir, tmp_path, capsys):
    """`jaxpage batch --tensor-parallel-size 2` and `--data-parallel-size 2` over the simulated devices
    (tests/conftest.py): the same greedy completions as one device; a size the devices cannot hold is refused with a
    clear message."""
    lines = [completion_line(f"r{i}", p, max_tokens=12) for i, p in enumerate(PROMPTS)]
    write_lines(tmp_path / "in.jsonl", lines)
    results = {}
    for name, options in (
        ("one", []),
        ("tp2", ["--tensor-parallel-size", "2"]),
        ("dp2", ["--data-parallel-size", "2"]),
    ):
        out = tmp_path / f"{name}.jsonl"
        status, stderr = run_cli(batch_command(tiny_dir, tmp_path / "in.jsonl", out) + options, capsys)
        assert status == 0, stderr
        results[name] = {k: choices(r) for k, r in read_records(out).items()}
    assert results["tp2"] == results["dp2"] == results["one"] and len(results["one"]) == len(PROMPTS)
    command = batch_command(tiny_dir, tmp_path / "in.jsonl", tmp_path / "x.jsonl") + ["--tensor-parallel-size", "16"]
    status, stderr = run_cli(command, capsys)
    assert status == 2 and "tensor_parallel_size 16 needs 16 devices" in stderr and "Traceback" not in stderr


def test_default_model_chat_and_completion(smollm2_path, tmp_path):
    llm = LLM(None, max_model_len=256, max_num_seqs=2)
    chat = {
        "custom_id": "chat",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "messages": [{"role": "user", "content": "What is 2 + 2?"}],
            "max_completion_tokens": 8,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 2,
        },
    }
    text = {
        "custom_id": "text",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"prompt": "The capital of France is", "max_tokens": 5, "temperature": 0, "stop": ["\n"]},
    }
    write_lines(tmp_path / "in.jsonl", [chat, text])
    run_batch(tmp_path / "in.jsonl", tmp_path / "out.jsonl", llm, quiet=True)
    records = read_records(tmp_path / "out.jsonl")
    greedy = SamplingParams(temperature=0, max_tokens=8)
    reply = llm.chat([{"role": "user", "content": "What is 2 + 2?"}], greedy)[0].outputs[0]
    body = records["chat"]["response"]["body"]
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": reply.text}
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == len(reply.token_ids) and all(len(c["top_logprobs"]) == 2 for c in content)
    assert "".join(c["token"] for c in content).strip()
    expected = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=5, stop=["\n"]))
    assert records["text"]["response"]["body"]["choices"][0]["text"] == expected[0].outputs[0].text
