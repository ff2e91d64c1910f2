"""`jaxpage serve` against a live server on 127.0.0.1, with the official `openai` client: completions and chat, streamed
and not, n > 1, logprobs, stop, seeds; errors in OpenAI's shape; clients that disconnect abort their requests; after
every test no request is left and every page is free. The model is tiny and random, with SmolLM2's tokenizer."""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import math
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import uvicorn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from live_server import LiveServer, free_port, start_jaxpage_serve
from tiny_models import FULL_VOCAB_ENGINE

from jaxpage.entrypoints.async_engine import AsyncEngine
from jaxpage.entrypoints.llm import LLM
from jaxpage.entrypoints.openai_api import CHAT, COMMON_FIELDS, COMPLETIONS, ENDPOINT_FIELDS, UNSUPPORTED_FIELDS
from jaxpage.entrypoints.server import GracefulServer, create_app
from jaxpage.sampling_params import SamplingParams
from jaxpage.tokenizers.tokenizer import encode_chat

ENGINE = FULL_VOCAB_ENGINE
MESSAGES = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def llm(full_vocab_dir):
    """The served engine (its loop thread alone steps it while served)."""
    return LLM(full_vocab_dir, **ENGINE)


@pytest.fixture(scope="module")
def reference(full_vocab_dir):
    """Another engine on the same model, for LLM.generate's outputs."""
    return LLM(full_vocab_dir, **ENGINE)


@pytest.fixture(scope="module")
def served(llm):
    engine = AsyncEngine(llm.engine).start()
    app = create_app(engine, "tiny", max_body_bytes=20_000, tool_call_parser="hermes", enable_auto_tool_choice=True)
    server = LiveServer(app)
    yield server, engine
    server.stop()
    engine.shutdown(timeout_s=5)


@pytest.fixture
def client(served, llm):
    server, _ = served
    yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    deadline = time.monotonic() + 5
    while llm.engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_used_pages == 0


def test_completions_are_llm_generates(client, reference):
    prompt = "The quick brown fox"
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = reference.generate([prompt], params)[0].outputs[0]
    got = client.completions.create(
        model="tiny", prompt=prompt, temperature=0, max_tokens=12, extra_body={"ignore_eos": True}
    )
    assert got.choices[0].text == want.text and got.choices[0].finish_reason == "length"
    assert got.usage.completion_tokens == 12
    assert got.usage.prompt_tokens == len(reference.get_tokenizer()(prompt).input_ids)
    ids = client.completions.create(model="tiny", prompt=[5, 900, 13], temperature=0, max_tokens=4)
    want = reference.generate([{"prompt_token_ids": [5, 900, 13]}], SamplingParams(temperature=0, max_tokens=4))
    assert ids.choices[0].text == want[0].outputs[0].text


def test_streams_say_what_the_whole_response_says(client):
    args = dict(model="tiny", messages=MESSAGES, temperature=0, max_tokens=10)
    whole = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    completion = list(
        client.completions.create(model="tiny", prompt="Once upon", max_tokens=6, temperature=0, stream=True)
    )
    whole_completion = client.completions.create(model="tiny", prompt="Once upon", max_tokens=6, temperature=0)
    assert "".join(c.choices[0].text for c in completion) == whole_completion.choices[0].text


def test_a_stream_of_several_choices_with_logprobs_says_what_the_whole_response_says(client):
    args = dict(model="tiny", prompt="Colors:", n=2, max_tokens=8, temperature=1.0, seed=3, logprobs=2)
    whole = client.completions.create(**args)
    chunks = list(client.completions.create(**args, stream=True))
    for choice in whole.choices:
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
        assert "".join(c.text for c in mine) == choice.text
        assert mine[-1].finish_reason == choice.finish_reason
        streamed = [t for c in mine if c.logprobs for t in c.logprobs.tokens]
        assert streamed == choice.logprobs.tokens
        assert [x for c in mine if c.logprobs for x in c.logprobs.text_offset] == choice.logprobs.text_offset
        logprobs = [x for c in mine if c.logprobs for x in c.logprobs.token_logprobs]
        assert logprobs == pytest.approx(choice.logprobs.token_logprobs, abs=1e-4)


def test_n_logprobs_stop_and_seeds(client):
    several = client.chat.completions.create(
        model="tiny", messages=MESSAGES, n=3, max_tokens=8, temperature=1.0, seed=7, logprobs=True, top_logprobs=2
    )
    assert sorted(c.index for c in several.choices) == [0, 1, 2]
    for choice in several.choices:
        entries = choice.logprobs.content
        assert entries and all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in entries)
    again = client.chat.completions.create(
        model="tiny", messages=MESSAGES, n=3, max_tokens=8, temperature=1.0, seed=7, logprobs=True, top_logprobs=2
    )
    assert [c.message.content for c in again.choices] == [c.message.content for c in several.choices]
    full = client.completions.create(
        model="tiny", prompt="a b c", max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
    )
    text = full.choices[0].text
    stop = text[len(text) // 2 :][:3] if len(text) > 6 else None
    if stop and stop.strip():
        cut = client.completions.create(model="tiny", prompt="a b c", max_tokens=16, temperature=0, stop=[stop])
        assert cut.choices[0].finish_reason == "stop" and stop not in cut.choices[0].text
        assert text.startswith(cut.choices[0].text)


def test_structured_outputs_penalties_and_biases_over_http(client, reference):
    """response_format (json_schema via the client's parse() and a pydantic model, json_object), vLLM's
    structured_outputs, penalties and logit_bias reach the engine: the server's outputs are LLM.generate's with the
    same SamplingParams, and every JSON answer parses; a schema that does not compile is a 400 naming the field."""
    import pydantic

    from jaxpage.sampling_params import StructuredOutputsParams

    class Pet(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=8)
        age: int = pydantic.Field(ge=0, le=30)

    parsed = client.chat.completions.parse(model="tiny", messages=MESSAGES, response_format=Pet, temperature=0)
    assert isinstance(parsed.choices[0].message.parsed, Pet)
    anything = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=40, temperature=0, response_format={"type": "json_object"}
    )
    if anything.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(anything.choices[0].message.content), dict)
    choice = client.completions.create(
        model="tiny", prompt="Yes or no?", max_tokens=5, extra_body={"structured_outputs": {"choice": ["yes", "no"]}}
    )
    assert choice.choices[0].text in ("yes", "no")
    controls = dict(presence_penalty=1.5, frequency_penalty=0.5, logit_bias={"330": 5})
    got = client.completions.create(model="tiny", prompt="a b c", max_tokens=10, temperature=0, **controls)
    params = SamplingParams(temperature=0, max_tokens=10, **controls)
    assert got.choices[0].text == reference.generate(["a b c"], params)[0].outputs[0].text
    regex = StructuredOutputsParams(regex="[0-9]{4}")
    want = reference.generate(["x"], SamplingParams(temperature=0, max_tokens=8, structured_outputs=regex))
    got = client.completions.create(
        model="tiny", prompt="x", max_tokens=8, temperature=0, extra_body={"structured_outputs": {"regex": "[0-9]{4}"}}
    )
    assert got.choices[0].text == want[0].outputs[0].text and len(got.choices[0].text) == 4
    for body, field in (
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}}, "json"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"suffix": "end"}, "suffix"),
        ({"best_of": 3}, "best_of"),
        ({"temprature": 0.5}, "temprature is not a field of /v1/completions"),
        ({"messages": MESSAGES}, "messages is a field of /v1/chat/completions"),
        ({"modalities": ["audio"]}, "modalities"),
        ({"prompt_logprobs": 2, "stream": True}, "prompt_logprobs"),
    ):
        with pytest.raises(openai.BadRequestError, match=field):
            client.completions.create(model="tiny", prompt="x", max_tokens=4, extra_body=body)
    with pytest.raises(openai.BadRequestError, match="reasoning_effort"):
        client.chat.completions.create(model="tiny", messages=MESSAGES, reasoning_effort="high")


