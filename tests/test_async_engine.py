"""AsyncEngine: asyncio callers stream outputs from one background engine loop; the outputs are LLM.generate's, a
caller that leaves aborts its request (every page comes back), bad requests are refused where they are added, and
health tells the truth about the loop."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import pytest
from tiny_models import TINY_ENGINE

from jaxpage.entrypoints.async_engine import AsyncEngine, EngineDeadError
from jaxpage.entrypoints.llm import LLM
from jaxpage.sampling_params import RequestOutputKind, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(tiny_dir, skip_tokenizer_init=True, **TINY_ENGINE)


@pytest.fixture
def engine(llm):
    async_engine = AsyncEngine(llm.engine).start()
    yield async_engine
    async_engine.shutdown(timeout_s=5)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_used_pages == 0  # every page back, aborted requests' too


def prompt(i: int) -> dict:
    return {"prompt_token_ids": [(7 * i + j) % 90 + 3 for j in range(3 + i % 5)]}


async def collect(engine: AsyncEngine, request_id: str, request: dict, params: SamplingParams) -> list:
    return [output async for output in engine.generate(request_id, request, params)]


def test_concurrent_streams_give_generates_tokens(llm, engine):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    requests = [prompt(i) for i in range(10)]

    async def main():
        return await asyncio.gather(*(collect(engine, f"r{i}", r, params) for i, r in enumerate(requests)))

    streams = asyncio.run(main())
    for stream in streams:
        assert stream[-1].finished and not any(o.finished for o in stream[:-1])
        counts = [len(o.outputs[0].token_ids) for o in stream]
        assert counts == sorted(counts) and counts[-1] == 12  # token by token, as the engine makes progress
    engine.shutdown(timeout_s=5)
    want = llm.generate(requests, params)
    assert [s[-1].outputs[0].token_ids for s in streams] == [w.outputs[0].token_ids for w in want]


def test_a_slow_caller_gets_the_steps_merged_as_its_output_kind_asks(llm, engine):
    """The engine gives what each step adds; a caller that lags gets it merged: DELTA pieces that add up to the
    whole, CUMULATIVE outputs each holding everything so far, the last LLM.generate's."""
    base = dict(temperature=0, max_tokens=24, ignore_eos=True)
    kinds = (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE)

    async def slow(request_id: str, kind: RequestOutputKind) -> list:
        outputs = []
        async for output in engine.generate(request_id, prompt(1), SamplingParams(**base, output_kind=kind)):
            outputs.append(output)
            await asyncio.sleep(0.03)  # several steps go by
        return outputs

    async def main():
        return await asyncio.gather(*(slow(f"slow-{kind.name}", kind) for kind in kinds))

    delta, cumulative = asyncio.run(main())
    engine.shutdown(timeout_s=5)
    want = llm.generate([prompt(1)], SamplingParams(**base))[0].outputs[0].token_ids
    assert len(want) == 24
    assert 1 < len(delta) < 24  # merged while the caller slept
    assert [t for o in delta for t in o.outputs[0].token_ids] == want
    counts = [len(o.outputs[0].token_ids) for o in cumulative]
    assert 1 < len(cumulative) < 24 and counts == sorted(counts)
    assert all(o.outputs[0].token_ids == want[: len(o.outputs[0].token_ids)] for o in cumulative)
    assert cumulative[-1].outputs[0].token_ids == want and cumulative[-1].finished and delta[-1].finished


def test_a_caller_that_leaves_aborts_its_request(llm, engine, monkeypatch):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    step = llm.engine.step
    monkeypatch.setattr(llm.engine, "step", lambda: time.sleep(0.01) or step())  # 40 tokens take 0.4 s at least

    async def leave_after(n: int, request_id: str) -> int:
        seen = 0
        async for _ in engine.generate(request_id, prompt(1), params):
            seen += 1
            if seen == n:
                break  # as a disconnected client's handler does
        return seen

    async def cancelled(request_id: str) -> None:
        started = asyncio.Event()

        async def consume():
            async for _ in engine.generate(request_id, prompt(2), params):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()  # as the server does to the handler of a client that disconnected
        with pytest.raises(asyncio.CancelledError):
            await task

    async def main():
        await asyncio.gather(leave_after(2, "leaves"), cancelled("cancelled"))
        # The others go on meanwhile, and end normally.
        return await collect(engine, "stays", prompt(3), SamplingParams(temperature=0, max_tokens=5))

    stays = asyncio.run(main())
    assert stays[-1].finished and stays[-1].outputs[0].finish_reason in ("length", "stop")
    deadline = time.monotonic() + 5
    while llm.engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_used_pages == 0


