"""EngineProcess: an LLMEngine and its loop in a process of its own (vLLM's engine core process), driven from the
server's process.

The engine process (spawned, "jaxpage-engine") loads the model, warms it up, and runs the engine loop
(jaxpage.entrypoints.engine_loop) over it; the server's process keeps the HTTP handling, the chat templates and the
tokenization of new requests, so none of them takes the GIL from the loop that feeds the device. A request is checked
and tokenized here, by an InputProcessor of this process over the same tokenizer, model facts and arguments (every
ValueError a caller would get, it gets here, before anything is sent); the engine process then makes it its own from the
prompt's token ids (the same checks again, cheap without text; its sampling seeds, grammar and LoRA adapter). The engine
gives token ids alone (its requests have no detokenizers), and what each step added (a request's outputs after its
first as TokenDeltas, plain values, where they carry nothing more); the text is made here, as the turns
come (jaxpage.engine.output_texts: detokenization, stop strings, the outputs as each caller asks), so detokenization
takes no time from the loop either; a sample a stop string ends here is stopped in the engine. The pipe carries ("add",
...), ("abort", request id), ("stop_samples", (request id, indexes)) and ("forget_lora", id) one way, and the turns of
the loop (each its queued and refused requests, its step's outputs, the count waiting, the gauges for the metrics at
most every GAUGES_EVERY_S) the other way, sent by a thread of the engine process (the loop never waits for this process
to read them: turns that come meanwhile go together), where a thread of this process hands them to the AsyncEngine.

If the engine process dies (killed, out of memory), the thread reading its pipe finds the pipe closed: every open stream
hears EngineDeadError, and /health fails. A model that does not load fails the EngineProcess's construction with the
engine process's own error.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import signal
import threading
import time
from collections.abc import Callable

from jaxpage.config import EngineConfig
from jaxpage.engine.lora_adapters import LoRAAdapters
from jaxpage.engine.output_processor import Request, each_output
from jaxpage.engine.output_texts import OutputTexts, engine_output_kind, request_id_of
from jaxpage.entrypoints.engine_loop import EngineDeadError, EngineLoop, LoopTurn
from jaxpage.entrypoints.metrics import EngineGauges, engine_gauges

logger = logging.getLogger("jaxpage")
GAUGES_EVERY_S = 0.1  # while the engine steps, its gauges come at most this often


@dataclasses.dataclass(frozen=True)
class EngineFacts:
    """What the server's process needs of the engine to take requests for it (sent once it has started)."""

    config: EngineConfig  # as the engine runs it
    model_config: object  # jaxpage.config.ModelConfig
    max_model_len: int
    num_pages: int  # a replica's pool, the null page included
    eos_token_ids: frozenset[int]
    generation_defaults: object  # jaxpage.models.generation_config.GenerationDefaults
    gauges: EngineGauges


class _ForwardedAdapters(LoRAAdapters):
    """This process's LoRA adapters (read to check a request's): one forgotten is forgotten by the engine too."""

    forward: Callable[[int], None] = staticmethod(lambda lora_int_id: None)

    def forget(self, lora_int_id: int) -> None:
        super().forget(lora_int_id)
        self.forward(lora_int_id)


