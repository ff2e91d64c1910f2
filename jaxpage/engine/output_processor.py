"""From what a step did to the sequences (jaxpage.engine.scheduler.SequenceUpdate) to what callers see (RequestOutput):
detokenization, stop strings, logprobs and metrics. Host-only (no jax).

The output processor owns the requests' outputs (their completions, text and metrics); it never writes a Sequence.
A stop string it finds ends a sample: it says which sequences, and the engine has their scheduler finish them.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING

from jaxpage.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jaxpage.sampling_params import SamplingParams
from jaxpage.sequence import ScheduledSequence, Sequence, SequenceUpdate, prompt_logprob_rows

if TYPE_CHECKING:  # jaxpage.tokenizers.tokenizer imports the model loaders (jax): not at run time here
    from jaxpage.tokenizers.tokenizer import IncrementalDetokenizer

logger = logging.getLogger("jaxpage")


@dataclasses.dataclass
class Request:
    """A checked request and its state in the engine: LLMEngine.prepare_request makes it, add_prepared_requests
    queues it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    detokenizers: list[IncrementalDetokenizer | None]  # None with skip_tokenizer_init
    completions: list[CompletionOutput]
    metrics: RequestMetrics
    error: str | None = None
    replica: int = 0  # the data-parallel replica it runs on (jaxpage.engine.replica)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # a slot per prompt token when asked

    def output(self) -> RequestOutput:
        finished = all(c.finish_reason is not None for c in self.completions)
        outputs = [dataclasses.replace(c, token_ids=list(c.token_ids)) for c in self.completions]
        prompt_logprobs = None if self.prompt_logprobs is None else list(self.prompt_logprobs)
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            outputs,
            finished,
            self.metrics,
            self.error,
            prompt_logprobs,
            max((seq.num_cached_tokens or 0 for seq in self.seqs), default=0),
        )