def test_every_field_is_honoured_or_refused(client, reference):
    """Fields without effect are accepted (and change nothing); vLLM's stop_token_ids, skip_special_tokens and
    prompt_logprobs are honoured: the outputs are LLM.generate's with the same SamplingParams."""
    plain = client.completions.create(model="tiny", prompt="a b c", max_tokens=6, temperature=0)
    no_effect = {"metadata": {"k": "v"}, "store": False, "service_tier": "auto", "modalities": ["text"]}
    same = client.completions.create(
        model="tiny", prompt="a b c", max_tokens=6, temperature=0, user="u", extra_body=no_effect
    )
    assert same.choices[0].text == plain.choices[0].text
    params = SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[330, 28], prompt_logprobs=2)
    want = reference.generate(["a b c"], params)[0]
    extra = {"stop_token_ids": [330, 28], "skip_special_tokens": True, "prompt_logprobs": 2, "top_k": None}
    got = client.completions.create(model="tiny", prompt="a b c", max_tokens=6, temperature=0, extra_body=extra)
    assert got.choices[0].text == want.outputs[0].text
    prompt_logprobs = got.choices[0].model_extra["prompt_logprobs"]
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(want.prompt_token_ids)
    for entry, expected in zip(prompt_logprobs[1:], want.prompt_logprobs[1:], strict=True):
        assert {int(t): e["logprob"] for t, e in entry.items()} == pytest.approx(
            {t: lp.logprob for t, lp in expected.items()}, abs=1e-4
        )


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}, "celsius": {"type": "boolean"}},
            "required": ["city", "celsius"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "additionalProperties": False}},
}


def test_tool_calls_forced_by_tool_choice_always_parse(client):
    """tool_choice "required" and a named function are enforced with structured outputs: the call parses, its
    arguments follow the function's schema; streamed calls are the whole response's; a second turn with the
    assistant's tool_calls (content null) and the tool's result renders through the chat template."""
    args = dict(model="tiny", messages=MESSAGES, tools=[WEATHER, CLOCK], temperature=0, max_tokens=60)
    required = client.chat.completions.create(tool_choice="required", parallel_tool_calls=False, **args)
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in ("get_weather", "get_time")
    arguments = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert arguments["city"] in ("Paris", "Rome") and isinstance(arguments["celsius"], bool)
    named = client.chat.completions.create(
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, **args
    )
    assert named.choices[0].finish_reason == "stop"
    [call] = named.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city", "celsius"}

    chunks = list(
        client.chat.completions.create(tool_choice="required", parallel_tool_calls=False, stream=True, **args)
    )
    streamed = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert [(t.index, t.function.name, t.function.arguments) for t in streamed] == [
        (0, c.function.name, c.function.arguments) for c in choice.message.tool_calls
    ]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    turn = {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]}
    result = {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 21}'}
    second = client.chat.completions.create(
        model="tiny", messages=[*MESSAGES, turn, result], tools=[WEATHER], tool_choice="none", max_tokens=4
    )
    assert second.choices[0].message.content and not second.choices[0].message.tool_calls


def test_auto_tool_choice_finds_hermes_calls_in_the_text(client):
    """tool_choice "auto" with --tool-call-parser hermes: the calls the model writes become tool_calls, the rest
    content, whole and streamed (the tiny model is made to write one with a regex)."""
    call = '{"name": "get_weather", "arguments": {"city": "Rome", "celsius": true}}'
    regex = "Let me check[.]\n<tool_call>\n" + re.escape(call) + "\n</tool_call>"
    args = dict(model="tiny", messages=MESSAGES, tools=[WEATHER], max_tokens=60, temperature=0)
    extra = {"structured_outputs": {"regex": regex}}
    whole = client.chat.completions.create(**args, extra_body=extra).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == "Let me check."
    [made] = whole.message.tool_calls
    assert made.function.name == "get_weather"
    assert json.loads(made.function.arguments) == {"city": "Rome", "celsius": True}
    chunks = list(client.chat.completions.create(**args, stream=True, extra_body=extra))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    streamed = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert content == "Let me check." and [t.function.arguments for t in streamed] == [made.function.arguments]
    plain = client.chat.completions.create(**args, tool_choice="none", extra_body=extra).choices[0]
    assert plain.finish_reason == "stop" and "<tool_call>" in plain.message.content and not plain.message.tool_calls


