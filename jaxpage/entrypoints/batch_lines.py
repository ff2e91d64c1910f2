"""What every batch job shares (jaxpage.entrypoints.batch's for generation, batch_pooling's for pooling models): its
lines taken one by one, custom_ids checked, a resumed run's done lines skipped, a record written and flushed as each
request finishes, and the job's summary."""

from __future__ import annotations

import dataclasses
import json
import time
import uuid

from tqdm import tqdm

from jaxpage.entrypoints.json_body import check_unicode, parse_json
from jaxpage.entrypoints.openai_api import RequestError
from jaxpage.entrypoints.served_models import ModelNotFound


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
    inputs: int = 0  # a pooling job's: texts embedded or classified, pairs scored (in this run)

    def rate(self) -> str:
        """The job's speed so far: inputs a second for a pooling job, completion tokens a second otherwise."""
        seconds = self.seconds or float("inf")
        if self.inputs:
            return f"{self.inputs / seconds:.1f} inputs/s"
        return f"{self.completion_tokens / seconds:.1f} completion tokens/s"

    def describe(self) -> str:
        made = f"{self.inputs} inputs of" if self.inputs else ""
        text = (
            f"{self.requests} requests: {self.succeeded} succeeded, {self.failed} failed, {self.resumed} already "
            f"done; {made} {self.prompt_tokens} prompt and {self.completion_tokens} completion tokens in "
            f"{self.seconds:.1f}s ({self.rate()})"
        ).replace("done;  ", "done; ")
        spec = self.spec_decoding
        if spec is not None and spec["num_drafts"]:
            text += (
                f"; speculative decoding: {spec['num_drafts']} drafts, {spec['num_accepted_tokens']} of "
                f"{spec['num_draft_tokens']} draft tokens accepted ({spec['acceptance_rate']:.2f}), mean accepted "
                f"length {spec['mean_accepted_length']:.2f}"
            )
        return text


class LineJob:
    """What every batch job does with its lines: each parsed, its custom_id checked, skipped when an earlier run
    did it, handed to `submit` (ValueError: the line's 400; ModelNotFound: 404; anything else: 500), and its record
    written and flushed when `step` finishes it. A job over another kind of engine says how it submits, steps,
    aborts and counts what is pending."""

    unit = "req"

    def __init__(self, engine, done: set[str], quiet: bool):
        self.engine = engine
        self.done = done
        self.quiet = quiet
        self.summary = BatchSummary()
        self.seen: set[str] = set()  # custom_ids of this input so far

    def run(self, lines, out, total: int, max_pending: int) -> None:
        self.out = out
        start = time.perf_counter()
        self.bar = tqdm(total=total, disable=self.quiet, desc="batch", unit=self.unit, dynamic_ncols=True)
        numbered = enumerate(lines, 1)
        exhausted = False
        try:
            while True:
                while not exhausted and self.num_pending() < max_pending:
                    item = next(numbered, None)
                    if item is None:
                        exhausted = True
                    elif item[1].strip():
                        self._take(*item)
                if not self.num_pending():
                    break
                self.step()
                self.summary.seconds = time.perf_counter() - start
                self.bar.set_postfix_str(f"{self.summary.rate()}, {self.summary.failed} failed", refresh=False)
        finally:
            if self.num_pending():  # interrupted: nothing half-done stays in the engine
                self.abort_pending()
            self.bar.close()
        self.summary.seconds = time.perf_counter() - start

    def num_pending(self) -> int:
        raise NotImplementedError

    def submit(self, custom_id: str, line_number: int, record: dict) -> None:
        raise NotImplementedError

    def step(self) -> None:
        raise NotImplementedError

    def abort_pending(self) -> None:
        raise NotImplementedError

    def _take(self, line_number: int, line: bytes) -> None:
        """Records an error for a bad line, skips a request already done, or submits the request."""
        self.summary.requests += 1
        try:
            record = parse_json(line, f"line {line_number}")
        except ValueError as e:  # not JSON, nested too deep, NaN, a key twice, ...
            return self.error(f"line-{line_number}", None, "invalid_json", str(e))
        custom_id = record.get("custom_id") if isinstance(record, dict) else None
        if not isinstance(custom_id, str) or not custom_id or not _is_text(custom_id):
            message = f"line {line_number}: custom_id must be a non-empty string of valid text"
            return self.error(f"line-{line_number}", None, "invalid_request", message)
        if custom_id in self.seen:
            message = f"line {line_number}: custom_id {custom_id!r} repeats an earlier line's"
            return self.error(f"line-{line_number}", None, "duplicate_custom_id", message)
        self.seen.add(custom_id)
        if custom_id in self.done:
            self.summary.resumed += 1
            self.bar.update()
            return None
        try:
            check_unicode(record, whole=f"line {line_number}")  # a lone surrogate or a byte not UTF-8, in any field
            if record.get("method", "POST") != "POST":
                raise RequestError(f"method must be POST, got {record.get('method')!r}")
            self.submit(custom_id, line_number, record)
        except ModelNotFound as e:
            return self.error(custom_id, 404, "model_not_found", str(e))
        except ValueError as e:  # RequestError, and the engine's own checks (prompt too long, ...)
            return self.error(custom_id, 400, "invalid_request", str(e))
        except Exception as e:  # not the line's fault, as far as anyone knows: record it and go on
            return self.error(custom_id, 500, "internal_error", f"{type(e).__name__}: {e}")
        return None

    def succeeded(self, custom_id: str, request_id: str, body: dict) -> None:
        self.summary.succeeded += 1
        self.summary.prompt_tokens += body["usage"].get("prompt_tokens", body["usage"].get("total_tokens", 0))
        self.summary.completion_tokens += body["usage"].get("completion_tokens", 0)
        self._write(custom_id, {"status_code": 200, "request_id": request_id, "body": body}, None)

    def error(self, custom_id: str, status: int | None, code: str, message: str) -> None:
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
