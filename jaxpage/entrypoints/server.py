"""`jaxpage serve`: an OpenAI-compatible HTTP server (FastAPI on uvicorn) over one AsyncEngine.

    POST /v1/completions, /v1/chat/completions   OpenAI's bodies (jaxpage.entrypoints.openai_api, shared with `jaxpage
                                                 batch`); `stream: true` sends server-sent events, `data: [DONE]` last
    GET  /v1/models, /health, /version, /metrics (Prometheus, vLLM's names under `jaxpage:`:
    jaxpage.entrypoints.metrics), /tokenizer_info   POST /tokenize, /detokenize
    POST /v1/load_lora_adapter, /v1/unload_lora_adapter   LoRA adapters while serving (with an API key only); a
                                                 request's `model` picks the base model or an adapter
                                                 (jaxpage.entrypoints.served_models)
    GET  /   a chat page (jaxpage/entrypoints/static/chat.html: one file, script and style inline, no CDN)
    POST /v1/embeddings, /v1/score, /v1/rerank, /classify   a 400 naming the runner: a pooling model's server
                                                 (jaxpage.entrypoints.pooling_server, which serve starts for one)
                                                 answers them

Errors have OpenAI's shape, {"error": {"message", "type", "param", "code"}}: 400 for a bad body (the message names
the field; bodies nested too deep or with numbers too long are refused before they are parsed; a body that is not a
JSON object of UTF-8 text, lone surrogates included, is refused where it enters: jaxpage.entrypoints.json_body), 401
without the right key when an API key is set (compared in constant time; every path but OPEN_PATHS), 404 for an
unknown path or model, 413 for a body over max_body_bytes, 503 with Retry-After when max_waiting_requests requests
wait already (AsyncEngine's admission), 500 for a request that failed in a step. A client that disconnects aborts
its request (its pages are freed at once), streaming or not. `/health` is 200 only while the engine loop is alive
and making progress (AsyncEngine.health). Each request gets a log line when it ends (RequestLog).

Shutdown (SIGINT, SIGTERM): no new connections; requests in flight get shutdown_timeout_s to finish, then the engine
aborts them and their clients get a 503 in OpenAI's error shape, or, streaming, an error event and [DONE].
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from jaxpage.entrypoints.async_engine import AsyncEngine, EngineDeadError, ServerBusyError
from jaxpage.entrypoints.engine_process import EngineProcess
from jaxpage.entrypoints.http_app import (
    RETRY_AFTER_S,
    add_wrong_runner_routes,
    error_response,
    new_app,
    read_body,
)
from jaxpage.entrypoints.metrics import ServerMetrics
from jaxpage.entrypoints.openai_api import (
    CHAT,
    COMPLETIONS,
    chat_token_ids,
    engine_prompt,
    parse_request,
    split_prompts,
)
from jaxpage.entrypoints.openai_responses import Stream, combine_bodies, response_body
from jaxpage.entrypoints.pooling_protocol import POOLING_ENDPOINTS
from jaxpage.entrypoints.pooling_server import serve_pooling_app
from jaxpage.entrypoints.served_models import LoRAModule, ModelNotFound, ServedModels
from jaxpage.entrypoints.startup_heap import freeze_startup_heap
from jaxpage.entrypoints.tool_calls import TOOL_CALL_PARSERS
from jaxpage.models.pooling_model import engine_runner
from jaxpage.outputs import RequestOutput
from jaxpage.sources import HubDownload
from jaxpage.validation import check_bool, check_text, describe, is_int
from jaxpage.version import installed_version

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024


def create_app(
    engine: AsyncEngine,
    model_name: str | list[str],
    *,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    log_requests: bool = True,
    tool_call_parser: str | None = None,
    enable_auto_tool_choice: bool = False,
    lora_modules: list[LoRAModule] = (),
) -> FastAPI:
    """The app serving `engine` (whose max_waiting_requests is the server's admission limit) as `model_name`, and
    the LoRA adapters of `lora_modules` (read now: ModelLoadError or ValueError naming a bad one) under their names.
    tool_call_parser (jaxpage.entrypoints.tool_calls.TOOL_CALL_PARSERS) and enable_auto_tool_choice: vLLM's
    --tool-call-parser and --enable-auto-tool-choice, which tool_choice "auto" needs."""
    if tool_call_parser is not None and tool_call_parser not in TOOL_CALL_PARSERS:
        raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got {tool_call_parser!r}")
    defaults = engine.engine.generation_defaults
    if defaults.sampling:
        logging.getLogger("jaxpage").info(
            "sampling defaults from the model's generation config (%s): %s", defaults.source, defaults.sampling_dict
        )
    parse_options = dict(
        tool_parser=tool_call_parser, auto_tool_choice=enable_auto_tool_choice, defaults=defaults.sampling_dict
    )
    served = ServedModels(model_name, engine.engine, lora_modules, engine.engine.config.model)
    app = new_app(api_key)
    metrics = ServerMetrics(engine.gauges)
    engine.observers.append(metrics.observe)
    _add_info_routes(app, engine, served, metrics, api_key is not None)
    _add_tokenizer_routes(app, engine, max_body_bytes)
    _add_openai_routes(app, engine, served, max_body_bytes, log_requests, parse_options)
    _add_lora_routes(app, served, api_key is not None)
    add_wrong_runner_routes(app, POOLING_ENDPOINTS, "generate")
    return app


def _add_info_routes(app: FastAPI, engine: AsyncEngine, served: ServedModels, metrics: ServerMetrics, keyed: bool):
    """The chat page (told whether to ask for the API key), /health, /metrics, /version and /v1/models."""
    chat_page = (Path(__file__).parent / "static" / "chat.html").read_text()
    chat_page = chat_page.replace("const NEEDS_API_KEY = false;", f"const NEEDS_API_KEY = {str(keyed).lower()};")

    @app.get("/", response_class=HTMLResponse)
    async def chat():
        return chat_page

    @app.get("/health")
    async def health():
        healthy, why = engine.health()
        return JSONResponse({"status": why}, status_code=200 if healthy else 503)

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version():
        return {"version": installed_version()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": served.cards(engine.max_model_len)}


def _add_lora_routes(app: FastAPI, served: ServedModels, keyed: bool) -> None:
    """vLLM's /v1/load_lora_adapter {"lora_name", "lora_path"} and /v1/unload_lora_adapter {"lora_name"}: only on a
    server with an API key (the middleware checks it), since a body may name any directory of this host."""

    async def change(request: Request, fields: tuple[str, ...], act) -> Response:
        if not keyed:
            message = "loading and unloading LoRA adapters while serving needs a server started with --api-key"
            return error_response(403, message, "permission_error")
        body, error = await read_body(request, 64 * 1024)
        if error is not None:
            return error
        missing, unknown = [f for f in fields if f not in body], sorted(set(body) - set(fields))
        if missing or unknown:
            problems = {"missing": missing, "unknown": unknown}
            what = "; ".join(f"{problem} {', '.join(names)}" for problem, names in problems.items() if names)
            return error_response(400, f"the body takes {', '.join(fields)}: {what}")
        try:
            message = await asyncio.to_thread(act, *(body[f] for f in fields))
        except ModelNotFound as e:
            return error_response(404, str(e), "not_found_error")
        except ValueError as e:  # ModelLoadError too
            return error_response(400, str(e))
        return Response(message, media_type="text/plain")

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        def load(name, path):
            served.load(name, path)
            return f"Success: LoRA adapter '{name}' added successfully."

        return await change(request, ("lora_name", "lora_path"), load)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        def unload(name):
            served.unload(name)
            return f"Success: LoRA adapter '{name}' removed successfully."

        return await change(request, ("lora_name",), unload)


def _add_tokenizer_routes(app: FastAPI, engine: AsyncEngine, max_body_bytes: int) -> None:
    """/tokenize, /detokenize and /tokenizer_info (vLLM's; lm-eval's remote tokenizer uses all three)."""

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body, error = await read_body(request, max_body_bytes)
        if error is not None:
            return error
        try:
            tokens = await asyncio.to_thread(_tokenize, engine.tokenizer, body)  # a long text would block the loop
        except ValueError as e:
            return error_response(400, str(e))
        return {"count": len(tokens), "max_model_len": engine.max_model_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body, error = await read_body(request, max_body_bytes)
        if error is not None:
            return error
        if engine.tokenizer is None:
            return error_response(400, "this server runs without a tokenizer (skip_tokenizer_init)")
        vocab = engine.vocab_size
        tokens = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(tokens, list) or not all(is_int(t) and 0 <= t < vocab for t in tokens):
            return error_response(400, f"tokens must be a list of token ids in [0, {vocab}), got {describe(tokens)}")
        return {"prompt": await asyncio.to_thread(engine.tokenizer.decode, tokens)}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        tokenizer = engine.tokenizer
        if tokenizer is None:
            return error_response(400, "this server runs without a tokenizer (skip_tokenizer_init)")
        special = {f"{name}_token": getattr(tokenizer, f"{name}_token", None) for name in ("bos", "eos", "pad", "unk")}
        return {
            "tokenizer_class": type(tokenizer).__name__,
            **special,
            "chat_template": tokenizer.chat_template,
            "model_max_length": engine.max_model_len,
            "vocab_size": engine.vocab_size,
        }


def _tokenize(tokenizer, body) -> list[int]:
    if tokenizer is None:
        raise ValueError("this server runs without a tokenizer (skip_tokenizer_init)")
    if not isinstance(body, dict) or ("prompt" in body) == ("messages" in body):
        raise ValueError("the body must be an object with either prompt (text) or messages")
    if "messages" in body:
        return chat_token_ids(tokenizer, body["messages"])
    text = check_text("prompt", body["prompt"], allow_empty=True)
    add_special = check_bool("add_special_tokens", body.get("add_special_tokens", True))
    return list(tokenizer(text, add_special_tokens=add_special).input_ids)


def _add_openai_routes(
    app: FastAPI,
    engine: AsyncEngine,
    served: ServedModels,
    max_body_bytes: int,
    log_requests: bool,
    parse_options: dict,
):
    """/v1/completions and /v1/chat/completions (parse_options: parse_request's options: tools, defaults)."""
    request_ids = itertools.count()

    async def openai_endpoint(request: Request, url: str):
        request_id = f"{'chatcmpl' if url == CHAT else 'cmpl'}-{next(request_ids)}"
        log = RequestLog(request_id, url, log_requests)
        body, error = await read_body(request, max_body_bytes)
        if error is not None:
            return log.refused(error)
        try:
            parsed = [parse_request(url, one, allow_stream=True, **parse_options) for one in split_prompts(url, body)]
            lora_request = served.lora_request(body.get("model"))
            # Templating and tokenizing in a worker thread: a long conversation would block every other client.
            prompts = await asyncio.to_thread(lambda: [engine_prompt(p, engine.tokenizer) for p in parsed])
        except ModelNotFound as e:
            return log.refused(error_response(404, str(e), "not_found_error"))
        except ValueError as e:  # RequestError, or a chat template that refuses the messages
            return log.refused(error_response(400, str(e)))
        model_name = served.name_of(lora_request, body.get("model"))  # what the responses say
        ids = [request_id] if len(parsed) == 1 else [f"{request_id}-{i}" for i in range(len(parsed))]
        outputs = [
            engine.generate(one_id, prompt, p.params, fit_context=not p.default_max_tokens, lora_request=lora_request)
            for one_id, prompt, p in zip(ids, prompts, parsed, strict=True)
        ]
        if parsed[0].stream:
            # A refused request fails here, before any byte is sent; the other prompts' requests are then aborted.
            firsts = await asyncio.gather(*(anext(o) for o in outputs), return_exceptions=True)
            failed = next((e for e in firsts if isinstance(e, BaseException)), None)
            if failed is not None:
                await asyncio.gather(*(o.aclose() for o in outputs))
                return log.refused(_generate_error(failed))
            stream_id = f"{'chatcmpl' if url == CHAT else 'cmpl'}-{uuid.uuid4().hex}"
            streams = [Stream(p, model_name, i * p.params.n, stream_id) for i, p in enumerate(parsed)]
            events = _events(streams, firsts, outputs, log)
            return StreamingResponse(events, media_type="text/event-stream")
        # Not streamed: each request's one output is its final one (RequestOutputKind.FINAL_ONLY).
        lasts, failed = await _lasts_unless_disconnected(request, outputs)
        if failed is not None:
            return log.refused(_generate_error(failed))
        if lasts is None:
            return log.refused(error_response(499, "client disconnected"))
        failure = _failure(lasts)
        if failure is not None:
            return log.finished(lasts, failure)
        bodies = [response_body(p, o, model_name, engine.tokenizer) for p, o in zip(parsed, lasts, strict=True)]
        return log.finished(lasts, JSONResponse(combine_bodies(bodies)))

    @app.post(COMPLETIONS)
    async def completions(request: Request):
        return await openai_endpoint(request, COMPLETIONS)

    @app.post(CHAT)
    async def chat_completions(request: Request):
        return await openai_endpoint(request, CHAT)


def _generate_error(e: BaseException) -> JSONResponse:
    """The response to a request AsyncEngine.generate did not take."""
    if isinstance(e, ServerBusyError):
        return error_response(503, str(e), "server_busy", headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(e, EngineDeadError):
        return error_response(503, str(e), "server_error")
    if isinstance(e, ValueError):
        return error_response(400, str(e))
    raise e


def _failure(outputs: list[RequestOutput]) -> JSONResponse | None:
    """The error response of requests that did not finish: aborted by the server (its shutdown: 503) or failed in a
    step (500); None when all finished."""
    for output in outputs:
        if output.error is not None:
            return error_response(500, f"the request failed: {output.error}", "server_error")
        if any(c.finish_reason == "abort" for c in output.outputs):
            return error_response(503, "the server shut down before the request finished", "server_error")
    return None


class RequestLog:
    """One log line per request (logger "jaxpage.requests", INFO), when it ends: its status, and its token counts
    or why it was refused. `jaxpage serve --disable-log-requests` turns it off."""

    logger = logging.getLogger("jaxpage.requests")

    def __init__(self, request_id: str, url: str, enabled: bool):
        self.request_id, self.url, self.enabled = request_id, url, enabled
        self.start = time.monotonic()

    def refused(self, response: Response) -> Response:
        if self.enabled:
            message = json.loads(response.body).get("error", {}).get("message", "") if response.body else ""
            self.logger.info("%s POST %s %d: %s", self.request_id, self.url, response.status_code, message)
        return response

    def finished(self, outputs: list[RequestOutput], response: Response | None = None, note: str = ""):
        if self.enabled:
            prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
            completion_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
            reasons = ",".join(sorted({str(c.finish_reason) for o in outputs for c in o.outputs}))
            status = 200 if response is None else response.status_code
            self.logger.info(
                "%s POST %s %d: %d prompt + %d completion tokens, finish %s, %.2f s%s", self.request_id, self.url,
                status, prompt_tokens, completion_tokens, reasons, time.monotonic() - self.start, note,
            )  # fmt: skip
        return response


async def _events(streams: list[Stream], firsts: list[RequestOutput], outputs: list[AsyncIterator], log: RequestLog):
    """Server-sent events of a streaming request (one Stream per prompt, their chunks as they come). A request the
    server could not finish (shut down, a failed step) ends with an error event, then [DONE]. Starlette cancels this
    generator when the client disconnects, which closes `outputs` and so aborts the requests."""
    queue: asyncio.Queue = asyncio.Queue()

    async def follow(i: int):
        output = firsts[i]
        await queue.put((i, output))
        try:
            while not output.finished:
                output = await anext(outputs[i])
                await queue.put((i, output))
        except EngineDeadError as e:  # the engine stopped (its loop or its process died): the stream ends with it
            await queue.put((i, e))

    followers = [asyncio.ensure_future(follow(i)) for i in range(len(streams))]
    lasts = list(firsts)
    try:
        unfinished, failure = len(streams), None
        while unfinished:
            i, output = await queue.get()
            if isinstance(output, EngineDeadError):
                failure = error_response(503, str(output), "server_error")
                break
            lasts[i] = output
            for chunk in streams[i].chunks(output):
                yield f"data: {json.dumps(chunk)}\n\n"
            unfinished -= output.finished
        if failure is None:
            failure = _failure(lasts)
        if failure is not None:
            yield f"data: {failure.body.decode()}\n\n"
        elif streams[0].request.include_usage:
            yield f"data: {json.dumps(streams[0].usage_chunk(lasts))}\n\n"
        yield "data: [DONE]\n\n"
        log.finished(lasts, failure)
    except asyncio.CancelledError:
        log.finished(lasts, note=" (the client disconnected: aborted)")
        raise
    finally:
        for follower in followers:
            follower.cancel()
        await asyncio.gather(*followers, return_exceptions=True)
        await asyncio.gather(*(o.aclose() for o in outputs))


async def _lasts_unless_disconnected(request: Request, outputs: list[AsyncIterator]) -> tuple[list | None, object]:
    """(the requests' finished outputs, None); (None, the exception) when one of them was refused (the others are
    then aborted, before any byte is sent); (None, None), the requests aborted, if the client disconnects first."""

    async def last(rest):
        output = None
        async for item in rest:
            output = item
        return output

    tasks = [asyncio.ensure_future(last(o)) for o in outputs]
    disconnected = asyncio.ensure_future(_disconnect(request))
    waiting, failed = set(tasks), None
    while waiting and failed is None and not disconnected.done():
        done, waiting = await asyncio.wait(waiting | {disconnected}, return_when=asyncio.FIRST_COMPLETED)
        waiting.discard(disconnected)
        failed = next((task.exception() for task in done if task is not disconnected and task.exception()), None)
    disconnected.cancel()
    if not waiting and failed is None:
        return [task.result() for task in tasks], None
    for task in waiting:
        task.cancel()  # raised inside the requests' streams, which aborts them
    await asyncio.gather(*waiting, return_exceptions=True)
    return None, failed


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class GracefulServer(uvicorn.Server):
    """uvicorn's server, whose graceful shutdown (SIGINT, SIGTERM) ends in time: shutdown_timeout_s after the signal,
    the engine aborts every request still running, so that each handler answers its client (see the module
    docstring) before uvicorn's own deadline, a few seconds later, cuts the connections."""

    GRACE_S = 5.0  # for the handlers to answer after the abort

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, shutdown_timeout_s: float):
        config.timeout_graceful_shutdown = shutdown_timeout_s + self.GRACE_S
        super().__init__(config)
        self.engine = engine
        self._abort_timer = threading.Timer(shutdown_timeout_s, engine.abort_all)
        self._abort_timer.daemon = True

    def handle_exit(self, sig, frame) -> None:
        if not self.should_exit:
            self._abort_timer.start()
        super().handle_exit(sig, frame)

    def run(self, sockets=None) -> None:
        try:
            super().run(sockets)
        finally:
            self._abort_timer.cancel()


def serve(
    model: str | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    served_model_name: str | list[str] | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_waiting_requests: int | None = None,
    stall_timeout_s: float = 120.0,
    shutdown_timeout_s: float = 30.0,
    log_requests: bool = True,
    tool_call_parser: str | None = None,
    enable_auto_tool_choice: bool = False,
    lora_modules: list[LoRAModule] = (),
    warmup: bool = True,
    engine_process: bool | None = None,
    **engine_args,
) -> None:
    """Loads the model, compiles every step shape (warmup), and serves until SIGINT or SIGTERM: then it stops
    accepting, lets running requests finish within shutdown_timeout_s, aborts the rest, and returns. engine_process:
    the engine steps in a process of its own (jaxpage.entrypoints.engine_process), so that the HTTP handling takes no
    time from it; by default (None) it does, unless several hosts run the engine (whose processes replay process 0's
    steps), where it steps in a thread of this process."""
    download = HubDownload(engine_args.get("revision"), engine_args.get("download_dir"))
    if engine_runner(model, engine_args.get("runner", "auto"), download) == "pooling":
        generate_only = dict(
            lora_modules=lora_modules,
            tool_call_parser=tool_call_parser,
            enable_auto_tool_choice=enable_auto_tool_choice,
            engine_process=engine_process,
        )
        async_engine, app = serve_pooling_app(
            model, engine_args, generate_only, max_waiting_requests, stall_timeout_s,
            model_name=served_model_name or model, api_key=api_key, max_body_bytes=max_body_bytes,
            log_requests=log_requests,
        )  # fmt: skip
        return _serve_app(app, async_engine, host, port, shutdown_timeout_s)
    several_hosts = (engine_args.get("num_processes") or 1) > 1
    if engine_process and several_hosts:
        raise ValueError("engine_process: not with several hosts (num_processes > 1), whose engine runs here")
    if engine_process is None:
        engine_process = not several_hosts
    if engine_process:
        engine = EngineProcess(dict(model=model, **engine_args), warmup)
    else:
        from jaxpage.engine.llm_engine import LLMEngine

        engine = LLMEngine.from_engine_args(model=model, **engine_args)
        if warmup:
            engine.warmup()
    freeze_startup_heap()  # this process serves this engine for its life
    async_engine = AsyncEngine(engine, stall_timeout_s, max_waiting_requests).start()
    name = served_model_name or model or "SmolLM2-135M-Instruct"  # one name, or several (the first the main one)
    app = create_app(
        async_engine,
        name,
        api_key=api_key,
        max_body_bytes=max_body_bytes,
        log_requests=log_requests,
        tool_call_parser=tool_call_parser,
        enable_auto_tool_choice=enable_auto_tool_choice,
        lora_modules=lora_modules,
    )
    _serve_app(app, async_engine, host, port, shutdown_timeout_s)


def _serve_app(app: FastAPI, async_engine, host: str, port: int, shutdown_timeout_s: float) -> None:
    """Serves `app` until SIGINT or SIGTERM, then shuts down gracefully (GracefulServer) and stops async_engine."""
    config = uvicorn.Config(app, host=host, port=port, log_level="info", access_log=False)
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then restores the handlers it found and raises the signal
    # again; handlers that ignore it make the process exit here, with status 0, rather than die of the signal.
    main = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)} if main else {}
    try:
        GracefulServer(config, async_engine, shutdown_timeout_s).run()
    finally:
        async_engine.shutdown(timeout_s=0)  # what the graceful shutdown left running is aborted
        for sig, handler in previous.items():
            signal.signal(sig, handler)
