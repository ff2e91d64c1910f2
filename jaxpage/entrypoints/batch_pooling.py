"""A batch job of a pooling model (`jaxpage batch` with a pooling model; jaxpage.entrypoints.batch): lines of
"url": "/v1/embeddings" (what OpenAI's Batch API takes), "/v1/score", "/v1/rerank" or "/classify", with the same
records, resume and exactly-once output as a generation job. A line's inputs (a /v1/embeddings body may hold many)
run in the engine's packed steps beside other lines'; its record is written when the last of them is done."""

from __future__ import annotations

import dataclasses
import uuid

from jaxpage.engine.pair_scoring import PairScoring
from jaxpage.engine.pooling_engine import PoolingEngine
from jaxpage.entrypoints.batch_lines import LineJob
from jaxpage.entrypoints.openai_api import ENDPOINTS as GENERATE_ENDPOINTS
from jaxpage.entrypoints.openai_api import RequestError
from jaxpage.entrypoints.pooling_protocol import PoolingBody, check_task, parse_pooling_request, response_of
from jaxpage.entrypoints.pooling_server import prepare_pooling
from jaxpage.entrypoints.served_models import ModelNotFound
from jaxpage.outputs import PoolingRequestOutput
from jaxpage.validation import describe


@dataclasses.dataclass
class _Line:
    custom_id: str
    request: PoolingBody
    plan: PairScoring | None
    request_ids: list[str]
    model: str
    outputs: dict[str, PoolingRequestOutput] = dataclasses.field(default_factory=dict)


class PoolingJob(LineJob):
    unit = "input"

    def __init__(self, engine: PoolingEngine, done: set[str], quiet: bool):
        super().__init__(engine, done, quiet)
        self.name = str(engine.config.model)
        self.lines: dict[str, _Line] = {}  # by the line's key
        self.line_of: dict[str, str] = {}  # engine request id -> its line's key

    def num_pending(self) -> int:
        return len(self.lines)

    def abort_pending(self) -> None:
        self.engine.abort_request(list(self.line_of))

    def submit(self, custom_id: str, line_number: int, record: dict) -> None:
        url, body = record.get("url"), record.get("body")
        if url in GENERATE_ENDPOINTS:
            raise RequestError(
                f"{url} needs a model run by the generate runner; this job's model runs on the pooling one"
            )
        request = parse_pooling_request(url, body)
        model = body.get("model")
        if model is not None and model != self.name:
            raise ModelNotFound(f"model {describe(model)} does not exist (this job has {self.name!r})")
        check_task(url, self.engine.task)
        key = f"batch-{line_number}-{uuid.uuid4().hex[:8]}"
        ids = (f"{key}-{i}" for i in range(1 << 30))
        requests, plan = prepare_pooling(self.engine, request, lambda: next(ids))
        self.engine.add_prepared_requests(requests)
        request_ids = [r.request_id for r in requests]
        self.lines[key] = _Line(custom_id, request, plan, request_ids, model or self.name)
        self.line_of.update((request_id, key) for request_id in request_ids)

    def step(self) -> None:
        for output in self.engine.step():
            key = self.line_of.pop(output.request_id, None)
            if key is None:  # the engine may serve others too
                continue
            line = self.lines[key]
            line.outputs[output.request_id] = output
            if len(line.outputs) == len(line.request_ids):
                del self.lines[key]
                self._finish(key, line)

    def _finish(self, key: str, line: _Line) -> None:
        outputs = [line.outputs[request_id] for request_id in line.request_ids]
        failed = next((o for o in outputs if o.error is not None), None)
        if failed is not None:  # failed at run time; the engine went on with the others
            return self.error(line.custom_id, 500, "internal_error", failed.error)
        try:
            scores = None if line.plan is None else line.plan.scores(outputs)
            body = response_of(line.request, key, outputs, scores, line.model, self.engine.model.labels)
        except Exception as e:
            return self.error(line.custom_id, 500, "internal_error", f"{type(e).__name__}: {e}")
        self.summary.inputs += len(line.request.inputs) or len(line.request.pairs)
        return self.succeeded(line.custom_id, key, body)
