"""EngineLoop: one LLMEngine stepped by a thread of its own ("jaxpage-engine"), fed through an inbox.

The loop steps while any request is unfinished and otherwise sleeps until something arrives in its inbox: ("add",
Request) -- a request checked and tokenized already (LLMEngine.prepare_request) --, ("abort", request_id) and
("stop_samples", (request_id, indexes)), in the order they were sent, or the stop. Between two steps it takes everything
in its inbox, so every request that arrived during a step joins the next one. Each turn ends with a LoopTurn handed to
`report` in the loop thread: the requests it queued or refused, the outputs of its step, and how many requests wait in
the engine. If the loop itself dies, `on_exit` hears why; after a stop it hears EngineDeadError("the engine has shut
down").

The loop runs where its engine is: beside the server (jaxpage.entrypoints.async_engine) or in an engine process of its
own (jaxpage.entrypoints.engine_process), whose report sends each turn to the server's process.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

from jaxpage.engine.llm_engine import LLMEngine
from jaxpage.engine.output_processor import Request, StepTokens, TokenDelta
from jaxpage.outputs import RequestOutput


class EngineDeadError(RuntimeError):
    """The engine loop has stopped: no request can be served."""


@dataclasses.dataclass
class LoopTurn:
    """What one turn of the loop did."""

    added: list[str]  # request ids queued in the engine this turn
    refused: list[tuple[str, BaseException]]  # (request id, why) of requests the engine would not queue
    # of its step (TokenDeltas and StepTokens: an engine process's requests)
    outputs: list[RequestOutput | TokenDelta | StepTokens]
    num_waiting: int  # requests waiting in the engine after it
    ended_at: float = 0.0  # time.monotonic() at its end (the clock is the machine's: any process may compare)
    gauges: object = None  # the engine's gauges (jaxpage.entrypoints.metrics.EngineGauges) where asked for


class EngineLoop:
    def __init__(
        self,
        engine: LLMEngine,
        report: Callable[[LoopTurn], None],
        on_exit: Callable[[BaseException], None],
        gauges: Callable[[LLMEngine], object] | None = None,
        gauges_every_s: float = 0.0,
    ):
        """gauges(engine), if given, goes with a turn's report at most every gauges_every_s seconds (and with every
        turn that finds nothing to do)."""
        self.engine = engine
        self._report = report
        self._on_exit = on_exit
        self._gauges, self._gauges_every_s, self._gauges_at = gauges, gauges_every_s, float("-inf")
        self._lock = threading.Lock()  # guards _inbox; never held across a step
        self._inbox: list[tuple[str, Request | str]] = []
        self._work = threading.Event()
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self.last_progress = time.monotonic()  # when the loop last finished a step (or found nothing to do)
        self._thread = threading.Thread(target=self._run, name="jaxpage-engine", daemon=True)

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def send(self, kind: str, item) -> None:
        """("add", Request) or ("abort", request_id), for the loop's next turn."""
        with self._lock:
            self._inbox.append((kind, item))
        self._work.set()

    def busy(self) -> bool:
        """Whether a request is unfinished or something waits in the inbox."""
        return self.engine.has_unfinished_requests() or bool(self._inbox)

    def alive(self) -> bool:
        return self.error is None and not self._stop.is_set() and self._thread.is_alive()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stops the loop after its turn (what is unfinished stays so) and waits up to timeout_s for it."""
        self._stop.set()
        self._work.set()
        self._thread.join(timeout=timeout_s)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                added, refused = self._take_inbox()
                idle = not self.engine.has_unfinished_requests()
                outputs = self.engine.step()  # idle, it gives the final outputs of requests aborted meanwhile
                self.last_progress = now = time.monotonic()
                gauges = None
                if self._gauges is not None and (idle or now - self._gauges_at >= self._gauges_every_s):
                    gauges, self._gauges_at = self._gauges(self.engine), now
                self._report(LoopTurn(added, refused, outputs, self.engine.num_waiting_requests(), now, gauges))
                if idle:  # until a request, an abort or the stop comes (each sets _work)
                    self._work.wait()
                    self._work.clear()
            ended: BaseException = EngineDeadError("the engine has shut down")
        except BaseException as e:  # noqa: BLE001 -- every stream must hear of it
            self.error = e
            ended = EngineDeadError(f"the engine loop stopped ({type(e).__name__}: {e})")
            ended.__cause__ = e
        self._on_exit(ended)

    def _take_inbox(self) -> tuple[list[str], list[tuple[str, BaseException]]]:
        """Queues the requests and applies the aborts sent since the last turn, in order: (the ids queued, those
        refused with why: a request_id taken by a user of the LLMEngine itself)."""
        with self._lock:
            inbox, self._inbox = self._inbox, []
        added, refused = [], []
        for kind, item in inbox:
            if kind == "abort":
                self.engine.abort_request(item)
                continue
            if kind == "stop_samples":  # (request_id, indexes): stop strings found where the text is made
                self.engine.stop_samples(*item)
                continue
            try:
                self.engine.add_prepared_requests([item])
                added.append(item.request_id)
            except ValueError as e:
                refused.append((item.request_id, e))
        return added, refused
