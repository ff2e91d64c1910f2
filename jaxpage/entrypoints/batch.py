"""Batch jobs: a JSONL file of OpenAI batch requests in, one JSONL line per request out, resumable.

    jaxpage batch INPUT.jsonl OUTPUT.jsonl [--model SRC] [engine options] [--lora-modules NAME=PATH ...] [--quiet]
    jaxpage.entrypoints.batch.run_batch(input_path, output_path, llm=None, **engine_args) -> BatchSummary

Input lines: {"custom_id", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions", "body": {...}}
(see `jaxpage.entrypoints.openai_api` for the body fields). Output lines, in the order requests finish: {"id",
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

import dataclasses
import json
import time
import uuid
from pathlib import Path

from tqdm import tqdm

from jaxpage.entrypoints.json_body import check_unicode, parse_json
from jaxpage.entrypoints.openai_api import (
    ParsedRequest,
    RequestError,
    engine_prompt,
    parse_request,
    split_prompts,
)
from jaxpage.entrypoints.openai_responses import response_body
from jaxpage.entrypoints.served_models import LoRAModule, ModelNotFound, ServedModels
from jaxpage.entrypoints.startup_heap import freeze_startup_heap

PENDING_PER_SEQ = 2  # requests held in the engine per max_num_seqs: enough to keep every step full


class BatchError(Exception):
    """The job itself cannot run (unreadable input, output not writable)."""


@dataclasses.dataclass
class BatchSummary:
    requests: int = 0  # lines that hold a request (or should): done in this run or an earlier one
    succeeded: int = 0  # in this run
    failed: int = 0  # in this run: error records written
    resumed: int = 0  # found in the output from an earlier run, skipped
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0
    spec_decoding: dict | None = None  # SpecDecodingStats.as_dict() of this run, with speculative decoding

    def describe(self) -> str:
        rate = self.completion_tokens / self.seconds if self.seconds else 0.0
        text = (
            f"{self.requests} requests: {self.succeeded} succeeded, {self.failed} failed, {self.resumed} already "
            f"done; {self.prompt_tokens} prompt and {self.completion_tokens} completion tokens in {self.seconds:.1f}s "
            f"({rate:.1f} completion tokens/s)"
        )
        spec = self.spec_decoding
        if spec is not None and spec["num_drafts"]:
            text += (
                f"; speculative decoding: {spec['num_drafts']} drafts, {spec['num_accepted_tokens']} of "
                f"{spec['num_draft_tokens']} draft tokens accepted ({spec['acceptance_rate']:.2f}), mean accepted "
                f"length {spec['mean_accepted_length']:.2f}"
            )
        return text


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
        job = _Job(llm, done, quiet, lora_modules)
    except ValueError as e:  # ModelLoadError too: a LoRA adapter that cannot be served
        raise BatchError(str(e)) from None
    try:
        out = open(output_path, "a", encoding="utf-8")  # noqa: SIM115 (closed below, after the job)
    except OSError as e:
        raise BatchError(f"cannot write the output {output_path}: {e.strerror or e}") from None
    stats = llm.engine.spec_decoding_stats
    before = None if stats is None else stats.copy()
    with out, open(input_path, "rb") as lines:  # bytes: a line that is not UTF-8 is that line's error (json_body)
        job.run(lines, out, total)
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


class _Job:
    def __init__(self, llm, done: set[str], quiet: bool, lora_modules: list[LoRAModule]):
        self.engine = llm.engine
        self.done = done
        self.quiet = quiet
        self.summary = BatchSummary()
        model = self.engine.config.model
        self.models = ServedModels(str(model or "SmolLM2-135M-Instruct"), self.engine, lora_modules, model)
        # engine request id -> (custom_id, request, the model's name its response gives)
        self.pending: dict[str, tuple[str, ParsedRequest, str]] = {}
        self.seen: set[str] = set()  # custom_ids of this input so far

    def run(self, lines, out, total: int) -> None:
        self.out = out
        start = time.perf_counter()
        max_pending = PENDING_PER_SEQ * self.engine.config.max_num_seqs
        self.bar = tqdm(total=total, disable=self.quiet, desc="batch", unit="req", dynamic_ncols=True)
        numbered = enumerate(lines, 1)
        exhausted = False
        try:
            while True:
                while not exhausted and len(self.pending) < max_pending:
                    item = next(numbered, None)
                    if item is None:
                        exhausted = True
                    elif item[1].strip():
                        self._take(*item)
                if not self.pending:
                    break
                for output in self.engine.step():
                    if output.finished and output.request_id in self.pending:  # the engine may serve others too
                        self._finish(output)
                self.summary.seconds = time.perf_counter() - start
                rate = self.summary.completion_tokens / self.summary.seconds if self.summary.seconds else 0
                self.bar.set_postfix_str(f"{rate:.1f} tok/s, {self.summary.failed} failed", refresh=False)
        finally:
            if self.pending:  # interrupted: nothing half-done stays in the engine
                self.engine.abort_request(list(self.pending))
            self.bar.close()
        self.summary.seconds = time.perf_counter() - start

    def _take(self, line_number: int, line: bytes) -> None:
        """Records an error for a bad line, skips a request already done, or hands the request to the engine."""
        self.summary.requests += 1
        try:
            record = parse_json(line, f"line {line_number}")
        except ValueError as e:  # not JSON, nested too deep, NaN, a key twice, ...
            return self._error(f"line-{line_number}", None, "invalid_json", str(e))
        custom_id = record.get("custom_id") if isinstance(record, dict) else None
        if not isinstance(custom_id, str) or not custom_id or not _is_text(custom_id):
            message = f"line {line_number}: custom_id must be a non-empty string of valid text"
            return self._error(f"line-{line_number}", None, "invalid_request", message)
        if custom_id in self.seen:
            message = f"line {line_number}: custom_id {custom_id!r} repeats an earlier line's"
            return self._error(f"line-{line_number}", None, "duplicate_custom_id", message)
        self.seen.add(custom_id)
        if custom_id in self.done:
            self.summary.resumed += 1
            self.bar.update()
            return None
        try:
            check_unicode(record, whole=f"line {line_number}")  # a lone surrogate or a byte not UTF-8, in any field
            if record.get("method", "POST") != "POST":
                raise RequestError(f"method must be POST, got {record.get('method')!r}")
            if len(split_prompts(record.get("url"), record.get("body"))) > 1:
                raise RequestError("prompt must be one prompt in a batch line (one line per prompt)")
            defaults = self.engine.generation_defaults.sampling_dict
            request = parse_request(record.get("url"), record.get("body"), defaults=defaults)
            lora_request = self.models.lora_request(record["body"].get("model"))
            prompt = engine_prompt(request, self.engine.tokenizer)
            request_id = f"batch-{line_number}-{uuid.uuid4().hex[:8]}"
            self.engine.add_request(request_id, prompt, request.params, lora_request=lora_request)
        except ModelNotFound as e:
            return self._error(custom_id, 404, "model_not_found", str(e))
        except ValueError as e:  # RequestError, and the engine's own checks (prompt too long, ...)
            return self._error(custom_id, 400, "invalid_request", str(e))
        except Exception as e:  # not the line's fault, as far as anyone knows: record it and go on
            return self._error(custom_id, 500, "internal_error", f"{type(e).__name__}: {e}")
        self.pending[request_id] = (custom_id, request, self.models.name_of(lora_request))
        return None

    def _finish(self, output) -> None:
        custom_id, request, model = self.pending.pop(output.request_id)
        if output.error is not None:  # failed at run time; the engine went on with the others
            return self._error(custom_id, 500, "internal_error", output.error)
        try:
            body = response_body(request, output, model, self.engine.tokenizer)
        except Exception as e:
            return self._error(custom_id, 500, "internal_error", f"{type(e).__name__}: {e}")
        self.summary.succeeded += 1
        self.summary.prompt_tokens += body["usage"]["prompt_tokens"]
        self.summary.completion_tokens += body["usage"]["completion_tokens"]
        self._write(custom_id, {"status_code": 200, "request_id": output.request_id, "body": body}, None)

    def _error(self, custom_id: str, status: int | None, code: str, message: str) -> None:
        if custom_id in self.done:  # recorded by an earlier run
            self.summary.resumed += 1
            self.bar.update()
            return
        self.summary.failed += 1
        if status is None:  # not a request: the record's error says why
            self._write(custom_id, None, {"code": code, "message": message})
        else:
            kind = {400: "invalid_request_error", 404: "not_found_error"}.get(status, "server_error")
            body = {"error": {"message": message, "type": kind, "code": code}}
            self._write(custom_id, {"status_code": status, "request_id": None, "body": body}, None)

    def _write(self, custom_id: str, response, error) -> None:
        record = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": response, "error": error}
        line = json.dumps(record, ensure_ascii=False)
        if not _is_text(line):  # an unpaired surrogate quoted from the input: JSON's escapes can still hold it
            line = json.dumps(record)
        self.out.write(line + "\n")
        self.out.flush()  # in the OS's hands now: a killed process loses nothing written
        self.bar.update()


def _is_text(text: str) -> bool:
    """Whether `text` can be written as UTF-8 (JSON strings may carry unpaired surrogates; files cannot)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