def test_echo_gives_the_prompts_log_probs_as_lm_eval_reads_them(client, reference):
    """echo with logprobs (lm-eval's loglikelihood request): the text is the prompt then the completion; tokens,
    token_logprobs (the first null), top_logprobs and text_offset cover the prompt's tokens, then the completion's;
    the prompt's log-probs are LLM.generate's prompt_logprobs (within 1e-4), for a text prompt and for token ids."""
    prompt = "The capital of France is"
    ids = reference.get_tokenizer()(prompt).input_ids
    want = reference.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))[0]
    for sent in (prompt, ids):
        got = client.completions.create(
            model="tiny", prompt=sent, max_tokens=1, temperature=0, logprobs=1, echo=True
        ).choices[0]
        assert got.text == prompt + want.outputs[0].text
        logprobs = got.logprobs
        assert len(logprobs.tokens) == len(ids) + 1 and logprobs.token_logprobs[0] is None
        assert logprobs.top_logprobs[0] is None and "".join(logprobs.tokens) == got.text
        assert logprobs.text_offset == [len("".join(logprobs.tokens[:i])) for i in range(len(logprobs.tokens))]
        for position in range(1, len(ids)):
            expected = want.prompt_logprobs[position][ids[position]].logprob
            assert abs(logprobs.token_logprobs[position] - expected) < 1e-4
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0, echo=True)
    assert plain.choices[0].text.startswith(prompt) and plain.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError, match="echo"):
        client.chat.completions.create(model="tiny", messages=MESSAGES, extra_body={"echo": True})


def test_a_stream_with_continuous_usage_stats_as_guidellm_sends_it(served):
    """guidellm's raw request: stream_options with vLLM's continuous_usage_stats; every chunk carries the counts so
    far, the last one the whole."""
    server, _ = served
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True}
    body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 6 and all("usage" in c for c in chunks)


def test_several_prompts_in_one_completions_request(client, reference):
    """prompt as a list of strings or of token-id lists: one choice per prompt and sample, prompt i's sample j at
    index i * n + j, streamed too, usage summed."""
    prompts = ["The sky is", "Numbers: 1 2"]
    args = dict(model="tiny", temperature=0, max_tokens=5, extra_body={"ignore_eos": True})
    want = [o.outputs[0].text for o in reference.generate(prompts, SamplingParams(temperature=0, max_tokens=5))]
    got = client.completions.create(prompt=prompts, n=2, **args)
    assert [(c.index, c.text) for c in got.choices] == [(0, want[0]), (1, want[0]), (2, want[1]), (3, want[1])]
    assert got.usage.completion_tokens == 20
    ids = [reference.get_tokenizer()(p).input_ids for p in prompts]
    assert [c.text for c in client.completions.create(prompt=ids, **args).choices] == want
    chunks = list(
        client.completions.create(prompt=prompts, stream=True, stream_options={"include_usage": True}, **args)
    )
    texts = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in (0, 1)]
    assert texts == want and chunks[-1].usage.completion_tokens == 10 and len({c.id for c in chunks}) == 1


def test_usage_counts_prompt_tokens_from_the_prefix_cache(client):
    prompt = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen"
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    again = client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % 8 == 0 and cached < again.usage.prompt_tokens  # whole pages (page_size 8)


def test_max_tokens_beyond_the_context_is_refused(client):
    with pytest.raises(openai.BadRequestError, match="maximum context length is 96"):
        client.completions.create(model="tiny", prompt="Hello there", max_tokens=95)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])
def test_bodies_nested_too_deep_or_with_huge_numbers_are_refused_before_parsing(served, path):
    server, _ = served
    bodies = {
        b"[" * 10_000 + b"]" * 10_000: "deep",
        b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}": "digits",
        b"9" * 5000: "digits",
    }
    for body, named in bodies.items():
        response = httpx.post(f"{server.url}{path}", content=body)
        assert response.status_code == 400 and named in response.json()["error"]["message"], response.text


def test_each_request_is_logged_and_a_client_gone_mid_body_is_one_quiet_line(served, client, log_records):
    server, _ = served
    client.completions.create(model="tiny", prompt="Log me", max_tokens=3, temperature=0)
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        head = (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 900\r\n\r\n"
        )
        sock.sendall(head + b'{"prompt": "cut sh')
    deadline = time.monotonic() + 5
    while not any("499" in r.getMessage() for r in log_records) and time.monotonic() < deadline:
        time.sleep(0.01)
    lines = [r.getMessage() for r in log_records if r.name == "jaxpage.requests"]
    assert any(
        " POST /v1/completions 200: " in line and "+ 3 completion tokens, finish length" in line for line in lines
    )
    assert any("499: the client disconnected before sending the whole body" in line for line in lines), lines
    assert not [r for r in log_records if r.levelno >= logging.WARNING or r.exc_info], log_records


def test_tokenizer_info_as_vllm_serves_it(served, reference):
    server, _ = served
    info = httpx.get(f"{server.url}/tokenizer_info").json()
    tokenizer = reference.get_tokenizer()
    assert info["eos_token"] == tokenizer.eos_token and info["chat_template"] == tokenizer.chat_template
    assert info["model_max_length"] == 96


def test_errors_have_openais_shape(served, client):
    server, _ = served
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model="tiny", prompt="x", temperature="hot")
    assert "temperature" in str(error.value) and "hot" in str(error.value)
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model="tiny", messages=[])
    with pytest.raises(openai.NotFoundError, match="other"):
        client.completions.create(model="other", prompt="x")
    with pytest.raises(openai.BadRequestError, match="prompt_token_ids|token id"):
        client.completions.create(model="tiny", prompt=[10**7])
    with pytest.raises(openai.BadRequestError, match="/v1/embeddings needs a model run by the pooling runner"):
        client.embeddings.create(model="tiny", input="x")
    response = httpx.post(f"{server.url}/v1/completions", content=b"{not json")
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
    response = httpx.post(f"{server.url}/v1/completions", content=json.dumps({"prompt": "x" * 30_000}))
    assert response.status_code == 413 and "20000 bytes" in response.json()["error"]["message"]
    response = httpx.get(f"{server.url}/v1/nothing")
    assert response.status_code == 404 and "error" in response.json()


