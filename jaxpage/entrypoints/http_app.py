"""What both of `jaxpage serve`'s apps share (jaxpage.entrypoints.server's for generation, pooling_server's for
pooling models): errors in OpenAI's shape, the API key, request bodies read within their limit, and routes that
refuse what the model's runner cannot serve."""

from __future__ import annotations

import asyncio
import hmac

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from jaxpage.entrypoints.json_body import parse_json_body
from jaxpage.version import installed_version

RETRY_AFTER_S = 1
# Paths anyone may read when an API key is set: the chat page (it asks for the key), liveness, metrics, version.
OPEN_PATHS = frozenset({"/", "/health", "/metrics", "/version"})


def error_response(status: int, message: str, kind: str = "invalid_request_error", headers=None) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


def new_app(api_key: str | None) -> FastAPI:
    """A FastAPI app whose errors have OpenAI's shape and whose paths but OPEN_PATHS need `api_key` (None: none)."""
    app = FastAPI(title="jaxpage", version=installed_version(), docs_url=None, redoc_url=None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_response(e.status_code, str(e.detail), kind)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request: Request, e: RequestValidationError):
        return error_response(400, str(e))

    @app.middleware("http")
    async def check_key(request: Request, call_next):
        if api_key is not None and request.url.path not in OPEN_PATHS:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return error_response(401, "invalid or missing API key", "authentication_error")
        return await call_next(request)

    return app


def add_wrong_runner_routes(app: FastAPI, urls, runner: str) -> None:
    """POST routes for `urls`, which this server's model cannot serve (it runs on `runner`): each a 400 saying so."""
    other = "pooling" if runner == "generate" else "generate"

    async def refuse(request: Request):
        return error_response(
            400,
            f"{request.url.path} needs a model run by the {other} runner; this server's model runs on the {runner} "
            f"runner (start a server of a {other} model, or with --runner {other} where the model is one)",
        )

    for url in urls:
        app.add_api_route(url, refuse, methods=["POST"])


async def read_body(request: Request, max_body_bytes: int):
    """(the JSON body, None), or (None, the error response): over max_body_bytes (413), not a JSON object of UTF-8
    text, nested too deep or with a number too long (400: jaxpage.entrypoints.json_body), the client gone before
    sending it all (499)."""
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > max_body_bytes:
        return None, error_response(413, f"request body over {max_body_bytes} bytes")
    raw = b""
    try:
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > max_body_bytes:
                return None, error_response(413, f"request body over {max_body_bytes} bytes")
    except ClientDisconnect:
        return None, error_response(499, "the client disconnected before sending the whole body")
    try:
        return await asyncio.to_thread(parse_json_body, raw), None
    except ValueError as e:
        return None, error_response(400, str(e))