def test_bad_requests_are_refused_where_they_are_added(llm, engine, monkeypatch):
    step = llm.engine.step
    monkeypatch.setattr(llm.engine, "step", lambda: time.sleep(0.02) or step())  # "taken" runs for a second at least

    async def main():
        with pytest.raises(ValueError, match="prompt_token_ids"):
            await collect(engine, "bad", {"prompt_token_ids": [10**6]}, SamplingParams())
        with pytest.raises(ValueError, match="max_tokens"):
            await collect(engine, "bad", prompt(0), SamplingParams(max_tokens=0))
        # An id in use by another open stream.
        running = engine.generate("running", prompt(1), SamplingParams(max_tokens=50, ignore_eos=True))
        async with contextlib.aclosing(running):
            await anext(running)
            with pytest.raises(ValueError, match="'running' is already in use"):
                await collect(engine, "running", prompt(0), SamplingParams())
        # A request the engine refuses when the loop takes it in (no such refusal is known today: prepare_request
        # checks everything add_prepared_requests does but for ids, and the engine's ids are the AsyncEngine's own).
        add = llm.engine.add_prepared_requests

        def refuse(requests):
            raise ValueError(f"request_id {requests[0].request_id!r} is already in use")

        monkeypatch.setattr(llm.engine, "add_prepared_requests", refuse)
        with pytest.raises(ValueError, match="already in use"):
            await collect(engine, "refused", prompt(0), SamplingParams())
        monkeypatch.setattr(llm.engine, "add_prepared_requests", add)
        with pytest.raises(ValueError, match="request_id must be a string, got None"):
            engine.abort(None)
        # The loop serves on.
        return await collect(engine, "good", prompt(0), SamplingParams(temperature=0, max_tokens=3))

    assert asyncio.run(main())[-1].finished
    assert engine.health() == (True, "ok")


def test_health_tells_a_stalled_or_dead_loop(llm):
    engine = AsyncEngine(llm.engine, stall_timeout_s=0.2).start()
    assert engine.health() == (True, "ok")
    release = threading.Event()
    step = llm.engine.step
    llm.engine.step = lambda: release.wait() and step()  # a step that does not finish

    async def stuck():
        return await collect(engine, "stuck", prompt(0), SamplingParams(temperature=0, max_tokens=2))

    async def main():
        task = asyncio.create_task(stuck())
        await asyncio.sleep(0.6)
        healthy, why = engine.health()
        assert not healthy and "no step has finished" in why
        release.set()
        return await task

    try:
        assert asyncio.run(main())[-1].finished
        assert engine.health() == (True, "ok")  # progress again
        llm.engine.step = lambda: 1 / 0  # the loop itself dies

        async def dies():
            with pytest.raises(EngineDeadError, match="ZeroDivisionError"):
                await collect(engine, "dies", prompt(0), SamplingParams(max_tokens=2))

        asyncio.run(dies())
        healthy, why = engine.health()
        assert not healthy and "not running" in why
        with pytest.raises(EngineDeadError, match="not running"):  # and no new request is taken
            asyncio.run(collect(engine, "x", prompt(0), None))
    finally:
        llm.engine.step = step
        for request_id in ("stuck", "dies", "x"):
            llm.engine.abort_request(request_id)
        llm.engine.step()