def test_tokenize_and_detokenize(served, reference):
    server, _ = served
    tokenizer = reference.get_tokenizer()
    tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello world"}).json()
    assert tokens["tokens"] == list(tokenizer("Hello world").input_ids) and tokens["count"] == len(tokens["tokens"])
    assert tokens["max_model_len"] == 96
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": MESSAGES}).json()
    assert chat["tokens"] == encode_chat(tokenizer, MESSAGES)
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert text == {"prompt": "Hello world"}
    bad = httpx.post(f"{server.url}/detokenize", json={"tokens": [1, -5]})
    assert bad.status_code == 400 and "tokens must be a list of token ids" in bad.json()["error"]["message"]
    both = httpx.post(f"{server.url}/tokenize", json={"prompt": "x", "messages": MESSAGES})
    assert both.status_code == 400


def metric(text: str, name: str, absent: float | None = None) -> float:
    """The value of the sample `name` (with its labels, if any) in a Prometheus exposition; `absent` if given and
    there is none (a labelled series appears with its first count)."""
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " ")]
    if not values and absent is not None:
        return absent
    assert len(values) == 1, (name, values)
    return values[0]


def test_metrics_count_what_clients_received(served, client):
    server, _ = served
    before = httpx.get(f"{server.url}/metrics").text
    replies = [
        client.completions.create(model="tiny", prompt=f"Count {i}", max_tokens=3 + i, temperature=0) for i in range(4)
    ]
    for i in range(2):  # streamed: the engine's outputs hold what each step added
        stream = client.completions.create(
            model="tiny", prompt=f"Stream {i}", max_tokens=6, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        replies += [chunk for chunk in stream if chunk.usage is not None]
    after = httpx.get(f"{server.url}/metrics").text
    for name in ("jaxpage:generation_tokens_total", "jaxpage:prompt_tokens_total"):
        field = "completion_tokens" if "generation" in name else "prompt_tokens"
        received = sum(getattr(r.usage, field) for r in replies)
        assert metric(after, name) - metric(before, name) == received, name
    count = "jaxpage:time_to_first_token_seconds_count"
    assert metric(after, count) - metric(before, count) == 6
    assert metric(after, "jaxpage:e2e_request_latency_seconds_count") >= 6
    itl = "jaxpage:inter_token_latency_seconds_count"
    assert metric(after, itl) - metric(before, itl) >= 2  # a streamed request's outputs after its first
    assert metric(after, "jaxpage:num_requests_running") == 0 and metric(after, "jaxpage:kv_cache_usage_perc") == 0
    assert metric(after, "jaxpage:prefix_cache_queries_total") >= metric(after, "jaxpage:prefix_cache_hits_total")


def test_a_burst_never_takes_more_than_max_waiting_requests(reference, monkeypatch):
    """200 requests at once against max_waiting_requests=64: never more than 64 wait, every accepted request is
    answered, the others get 503 with Retry-After; a request with large n counts once."""
    engine = reference.engine
    waiting = []
    add = engine.add_prepared_requests
    monkeypatch.setattr(
        engine, "add_prepared_requests", lambda r: (add(r), waiting.append(engine.num_waiting_requests()))
    )
    async_engine = AsyncEngine(engine, max_waiting_requests=64).start()
    server = LiveServer(create_app(async_engine, "tiny", log_requests=False))

    async def burst():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=200)) as http:
            body = {"prompt": "Burst", "max_tokens": 3, "temperature": 0}
            return await asyncio.gather(*(http.post(f"{server.url}/v1/completions", json=body) for _ in range(200)))

    try:
        responses = asyncio.run(burst())
        statuses = [r.status_code for r in responses]
        assert set(statuses) == {200, 503} and statuses.count(200) >= 64, collections.Counter(statuses)
        assert max(waiting) <= 64
        busy = next(r for r in responses if r.status_code == 503)
        assert busy.headers["retry-after"] == "1" and busy.json()["error"]["type"] == "server_busy"
        assert all(r.json()["usage"]["completion_tokens"] == 3 for r in responses if r.status_code == 200)
        async_engine.max_waiting_requests = 2  # n samples are one request: one large n does not lock others out

        async def large_n_and_another():
            async with httpx.AsyncClient(timeout=120) as http:
                body = {"prompt": "Many", "max_tokens": 20, "n": 24, "temperature": 1, "ignore_eos": True}
                many = asyncio.ensure_future(http.post(f"{server.url}/v1/completions", json=body))
                while not engine.num_waiting() and not many.done():  # 16 of its samples wait for rows
                    await asyncio.sleep(0.001)
                other = await http.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
                return await many, other

        many, other = asyncio.run(large_n_and_another())
        assert many.status_code == 200 and len(many.json()["choices"]) == 24 and other.status_code == 200
    finally:
        server.stop()
        async_engine.shutdown(timeout_s=5)


def test_health_models_and_version(served):
    server, _ = served
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"] == "tiny"
    assert httpx.get(f"{server.url}/version").json()["version"]


def test_an_api_key_is_required_when_set(llm):
    engine = AsyncEngine(llm.engine)  # not started: the module's served engine has its own loop
    server = LiveServer(create_app(engine, "tiny", api_key="sesame"))
    try:
        keyless = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            keyless.models.list()
        keyed = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sesame", max_retries=0)
        assert keyed.models.list().data[0].id == "tiny"
        key = {"Authorization": "Bearer sesame"}
        for path in ("/tokenize", "/detokenize"):
            assert httpx.post(f"{server.url}{path}", json={"prompt": "x"}).status_code == 401
        assert httpx.get(f"{server.url}/tokenizer_info").status_code == 401
        assert httpx.post(f"{server.url}/tokenize", json={"prompt": "x"}, headers=key).status_code == 200
        assert httpx.get(f"{server.url}/health").status_code == 503  # no key needed (and this loop never ran)
        page = httpx.get(f"{server.url}/")
        assert page.status_code == 200 and "const NEEDS_API_KEY = true;" in page.text  # the page asks for the key
    finally:
        server.stop()


@pytest.fixture
def aborted(llm, monkeypatch) -> list[str]:
    """The ids of the requests aborted while unfinished."""
    ids = []
    abort = llm.engine.abort_request

    def record(request_ids):
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            if request_id in llm.engine.output_processor.requests:
                ids.append(request_id)
        abort(request_ids)

    monkeypatch.setattr(llm.engine, "abort_request", record)
    return ids