class OutputProcessor:
    """The unfinished requests, by request_id and by their sequences' ids, and their outputs."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer  # None with skip_tokenizer_init
        self.requests: dict[str, Request] = {}
        self.request_of_seq: dict[int, Request] = {}
        self._ended: list[RequestOutput] = []  # final outputs of requests aborted or failed, for the next step

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        for seq in request.seqs:
            self.request_of_seq[seq.seq_id] = request

    def mark_scheduled(self, items: list[ScheduledSequence], now: float) -> None:
        for item in items:
            metrics = self.request_of_seq[item.seq.seq_id].metrics
            metrics.first_scheduled_time = metrics.first_scheduled_time or now

    def record_prompt_logprobs(self, items: list[ScheduledSequence], result) -> None:
        """Keeps the prompt log-probs a step computed (result: its StepOutput) in their requests, by prompt position;
        a position computed again (after a preemption) is overwritten with the same values."""
        if result.prompt_logprobs is None:
            return
        target, rank, top_ids, top_values = result.prompt_logprobs
        decode = self.tokenizer.decode if self.tokenizer else lambda ids: None
        for row, (index, _, position) in enumerate(prompt_logprob_rows(items)):
            request = self.request_of_seq.get(items[index].seq.seq_id)
            if request is None or request.prompt_logprobs is None:
                continue
            token = request.prompt_token_ids[position]
            entry = {token: Logprob(float(target[row]), int(rank[row]), decode([token]))}
            for r, (tid, value) in enumerate(zip(top_ids[row], top_values[row], strict=True)):
                if r == request.params.prompt_logprobs:
                    break
                entry.setdefault(int(tid), Logprob(float(value), r + 1, decode([int(tid)])))
            request.prompt_logprobs[position] = entry

    def process(
        self, updates: list[tuple[SequenceUpdate, object]], now: float
    ) -> tuple[list[RequestOutput], list[tuple[int, Sequence]]]:
        """(the outputs of the requests that progressed or ended, the sequences a stop string or a failure ended,
        which the engine must finish, with their replicas). `updates`: each with its step's StepOutput (for
        log-probs)."""
        progressed: dict[str, Request] = {}
        ended: list[tuple[int, Sequence]] = []
        for update, result in updates:
            request = self.request_of_seq.get(update.seq.seq_id)
            if request is None:  # the request failed earlier in this loop
                continue
            try:
                if self._add_tokens(request, update, result, now):
                    ended.append((request.replica, update.seq))
            except Exception as e:  # this request's own failure: it ends, the others go on
                logger.exception("request %r failed", request.request_id)
                ended += [(request.replica, seq) for seq in self.end(request, "error", f"{type(e).__name__}: {e}")]
                progressed.pop(request.request_id, None)
                continue
            progressed[request.request_id] = request
        outputs = self.take_ended()
        for request in progressed.values():
            out = request.output()
            if out.finished:
                request.metrics.finished_time = now
                self._forget(request)
            outputs.append(out)
        return outputs, ended

    def _add_tokens(self, request: Request, update: SequenceUpdate, result, now: float) -> bool:
        """Adds a sample's new tokens to its completion; whether a stop string ended it (where the scheduler had
        not)."""
        index = request.seqs.index(update.seq)
        completion = request.completions[index]
        detokenizer = request.detokenizers[index]
        params = request.params
        ended_by_token = update.finish_reason == "stop"  # a stop token id or EOS: no stop string is looked for
        last = len(update.token_ids) - 1
        for position, token in enumerate(update.token_ids):
            completion.token_ids.append(token)
            if result.logprobs is not None and params.logprobs is not None:
                self._record_logprobs(completion, params.logprobs, token, result, (update.row, position))
            delta = detokenizer.add(token) if detokenizer else ""
            completion.text = detokenizer.text if detokenizer else ""
            request.metrics.first_token_time = request.metrics.first_token_time or now
            request.metrics.last_token_time = now
            early = len(completion.token_ids) <= params.min_tokens  # vLLM: no stop string ends it before min_tokens
            if not (ended_by_token and position == last) and not early and self._stop_string(completion, params, delta):
                return update.finish_reason is None
        if update.finish_reason is not None:
            completion.finish_reason, completion.stop_reason = update.finish_reason, update.stop_reason
        elif params.stop:
            # Hold back what could be the start of a stop string, so a stream never shows text it takes back.
            held = max(map(len, params.stop)) - 1
            completion.text = completion.text[: len(completion.text) - held] if held else completion.text
        return False

    @staticmethod
    def _stop_string(completion: CompletionOutput, params: SamplingParams, delta: str) -> bool:
        """Whether the text, grown by `delta`, now holds a stop string: then it is cut before it, and the
        completion ends ("stop", the string)."""
        if not delta or not params.stop:
            return False
        # A stop string can only be new if it overlaps the delta: search the tail that could hold it.
        longest = max(map(len, params.stop))
        tail_start = max(0, len(completion.text) - len(delta) - longest + 1)
        hits = [(completion.text.find(s, tail_start), s) for s in params.stop]
        hits = [(pos, s) for pos, s in hits if pos >= 0]
        if not hits:
            return False
        pos, stop = min(hits)
        completion.text = completion.text[:pos]
        completion.finish_reason, completion.stop_reason = "stop", stop
        return True

    def _record_logprobs(self, completion: CompletionOutput, num: int, token: int, result, at: tuple) -> None:
        decode = self.tokenizer.decode if self.tokenizer else lambda ids: None
        entry = {token: Logprob(float(result.logprobs[at]), None, decode([token]))}
        top = zip(result.top_logprob_ids[at][:num], result.top_logprobs[at][:num], strict=True)
        for rank, (tid, value) in enumerate(top, 1):
            entry[int(tid)] = Logprob(float(value), rank, decode([int(tid)]))
        if entry[token].rank is None:
            ranks = [i for i, t in enumerate(result.top_logprob_ids[at], 1) if int(t) == token]
            entry[token] = dataclasses.replace(entry[token], rank=ranks[0] if ranks else None)
        completion.logprobs.append(entry)
        completion.cumulative_logprob += float(result.logprobs[at])

    def end(self, request: Request, finish_reason: str, error: str | None = None) -> list[Sequence]:
        """Ends a request outside the normal flow ("abort" or "error"); its final output waits for the next
        `take_ended`. Returns its unfinished sequences, which the engine must finish."""
        unfinished = []
        for seq, completion in zip(request.seqs, request.completions, strict=True):
            if completion.finish_reason is None:
                completion.finish_reason = finish_reason
                unfinished.append(seq)
        request.error = error
        request.metrics.finished_time = time.time()
        self._forget(request)
        self._ended.append(request.output())
        return unfinished

    def take_ended(self) -> list[RequestOutput]:
        ended, self._ended = self._ended, []
        return ended

    def _forget(self, request: Request) -> None:
        del self.requests[request.request_id]
        for seq in request.seqs:
            self.request_of_seq.pop(seq.seq_id, None)
