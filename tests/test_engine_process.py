"""The engine in a process of its own (jaxpage.entrypoints.engine_process), as `jaxpage serve` runs it: the `openai`
client gets what LLM.generate gives, streamed or not; bad requests are refused in the server's process, before the
engine hears of them; a client that leaves aborts its request in the engine process; /metrics reads the engine
process's gauges; an engine process that dies ends every stream with an error and fails /health; one that cannot start
fails with its own error. The model is tiny and random, with SmolLM2's tokenizer."""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import httpx
import openai
import pytest
from live_server import LiveServer
from tiny_models import FULL_VOCAB_ENGINE

from jaxpage.entrypoints.async_engine import AsyncEngine
from jaxpage.entrypoints.engine_process import EngineProcess
from jaxpage.entrypoints.llm import LLM
from jaxpage.entrypoints.server import create_app
from jaxpage.sampling_params import SamplingParams

ENGINE = FULL_VOCAB_ENGINE


@pytest.fixture(scope="module")
def served(full_vocab_dir):
    engine = AsyncEngine(EngineProcess(dict(model=full_vocab_dir, **ENGINE), warmup=False)).start()
    server = LiveServer(create_app(engine, "tiny"))
    yield server, engine
    server.stop()
    engine.shutdown(timeout_s=5)


@pytest.fixture(scope="module")
def reference(full_vocab_dir):
    """An engine of this process on the same model, for LLM.generate's outputs."""
    return LLM(full_vocab_dir, **ENGINE)


@pytest.fixture
def client(served):
    server, engine = served
    yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    deadline = time.monotonic() + 10
    while (engine.gauges().num_running or engine._core.busy()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.gauges().num_running == 0 and not engine._core.busy()


def test_completions_through_the_engine_process_are_llm_generates(client, reference):
    prompts = ["The quick brown fox", "Once upon a time", "Name three colors."]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    want = [o.outputs[0].text for o in reference.generate(prompts, params)]
    extra = {"ignore_eos": True}
    whole = client.completions.create(model="tiny", prompt=prompts, temperature=0, max_tokens=10, extra_body=extra)
    assert [c.text for c in sorted(whole.choices, key=lambda c: c.index)] == want
    for prompt, text in zip(prompts, want, strict=True):
        stream = client.completions.create(
            model="tiny", prompt=prompt, temperature=0, max_tokens=10, stream=True, extra_body=extra
        )
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


@pytest.mark.parametrize("stream", [False, True])
def test_the_text_made_beside_the_engine_process_is_the_engines_own(client, served, reference, stream):
    """The server's process makes the text of the engine process's token ids (OutputTexts) as LLMEngine makes it:
    n samples, a stop string that ends one sample early (the engine process is told to stop it), log-probs."""
    prompt = "The quick brown fox"
    greedy = reference.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    stop = greedy[0].outputs[0].text[12:15]  # occurs in the greedy sample
    fields = dict(n=3, seed=7, temperature=0.7, max_tokens=30, stop=[stop], logprobs=2)
    want = reference.generate([prompt], SamplingParams(**fields, ignore_eos=True))[0].outputs
    assert "stop" in {w.finish_reason for w in want}
    sent = served[1]._core._sent
    got = client.completions.create(
        model="tiny", prompt=prompt, stream=stream, extra_body={"ignore_eos": True}, **fields
    )
    texts, reasons, logprobs = {}, {}, {}
    for choice in (c for chunk in got for c in chunk.choices) if stream else got.choices:
        texts[choice.index] = texts.get(choice.index, "") + choice.text
        reasons[choice.index] = choice.finish_reason or reasons.get(choice.index)
        logprobs.setdefault(choice.index, []).extend(choice.logprobs.token_logprobs if choice.logprobs else [])
    assert [texts[i] for i in range(3)] == [w.text for w in want]
    assert [reasons[i] for i in range(3)] == [w.finish_reason for w in want]
    for i, w in enumerate(want):
        expected = [entry[t].logprob for entry, t in zip(w.logprobs, w.token_ids, strict=True)]
        assert logprobs[i] == pytest.approx(expected, abs=1e-5)
    assert served[1]._core._sent >= sent + 2  # the request, and the samples its stop string ended, told to stop


def test_a_bad_request_is_refused_by_the_servers_process(client, served):
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="tiny", prompt="Hi", max_tokens=500)  # beyond max_model_len: fit_context
    with pytest.raises(openai.BadRequestError, match="top_k"):
        client.completions.create(model="tiny", prompt="Hi", max_tokens=2, extra_body={"top_k": 10**6})
    assert served[1]._core._sent == served[1]._core._taken  # (nothing reached the engine but what it took)