def test_64_streaming_clients_some_leaving(served, client, reference, aborted):
    """64 clients at once, every third leaving after its first text: the others get LLM.generate's text, the
    leavers' requests are aborted, and /metrics counts exactly that."""
    server, _ = served

    async def one(i: int, http: httpx.AsyncClient) -> str:
        body = {"model": "tiny", "prompt": f"Story {i % 4}:", "max_tokens": 40, "temperature": 0, "stream": True,
                "ignore_eos": True}  # fmt: skip
        text = ""
        async with http.stream("POST", f"{server.url}/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += json.loads(line[6:])["choices"][0]["text"]
                    if i % 3 == 0 and text:
                        return "left"  # disconnects midway
        return text

    async def main():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=100)) as http:
            return await asyncio.gather(*(one(i, http) for i in range(64)))

    metrics = f"{server.url}/metrics"
    before = httpx.get(metrics).text
    results = asyncio.run(main())
    after = httpx.get(metrics).text
    assert results.count("left") == 22 and len(aborted) >= 11  # most leave before their 40 tokens are done
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = [o.outputs[0].text for o in reference.generate([f"Story {i}:" for i in range(4)], params)]
    assert [text for text in results if text != "left"] == [want[i % 4] for i in range(64) if i % 3]

    def delta(name: str) -> float:
        return metric(after, name, absent=0) - metric(before, name, absent=0)

    assert delta('jaxpage:request_success_total{finished_reason="length"}') == 64 - 22 + (22 - len(aborted))
    assert delta('jaxpage:request_success_total{finished_reason="abort"}') == len(aborted)


def test_a_client_that_leaves_a_whole_response_aborts_it(served, client, llm, aborted, monkeypatch):
    server, _ = served
    step = llm.engine.step
    monkeypatch.setattr(llm.engine, "step", lambda: time.sleep(0.02) or step())  # 80 tokens take 1.6 s at least
    body = {"model": "tiny", "prompt": "Long:", "max_tokens": 80, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=0.5)
    deadline = time.monotonic() + 5
    while not aborted and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(aborted) == 1


def test_a_shutdown_that_runs_out_of_time_answers_every_client(reference, monkeypatch):
    """Past --shutdown-timeout the requests still running are aborted: a whole response becomes a 503 in OpenAI's
    shape, a stream ends with an error event and [DONE]."""
    engine = reference.engine
    step = engine.step
    monkeypatch.setattr(engine, "step", lambda: time.sleep(0.05) or step())  # 80 tokens take 4 s at least
    async_engine = AsyncEngine(engine).start()
    port = free_port()
    config = uvicorn.Config(create_app(async_engine, "tiny"), host="127.0.0.1", port=port, log_level="warning")
    server = GracefulServer(config, async_engine, shutdown_timeout_s=0.5)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}/v1/completions"
    body = {"prompt": "Long", "max_tokens": 80, "ignore_eos": True, "temperature": 0}

    async def clients():
        async with httpx.AsyncClient(timeout=60) as http:
            whole = asyncio.ensure_future(http.post(url, json=body))
            events = []
            async with http.stream("POST", url, json=dict(body, stream=True)) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        if len(events) == 1:
                            server.handle_exit(signal.SIGTERM, None)  # as the signal handler does
            return await whole, events

    try:
        while not server.started:
            time.sleep(0.01)
        whole, events = asyncio.run(clients())
        assert whole.status_code == 503 and "shut down" in whole.json()["error"]["message"]
        assert events[-1] == "[DONE]" and "shut down" in json.loads(events[-2])["error"]["message"]
        thread.join(timeout=30)
        assert not thread.is_alive()
    finally:
        server.should_exit = True
        async_engine.shutdown(timeout_s=0)


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])
def test_jaxpage_serve_starts_serves_and_stops_gracefully(full_vocab_dir, stop):
    """A signal while a request streams: the server stops accepting, lets it finish within --shutdown-timeout and
    exits 0. (What outlasts the timeout is aborted: AsyncEngine.shutdown, tested in test_async_engine.)"""
    port = free_port()
    command = ["--model", full_vocab_dir, "--port", str(port),
               "--max-model-len", "96", "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--page-size", "8",
               "--served-model-name", "tiny"]  # fmt: skip
    process = start_jaxpage_serve(command, port)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        reply = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, temperature=0)
        assert reply.choices[0].finish_reason in ("length", "stop")
        stream = client.completions.create(
            model="tiny", prompt="Once", max_tokens=80, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        chunks = [next(iter(stream))]
        process.send_signal(stop)
        chunks += list(stream)
        finished = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finished == ["length"]
        assert process.wait(timeout=60) == 0
        with pytest.raises(httpx.TransportError):  # no longer accepting
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
    finally:
        process.kill()


def test_jaxpage_serve_refuses_bad_options_in_one_line():
    result = subprocess.run(
        [sys.executable, "-m", "jaxpage", "serve", "--port", "70000"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2
    assert result.stderr.strip() == "jaxpage: error: --port must be in [0, 65535], got 70000"


def test_metrics_carry_the_speculative_decoding_counters(full_vocab_dir):
    from jaxpage.entrypoints.metrics import ServerMetrics, engine_gauges

    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    llm = LLM(full_vocab_dir, **ENGINE, speculative_config=spec)
    llm.engine.spec_decoder.policy.should_verify = lambda num_seqs, drafts, *shapes: bool(drafts)
    llm.generate([{"prompt_token_ids": [5, 6, 7, 5, 6, 7, 5, 6]}], SamplingParams(temperature=0, max_tokens=12))
    stats = llm.engine.spec_decoding_stats
    assert stats.num_drafts > 0
    text = ServerMetrics(lambda: engine_gauges(llm.engine)).exposition().decode()
    assert metric(text, "jaxpage:spec_decode_num_drafts_total") == stats.num_drafts
    assert metric(text, "jaxpage:spec_decode_num_accepted_tokens_total") == stats.num_accepted_tokens
    assert (
        metric(text, 'jaxpage:spec_decode_num_accepted_tokens_per_pos_total{position="0"}')
        == (stats.num_accepted_tokens_per_pos[0])
    )


# Text as a JSON body can spell it: any character, and often a lone surrogate (an escape like \ud800: half a pair).
texts = st.text(st.characters(exclude_categories=[]) | st.sampled_from("\ud800\udbff\udc00\udfff"), max_size=20)
keys = st.text(st.characters(exclude_categories=[]) | st.sampled_from("\ud800\udfff"), max_size=8)
garbage = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | texts,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(keys, inner, max_size=3),
    max_leaves=6,
)
small_numbers = st.integers(-2, 40) | st.floats(-1, 2) | st.sampled_from([math.nan, True, None, 2**70, -(2**70)])
FIELDS = sorted(COMMON_FIELDS | ENDPOINT_FIELDS[CHAT] | ENDPOINT_FIELDS[COMPLETIONS] | UNSUPPORTED_FIELDS.keys())
bodies = st.dictionaries(st.sampled_from([*FIELDS, "bogus"]) | keys, small_numbers | garbage, max_size=6)
chat_messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant"]) | texts, "content": texts | garbage},
        optional={"name": texts},
    ),
    min_size=1,
    max_size=2,
)
# How the body travels: as json.dumps writes it (ASCII, lone surrogates escaped), as UTF-8 with the surrogates raw
# (bytes that are not UTF-8), or escaped with a few bytes that are never UTF-8 spliced in somewhere.
NOT_UTF8 = [b"\xff", b"\x80", b"\xc0\xaf", b"\xed\xa0\x80", b"\xe9"]
encodings = st.sampled_from(["escaped", "raw"]) | st.tuples(st.integers(0, 10**6), st.sampled_from(NOT_UTF8))