def test_callers_never_wait_for_a_step(llm, engine, monkeypatch):
    """A step holds the engine's lock throughout; adding and aborting requests meanwhile must not stall the caller's
    event loop (every other stream and handler runs on it)."""
    step = llm.engine.step

    def slow_step():
        with llm.engine._lock:  # as a long device step does
            time.sleep(0.3)
        return step()

    monkeypatch.setattr(llm.engine, "step", slow_step)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    async def main():
        gaps, last = [], time.monotonic()

        async def tick():
            nonlocal last
            while True:
                await asyncio.sleep(0.01)
                gaps.append(time.monotonic() - last)
                last = time.monotonic()

        ticker = asyncio.create_task(tick())
        first = asyncio.create_task(collect(engine, "first", prompt(0), params))
        await asyncio.sleep(0.1)  # the loop is in a step now
        outputs = await asyncio.gather(*(collect(engine, f"more-{i}", prompt(i), params) for i in range(3)), first)
        ticker.cancel()
        return outputs, max(gaps)

    outputs, longest_gap = asyncio.run(main())
    assert all(o[-1].finished for o in outputs)
    assert longest_gap < 0.15, longest_gap  # never the 0.3 s of a step


def test_shutdown_lets_requests_finish_within_the_timeout_and_aborts_the_rest(llm, monkeypatch):
    step = llm.engine.step
    monkeypatch.setattr(llm.engine, "step", lambda: time.sleep(0.02) or step())
    engine = AsyncEngine(llm.engine).start()
    params = {name: SamplingParams(max_tokens=n, ignore_eos=True) for name, n in (("short", 2), ("long", 50))}

    async def main():
        streams = {name: asyncio.create_task(collect(engine, name, prompt(1), p)) for name, p in params.items()}
        await asyncio.sleep(0.1)
        await asyncio.to_thread(engine.shutdown, 0.3)
        return {name: (await task)[-1] for name, task in streams.items()}

    last = asyncio.run(main())
    assert last["short"].outputs[0].finish_reason == "length"
    assert last["long"].outputs[0].finish_reason == "abort"
    assert not llm.engine.has_unfinished_requests() and llm.engine.block_manager.num_used_pages == 0
    with pytest.raises(EngineDeadError):
        asyncio.run(collect(engine, "after", prompt(0), None))


def test_requests_that_arrive_during_a_step_all_join_the_next_one(llm, engine, monkeypatch):
    """Requests sent while a step runs are taken in together when it ends, not one by one over later steps."""
    step = llm.engine.step
    known_at_step = []

    def slow_step():
        with llm.engine._lock:  # the whole step holds the engine's lock, as a long device step does
            known_at_step.append(len(llm.engine.output_processor.requests))
            time.sleep(0.3)
            return step()

    monkeypatch.setattr(llm.engine, "step", slow_step)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    async def main():
        first = asyncio.create_task(collect(engine, "first", prompt(0), params))
        await asyncio.sleep(0.1)  # the loop is in the first request's step now
        more = [collect(engine, f"more-{i}", prompt(i), params) for i in range(1, 9)]
        return await asyncio.gather(first, *more)

    outputs = asyncio.run(main())
    assert all(o[-1].finished for o in outputs)
    busy = [n for n in known_at_step if n]
    assert busy[:2] == [1, 9], known_at_step


def test_an_id_is_free_again_once_its_stream_has_left(engine):
    """The abort of a stream that left comes before a new request under the same id, and does not end it."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    async def main():
        async with contextlib.aclosing(engine.generate("same", prompt(0), params)) as stream:
            async for _ in stream:
                break  # aclosing: the stream ends here, not when the garbage collector finds it
        return await collect(engine, "same", prompt(1), params)

    again = asyncio.run(main())
    assert again[-1].outputs[0].finish_reason == "length" and len(again[-1].outputs[0].token_ids) == 8


def test_an_idle_loop_sleeps_until_a_request_comes(llm, monkeypatch):
    steps = []
    step = llm.engine.step
    monkeypatch.setattr(llm.engine, "step", lambda: steps.append(time.monotonic()) or step())
    engine = AsyncEngine(llm.engine).start()
    try:
        time.sleep(1.5)
        assert len(steps) <= 1  # the first turn's; no polling while nothing is asked
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        stream = asyncio.run(collect(engine, "wakes", prompt(0), params))
        assert stream[-1].finished and len(stream[-1].outputs[0].token_ids) == 3
    finally:
        engine.shutdown(timeout_s=5)
