"""AsyncEngine: one LLMEngine stepped by one background thread, for asyncio callers (the HTTP server).

The engine loop (thread "jaxpage-engine") steps while any request is unfinished and sleeps otherwise. Each request
streams into an asyncio.Queue on its caller's event loop: the loop thread hands every RequestOutput over with
`loop.call_soon_threadsafe`, so a handler never waits on the engine and the engine never waits on a handler. A caller
that stops iterating before the request finished (a client that disconnected: its task is cancelled) aborts the
request at the loop's next turn, which frees its pages. Callers never wait for the engine's lock (a step holds it
throughout): add_request runs in a worker thread, and aborts are queued for the loop.

Requests are checked when they are added, in the caller's thread (LLMEngine.add_request: ValueError naming the field),
so nothing a caller sends reaches the loop unchecked. A failing step ends every request then running with the error
(LLMEngine.step) and the loop goes on; if the loop itself dies, every open stream raises EngineDeadError and the
engine takes no more requests.

Health (`health()`): healthy only while the loop is alive and, while work is pending, has finished a step within
`stall_timeout_s` (a step stuck in the device, or a loop that no longer steps, is not healthy).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable

from jaxpage.llm_engine import LLMEngine
from jaxpage.outputs import RequestOutput
from jaxpage.sampling_params import SamplingParams

logger = logging.getLogger("jaxpage")

IDLE_WAIT_S = 0.5  # how long the idle loop sleeps before looking again (a new request wakes it at once)


class EngineDeadError(RuntimeError):
    """The engine loop has stopped: no request can be served."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine, stall_timeout_s: float = 120.0):
        self.engine = engine
        self.stall_timeout_s = stall_timeout_s
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._work = threading.Event()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._last_progress = time.monotonic()  # when the loop last finished a step (or found nothing to do)
        self._adding: set[str] = set()  # request ids whose add_request runs in a worker thread
        self._aborts: list[str] = []  # request ids to abort at the loop's next turn
        self._thread = threading.Thread(target=self._run, name="jaxpage-engine", daemon=True)
        # Called in the loop thread with every output it hands over (the server's metrics); an observer's own failure
        # is logged, never the loop's.
        self.observers: list[Callable[[RequestOutput], None]] = []

    def start(self) -> AsyncEngine:
        self._thread.start()
        return self

    # ----- callers (any event loop) -----

    async def generate(
        self, request_id: str, prompt: str | dict, params: SamplingParams | None = None
    ) -> AsyncIterator[RequestOutput]:
        """The request's outputs as the engine makes progress, the last one finished. ValueError (nothing queued) for
        an invalid request; EngineDeadError when the loop has stopped. Leaving the iteration early aborts it."""
        self._check_alive()
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already in use")
            self._streams[request_id] = (asyncio.get_running_loop(), queue)
        finished = False
        try:
            self._check_alive()  # again: a loop that died before the stream was listed did not tell it
            with self._lock:
                self._adding.add(request_id)
            # In a worker thread: add_request waits for the engine's lock, which a step holds throughout.
            await asyncio.to_thread(self._add, request_id, prompt, params)
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise EngineDeadError(f"the engine loop stopped ({type(item).__name__}: {item})") from item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:  # the caller went away (or the request was refused: then there is nothing to abort)
                self.abort(request_id)

    @property
    def num_waiting(self) -> int:
        """Sequences waiting to be admitted."""
        return len(self.engine.scheduler.waiting)

    def abort(self, request_id: str) -> None:
        """Aborts the request at the loop's next turn (without waiting for the engine's lock)."""
        with self._lock:
            self._aborts.append(request_id)
        self._work.set()

    def _add(self, request_id: str, prompt, params) -> None:
        try:
            self.engine.add_request(request_id, prompt, params)
        finally:
            with self._lock:
                self._adding.discard(request_id)
            self._work.set()

    def _apply_aborts(self) -> None:
        """In the loop thread: the aborts asked for, but those of requests still being added wait for that."""
        with self._lock:
            now = [rid for rid in self._aborts if rid not in self._adding]
            self._aborts = [rid for rid in self._aborts if rid in self._adding]
        if now:
            self.engine.abort_request(now)

    def health(self) -> tuple[bool, str]:
        """(healthy, why): see the module docstring."""
        if self._error is not None or not self._thread.is_alive():
            return False, f"the engine loop is not running ({self._error!r})"
        stalled = time.monotonic() - self._last_progress
        if self.engine.has_unfinished_requests() and stalled > self.stall_timeout_s:
            return False, f"no step has finished for {stalled:.0f} s with requests pending"
        return True, "ok"

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Lets the requests in flight finish within timeout_s, aborts the rest, and stops the loop."""
        deadline = time.monotonic() + timeout_s
        while self.engine.has_unfinished_requests() and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.05)
        with self._lock:
            unfinished = list(self._streams)
        for request_id in unfinished:
            self.abort(request_id)
        deadline = time.monotonic() + 5.0
        while self.engine.has_unfinished_requests() and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.01)
        self._stop.set()
        self._work.set()
        self._thread.join(timeout=max(5.0, timeout_s))

    def _check_alive(self) -> None:
        if self._error is not None or self._stop.is_set() or not self._thread.is_alive():
            raise EngineDeadError("the engine loop is not running")

    # ----- the loop thread -----

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._apply_aborts()
                idle = not self.engine.has_unfinished_requests()
                self._deliver(self.engine.step())  # idle, it hands over the final outputs of requests aborted meanwhile
                self._last_progress = time.monotonic()
                if idle:
                    self._work.wait(IDLE_WAIT_S)
                    self._work.clear()
        except BaseException as e:  # noqa: BLE001 -- every stream must hear of it
            self._error = e
            with self._lock:
                streams = list(self._streams.values())
            for loop, queue in streams:
                self._put(loop, queue, e)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            for observe in self.observers:
                try:
                    observe(output)
                except Exception:
                    logger.exception("an observer of the engine's outputs failed")
            with self._lock:
                stream = self._streams.get(output.request_id)
            if stream is not None:
                self._put(*stream, output)

    @staticmethod
    def _put(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, item) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the caller's event loop is closed: nobody is listening
            pass