def has_lone_surrogate(value) -> bool:
    return re.search("[\ud800-\udfff]", json.dumps(value, ensure_ascii=False)) is not None


@pytest.mark.usefixtures("client")
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bodies, prompt=texts | garbage, messages=chat_messages, chat=st.booleans(), encoding=encodings)
def test_no_body_gets_a_500(served, log_records, body, prompt, messages, chat, encoding):
    """Generated garbage in every field the server knows and in keys, lone surrogates and bytes that are not UTF-8
    among it, on both endpoints: a 200 or a 4xx naming the problem, never a 500 nor a traceback in the log (a body
    that is not UTF-8 text is a 400); the engine serves on (the client fixture checks that every page is free)."""
    server, _ = served
    url = CHAT if chat else COMPLETIONS
    body = {**body, "messages": messages} if chat else {**body, "prompt": prompt}
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 8:
        body["max_tokens"] = 8  # keeps generation short; its validation is fuzzed below 9 all the same
    raw = json.dumps(body).encode()  # NaN as Python writes it
    if encoding == "raw":
        raw = json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass")
    elif isinstance(encoding, tuple):
        where, junk = encoding[0] % (len(raw) + 1), encoding[1]
        raw = raw[:where] + junk + raw[where:]
    response = httpx.post(f"{server.url}{url}", content=raw, timeout=60)
    assert response.status_code in (200, 400, 404), response.text
    if response.status_code != 200:
        assert response.json()["error"]["message"]
    # Escaped, a high surrogate followed by a low one is one character (JSON's way to write one past U+FFFF): only a
    # lone one is refused. Raw, every surrogate's bytes are not UTF-8.
    sent = json.loads(raw) if encoding == "escaped" else body
    if isinstance(encoding, tuple) or has_lone_surrogate(sent):
        assert response.status_code == 400, response.text
    assert not [r for r in log_records if r.levelno >= logging.ERROR or r.exc_info], log_records


# Valid bodies of every endpoint that between them hold a string (value or key) in every field that takes one. Each is
# served (test_the_full_bodies_are_served); with a lone surrogate put into any one of its strings, none is.
FULL_BODIES = [
    (COMPLETIONS, {"model": "tiny", "prompt": "Hi", "max_tokens": 2, "stop": ["\n\n", "END"], "logit_bias": {"330": 1},
                   "user": "u", "metadata": {"k": "v"}, "service_tier": "auto", "bad_words": ["xyz"],
                   "structured_outputs": {"regex": "[a-z]+"}}),
    (COMPLETIONS, {"prompt": ["one", "two"], "max_tokens": 2, "response_format": {"type": "json_schema", "json_schema":
                   {"name": "n", "schema": {"type": "object", "properties": {"a": {"type": "string"}}}}}}),
    (CHAT, {"model": "tiny", "max_tokens": 2, "stop": "\n\n",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Weather?"}], "name": "ann"},
                         {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                          "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
                         {"role": "tool", "tool_call_id": "call_1", "content": "21"}],
            "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
    (CHAT, {"messages": MESSAGES, "max_tokens": 2, "structured_outputs": {"choice": ["yes", "no"]}}),
    ("/tokenize", {"prompt": "Hi", "add_special_tokens": True}),
    ("/tokenize", {"messages": MESSAGES}),
    ("/detokenize", {"tokens": [1, 2]}),
]  # fmt: skip


def string_places(value, path: tuple = ()) -> list[tuple[tuple, bool]]:
    """(path, is_key) of every string in a JSON value, keys included: a path is the keys and indices leading there."""
    if isinstance(value, str):
        return [(path, False)]
    if isinstance(value, dict):
        return [p for key, item in value.items() for p in [((*path, key), True), *string_places(item, (*path, key))]]
    if isinstance(value, list):
        return [p for i, item in enumerate(value) for p in string_places(item, (*path, i))]
    return []


def with_surrogate(value, path: tuple, is_key: bool, surrogate: str, at: int):
    """A copy of `value` whose string at `path` (the key there, with is_key) has `surrogate` put in at `at`."""

    def put(text: str) -> str:
        return text[: at % (len(text) + 1)] + surrogate + text[at % (len(text) + 1) :]

    if not path:
        return put(value)
    head, rest = path[0], path[1:]
    if isinstance(value, list):
        return [
            with_surrogate(item, rest, is_key, surrogate, at) if i == head else item for i, item in enumerate(value)
        ]
    if is_key and not rest:
        return {put(key) if key == head else key: item for key, item in value.items()}
    return {
        key: with_surrogate(item, rest, is_key, surrogate, at) if key == head else item for key, item in value.items()
    }


def field_name(path: tuple) -> str:
    """A path as the server names it: messages[0].content."""
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")


def test_the_full_bodies_are_served(served, client):
    server, _ = served
    for url, body in FULL_BODIES:
        response = httpx.post(f"{server.url}{url}", json=body, timeout=60)
        assert response.status_code == 200, (url, body, response.text)


@pytest.mark.usefixtures("client")
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    data=st.data(),
    which=st.integers(0, len(FULL_BODIES) - 1),
    surrogate=st.sampled_from("\ud800\udbff\udc00\udfff") | st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF),
    at=st.integers(0, 100),
    raw=st.booleans(),
)
def test_a_lone_surrogate_in_any_string_of_any_body_is_a_400_naming_it(served, data, which, surrogate, at, raw):
    """Any string of a valid body, key or value, of any endpoint, with a lone surrogate in it, escaped as json.dumps
    writes it or raw (bytes that are not UTF-8): a 400 whose message names the field."""
    server, _ = served
    url, body = FULL_BODIES[which]
    path, is_key = data.draw(st.sampled_from(string_places(body)), label="string")
    hostile = with_surrogate(body, path, is_key, surrogate, at)
    content = json.dumps(hostile, ensure_ascii=not raw).encode("utf-8", "surrogatepass" if raw else "strict")
    response = httpx.post(f"{server.url}{url}", content=content, timeout=60)
    assert response.status_code == 400, response.text
    named = f"the keys of {field_name(path[:-1]) or 'the body'}" if is_key else field_name(path)
    assert response.json()["error"]["message"].startswith(f"{named} must be valid UTF-8 text"), response.text