class EngineProcess:
    """As AsyncEngine drives an engine: start, prepare, send, busy, alive, stop, and what the server reads (tokenizer,
    max_model_len, vocab_size, config, generation_defaults, input_processor, gauges)."""

    def __init__(
        self,
        engine_args: dict,
        warmup: bool = True,
        start_timeout_s: float | None = None,
        make_engine: Callable | None = None,
    ):
        """Starts the engine process (which loads the model, warms it up unless warmup is False, and starts its loop)
        and waits for it; the engine process's error if it fails (TimeoutError after start_timeout_s). make_engine:
        how the engine process makes its engine from the EngineConfig of engine_args (default LLMEngine; a function
        the engine process can import by name: the benchmarks' engine with its device stubbed, say)."""
        from jaxpage.engine.input_processor import InputProcessor  # (imports the tokenizers: not for the child's sake)
        from jaxpage.engine.llm_engine import engine_tokenizer

        config = EngineConfig(**engine_args)  # bad arguments fail here, before any process starts
        self.error: BaseException | None = None
        self._send_lock = threading.Lock()
        context = multiprocessing.get_context("spawn")  # a fork would copy whatever jax state this process has
        self._conn, child_end = context.Pipe()
        self._process = context.Process(
            target=_run_engine, args=(engine_args, warmup, child_end, make_engine), name="jaxpage-engine", daemon=True
        )
        self._process.start()
        child_end.close()
        try:  # the tokenizer loads here while the engine process loads the model
            self.tokenizer = None if config.skip_tokenizer_init else engine_tokenizer(config)
        except BaseException:
            self._process.kill()
            raise
        facts = self._started(start_timeout_s)
        self.config, self.generation_defaults = facts.config, facts.generation_defaults
        self.max_model_len, self.vocab_size = facts.max_model_len, facts.model_config.vocab_size
        self._gauges = facts.gauges
        adapters = _ForwardedAdapters.for_engine(facts.model_config, facts.config)
        adapters.forward = lambda lora_int_id: self._send(("forget_lora", lora_int_id))
        sizes = (self.vocab_size, facts.max_model_len, facts.num_pages)
        defaults = facts.generation_defaults.sampling_params()
        self.input_processor = InputProcessor(
            self.tokenizer, *sizes, facts.config, facts.eos_token_ids, adapters, defaults
        )
        self.last_progress = time.monotonic()  # when the engine last reported a turn
        self._sent = self._taken = 0  # messages sent to the engine process; of them, taken into its loop's inbox
        self._busy = False  # whether the engine had unfinished requests at its latest turn
        self._reader: threading.Thread | None = None
        self.texts = OutputTexts()  # the text of the engine's outputs, made here

    @property
    def engine(self) -> EngineProcess:
        """What the server reads of the engine (config, generation_defaults, input_processor): this."""
        return self

    def _started(self, timeout_s: float | None) -> EngineFacts:
        if not self._conn.poll(timeout_s):
            self._process.kill()
            raise TimeoutError(f"the engine process did not start in {timeout_s} s")
        try:
            kind, payload = self._conn.recv()
        except EOFError:
            self._process.join()
            raise EngineDeadError(f"the engine process exited (exit code {self._process.exitcode})") from None
        if kind == "failed":
            self._process.join()
            raise payload
        return payload

    def start(self, report: Callable[[LoopTurn], None], on_exit: Callable[[BaseException], None]) -> None:
        """Hands every turn of the engine's loop to report, in a thread of this process, then on_exit(why it
        ended)."""
        self._reader = threading.Thread(
            target=self._read, args=(report, on_exit), name="jaxpage-engine-reader", daemon=True
        )
        self._reader.start()

    def _read(self, report: Callable[[LoopTurn], None], on_exit: Callable[[BaseException], None]) -> None:
        try:
            while True:
                kind, payload = self._conn.recv()
                if kind == "exit":
                    ended = payload
                    break
                for turn, taken, busy in payload:  # ("turns", the turns since the last)
                    self.last_progress, self._taken, self._busy = time.monotonic(), taken, busy
                    if turn.gauges is not None:
                        self._gauges = turn.gauges
                    report(self._with_texts(turn))
        except (EOFError, OSError):
            self._process.join(timeout=5)
            ended = EngineDeadError(f"the engine process exited (exit code {self._process.exitcode})")
        except Exception as e:  # noqa: BLE001 -- a fault of this side: nothing more can be read, nobody may wait
            logger.exception("reading the engine process's turns failed; it is stopped")
            self._process.kill()
            ended = EngineDeadError(f"reading the engine process failed ({type(e).__name__}: {e})")
        self.error = ended
        on_exit(ended)

    def _with_texts(self, turn: LoopTurn) -> LoopTurn:
        """The turn with its outputs' text made (OutputTexts), the samples a stop string ended told to stop."""
        for request_id, _ in turn.refused:
            self.texts.forget(request_id)
        outputs = []
        for output in each_output(turn.outputs):  # RequestOutputs and TokenDeltas
            with_text, stopped = self.texts.apply(output)
            if stopped:
                self._send(("stop_samples", (request_id_of(output), stopped)))
            if with_text is not None:
                outputs.append(with_text)
        return dataclasses.replace(turn, outputs=outputs)

    def prepare(self, request_id: str, prompt, params, lora_request) -> Request:
        """The checked and tokenized request (LLMEngine.prepare_request's checks), which `send` sends."""
        return self.input_processor.prepare(request_id, prompt, params, None, lora_request)

    @property
    def default_params(self):
        """What a request without sampling params gets."""
        return self.input_processor.default_params

    def send(self, kind: str, item) -> None:
        """("add", a Request from prepare) or ("abort", request id), for the engine loop's next turn."""
        if kind == "add":  # the engine gives its token ids; its text is made here (OutputTexts)
            self.texts.add(item)
            prompt = {"prompt_token_ids": item.prompt_token_ids, "prompt": item.prompt}
            params = dataclasses.replace(item.params, output_kind=engine_output_kind(item))
            item = (item.request_id, prompt, params, item.metrics.arrival_time, item.lora_request)
        self._send((kind, item))

    def _send(self, message: tuple) -> None:
        with self._send_lock:
            if self.error is not None:
                return  # nobody will read it
            self._sent += 1
            try:
                self._conn.send(message)
            except (BrokenPipeError, OSError):  # the engine process is gone: the reader tells everyone
                pass

    def busy(self) -> bool:
        return self._busy or self._sent > self._taken

    def alive(self) -> bool:
        return self.error is None and self._process.is_alive()

    def gauges(self) -> EngineGauges:
        return self._gauges

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stops the engine loop and its process (killed if it has not ended within timeout_s)."""
        self._send(("stop", None))
        self._process.join(timeout_s)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        if self._reader is not None:
            self._reader.join(timeout=5)
        self._conn.close()


def _run_engine(engine_args: dict, warmup: bool, conn, make_engine: Callable | None) -> None:
    """The engine process: the engine, its loop, and the pipe's messages into its inbox until the server's process
    says stop or goes away."""
    from jaxpage.engine.llm_engine import LLMEngine
    from jaxpage.entrypoints.startup_heap import freeze_startup_heap

    # Ctrl-C reaches every process of the terminal's group: the server's process stops gracefully, and this one
    # serves the requests it lets finish until it says stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        engine = (make_engine or LLMEngine)(EngineConfig(**engine_args))
        if warmup:
            engine.warmup()
    except BaseException as e:  # noqa: BLE001 -- the server's process raises it
        conn.send(("failed", _picklable(e)))
        return
    freeze_startup_heap()  # this process serves this engine for its life
    facts = EngineFacts(
        engine.config,
        engine.model_config,
        engine.max_model_len,
        engine.input_processor.num_pages,
        engine.input_processor.eos_token_ids,
        engine.generation_defaults,
        engine_gauges(engine),
    )
    conn.send(("ready", facts))
    sender = _TurnSender(conn)
    taken = 0  # messages put into the loop's inbox

    def report(turn: LoopTurn) -> None:
        sender.put((turn, taken, loop.busy()))

    def on_exit(ended: BaseException) -> None:
        sender.close(_picklable(ended))

    loop = EngineLoop(engine, report, on_exit, engine_gauges, GAUGES_EVERY_S)
    loop.start()  # (after `loop` is bound: its first turn reports at once)
    while True:
        try:
            kind, item = conn.recv()
        except (EOFError, OSError):  # the server's process has gone
            break
        taken += 1  # (before it goes in: a turn that counts it and finds nothing to do has done it)
        if kind == "stop":
            break
        if kind == "add":
            request_id, prompt, params, arrival_time, lora_request = item
            try:
                request = engine.prepare_request(request_id, prompt, params, arrival_time, lora_request)
            except Exception as e:  # noqa: BLE001 -- its caller hears why
                report(LoopTurn([], [(request_id, e)], [], engine.num_waiting_requests(), time.monotonic()))
                continue
            request.detokenizers = [None] * len(request.seqs)  # token ids alone: the server's process makes the text
            request.token_deltas = True  # (and its outputs mostly TokenDeltas, cheap to pickle)
            loop.send("add", request)
        elif kind in ("abort", "stop_samples"):
            loop.send(kind, item)
        elif kind == "forget_lora":
            engine.input_processor.lora_adapters.forget(item)
    loop.stop()
    sender.close(None)
    engine.shutdown()


class _TurnSender:
    """Sends the loop's turns through the pipe from a thread of its own, so that the loop never waits for the server's
    process to read them: the turns that come while a send is under way go together in the next."""

    def __init__(self, conn):
        self.conn = conn
        self.pending: list[tuple] = []
        self.ended: tuple | None = None  # ("exit", why) once the loop has stopped
        self.ready = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="jaxpage-engine-sender", daemon=True)
        self.thread.start()

    def put(self, report: tuple) -> None:
        """(a LoopTurn, messages taken so far, whether the loop is busy)."""
        with self.ready:
            self.pending.append(report)
            self.ready.notify()

    def close(self, why: BaseException | None) -> None:
        """Sends what is pending, then ("exit", why) if why is not None, and ends (at once if it ended already)."""
        with self.ready:
            if self.ended is None:
                self.ended = ("exit", why)
            self.ready.notify()
        self.thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            with self.ready:
                while not self.pending and self.ended is None:
                    self.ready.wait()
                pending, self.pending, ended = self.pending, [], self.ended
            try:
                if pending:
                    self.conn.send(("turns", pending))
                if ended is not None:
                    if ended[1] is not None:
                        self.conn.send(ended)
                    return
            except (BrokenPipeError, OSError):  # the server's process has gone
                return


def _picklable(error: BaseException) -> BaseException:
    """error, or a RuntimeError saying what it was where it does not pickle."""
    import pickle

    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(error).__name__}: {error}")