def test_a_client_that_leaves_aborts_its_request_in_the_engine_process(client, served):
    _, engine = served
    finals = []
    engine.observers.append(lambda output: finals.extend(c.finish_reason for c in output.outputs if output.finished))
    try:
        stream = client.completions.create(
            model="tiny", prompt="Once", max_tokens=90, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        next(iter(stream))
        stream.close()
        deadline = time.monotonic() + 10
        while not finals and time.monotonic() < deadline:
            time.sleep(0.01)
        assert finals == ["abort"]  # (the client fixture then checks that nothing runs and nothing is pending)
    finally:
        engine.observers.pop()


def test_metrics_read_the_engine_processes_gauges(client, served):
    server, engine = served
    client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=4)
    deadline = time.monotonic() + 5
    while engine.gauges().prefix_cache_counts[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    text = httpx.get(f"{server.url}/metrics").text
    queries = engine.gauges().prefix_cache_counts[0]
    assert queries > 0 and f"jaxpage:prefix_cache_queries_total {float(queries)}" in text
    assert "jaxpage:num_requests_running 0.0" in text


def test_an_engine_process_that_dies_ends_every_stream_and_fails_health(full_vocab_dir):
    engine = AsyncEngine(EngineProcess(dict(model=full_vocab_dir, **ENGINE), warmup=False)).start()
    server = LiveServer(create_app(engine, "tiny"))
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        stream = client.completions.create(
            model="tiny", prompt="Once", max_tokens=80, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        next(iter(stream))
        os.kill(engine._core._process.pid, signal.SIGKILL)
        with pytest.raises(Exception, match="engine process exited"):  # the stream's last event is the error
            for chunk in stream:
                if chunk.choices and chunk.choices[0].finish_reason:
                    break
            else:
                raise AssertionError("the stream ended without a finish_reason")
        health = httpx.get(f"{server.url}/health")
        assert health.status_code == 503 and "engine process exited" in health.text
        with pytest.raises(openai.APIStatusError):
            client.completions.create(model="tiny", prompt="Hi", max_tokens=2)
    finally:
        server.stop()
        engine.shutdown(timeout_s=0)


def test_an_engine_process_that_cannot_start_raises_its_error(full_vocab_dir, monkeypatch):
    with pytest.raises(ValueError, match="max_model_len 100000 exceeds the model's"):
        EngineProcess(dict(model=full_vocab_dir, **ENGINE | dict(max_model_len=100_000)), warmup=False)
    # Arguments EngineConfig refuses fail before any process starts.
    monkeypatch.setattr("multiprocessing.context.SpawnProcess.start", lambda self: pytest.fail("a process started"))
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineProcess(dict(model=full_vocab_dir, **ENGINE | dict(max_num_seqs=0)), warmup=False)


def test_stop_samples_ends_the_samples_named_and_the_request_with_the_last(reference):
    """LLMEngine.stop_samples (a stop string found in the server's process): the samples named end now ("stop",
    their pages freed), the others run on, and the request's final output comes with the last of them."""
    engine = reference.engine
    params = SamplingParams(n=2, seed=1, temperature=0.8, max_tokens=20, ignore_eos=True)
    engine.add_request("two", "Once", params)
    for _ in range(3):
        assert not any(o.finished for o in engine.step())
    engine.stop_samples("two", [0])
    engine.stop_samples("nobody", [0])  # passed over
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    final = outputs[-1]
    assert final.finished and [c.finish_reason for c in final.outputs] == ["stop", "length"]
    assert len(final.outputs[0].token_ids) < 20 == len(final.outputs[1].token_ids)
    assert engine.block_manager.num_used_pages == 0


def test_a_request_whose_text_fails_beside_the_engine_process_ends_with_the_error(reference):
    """OutputTexts: a request whose detokenizer raises ends with finish_reason "error" (its samples told to stop in
    the engine, its late outputs passed over); the others go on."""
    from jaxpage.engine.output_texts import OutputTexts
    from jaxpage.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from jaxpage.sampling_params import RequestOutputKind

    texts = OutputTexts()
    params = SamplingParams(max_tokens=4, output_kind=RequestOutputKind.DELTA)
    good, bad = (reference.engine.prepare_request(rid, "Once", params) for rid in ("good", "bad"))
    for request in (good, bad):
        texts.add(request)

    def broken(token):
        raise RuntimeError("no text for it")

    bad.detokenizers[0].add = broken

    def engine_output(request_id: str) -> RequestOutput:  # token ids alone, as the engine process gives them
        return RequestOutput(request_id, None, [1], [CompletionOutput(0, "", [1159, 1553])], False, RequestMetrics(0.0))

    output, stopped = texts.apply(engine_output("bad"))
    assert output.finished and output.outputs[0].finish_reason == "error" and "no text for it" in output.error
    assert stopped == [0] and texts.apply(engine_output("bad")) == (None, [])
    output, stopped = texts.apply(engine_output("good"))
    assert not output.finished and output.outputs[0].token_ids == [1159, 1553] and output.outputs[0].text
    assert stopped == [] and output.error is None


@pytest.mark.parametrize("n", [1, 2])
def test_token_deltas_make_the_engines_own_text(reference, n):
    """An engine process's request (token ids alone, Request.token_deltas) gives its first and last outputs as
    RequestOutputs and those between as TokenDeltas; OutputTexts makes of them the text and tokens the engine gives
    a request of its own (n = 1: the output processor's short way, n = 2; a stop string, streamed), the samples a
    stop string ends told to stop."""
    from jaxpage.engine.output_processor import StepTokens, each_output
    from jaxpage.engine.output_texts import OutputTexts, engine_output_kind
    from jaxpage.outputs import RequestOutput
    from jaxpage.sampling_params import RequestOutputKind

    engine = reference.engine
    greedy = reference.generate(["Once upon"], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    fields = dict(n=n, seed=5, temperature=0.8, max_tokens=16, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    params = SamplingParams(**fields, stop=[greedy[0].outputs[0].text[6:8]])

    def run(request_id: str, texts: OutputTexts | None) -> tuple[dict, dict, list]:
        mine = engine.prepare_request(request_id, "Once upon", params)
        if texts is not None:  # as EngineProcess.send and the engine process make it
            texts.add(mine)
            engine_params = dataclasses.replace(params, output_kind=engine_output_kind(mine))
            request = engine.prepare_request(request_id, "Once upon", engine_params)
            request.detokenizers, request.token_deltas = [None] * n, True
        engine.add_prepared_requests([request if texts is not None else mine])
        text, tokens, kinds = dict.fromkeys(range(n), ""), {i: [] for i in range(n)}, []
        while engine.has_unfinished_requests():
            outputs = engine.step()
            kinds += [type(output) for output in outputs]
            for output in each_output(outputs):
                if texts is not None:
                    output, stopped = texts.apply(output)
                    if stopped:
                        engine.stop_samples(request_id, stopped)
                for c in output.outputs if output is not None else ():
                    text[c.index] += c.text
                    tokens[c.index] += c.token_ids
        return text, tokens, kinds

    own = run("own", None)
    beside = run("beside", OutputTexts())
    assert beside[:2] == own[:2] and any(own[0].values())
    assert beside[2][0] is RequestOutput and beside[2][-1] is RequestOutput
    assert (StepTokens if n == 1 else tuple) in beside[2]  # (a lean request's TokenDeltas come in a step's StepTokens)
    assert set(own[2]) == {RequestOutput}