# Bodies no endpoint may take, each with what its 400 must say. The escapes are JSON's, as json.dumps and JavaScript's
# JSON.stringify write a lone surrogate ("\ud800": half a surrogate pair, which no UTF-8 encoder can write).
ASSISTANT_CALL = b'{"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function", "function": '
TOOL = b'{"type": "function", "function": {"name": "f", "description": "%s", "parameters": {"type": "object", '
HOSTILE_BODIES = {
    "surrogate key": (b'{"\\ud800": 1, "prompt": "x"}', "the keys of the body must be valid UTF-8 text"),
    "surrogate prompt": (b'{"prompt": "hi \\udfff"}', "prompt must be valid UTF-8 text, got 'hi \\udfff'"),
    "surrogate in a prompt list": (b'{"prompt": ["ok", "\\ud800"]}', "prompt[1] must be valid UTF-8"),
    "surrogate stop": (b'{"prompt": "x", "stop": ["ok", "\\udbff"]}', "stop[1] must be valid UTF-8"),
    "surrogate logit_bias key": (b'{"prompt": "x", "logit_bias": {"\\ud800": 1}}', "the keys of logit_bias must"),
    "surrogate model": (b'{"model": "\\ud800", "prompt": "x"}', "model must be valid UTF-8"),
    "surrogate unknown field": (b'{"prompt": "x", "bogus": {"deep": ["\\udc00"]}}', "bogus.deep[0] must"),
    "surrogate content": (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content must"),
    "surrogate content part": (
        b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a\\udfff"}]}]}',
        "messages[0].content[0].text must",
    ),
    "surrogate name": (b'{"messages": [{"role": "user", "content": "hi", "name": "\\udc00"}]}', "messages[0].name"),
    "surrogate role": (b'{"messages": [{"role": "us\\ud800er", "content": "hi"}]}', "messages[0].role must"),
    "surrogate tool description": (
        b'{"messages": [{"role": "user", "content": "hi"}], "tools": [' + TOOL % b"\\ud800" + b'"properties": {}}}}]}',
        "tools[0].function.description must",
    ),
    "surrogate tool parameter": (
        b'{"messages": [{"role": "user", "content": "hi"}], "tools": ['
        + TOOL % b"d"
        + b'"properties": {"\\udfff": {"type": "string"}}}}}]}',
        "the keys of tools[0].function.parameters.properties must",
    ),
    "surrogate tool-call arguments": (
        b'{"messages": [{"role": "user", "content": "hi"}, '
        + ASSISTANT_CALL
        + b'{"name": "f", "arguments": "{\\"a\\": \\"\\ud800\\"}"}}]}]}',
        "messages[1].tool_calls[0].function.arguments must",
    ),
    "surrogate tool_choice": (
        b'{"messages": [{"role": "user", "content": "hi"}], "tool_choice": {"type": "function", "function": '
        b'{"name": "\\ud800"}}}',
        "tool_choice.function.name must",
    ),
    "surrogate json schema": (
        b'{"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": '
        b'{"enum": ["\\ud800"]}}}}',
        "response_format.json_schema.schema.enum[0] must",
    ),
    "surrogate regex": (b'{"prompt": "x", "structured_outputs": {"regex": "\\udc00+"}}', "structured_outputs.regex"),
    "surrogate detokenize key": (b'{"tokens": [1, 2], "\\udbff": 0}', "the keys of the body must"),
    "not UTF-8 in a value": (b'{"prompt": "caf\xe9"}', "prompt must be valid UTF-8 text, got 'caf\\udce9'"),
    "not UTF-8 in a key": (b'{"caf\xe9": 1, "prompt": "x"}', "the keys of the body must be valid UTF-8"),
    "a surrogate in UTF-8's form": (b'{"prompt": "\xed\xa0\x80"}', "prompt must be valid UTF-8 text"),
    "not UTF-8 outside strings": (b'{"prompt": "x"}\xff', "the body is not JSON"),
    "NaN": (b'{"prompt": "x", "temperature": NaN}', "the body has NaN, which is not JSON"),
    "Infinity": (b'{"prompt": "x", "metadata": {"a": Infinity}}', "the body has Infinity"),
    "-Infinity": (b'{"prompt": "x", "presence_penalty": -Infinity}', "the body has -Infinity"),
    "a float beyond range": (b'{"prompt": "x", "top_p": 1e999}', "the number '1e999', beyond the range of a float"),
    "a key twice": (b'{"prompt": "x", "prompt": "y"}', "the body has the key 'prompt' twice in one object"),
    "a nested key twice": (
        b'{"messages": [{"role": "user", "role": "system", "content": "x"}]}',
        "the body has the key 'role' twice",
    ),
    "an array": (b'[{"prompt": "x"}]', "the body must be a JSON object, got [{'prompt': 'x'}]"),
    "a number": (b"42", "the body must be a JSON object, got 42"),
    "a string": (b'"\\ud800"', "the body must be a JSON object"),
    "null": (b"null", "the body must be a JSON object, got None"),
    "empty": (b"", "the body is not JSON"),
    "cut short": (b'{"prompt": "x"', "the body is not JSON"),
}


@pytest.mark.parametrize(("raw", "named"), HOSTILE_BODIES.values(), ids=HOSTILE_BODIES.keys())
def test_hostile_bodies_get_a_400_naming_the_problem(served, client, log_records, raw, named):
    """On every endpoint that takes a body: 400 in OpenAI's shape, the message naming the problem (and the field),
    no traceback in the log; a normal request succeeds right after."""
    server, _ = served
    for path in (COMPLETIONS, CHAT, "/tokenize", "/detokenize"):
        response = httpx.post(f"{server.url}{path}", content=raw, headers={"Content-Type": "application/json"})
        assert response.status_code == 400, (path, response.text)
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and named in error["message"], (path, error)
    assert not [r for r in log_records if r.levelno >= logging.ERROR or r.exc_info], log_records
    reply = client.completions.create(model="tiny", prompt="Still here", max_tokens=2, temperature=0)
    assert reply.choices[0].finish_reason == "length"


def test_text_that_only_looks_like_a_surrogate_is_accepted(served, client):
    """A pair written as two escapes is one character (here an emoji), and an escaped backslash before "ud800" is
    six characters of text: both are UTF-8 text, and served."""
    server, _ = served
    for prompt in (b'"smile \\ud83d\\ude00"', b'"C:\\\\ud800"'):
        response = httpx.post(f"{server.url}{COMPLETIONS}", content=b'{"max_tokens": 2, "prompt": %s}' % prompt)
        assert response.status_code == 200, response.text
    pair = httpx.post(f"{server.url}/tokenize", content=b'{"prompt": "\\ud83d\\ude00"}').json()["tokens"]
    assert pair == httpx.post(f"{server.url}/tokenize", json={"prompt": "\U0001f600"}).json()["tokens"]


def test_the_openai_client_gets_a_bad_request_for_a_lone_surrogate(client):
    """Through the openai client's own post(), with the body as json.dumps writes it (the client's create() cannot
    encode a lone surrogate itself): openai.BadRequestError naming the field, and the next request is served."""
    from openai.types.chat import ChatCompletion

    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi", "name": "\ud800"}], "max_tokens": 2}
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\]\.name must be valid UTF-8 text") as error:
        client.post("/chat/completions", cast_to=ChatCompletion, content=json.dumps(body).encode())
    assert error.value.status_code == 400 and error.value.type == "invalid_request_error"
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2, "metadata": {"score": math.nan}}
    with pytest.raises(openai.BadRequestError, match="NaN"):
        client.post("/chat/completions", cast_to=ChatCompletion, content=json.dumps(body).encode())
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, temperature=0)
    assert reply.choices[0].finish_reason == "length"


