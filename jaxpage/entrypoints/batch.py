"""Batch jobs: a JSONL file of OpenAI batch requests in, one JSONL line per request out, resumable.

    jaxpage batch INPUT.jsonl OUTPUT.jsonl [--model SRC] [engine options] [--lora-modules NAME=PATH ...] [--quiet]
    jaxpage.entrypoints.batch.run_batch(input_path, output_path, llm=None, **engine_args) -> BatchSummary

Input lines: {"custom_id", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions", "body": {...}}
(see `jaxpage.entrypoints.openai_api` for the body fields); with a pooling model, "url": "/v1/embeddings",
"/v1/score", "/v1/rerank" or "/classify" (jaxpage.entrypoints.pooling_protocol; a job of batch_pooling.PoolingJob,
whose progress counts inputs a second). Output lines, in the order requests finish: {"id",
"custom_id", "response": {"status_code", "request_id", "body"}, "error"}; a request that is invalid gets status 400 and
an error body (a line whose text is not UTF-8, or holds a lone surrogate, included), a line that is not a request at
all (not JSON, no custom_id) a record with "error" set.

The input is read as the engine takes requests (a few times max_num_seqs ahead), never whole, and each record is
written and flushed when its request finishes. Every record has a unique custom_id: a line without one is
recorded as "line-N" (its 1-based line number), and so is a line that repeats an earlier custom_id. Running the
same job again resumes it: records already in the output are kept and their requests skipped, and a last line cut
short by a crash is dropped and redone. In the end each custom_id appears exactly once.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

from jaxpage.entrypoints.batch_lines import BatchSummary, LineJob
from jaxpage.entrypoints.batch_pooling import PoolingJob
from jaxpage.entrypoints.openai_api import (
    ParsedRequest,
    RequestError,
    engine_prompt,
    parse_request,
    split_prompts,
)
from jaxpage.entrypoints.openai_responses import response_body
from jaxpage.entrypoints.pooling_protocol import POOLING_ENDPOINTS
from jaxpage.entrypoints.served_models import LoRAModule, ServedModels
from jaxpage.entrypoints.startup_heap import freeze_startup_heap

PENDING_PER_SEQ = 2  # requests held in the engine per max_num_seqs: enough to keep every step full


class BatchError(Exception):
    """The job itself cannot run (unreadable input, output not writable)."""


def run_batch(
    input_path,
    output_path,
    llm=None,
    *,
    quiet: bool = False,
    lora_modules: list[LoRAModule] = (),
    freeze_heap: bool = False,
    **engine_args,
) -> BatchSummary:
    """Runs (or resumes) a batch job; returns its summary. Raises BatchError when the job cannot run (a LoRA adapter
    of `lora_modules` that cannot be served included). A line's body names the base model or an adapter in "model"
    (absent: the base model); another name is that line's error (404). freeze_heap: the engine this builds (no `llm`
    given) is the process's for its life (jaxpage.entrypoints.startup_heap)."""
    input_path, output_path = Path(input_path), Path(output_path)
    try:
        total = _count_requests(input_path)
    except OSError as e:
        raise BatchError(f"cannot read the input {input_path}: {e.strerror or e}") from None
    done = _resume(output_path)
    if llm is None:
        from jaxpage.entrypoints.llm import LLM

        llm = LLM(**engine_args)
        if freeze_heap:
            freeze_startup_heap()
    try:
        if llm.runner == "pooling":
            if lora_modules:
                raise ValueError("lora_modules: not for a pooling model")
            job = PoolingJob(llm.engine, done, quiet)
        else:
            job = _GenerateJob(llm, done, quiet, lora_modules)
    except ValueError as e:  # ModelLoadError too: a LoRA adapter that cannot be served
        raise BatchError(str(e)) from None
    try:
        out = open(output_path, "a", encoding="utf-8")  # noqa: SIM115 (closed below, after the job)
    except OSError as e:
        raise BatchError(f"cannot write the output {output_path}: {e.strerror or e}") from None
    stats = getattr(llm.engine, "spec_decoding_stats", None)
    before = None if stats is None else stats.copy()
    max_pending = PENDING_PER_SEQ * llm.engine.config.max_num_seqs
    with out, open(input_path, "rb") as lines:  # bytes: a line that is not UTF-8 is that line's error (json_body)
        job.run(lines, out, total, max_pending)
    if stats is not None:
        job.summary.spec_decoding = stats.since(before).as_dict()
    return job.summary


def _count_requests(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


def _resume(output_path: Path) -> set[str]:
    """The custom_ids already in the output. A last line without its newline (a write cut short) is removed."""
    if not output_path.exists():
        return set()
    with open(output_path, "rb+") as f:
        data = f.read()
        keep = data.rfind(b"\n") + 1
        if keep < len(data):
            f.truncate(keep)
    done = set()
    for line in data[:keep].splitlines():
        try:
            done.add(json.loads(line)["custom_id"])
        except (ValueError, KeyError, TypeError):
            raise BatchError(f"{output_path} holds a line that is not a batch output record: {line[:200]!r}") from None
    return done


class _GenerateJob(LineJob):
    """A batch of /v1/completions and /v1/chat/completions lines over an LLMEngine."""

    def __init__(self, llm, done: set[str], quiet: bool, lora_modules: list[LoRAModule]):
        super().__init__(llm.engine, done, quiet)
        model = self.engine.config.model
        self.models = ServedModels(str(model or "SmolLM2-135M-Instruct"), self.engine, lora_modules, model)
        # engine request id -> (custom_id, request, the model's name its response gives)
        self.pending: dict[str, tuple[str, ParsedRequest, str]] = {}

    def num_pending(self) -> int:
        return len(self.pending)

    def abort_pending(self) -> None:
        self.engine.abort_request(list(self.pending))

    def submit(self, custom_id: str, line_number: int, record: dict) -> None:
        url = record.get("url")
        if url in POOLING_ENDPOINTS:
            raise RequestError(f"{url} needs a model run by the pooling runner; this job's model generates")
        if len(split_prompts(url, record.get("body"))) > 1:
            raise RequestError("prompt must be one prompt in a batch line (one line per prompt)")
        defaults = self.engine.generation_defaults.sampling_dict
        request = parse_request(url, record.get("body"), defaults=defaults)
        lora_request = self.models.lora_request(record["body"].get("model"))
        prompt = engine_prompt(request, self.engine.tokenizer)
        request_id = f"batch-{line_number}-{uuid.uuid4().hex[:8]}"
        self.engine.add_request(request_id, prompt, request.params, lora_request=lora_request)
        self.pending[request_id] = (custom_id, request, self.models.name_of(lora_request))

    def step(self) -> None:
        for output in self.engine.step():
            if output.finished and output.request_id in self.pending:  # the engine may serve others too
                self._finish(output)

    def _finish(self, output) -> None:
        custom_id, request, model = self.pending.pop(output.request_id)
        if output.error is not None:  # failed at run time; the engine went on with the others
            return self.error(custom_id, 500, "internal_error", output.error)
        try:
            body = response_body(request, output, model, self.engine.tokenizer)
        except Exception as e:
            return self.error(custom_id, 500, "internal_error", f"{type(e).__name__}: {e}")
        return self.succeeded(custom_id, output.request_id, body)
