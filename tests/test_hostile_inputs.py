"""Hostile input: every bad value is refused where it enters, by name; one failing request never harms another.

The engine here is a tiny random model with SmolLM2's full vocabulary (49152) and tokenizer, so text prompts and
chat templates run end to end. After each group of attacks the same engine must still serve a fixed greedy request
with unchanged tokens, with no request left and every page free.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxpage.config import EngineConfig
from jaxpage.entrypoints.batch import run_batch
from jaxpage.entrypoints.llm import LLM
from jaxpage.sampling_params import SamplingParams
from jaxpage.validation import describe

VOCAB = 49152
ENGINE = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, page_size=8)
FIXED = ({"prompt_token_ids": [5, 900, 13, 2001, 40]}, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))


@pytest.fixture(scope="module")
def llm(full_vocab_dir):
    return LLM(full_vocab_dir, **ENGINE)


@pytest.fixture(scope="module")
def fixed_tokens(llm):
    return llm.generate(*FIXED)[0].outputs[0].token_ids


def assert_unharmed(llm, fixed_tokens) -> None:
    """Nothing left in the engine, every page free of references, the fixed greedy request unchanged."""
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_used_pages == 0
    engine.block_manager.check_invariants()
    assert llm.generate(*FIXED)[0].outputs[0].token_ids == fixed_tokens
    assert engine.block_manager.num_used_pages == 0


def assert_refused_by_name(error: pytest.ExceptionInfo, field: str, value) -> None:
    message = str(error.value)
    assert field in message, message
    assert describe(value) in message, message


# ----- SamplingParams: refused when built, by field and value -----

BAD_SAMPLING = [
    ("n", 0), ("n", -1), ("n", 129), ("n", 2.0), ("n", True), ("n", "2"), ("n", None),
    ("temperature", -0.1), ("temperature", math.nan), ("temperature", math.inf), ("temperature", -math.inf),
    ("temperature", 1e39), ("temperature", "1"), ("temperature", True), ("temperature", None), ("temperature", [1]),
    ("top_p", 0.0), ("top_p", -1.0), ("top_p", 1.01), ("top_p", math.nan), ("top_p", "0.5"), ("top_p", False),
    ("top_k", -2), ("top_k", 2**31), ("top_k", 1.5), ("top_k", True), ("top_k", "5"), ("top_k", None),
    ("min_p", -0.1), ("min_p", 1.5), ("min_p", math.nan), ("min_p", "0"), ("min_p", True),
    ("seed", 1.5), ("seed", "7"), ("seed", True), ("seed", [1]),
    ("max_tokens", 0), ("max_tokens", -5), ("max_tokens", 2.0), ("max_tokens", True), ("max_tokens", "16"),
    ("stop", ""), ("stop", [""]), ("stop", ["ok", ""]), ("stop", 5), ("stop", {"a": 1}), ("stop", [1, 2]),
    ("stop", ["\ud800"]), ("stop", [None]), ("stop", b"stop"),
    ("stop_token_ids", 5), ("stop_token_ids", [-1]), ("stop_token_ids", [2**31]), ("stop_token_ids", [1.0]),
    ("stop_token_ids", [True]), ("stop_token_ids", "12"), ("stop_token_ids", {"a": 1}),
    ("ignore_eos", 1), ("ignore_eos", "yes"), ("ignore_eos", None),
    ("logprobs", -1), ("logprobs", 21), ("logprobs", 2.5), ("logprobs", True), ("logprobs", "3"),
    ("skip_special_tokens", 0), ("skip_special_tokens", "no"),
]  # fmt: skip


@pytest.mark.parametrize(("field", "value"), BAD_SAMPLING, ids=[f"{f}={v!r}" for f, v in BAD_SAMPLING])
def test_bad_sampling_params_are_refused_by_name(field, value):
    with pytest.raises(ValueError) as error:
        SamplingParams(**{field: value})
    assert_refused_by_name(error, f"SamplingParams.{field}", value)
    if isinstance(value, bool | str | float | list | dict | bytes | type(None)) and field in ("n", "top_k", "seed"):
        assert isinstance(error.value, TypeError)  # a wrong type is a TypeError too


def test_sampling_params_changed_after_building_are_checked_again(llm, fixed_tokens):
    params = SamplingParams(max_tokens=4)
    params.temperature = math.nan
    with pytest.raises(ValueError, match="SamplingParams.temperature must be"):
        llm.generate({"prompt_token_ids": [5]}, params)
    assert_unharmed(llm, fixed_tokens)


# ----- engine arguments: refused before anything loads -----

BAD_ENGINE = [
    ("model", 3), ("model", ""), ("model", ["a"]), ("dtype", "float64"), ("dtype", 32), ("page_size", 0),
    ("page_size", 4096), ("page_size", 16.0), ("page_size", True), ("max_model_len", 1), ("max_model_len", 2**31),
    ("max_model_len", "64"), ("num_pages", 1), ("num_pages", 2**40), ("num_pages", 10.0),
    ("kv_cache_memory_bytes", 0), ("kv_cache_memory_bytes", -1), ("kv_cache_memory_bytes", 1.5e9),
    ("gpu_memory_utilization", 0), ("gpu_memory_utilization", 1.5), ("gpu_memory_utilization", math.nan),
    ("gpu_memory_utilization", "0.9"), ("gpu_memory_utilization", True), ("max_num_seqs", 0),
    ("max_num_seqs", 2**20), ("max_num_seqs", None), ("max_num_batched_tokens", 0),
    ("max_num_batched_tokens", 2**30), ("enable_prefix_caching", 1), ("enable_prefix_caching", "true"),
    ("seed", -1), ("seed", 0.5), ("seed", None), ("attention_impl", "triton"), ("attention_impl", None),
    ("compilation_cache_dir", ""), ("compilation_cache_dir", 5), ("load_format", "pt"), ("skip_tokenizer_init", 0),
]  # fmt: skip


@pytest.mark.parametrize(("field", "value"), BAD_ENGINE, ids=[f"{f}={v!r}" for f, v in BAD_ENGINE])
def test_bad_engine_arguments_are_refused_by_name(field, value):
    with pytest.raises(ValueError) as error:
        EngineConfig(**{field: value})
    assert_refused_by_name(error, f"engine argument {field}", value)


def test_unknown_engine_argument_is_named():
    with pytest.raises(TypeError, match="max_num_sequences"):
        EngineConfig(max_num_sequences=4)


# ----- requests through the engine and LLM -----

BAD_PROMPTS = [
    ("", "prompt"), ("\ud800 lone surrogate", "prompt"), (42, "prompt"), (None, "prompt"), (3.5, "prompt"),
    (b"bytes", "prompt"), ({"prompt_token_ids": []}, "prompt_token_ids"),
    ({"prompt_token_ids": [1, VOCAB]}, "prompt_token_ids"), ({"prompt_token_ids": [1, -1]}, "prompt_token_ids"),
    ({"prompt_token_ids": [1, 2**40]}, "prompt_token_ids"), ({"prompt_token_ids": [1, True]}, "prompt_token_ids"),
    ({"prompt_token_ids": [1, 2.0]}, "prompt_token_ids"), ({"prompt_token_ids": ["1"]}, "prompt_token_ids"),
    ({"prompt_token_ids": [None]}, "prompt_token_ids"), ({"prompt_token_ids": [3, None]}, "prompt_token_ids"),
    ({"prompt_token_ids": "123"}, "prompt_token_ids"), ({"prompt_token_ids": {"a": 1}}, "prompt_token_ids"),
    ({"prompt_token_ids": None}, "prompt_token_ids"), ({"prompt_token_ids": [[1, 2]]}, "prompt_token_ids"),
    ({"prompt_token_ids": np.zeros((2, 2), np.int32)}, "prompt_token_ids"), ({}, "prompt"), ({"text": "hi"}, "prompt"),
    ({"prompt": 5}, "prompt"), ({"prompt": ""}, "prompt"), ({"prompt": "ok", "multi_modal_data": {}}, "prompt"),
    ({"prompt_token_ids": [1] * 64}, "max_model_len"), ("word " * 200, "max_model_len"),
]  # fmt: skip


@pytest.mark.parametrize(("prompt", "named"), BAD_PROMPTS, ids=[f"prompt{i}" for i in range(len(BAD_PROMPTS))])
def test_bad_prompts_are_refused_and_queue_nothing(llm, fixed_tokens, prompt, named):
    with pytest.raises(ValueError, match=named):
        llm.generate([{"prompt_token_ids": [5, 6]}, prompt], SamplingParams(max_tokens=3))
    with pytest.raises(ValueError, match=named):
        llm.engine.add_request("hostile", prompt, SamplingParams(max_tokens=3))
    assert_unharmed(llm, fixed_tokens)


@pytest.mark.parametrize(
    ("request_id", "params", "named"),
    [
        (None, SamplingParams(), "request_id"),
        (7, SamplingParams(), "request_id"),
        ("", SamplingParams(), "request_id"),
        (["a"], SamplingParams(), "request_id"),
        ("ok", {"temperature": 0}, "sampling_params"),
        ("ok", [SamplingParams()], "sampling_params"),
        ("ok", SamplingParams(top_k=VOCAB + 1), "top_k"),
        ("ok", SamplingParams(stop_token_ids=[VOCAB]), "stop_token_ids"),
    ],
)
def test_bad_add_request_arguments_are_refused_by_name(llm, fixed_tokens, request_id, params, named):
    with pytest.raises(ValueError, match=named):
        llm.engine.add_request(request_id, {"prompt_token_ids": [5]}, params)
    assert_unharmed(llm, fixed_tokens)


def test_a_request_id_in_use_is_refused(llm, fixed_tokens):
    llm.engine.add_request("dup", {"prompt_token_ids": [5]}, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="request_id 'dup' is already in use"):
        llm.engine.add_request("dup", {"prompt_token_ids": [6]}, SamplingParams(max_tokens=2))
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert_unharmed(llm, fixed_tokens)


@pytest.mark.parametrize(
    "sampling_params",
    [{"temperature": 0}, "greedy", 5, [SamplingParams(), None, 3], (SamplingParams(),) * 3],
)
def test_generate_refuses_what_is_not_sampling_params(llm, fixed_tokens, sampling_params):
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate([{"prompt_token_ids": [5]}, {"prompt_token_ids": [6]}], sampling_params)
    assert_unharmed(llm, fixed_tokens)


BAD_CHATS = [
    ("hello", "messages"), ([], "messages"), ({"role": "user"}, "messages"), ([["hi"]], r"messages\[0\]"),
    ([{"content": "hi"}], r"messages\[0\].role"), ([{"role": "", "content": "hi"}], r"messages\[0\].role"),
    ([{"role": 5, "content": "hi"}], r"messages\[0\].role"), ([{"role": "user", "content": None}], "content"),
    ([{"role": "user"}], r"messages\[0\].content"), ([{"role": "user", "content": 5}], "content"),
    ([{"role": "user", "content": {"type": "text", "text": "hi"}}], "content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], r"content\[0\].type"),
    ([{"role": "user", "content": [{"type": "text"}]}], r"content\[0\].text"),
    ([{"role": "user", "content": ["hi"]}], r"content\[0\]"),
    ([{"role": "user", "content": "\udfff"}], "content"),
    ([{"role": "system", "content": "a"}, {"role": "assistant", "content": None}], r"messages\[1\].content"),
    ([{"role": "user", "content": "hi"}, "oops"], r"messages\[1\]"),
    ([{"role": "user", "content": "x " * 100}], "max_model_len"),
]  # fmt: skip


@pytest.mark.parametrize(("messages", "named"), BAD_CHATS, ids=[f"chat{i}" for i in range(len(BAD_CHATS))])
def test_bad_chat_messages_are_refused_by_name(llm, fixed_tokens, messages, named):
    with pytest.raises(ValueError, match=named):
        llm.chat(messages, SamplingParams(max_tokens=2))
    assert_unharmed(llm, fixed_tokens)


def test_openai_content_parts_are_accepted_as_text(llm):
    parts = [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]
    as_parts = llm.chat([{"role": "user", "content": parts}], SamplingParams(temperature=0, max_tokens=3))
    as_text = llm.chat([{"role": "user", "content": "Hi\nthere"}], SamplingParams(temperature=0, max_tokens=3))
    assert as_parts[0].prompt_token_ids == as_text[0].prompt_token_ids
    assert as_parts[0].outputs[0].token_ids == as_text[0].outputs[0].token_ids


def test_a_template_that_raises_is_refused_as_a_value_error(llm, fixed_tokens, monkeypatch):
    tokenizer = llm.get_tokenizer()
    template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be the user') }}{% endif %}"
    )
    monkeypatch.setattr(tokenizer, "chat_template", template + tokenizer.chat_template)
    with pytest.raises(ValueError, match="chat template cannot render these messages.*first message must be the user"):
        llm.chat([{"role": "assistant", "content": "hi"}])
    assert_unharmed(llm, fixed_tokens)


# ----- failures at run time -----


def test_a_request_failing_at_run_time_ends_alone(llm, fixed_tokens):
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request("bad", {"prompt_token_ids": [5, 900, 13]}, params)
    engine.add_request("good", FIXED[0], FIXED[1])

    def broken(token_id):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "the tokenizer broke")

    engine.output_processor.requests["bad"].detokenizers[0].add = broken
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
    assert finals["bad"].outputs[0].finish_reason == "error" and "the tokenizer broke" in finals["bad"].error
    assert finals["good"].error is None and finals["good"].outputs[0].token_ids == fixed_tokens
    assert_unharmed(llm, fixed_tokens)


def test_a_failed_device_step_ends_the_running_requests_and_the_engine_serves_on(llm, fixed_tokens, monkeypatch):
    engine = llm.engine
    calls = {"n": 0}
    launch_step = engine.executor.launch_step

    def fails_once(outputs, *args):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("device lost")
        return launch_step(outputs, *args)

    monkeypatch.setattr(engine.executor, "launch_step", fails_once)
    outputs = llm.generate([{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9]}], FIXED[1])
    assert [o.outputs[0].finish_reason for o in outputs] == ["error", "error"]
    assert all("device lost" in o.error for o in outputs)
    assert_unharmed(llm, fixed_tokens)


def test_aborting_a_streamed_request_ends_the_stream(llm, fixed_tokens):
    long = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    seen = []
    for output in llm.generate_stream({"prompt_token_ids": [5, 6, 7]}, long):
        seen.append(output)
        if len(seen) == 3:
            llm.engine.abort_request(output.request_id)
    assert seen[-1].finished and seen[-1].outputs[0].finish_reason == "abort"
    assert len(seen) == 4
    assert_unharmed(llm, fixed_tokens)


@pytest.mark.parametrize("request_id", [None, 7, 1.5, ["live", 3], ("live", None), [b"live"], {"live": 1}.values()])
def test_bad_abort_request_arguments_are_refused_by_name(llm, fixed_tokens, request_id):
    engine = llm.engine
    engine.add_request("live", {"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError) as error:
        engine.abort_request(request_id)
    assert str(error.value) == f"request_id must be a string or an iterable of strings, got {describe(request_id)}"
    finals = [output for _ in range(10) for output in engine.step() if output.finished]
    assert [(o.request_id, o.outputs[0].finish_reason) for o in finals] == [("live", "length")]  # refused whole
    assert_unharmed(llm, fixed_tokens)


# ----- batch lines -----

BAD_LINES = [
    "not json", "[" * 100_000, "null", "[]", "42", '"custom_id"', '{"custom_id": 5}', '{"custom_id": ""}',
    '{"custom_id": "\\ud800"}', '{"custom_id": "m", "method": "GET", "url": "/v1/completions", "body": {}}',
    '{"custom_id": "u", "method": "POST", "url": "/v1/embeddings", "body": {}}',
    '{"custom_id": "b", "url": "/v1/completions", "body": [1, 2]}',
    '{"custom_id": "p", "url": "/v1/completions", "body": {"prompt": "\\udc00"}}',
    '{"custom_id": "t", "url": "/v1/completions", "body": {"prompt": "hi", "temperature": "hot"}}',
    '{"custom_id": "k", "url": "/v1/completions", "body": {"prompt": [1, 99999999999]}}',
    '{"custom_id": "c", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": null}]}}',
    '{"custom_id": "d", "url": "/v1/chat/completions", "body": {"messages": [{"content": "no role"}]}}',
    '{"custom_id": "n", "url": "/v1/completions", "body": {"prompt": "hi", "n": 1000}}',
    '{"custom_id": "s", "url": "/v1/completions", "body": {"prompt": "hi", "stop": {"x": 1}}}',
]  # fmt: skip


def test_a_batch_of_bad_lines_records_each_and_finishes(llm, fixed_tokens, tmp_path):
    good = {"custom_id": "good", "url": "/v1/completions", "body": {"prompt": [5, 6], "max_tokens": 3}}
    (tmp_path / "in.jsonl").write_text("\n".join([*BAD_LINES, json.dumps(good)]) + "\n")
    summary = run_batch(tmp_path / "in.jsonl", tmp_path / "out.jsonl", llm, quiet=True)
    assert (summary.requests, summary.succeeded, summary.failed) == (len(BAD_LINES) + 1, 1, len(BAD_LINES))
    records = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert len(records) == len(BAD_LINES) + 1
    for record in records:
        if record["custom_id"] != "good":
            error = record["error"] or record["response"]["body"]["error"]
            assert error["message"]
    assert_unharmed(llm, fixed_tokens)


# Lines that hold a request whose text is not UTF-8 text (a lone surrogate escaped, bytes that are not UTF-8): each is
# a 400 under its own custom_id, naming the field. Then lines that are no request at all: each an error record.
NOT_TEXT_LINES = {
    "key": (b'{"custom_id": "key", "url": "/v1/completions", "body": {"prompt": "x", "\\ud800": 1}}',
            "the keys of body"),
    "stop": (b'{"custom_id": "stop", "url": "/v1/completions", "body": {"prompt": "x", "stop": ["\\udfff"]}}',
             "body.stop[0]"),
    "name": (b'{"custom_id": "name", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", '
             b'"content": "hi", "name": "\\udc00"}]}}', "body.messages[0].name"),
    "tool": (b'{"custom_id": "tool", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", '
             b'"content": "hi"}], "tools": [{"type": "function", "function": {"name": "f", '
             b'"description": "\\ud800"}}]}}',
             "body.tools[0].function.description"),
    "bytes": (b'{"custom_id": "bytes", "url": "/v1/completions", "body": {"prompt": "caf\xe9", "max_tokens": 2}}',
              "body.prompt"),
    "url": (b'{"custom_id": "url", "url": "/v1/completions\\ud800", "body": {"prompt": "x"}}', "url"),
}  # fmt: skip
NOT_REQUEST_LINES = [
    (b'{"custom_id": "caf\xe9", "url": "/v1/completions", "body": {"prompt": "x"}}', "custom_id must be"),
    (b'{"custom_id": "nan", "url": "/v1/completions", "body": {"prompt": "x", "temperature": NaN}}', "has NaN"),
    (b'{"custom_id": "a", "custom_id": "b", "url": "/v1/completions", "body": {"prompt": "x"}}', "twice"),
    (b'\xff\xfe{"custom_id": "utf16"}', "is not JSON"),
]


def test_batch_lines_that_are_not_utf8_text_are_each_their_own_error(llm, fixed_tokens, tmp_path):
    good = b'{"custom_id": "good", "url": "/v1/completions", "body": {"prompt": [5, 6], "max_tokens": 3}}'
    lines = [line for line, _ in NOT_TEXT_LINES.values()] + [line for line, _ in NOT_REQUEST_LINES] + [good]
    (tmp_path / "in.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    summary = run_batch(tmp_path / "in.jsonl", tmp_path / "out.jsonl", llm, quiet=True)
    assert (summary.requests, summary.succeeded, summary.failed) == (len(lines), 1, len(lines) - 1)
    records = {r["custom_id"]: r for r in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    assert records["good"]["response"]["status_code"] == 200
    for custom_id, (_, field) in NOT_TEXT_LINES.items():
        response = records[custom_id]["response"]
        assert response["status_code"] == 400, response
        assert response["body"]["error"]["message"].startswith(f"{field} must be valid UTF-8 text"), response
    first = len(NOT_TEXT_LINES) + 1
    for number, (_, named) in enumerate(NOT_REQUEST_LINES, first):
        assert named in records[f"line-{number}"]["error"]["message"], records[f"line-{number}"]
    assert_unharmed(llm, fixed_tokens)


# ----- generated garbage -----

garbage = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=30) | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)
number_like = st.integers(-3, 70) | st.floats(-1, 2) | st.sampled_from([math.nan, math.inf, True, None, 2**40])
sampling_kwargs = st.dictionaries(
    st.sampled_from(["n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "logprobs", "stop",
                     "stop_token_ids", "ignore_eos", "skip_special_tokens", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "logit_bias", "allowed_token_ids", "bad_words", "min_tokens",
                     "prompt_logprobs", "structured_outputs"]),
    number_like | garbage,
    max_size=5,
)  # fmt: skip
prompts = (
    st.text(max_size=40)
    | st.builds(lambda ids: {"prompt_token_ids": ids}, st.lists(st.integers(-2, VOCAB + 2), max_size=20) | garbage)
    | garbage
)
text_part = st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=10)})
messages = st.lists(
    st.fixed_dictionaries(
        {},
        optional={
            "role": st.sampled_from(["user", "system", "assistant", "tool", ""]) | garbage,
            "content": st.text(max_size=30) | st.lists(text_part, max_size=3) | garbage,
        },
    )
    | garbage,
    max_size=3,
)  # fmt: skip


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(kwargs=sampling_kwargs, prompt=prompts, conversation=messages)
def test_generated_garbage_runs_or_is_refused(llm, fixed_tokens, kwargs, prompt, conversation):
    kwargs.setdefault("max_tokens", 4)
    try:
        params = SamplingParams(**kwargs)
    except ValueError:
        params = SamplingParams(max_tokens=4)
    if params.max_tokens is None or params.max_tokens > 8:
        params.max_tokens = 8  # keep the examples quick: long generations prove nothing more here
    params.n = min(params.n, 3)
    for attempt in (lambda: llm.generate(prompt, params), lambda: llm.chat(conversation, params)):
        try:
            outputs = attempt()
        except ValueError as e:  # the documented refusal (ArgumentTypeError, for wrong types, is one too)
            assert str(e)
        else:
            assert all(o.finished and o.error is None for o in outputs)
    assert not llm.engine.has_unfinished_requests() and llm.engine.block_manager.num_used_pages == 0


def test_after_the_garbage_the_engine_is_unharmed(llm, fixed_tokens):
    assert_unharmed(llm, fixed_tokens)