def test_json_text_inside_a_body_is_read_as_strictly_as_the_body(served, client, log_records):
    """JSON text in a body's strings (an assistant turn's tool-call arguments, a schema given as text): a lone
    surrogate escaped there is a 400 naming where, and so is a schema nested too deep; arguments nested too deep for
    a parser stay text, as arguments that are not JSON do. Never a 500."""
    server, _ = served

    def turn(arguments: str) -> dict:
        call = {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
        return {"model": "tiny", "max_tokens": 2, "tools": [WEATHER], "tool_choice": "none",
                "messages": [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]}]}  # fmt: skip

    def schema(text: str) -> dict:
        return {"model": "tiny", "prompt": "x", "max_tokens": 2, "structured_outputs": {"json": text}}

    for url, body, named in (
        (CHAT, turn('{"city": "\\ud800"}'), "messages[1].tool_calls[0].function.arguments.city must be valid UTF-8"),
        (COMPLETIONS, schema('{"enum": ["\\ud800"]}'), "structured_outputs.json.enum[0] must be valid UTF-8"),
        (COMPLETIONS, schema("[" * 3000 + "]" * 3000), "structured_outputs.json nests arrays and objects over 100"),
        (COMPLETIONS, schema('{"type": "number", "maximum": NaN}'), "structured_outputs.json has NaN"),
    ):
        response = httpx.post(f"{server.url}{url}", json=body)
        assert response.status_code == 400 and named in response.json()["error"]["message"], response.text
    deep = httpx.post(f"{server.url}{CHAT}", json=turn("[" * 3000 + "]" * 3000))
    assert deep.status_code == 400 and "max_model_len 96" in deep.json()["error"]["message"], deep.text  # rendered
    assert not [r for r in log_records if r.levelno >= logging.ERROR or r.exc_info], log_records


def test_the_readme_field_table_is_the_servers():
    """README.md's table of request fields names exactly the fields the server honours, accepts or refuses."""
    from pathlib import Path

    from jaxpage.entrypoints import openai_api

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    table = readme.split("<!-- fields:", 1)[1].split("\n\n", 1)[0]
    rows = {}
    for line in table.splitlines()[3:]:
        label, names = line.strip("|").split("|", 1)
        outside, depth = "", 0  # the names outside parentheses are fields; inside, their values
        for char in names:
            depth += (char == "(") - (char == ")")
            outside += char if depth == 0 and char != ")" else ""
        rows[label.strip()] = set(re.findall(r"`([a-z_]+)`", outside))
    assert rows == {
        "honoured, both endpoints": openai_api.COMMON_FIELDS,
        "honoured, chat completions": openai_api.ENDPOINT_FIELDS[openai_api.CHAT],
        "honoured, completions": openai_api.ENDPOINT_FIELDS[openai_api.COMPLETIONS],
        "accepted, no effect on the output": openai_api.NO_EFFECT_FIELDS,
        "refused (400 naming it)": set(openai_api.UNSUPPORTED_FIELDS),
    }
