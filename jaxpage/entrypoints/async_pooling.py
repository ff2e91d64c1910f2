"""AsyncPoolingEngine: a PoolingEngine's loop, in a thread of its own, for asyncio callers (the HTTP server).

A caller's inputs are checked and tokenized in a worker thread (ValueError naming the field, nothing queued), then
go into the loop's inbox; between two steps the loop takes everything there, so inputs that arrive during a step
join the next one (each step packs as many as fit: jaxpage.engine.pooling_engine). Each output goes back to its
caller's event loop. A caller that stops waiting (a client that disconnected: its task is cancelled) drops its
inputs that have not run yet. A step that fails fails its inputs' requests with the error and the loop goes on; if
the loop itself dies, every waiting caller gets EngineDeadError.

Admission (`max_waiting_requests`): a request is refused with ServerBusyError, before it is tokenized, when that many
inputs wait already. Health: alive, and with work pending, a step finished within `stall_timeout_s`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

from jaxpage.engine.pooling_engine import PoolingEngine, PoolingRequest
from jaxpage.entrypoints.async_engine import ServerBusyError
from jaxpage.entrypoints.engine_loop import EngineDeadError
from jaxpage.outputs import PoolingRequestOutput

logger = logging.getLogger("jaxpage")


class AsyncPoolingEngine:
    def __init__(self, engine: PoolingEngine, stall_timeout_s: float = 120.0, max_waiting_requests: int | None = None):
        self.engine = engine
        self.stall_timeout_s = stall_timeout_s
        self.max_waiting_requests = max_waiting_requests
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._inbox: list[tuple[PoolingRequest, asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._aborts: list[str] = []
        self._futures: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._admitted = 0  # inputs admitted and not yet taken by the loop (being tokenized, or in the inbox)
        self._stopping = False
        self._dead: BaseException | None = None
        self._last_progress = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="jaxpage-pooling-loop", daemon=True)

    def start(self) -> AsyncPoolingEngine:
        self._thread.start()
        return self

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    async def pool(self, prepare: Callable[[], list[PoolingRequest]], count: int) -> list[PoolingRequestOutput]:
        """The outputs of the requests `prepare` makes (called in a worker thread: checking and tokenizing), in its
        order; `count`: how many it makes, for admission. Raises ServerBusyError, EngineDeadError, or prepare's
        ValueError."""
        with self._lock:
            if self._dead is not None or self._stopping:
                raise EngineDeadError("the engine has stopped; it takes no more requests")
            waiting = self._admitted + self.engine.num_waiting_requests
            if self.max_waiting_requests is not None and waiting + count > self.max_waiting_requests:
                raise ServerBusyError(f"{waiting} inputs are waiting already (max_waiting_requests)")
            self._admitted += count
        try:
            requests = await asyncio.to_thread(prepare)
        except BaseException:
            with self._lock:
                self._admitted -= count
            raise
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in requests]
        with self._wake:
            self._admitted -= count
            self._inbox += [(r, loop, f) for r, f in zip(requests, futures, strict=True)]
            self._wake.notify()
        try:
            return list(await asyncio.gather(*futures))
        except asyncio.CancelledError:
            with self._wake:
                self._aborts += [r.request_id for r in requests]
                self._wake.notify()
            raise

    def abort_all(self) -> None:
        """Drops every input not yet run and fails its caller with EngineDeadError (a server whose shutdown time is
        up); a step under way finishes."""
        with self._wake:
            self._aborts += [request.request_id for request, _, _ in self._inbox] + list(self._futures)
            self._futures.update({r.request_id: (loop, f) for r, loop, f in self._inbox})
            self._inbox = []
            pending = list(self._futures)
            self._wake.notify()
        for request_id in pending:
            self._deliver(request_id, EngineDeadError("the server shut down before the request ran"))

    def health(self) -> tuple[bool, str]:
        if self._dead is not None or not self._thread.is_alive():
            return False, f"the engine loop has stopped: {self._dead!r}"
        busy = self.engine.has_unfinished_requests() or self._inbox
        if busy and time.monotonic() - self._last_progress > self.stall_timeout_s:
            return False, f"no step finished in {self.stall_timeout_s:.0f} s"
        return True, "ok"

    def shutdown(self, timeout_s: float = 30.0) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout=timeout_s)

    def _run(self) -> None:
        try:
            while True:
                with self._wake:
                    while not (self._inbox or self._aborts or self._stopping or self.engine.has_unfinished_requests()):
                        self._wake.wait()
                    if self._stopping:
                        break
                    inbox, self._inbox = self._inbox, []
                    aborts, self._aborts = self._aborts, []
                for request, loop, future in inbox:
                    self._futures[request.request_id] = (loop, future)
                self.engine.add_prepared_requests([request for request, _, _ in inbox])
                self.engine.abort_request(aborts)
                for request_id in aborts:
                    self._futures.pop(request_id, None)
                if self.engine.has_unfinished_requests():
                    for output in self.engine.step():
                        self._deliver(output.request_id, output)
                    self._last_progress = time.monotonic()
        except BaseException as e:  # the loop is dead: every waiting caller hears it
            logger.exception("the pooling engine loop died")
            self._dead = e
        error = EngineDeadError("the engine stopped before the request ran" if self._dead is None else repr(self._dead))
        with self._lock:
            pending = list(self._futures) + [request.request_id for request, _, _ in self._inbox]
            self._futures.update({r.request_id: (loop, f) for r, loop, f in self._inbox})
        for request_id in pending:
            self._deliver(request_id, error)

    def _deliver(self, request_id: str, item) -> None:
        target = self._futures.pop(request_id, None)
        if target is None:
            return
        loop, future = target

        def settle():
            if not future.done():
                (future.set_exception if isinstance(item, BaseException) else future.set_result)(item)

        try:
            loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the caller's event loop has closed
            pass
