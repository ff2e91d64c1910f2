"""`jaxpage serve`: an OpenAI-compatible HTTP server (FastAPI on uvicorn) over one AsyncEngine.

    POST /v1/completions, /v1/chat/completions   OpenAI's bodies (jaxpage.entrypoints.openai_api, shared with `jaxpage
                                                 batch`); `stream: true` sends server-sent events, `data: [DONE]` last
    GET  /v1/models, /health, /version, /metrics (Prometheus, vLLM's names under `jaxpage:`:
    jaxpage.entrypoints.metrics) POST /tokenize, /detokenize
    GET  /   a chat page (jaxpage/entrypoints/static/chat.html: one file, script and style inline, no CDN)

Errors have OpenAI's shape, {"error": {"message", "type", "param", "code"}}: 400 for a bad body (the message names
the field), 401 without the right key when an API key is set (compared in constant time), 404 for an unknown path or
model, 413 for a body over max_body_bytes, 503 with Retry-After while more than max_waiting_requests wait. A client
that disconnects aborts its request (its pages are freed at once), streaming or not. `/health` is 200 only while the
engine loop is alive and making progress (AsyncEngine.health).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import json
import signal
import threading
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

import jaxpage
from jaxpage.entrypoints.async_engine import AsyncEngine, EngineDeadError
from jaxpage.entrypoints.metrics import ServerMetrics
from jaxpage.entrypoints.openai_api import CHAT, COMPLETIONS, Stream, engine_prompt, parse_request, response_body
from jaxpage.outputs import RequestOutput
from jaxpage.tokenizers.tokenizer import encode_chat
from jaxpage.validation import check_bool, check_text, describe, is_int

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
RETRY_AFTER_S = 1


def error_response(status: int, message: str, kind: str = "invalid_request_error", headers=None) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


def create_app(
    engine: AsyncEngine,
    model_name: str,
    *,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_waiting_requests: int | None = None,
) -> FastAPI:
    app = FastAPI(title="jaxpage", version=jaxpage.__version__, docs_url=None, redoc_url=None)
    metrics = ServerMetrics(engine.engine)
    engine.observers.append(metrics.observe)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_response(e.status_code, str(e.detail), kind)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request: Request, e: RequestValidationError):
        return error_response(400, str(e))

    @app.middleware("http")
    async def check_key(request: Request, call_next):
        if api_key is not None and request.url.path.startswith("/v1/"):
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return error_response(401, "invalid or missing API key", "authentication_error")
        return await call_next(request)

    _add_info_routes(app, engine, model_name, metrics)
    _add_tokenizer_routes(app, engine, max_body_bytes)
    _add_openai_routes(app, engine, model_name, max_body_bytes, max_waiting_requests)
    return app


def _add_info_routes(app: FastAPI, engine: AsyncEngine, model_name: str, metrics: ServerMetrics) -> None:
    """The chat page, /health, /metrics, /version and /v1/models."""
    chat_page = (Path(__file__).parent / "static" / "chat.html").read_text()

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
        return {"version": jaxpage.__version__}

    @app.get("/v1/models")
    async def models():
        model = {
            "id": model_name,
            "object": "model",
            "owned_by": "jaxpage",
            "max_model_len": engine.max_model_len,
        }
        return {"object": "list", "data": [model]}


def _add_tokenizer_routes(app: FastAPI, engine: AsyncEngine, max_body_bytes: int) -> None:
    """/tokenize and /detokenize (vLLM's)."""

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body, error = await read_body(request, max_body_bytes)
        if error is not None:
            return error
        tokenizer = engine.tokenizer
        try:
            if tokenizer is None:
                raise ValueError("this server runs without a tokenizer (skip_tokenizer_init)")
            if not isinstance(body, dict) or ("prompt" in body) == ("messages" in body):
                raise ValueError("the body must be an object with either prompt (text) or messages")
            if "messages" in body:
                tokens = encode_chat(tokenizer, body["messages"])
            else:
                text = check_text("prompt", body["prompt"], allow_empty=True)
                add_special = check_bool("add_special_tokens", body.get("add_special_tokens", True))
                tokens = list(tokenizer(text, add_special_tokens=add_special).input_ids)
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
        return {"prompt": engine.tokenizer.decode(tokens)}


def _add_openai_routes(
    app: FastAPI, engine: AsyncEngine, model_name: str, max_body_bytes: int, max_waiting_requests: int | None
) -> None:
    """/v1/completions and /v1/chat/completions."""
    request_ids = itertools.count()

    async def openai_endpoint(request: Request, url: str):
        body, error = await read_body(request, max_body_bytes)
        if error is not None:
            return error
        try:
            parsed = parse_request(url, body, allow_stream=True)
            model = body.get("model")
            if model is not None and model != model_name:
                message = f"model {model!r} does not exist (this server has {model_name!r})"
                return error_response(404, message, "not_found_error")
            prompt = engine_prompt(parsed, engine.tokenizer)
        except ValueError as e:  # RequestError, or a chat template that refuses the messages
            return error_response(400, str(e))
        if max_waiting_requests is not None and engine.num_waiting > max_waiting_requests:
            busy = "the server is busy: too many requests waiting"
            return error_response(503, busy, "server_busy", headers={"Retry-After": str(RETRY_AFTER_S)})
        request_id = f"{'chatcmpl' if url == CHAT else 'cmpl'}-{next(request_ids)}"
        outputs = engine.generate(request_id, prompt, parsed.params)
        try:
            first = await anext(outputs)  # a refused request fails here, before any byte is sent
        except ValueError as e:
            return error_response(400, str(e))
        except EngineDeadError as e:
            return error_response(503, str(e), "server_error")
        if parsed.stream:
            return StreamingResponse(
                _events(Stream(parsed, model_name), first, outputs), media_type="text/event-stream"
            )
        last = await _last_unless_disconnected(request, first, outputs)
        if last is None:
            return error_response(499, "client disconnected")
        return JSONResponse(response_body(parsed, last, model_name, engine.tokenizer))

    @app.post(COMPLETIONS)
    async def completions(request: Request):
        return await openai_endpoint(request, COMPLETIONS)

    @app.post(CHAT)
    async def chat_completions(request: Request):
        return await openai_endpoint(request, CHAT)


async def read_body(request: Request, max_body_bytes: int):
    """(the JSON body, None), or (None, the error response): over max_body_bytes (413), not JSON (400)."""
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > max_body_bytes:
        return None, error_response(413, f"request body over {max_body_bytes} bytes")
    raw = b""
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > max_body_bytes:
            return None, error_response(413, f"request body over {max_body_bytes} bytes")
    try:
        return json.loads(raw), None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return None, error_response(400, f"the body is not JSON ({e})")


async def _events(stream: Stream, first: RequestOutput, outputs: AsyncIterator[RequestOutput]):
    """Server-sent events of a streaming request. Starlette cancels this generator when the client disconnects,
    which closes `outputs` and so aborts the request."""
    try:
        output = first
        while True:
            for chunk in stream.chunks(output):
                yield f"data: {json.dumps(chunk)}\n\n"
            if output.finished:
                break
            output = await anext(outputs)
        yield "data: [DONE]\n\n"
    finally:
        await outputs.aclose()


async def _last_unless_disconnected(request: Request, first: RequestOutput, outputs) -> RequestOutput | None:
    """The request's finished output; None (the request aborted) if the client disconnects first."""

    async def last():
        output = first
        async for later in outputs:
            output = later
        return output

    if first.finished:
        return first
    finishing = asyncio.ensure_future(last())
    disconnected = asyncio.ensure_future(_disconnect(request))
    done, _ = await asyncio.wait({finishing, disconnected}, return_when=asyncio.FIRST_COMPLETED)
    disconnected.cancel()
    if finishing in done:
        return finishing.result()
    finishing.cancel()  # raised inside the request's stream, which aborts the request
    with contextlib.suppress(asyncio.CancelledError):
        await finishing
    return None


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def serve(
    model: str | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    served_model_name: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_waiting_requests: int | None = None,
    stall_timeout_s: float = 120.0,
    shutdown_timeout_s: float = 30.0,
    warmup: bool = True,
    **engine_args,
) -> None:
    """Loads the model, compiles every step shape (warmup), and serves until SIGINT or SIGTERM: then it stops
    accepting, lets running requests finish within shutdown_timeout_s, aborts the rest, and returns."""
    import uvicorn

    from jaxpage.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(model=model, **engine_args)
    if warmup:
        engine.warmup()
    async_engine = AsyncEngine(engine, stall_timeout_s=stall_timeout_s).start()
    name = served_model_name or model or "SmolLM2-135M-Instruct"
    app = create_app(
        async_engine, name, api_key=api_key, max_body_bytes=max_body_bytes, max_waiting_requests=max_waiting_requests
    )
    config = uvicorn.Config(
        app, host=host, port=port, timeout_graceful_shutdown=shutdown_timeout_s, log_level="info", access_log=False
    )
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then restores the handlers it found and raises the signal
    # again; handlers that ignore it make the process exit here, with status 0, rather than die of the signal.
    main = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)} if main else {}
    try:
        uvicorn.Server(config).run()
    finally:
        async_engine.shutdown(timeout_s=0)  # what uvicorn's graceful shutdown left running is aborted
        for sig, handler in previous.items():
            signal.signal(sig, handler)
