"""`jaxpage serve` of a pooling model: /v1/embeddings, /v1/score, /v1/rerank and /classify (their bodies:
jaxpage.entrypoints.pooling_protocol) over one AsyncPoolingEngine, beside /health, /version, /v1/models and /tokenize.
Generation's endpoints answer 400 naming the runner, as the generate server's answer these. Errors have OpenAI's
shape, and the API key, body limits and JSON checks are the generate server's (jaxpage.entrypoints.http_app)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from jaxpage.engine.pair_scoring import PairScoring, plan_pair_scoring
from jaxpage.engine.pooling_engine import PoolingEngine
from jaxpage.entrypoints.async_engine import ServerBusyError
from jaxpage.entrypoints.async_pooling import AsyncPoolingEngine
from jaxpage.entrypoints.engine_loop import EngineDeadError
from jaxpage.entrypoints.http_app import RETRY_AFTER_S, add_wrong_runner_routes, error_response, new_app, read_body
from jaxpage.entrypoints.openai_api import ENDPOINTS as GENERATE_ENDPOINTS
from jaxpage.entrypoints.pooling_protocol import (
    POOLING_ENDPOINTS,
    PoolingBody,
    check_task,
    parse_pooling_request,
    response_of,
)
from jaxpage.validation import check_text, describe
from jaxpage.version import installed_version

logger = logging.getLogger("jaxpage.requests")


def create_pooling_app(
    engine: AsyncPoolingEngine,
    model_name: str | list[str],
    *,
    api_key: str | None = None,
    max_body_bytes: int,
    log_requests: bool = True,
) -> FastAPI:
    names = [model_name] if isinstance(model_name, str) else list(model_name)
    app = new_app(api_key)
    pooling: PoolingEngine = engine.engine
    request_ids = itertools.count()

    @app.get("/health")
    async def health():
        healthy, why = engine.health()
        return JSONResponse({"status": why}, status_code=200 if healthy else 503)

    @app.get("/version")
    async def version():
        return {"version": installed_version()}

    @app.get("/v1/models")
    async def models():
        card = dict(object="model", owned_by="jaxpage", max_model_len=pooling.max_model_len, root=None, parent=None)
        return {"object": "list", "data": [{"id": name, **card} for name in names]}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body, error = await read_body(request, max_body_bytes)
        if error is not None:
            return error
        if pooling.tokenizer is None:
            return error_response(400, "this server runs without a tokenizer (skip_tokenizer_init)")
        if not isinstance(body, dict) or not isinstance(body.get("prompt"), str):
            return error_response(400, f"the body must be an object with a prompt (text), got {describe(body)}")
        text = body["prompt"]
        tokens = await asyncio.to_thread(lambda: list(pooling.tokenizer(text).input_ids))
        return {"count": len(tokens), "max_model_len": pooling.max_model_len, "tokens": tokens}

    async def endpoint(request: Request, url: str):
        request_id = f"{url.rsplit('/', 1)[1]}-{next(request_ids)}"
        start = time.monotonic()
        body, error = await read_body(request, max_body_bytes)
        if error is None:
            response = await _answer(engine, pooling, url, body, names, request_id)
        else:
            response = error
        if log_requests:
            logger.info("%s POST %s %d, %.2f s", request_id, url, response.status_code, time.monotonic() - start)
        return response

    for url in POOLING_ENDPOINTS:
        app.add_api_route(url, _route(endpoint, url), methods=["POST"])
    add_wrong_runner_routes(app, GENERATE_ENDPOINTS, "pooling")
    return app


def _route(endpoint, url: str):
    async def route(request: Request):
        return await endpoint(request, url)

    return route


async def _answer(engine: AsyncPoolingEngine, pooling: PoolingEngine, url: str, body, names, request_id: str):
    """The response to one pooling request's body."""
    try:
        parsed = parse_pooling_request(url, body)
        model = body.get("model")
        if model is not None and model not in names:
            shown = ", ".join(repr(n) for n in names)
            message = f"model {describe(model)} does not exist (this server has {shown})"
            return error_response(404, message, "not_found_error")
        check_task(url, pooling.task)
        ids = (f"{request_id}-{i}" for i in itertools.count())
        prepared = []

        def prepare():
            prepared.append(prepare_pooling(pooling, parsed, lambda: next(ids)))
            return prepared[0][0]

        outputs = await engine.pool(prepare, len(parsed.inputs) or len(parsed.pairs))
        failed = next((o for o in outputs if o.error is not None), None)
        if failed is not None:
            return error_response(500, f"the request failed: {failed.error}", "server_error")
        plan = prepared[0][1]
        scores = None if plan is None else plan.scores(outputs)
        return JSONResponse(response_of(parsed, request_id, outputs, scores, model or names[0], pooling.model.labels))
    except (ServerBusyError, EngineDeadError) as e:
        headers = {"Retry-After": str(RETRY_AFTER_S)} if isinstance(e, ServerBusyError) else None
        return error_response(503, str(e), "server_busy" if headers else "server_error", headers=headers)
    except ValueError as e:  # RequestError, or an input the engine refuses (its length, a token id, dimensions)
        return error_response(400, str(e))


def prepare_pooling(pooling: PoolingEngine, parsed: PoolingBody, new_id) -> tuple[list, PairScoring | None]:
    """The checked, tokenized requests of a parsed body (ValueError naming what is wrong), and for score and rerank
    the plan that turns their outputs into the pairs' scores (server and batch jobs)."""
    if parsed.pairs:
        plan = plan_pair_scoring(pooling, parsed.pairs, parsed.params, new_id)
        return plan.requests, plan
    for i, item in enumerate(parsed.inputs):
        if isinstance(item, str):
            check_text(f"input[{i}]", item)
    return [pooling.prepare_request(new_id(), item, parsed.params) for item in parsed.inputs], None


def serve_pooling_app(
    model: str | None, engine_args: dict, generate_only: dict, max_waiting_requests, stall_timeout_s, **app_options
):
    """(the AsyncPoolingEngine, its app) of a pooling model, started; `generate_only`: serve's options for generation,
    each refused by name when set."""
    from jaxpage.config import EngineConfig

    for name, value in generate_only.items():
        if value:
            raise ValueError(f"{name} is for a generating model; this one runs on the pooling runner")
    engine = PoolingEngine(EngineConfig(model=model, **engine_args))
    async_engine = AsyncPoolingEngine(engine, stall_timeout_s, max_waiting_requests).start()
    return async_engine, create_pooling_app(async_engine, **app_options)
