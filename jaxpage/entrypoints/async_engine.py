"""AsyncEngine: one LLMEngine's loop (jaxpage.entrypoints.engine_loop) for asyncio callers (the HTTP server).

The loop runs beside the callers, in a thread of this process (AsyncEngine(an LLMEngine)), or with its engine in a
process of its own (AsyncEngine(an EngineProcess): jaxpage.entrypoints.engine_process), where the callers' HTTP
handling, tokenization and output delivery take no time from the loop that feeds the device. Each request's outputs
go to its caller's event loop (`loop.call_soon_threadsafe`, once a turn for all of that loop's streams), where they
wait for the caller, merged while it lags (_Outputs): a handler never waits on the engine and the engine never waits
on a handler.

Callers never wait for a step (a step holds the engine's lock throughout). A request is checked and tokenized in a
worker thread (LLMEngine.prepare_request: ValueError naming the field, and nothing queued), then goes into the loop's
inbox; aborts go there too, in the order they were asked for. Between two steps the loop takes everything in its
inbox, so every request that arrived during a step joins the next one. A caller that stops iterating before its
request finished (a client that disconnected: its task is cancelled) aborts it, which frees its pages.

Nothing a caller sends reaches the loop unchecked. A failing step ends every request then running with the error
(LLMEngine.step) and the loop goes on; if the loop itself dies, every open stream raises EngineDeadError and the
engine takes no more requests.

Admission (`max_waiting_requests`): a request is refused with ServerBusyError, before anything is done for it, when
that many requests already wait: those admitted and not yet in the engine (being tokenized, or in the inbox) plus
those the engine has waiting (a request's n samples count once). The count and the admission are one step under the
lock, so a burst of any size never takes more than the limit.

Health (`health()`): healthy only while the loop is alive and, while work is pending, has finished a step within
`stall_timeout_s` (a step stuck in the device, or a loop that no longer steps, is not healthy).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import NamedTuple

from jaxpage.engine.llm_engine import LLMEngine
from jaxpage.engine.output_processor import Request
from jaxpage.entrypoints.engine_loop import EngineDeadError, EngineLoop, LoopTurn
from jaxpage.entrypoints.engine_process import EngineProcess
from jaxpage.entrypoints.metrics import engine_gauges
from jaxpage.lora_request import LoRARequest
from jaxpage.outputs import RequestOutput
from jaxpage.sampling_params import RequestOutputKind, SamplingParams
from jaxpage.validation import check_text

logger = logging.getLogger("jaxpage")


class ServerBusyError(RuntimeError):
    """max_waiting_requests requests are waiting already: try again later."""


class _Outputs:
    """A stream's outputs its caller has not taken yet, in the caller's event loop. The engine gives a streamed request
    what is new at each step (RequestOutputKind.DELTA); here they add up to what the caller asked for: everything so far
    (CUMULATIVE), or what is new since the caller last took one (DELTA: merged while the caller lags, vLLM's
    RequestOutputCollector); a FINAL_ONLY request's one output is taken as it is. A slow caller costs neither the
    engine nor memory an item per step. An exception (the request refused, the engine stopped) comes after the output
    waiting."""

    def __init__(self, kind: RequestOutputKind):
        self.kind = kind
        self.output: RequestOutput | None = None  # waiting for the caller
        self.total: RequestOutput | None = None  # everything so far (CUMULATIVE)
        self.error: BaseException | None = None
        self.ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, BaseException):
            self.error = item
        elif self.kind is RequestOutputKind.CUMULATIVE:
            self.total = self.output = item if self.total is None else self.total.followed_by(item)
        elif self.kind is RequestOutputKind.DELTA and self.output is not None:
            self.output = self.output.followed_by(item)
        else:
            self.output = item
        self.ready.set()

    async def get(self) -> RequestOutput:
        while self.output is None and self.error is None:
            self.ready.clear()
            await self.ready.wait()
        if self.output is None:
            raise self.error
        output, self.output = self.output, None
        return output


def _put_all(items: list[tuple[_Outputs, RequestOutput | BaseException]]) -> None:
    for outputs, item in items:
        outputs.put(item)


class _Stream(NamedTuple):
    loop: asyncio.AbstractEventLoop  # the caller's
    outputs: _Outputs  # what its caller has not taken yet
    request_id: str  # the caller's


class AsyncEngine:
    def __init__(self, engine, stall_timeout_s: float = 120.0, max_waiting_requests: int | None = None):
        """engine: an LLMEngine, stepped by a thread of this process (jaxpage.entrypoints.engine_loop), or an
        EngineProcess (jaxpage.entrypoints.engine_process), whose engine steps in a process of its own."""
        self._core = engine if isinstance(engine, EngineProcess) else LocalEngine(engine)
        self.engine = self._core.engine  # what the server reads of it: its config, generation defaults, LoRA adapters
        self.stall_timeout_s = stall_timeout_s
        self.max_waiting_requests = max_waiting_requests
        # Each stream's request has its own id in the engine (request_id#serial): the final output of an aborted
        # request can come after a new request took its request_id, and must not end that one's stream.
        self._streams: dict[str, _Stream] = {}  # by the engine's request id
        self._engine_ids: dict[str, str] = {}  # request_id -> the engine's, for every open stream
        self._serial = itertools.count()
        self._lock = threading.Lock()  # guards _streams, _engine_ids and the counts; never held across a step
        self._admitted: set[str] = set()  # the engine ids of requests admitted and not yet in the engine
        self._engine_waiting = 0  # requests waiting in the engine, as the loop last counted them
        self._ended: BaseException | None = None  # why the loop stopped, once it has
        self.num_turns = 0  # turns of the loop handed over: its steps, and the turns that found nothing to do
        self.last_turn_at = 0.0  # time.monotonic() at the end of the latest turn handed over
        # Called with every output of the engine (the server's metrics), in the thread that hands it over: a streamed
        # request's outputs hold what each step added (DELTA), a whole one's its one final output (FINAL_ONLY). An
        # observer's own failure is logged, never the loop's.
        self.observers: list[Callable[[RequestOutput], None]] = []

    def start(self) -> AsyncEngine:
        self._core.start(self._on_turn, self._on_exit)
        return self

    # ----- callers (any event loop) -----

    async def generate(
        self,
        request_id: str,
        prompt: str | dict,
        params: SamplingParams | None = None,
        *,
        fit_context: bool = False,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """The request's outputs as the engine makes progress (through LoRA adapter `lora_request` if given), the last
        one finished. ValueError (nothing queued) for
        an invalid request, and with fit_context for max_tokens beyond what the context leaves after the prompt (as
        OpenAI's API refuses it; otherwise generation stops there, finish_reason "length"); ServerBusyError when
        max_waiting_requests wait; EngineDeadError when the loop has stopped. Leaving the iteration early aborts it."""
        self._check_alive()
        kind = RequestOutputKind.CUMULATIVE
        if isinstance(params, SamplingParams | None):  # (anything else is refused below, by prepare)
            params = params or self._core.default_params
            kind = params.output_kind
            if kind is RequestOutputKind.CUMULATIVE:  # the engine gives what is new; _Outputs adds it up
                params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
        outputs = _Outputs(kind)
        with self._lock:
            if request_id in self._engine_ids:
                raise ValueError(f"request_id {request_id!r} is already in use")
            limit = self.max_waiting_requests
            if limit is not None and len(self._admitted) + self._engine_waiting >= limit:
                raise ServerBusyError(f"the server is busy: {limit} requests are waiting already")
            engine_id = f"{request_id}#{next(self._serial)}"
            self._engine_ids[request_id] = engine_id
            self._streams[engine_id] = _Stream(asyncio.get_running_loop(), outputs, request_id)
            self._admitted.add(engine_id)
        finished = sent = False
        try:
            self._check_alive()  # again: a loop that died before the stream was listed did not tell it
            # In a worker thread: tokenizing a long prompt would hold up every other stream of this event loop.
            prepare = self._core.prepare
            request = await asyncio.to_thread(prepare, engine_id, prompt, params, lora_request)
            if fit_context:
                _check_fits_context(request, self.max_model_len)
            self._core.send("add", request)
            sent = True
            while True:
                item = await outputs.get()
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            with self._lock:
                del self._streams[engine_id], self._engine_ids[request_id]
                self._admitted.discard(engine_id)
            if sent and not finished:  # the caller went away (or the engine refused it: the abort then does nothing)
                self._core.send("abort", engine_id)

    @property
    def tokenizer(self):
        """The engine's tokenizer (None without one: skip_tokenizer_init)."""
        return self._core.tokenizer

    @property
    def max_model_len(self) -> int:
        return self._core.max_model_len

    @property
    def vocab_size(self) -> int:
        return self._core.vocab_size

    def gauges(self):
        """The engine's gauges for the metrics (jaxpage.entrypoints.metrics.EngineGauges): now, or as the engine
        process last sent them."""
        return self._core.gauges()

    @property
    def num_waiting_requests(self) -> int:
        """Requests waiting, as admission counts them (see the module docstring)."""
        with self._lock:
            return len(self._admitted) + self._engine_waiting

    def abort(self, request_id: str) -> None:
        """Aborts the request at the loop's next turn (without waiting for a step); its stream ends with the final
        output (finish_reason "abort"). An unknown or finished request_id is ignored; one that is not a string is a
        ValueError naming it."""
        check_text("request_id", request_id)
        with self._lock:
            engine_id = self._engine_ids.get(request_id)
        if engine_id is not None:
            self._core.send("abort", engine_id)

    def abort_all(self) -> None:
        """Aborts every request of an open stream at the loop's next turn (a server whose shutdown time is up)."""
        with self._lock:
            unfinished = list(self._streams)
        for engine_id in unfinished:
            self._core.send("abort", engine_id)

    def _busy(self) -> bool:
        return self._core.busy()

    def health(self) -> tuple[bool, str]:
        """(healthy, why): see the module docstring."""
        if not self._core.alive():
            return False, f"the engine loop is not running ({self._ended or self._core.error!r})"
        stalled = time.monotonic() - self._core.last_progress
        if self._busy() and stalled > self.stall_timeout_s:
            return False, f"no step has finished for {stalled:.0f} s with requests pending"
        return True, "ok"

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Lets the requests in flight finish within timeout_s, aborts the rest, and stops the loop."""
        deadline = time.monotonic() + timeout_s
        while self._busy() and time.monotonic() < deadline and self._core.alive():
            time.sleep(0.05)
        self.abort_all()
        deadline = time.monotonic() + 5.0
        while self._busy() and time.monotonic() < deadline and self._core.alive():
            time.sleep(0.01)
        self._core.stop(max(5.0, timeout_s))

    def _check_alive(self) -> None:
        if self._ended is not None or not self._core.alive():
            raise EngineDeadError("the engine loop is not running")

    # ----- the loop's turns (its thread, or the thread reading the engine process) -----

    def _on_turn(self, turn: LoopTurn) -> None:
        self.num_turns += 1
        self.last_turn_at = turn.ended_at
        with self._lock:  # counted in the engine now, no longer as admitted
            self._admitted.difference_update(turn.added)
            self._engine_waiting = turn.num_waiting
            items = [(self._streams.get(rid), e) for rid, e in turn.refused]
        for output in turn.outputs:
            for observe in self.observers:
                try:
                    observe(output)
                except Exception:
                    logger.exception("an observer of the engine's outputs failed")
            with self._lock:
                stream = self._streams.get(output.request_id)
            if stream is not None:
                items.append((stream, dataclasses.replace(output, request_id=stream.request_id)))
        self._hand_over(items)

    def _on_exit(self, ended: BaseException) -> None:
        """The loop stopped (ended: EngineDeadError saying why): nobody may wait for an output that will not come."""
        with self._lock:
            self._ended = ended
            streams = list(self._streams.values())
        self._hand_over([(stream, ended) for stream in streams])

    @staticmethod
    def _hand_over(items: list[tuple[_Stream | None, RequestOutput | BaseException]]) -> None:
        """Puts each item into its stream's outputs, in its caller's event loop: one call a loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for stream, item in items:
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream.outputs, item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # the caller's event loop is closed: nobody is listening
                pass


class LocalEngine:
    """An LLMEngine stepped by a thread of this process (EngineLoop), as AsyncEngine drives it."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.loop: EngineLoop | None = None

    def start(self, report: Callable[[LoopTurn], None], on_exit: Callable[[BaseException], None]) -> None:
        self.loop = EngineLoop(self.engine, report, on_exit).start()

    def prepare(self, request_id: str, prompt, params, lora_request) -> Request:
        return self.engine.prepare_request(request_id, prompt, params, lora_request=lora_request)

    @property
    def default_params(self) -> SamplingParams:
        """What a request without sampling params gets."""
        return self.engine.input_processor.default_params

    def send(self, kind: str, item) -> None:
        if self.loop is not None:
            self.loop.send(kind, item)

    def busy(self) -> bool:
        return self.loop is not None and self.loop.busy()

    def alive(self) -> bool:
        return self.loop is not None and self.loop.alive()

    @property
    def error(self) -> BaseException | None:
        return None if self.loop is None else self.loop.error

    @property
    def last_progress(self) -> float:
        return time.monotonic() if self.loop is None else self.loop.last_progress

    def stop(self, timeout_s: float) -> None:
        if self.loop is not None:
            self.loop.stop(timeout_s)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.model_config.vocab_size

    def gauges(self):
        return engine_gauges(self.engine)


def _check_fits_context(request: Request, max_model_len: int) -> None:
    prompt_tokens, max_tokens = len(request.prompt_token_ids), request.params.max_tokens
    if max_tokens is not None and prompt_tokens + max_tokens > max_model_len:
        raise ValueError(
            f"max_tokens is too large: {max_tokens}. This model's maximum context length is {max_model_len} tokens "
            f"and the request has {prompt_tokens} input tokens ({max_tokens} > {max_model_len} - {prompt_tokens})"
        )
