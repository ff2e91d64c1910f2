"""From what a step did to the sequences (jaxpage.engine.scheduler.SequenceUpdate) to what callers see (RequestOutput):
detokenization, stop strings, logprobs and metrics. Host-only (no jax).

The output processor owns the requests' outputs (their completions, text and metrics); it never writes a Sequence.
A stop string it finds ends a sample: it says which sequences, and the engine has their scheduler finish them.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from jaxpage.lora_request import LoRARequest
from jaxpage.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jaxpage.sampling_params import RequestOutputKind, SamplingParams
from jaxpage.sequence import ScheduledSequence, Sequence, SequenceUpdate, prompt_logprob_rows

if TYPE_CHECKING:  # jaxpage.tokenizers.tokenizer imports the model loaders (jax): not at run time here
    from jaxpage.tokenizers.tokenizer import IncrementalDetokenizer

logger = logging.getLogger("jaxpage")


@dataclasses.dataclass(slots=True)  # (slots: its fields are read for each of its outputs)
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
    # RequestOutputKind.DELTA: per completion, (token ids, characters of text, logprobs) its outputs gave already
    sent: list[tuple[int, int, int]] | None = None
    lora_request: LoRARequest | None = None  # the adapter it runs through
    # An engine process's request (token ids alone: no detokenizers, output_kind DELTA), whose outputs after its first
    # may go as TokenDeltas (token_delta), not RequestOutputs, where they carry nothing more: no log-probs, not its end.
    token_deltas: bool = False
    # Set by OutputProcessor.add: a request of token_deltas with one sample, output_kind DELTA and no log-probs, whose
    # steps that neither start nor end it give its TokenDelta straight from the scheduler's update, in the step's
    # StepTokens (OutputProcessor.process's short way); its completion holds the tokens of its other outputs alone,
    # which is all a DELTA output reads (the tokens past `sent`).
    lean_deltas: bool = False

    @property
    def detokenized_at_end(self) -> bool:
        """Whether its text is made when it ends, not token by token: nothing reads it before (FINAL_ONLY) and no
        stop string is looked for in it."""
        return self.params.output_kind is RequestOutputKind.FINAL_ONLY and not self.params.stop

    def output(self) -> RequestOutput:
        """Its output now, as its params' output_kind says: everything so far (CUMULATIVE, FINAL_ONLY), or what is
        new since the last output (DELTA)."""
        completions = self.completions
        if len(completions) == 1:
            finished = completions[0].finish_reason is not None
        else:
            finished = all([c.finish_reason is not None for c in completions])
        prompt_logprobs = None if self.prompt_logprobs is None else list(self.prompt_logprobs)
        if self.params.output_kind is RequestOutputKind.DELTA:
            sent = self.sent
            if sent is not None:  # the prompt's log-probs came with the first output
                prompt_logprobs = None
            else:
                sent = self.sent = [(0, 0, 0)] * len(completions)
            outputs = [_delta(c, sent, i) for i, c in enumerate(completions)]
        else:
            outputs = [
                CompletionOutput(
                    c.index, c.text, list(c.token_ids), c.cumulative_logprob, c.logprobs, c.finish_reason, c.stop_reason
                )
                for c in completions
            ]
        seqs = self.seqs
        cached = seqs[0].num_cached_tokens if len(seqs) == 1 else max(seq.num_cached_tokens or 0 for seq in seqs)
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            outputs,
            finished,
            self.metrics,
            self.error,
            prompt_logprobs,
            cached or 0,
        )

    def token_delta(self) -> TokenDelta:
        """Its DELTA output as a TokenDelta: its first output given already, no log-probs asked (token_deltas)."""
        sent, deltas = self.sent, []
        for index, c in enumerate(self.completions):
            token_ids = c.token_ids
            deltas.append((token_ids[sent[index][0] :], c.finish_reason, c.stop_reason))
            sent[index] = (len(token_ids), 0, 0)
        return self.request_id, deltas


# What an engine process gives for a request of token_deltas instead of a DELTA RequestOutput (Request.token_delta):
# (request_id, a (new token ids, finish_reason, stop_reason) per completion). A tuple of plain values, a twentieth of
# a RequestOutput's cost to pickle and a tenth to build; jaxpage.engine.output_texts makes the RequestOutput.
TokenDelta = tuple[str, list[tuple[list[int], str | None, int | str | None]]]


@dataclasses.dataclass(slots=True)
class StepTokens:
    """The TokenDeltas of a step's lean requests (Request.lean_deltas: one sample, neither started nor ended by the
    step), all in one object of two columns: a list and a tuple less to build a request, a third of the cost to
    pickle."""

    request_ids: list[str]
    token_ids: list[list[int]]  # each request's new tokens

    def deltas(self) -> list[TokenDelta]:
        pairs = zip(self.request_ids, self.token_ids, strict=True)
        return [(request_id, [(tokens, None, None)]) for request_id, tokens in pairs]


def each_output(outputs: list[RequestOutput | TokenDelta | StepTokens]) -> list[RequestOutput | TokenDelta]:
    """An engine step's outputs, StepTokens given as their TokenDeltas."""
    if not any(isinstance(output, StepTokens) for output in outputs):
        return outputs
    return [one for output in outputs for one in (output.deltas() if isinstance(output, StepTokens) else (output,))]


def final_text(request: Request) -> None:
    """The text of the tokens a FINAL_ONLY request's completions hold past what their detokenizers have seen (a
    request without stop strings, which nothing reads before its end, is detokenized at its end, in one call a
    completion: OutputProcessor._add_tokens)."""
    if not request.detokenized_at_end:
        return
    for completion, detokenizer in zip(request.completions, request.detokenizers, strict=True):
        if detokenizer is not None and detokenizer.num_tokens < len(completion.token_ids):
            detokenizer.extend(completion.token_ids[detokenizer.num_tokens :])
            completion.text = detokenizer.text


def _delta(completion: CompletionOutput, sent: list[tuple[int, int, int]], index: int) -> CompletionOutput:
    """What `completion` holds past what `sent[index]` says its outputs gave already (token ids, characters of text,
    log-probs), which it then counts as given."""
    c = completion
    tokens, chars, logprobs = sent[index]
    token_ids, text, all_logprobs = c.token_ids, c.text, c.logprobs
    sent[index] = (len(token_ids), len(text), len(all_logprobs) if all_logprobs else 0)
    new_logprobs = None if all_logprobs is None else all_logprobs[logprobs:]
    return CompletionOutput(
        c.index, text[chars:], token_ids[tokens:], c.cumulative_logprob, new_logprobs, c.finish_reason, c.stop_reason
    )


def add_tokens(
    completion: CompletionOutput,
    detokenizer: IncrementalDetokenizer | None,
    params: SamplingParams,
    tokens: list[int],
    finish_reason: str | None,
    stop_reason: int | None,
    record_logprobs: Callable[[CompletionOutput, int, int], None] | None = None,
) -> bool:
    """Adds a sample's new tokens to its completion, their text (unless detokenizer is None), and the finish reason the
    engine gave; whether a stop string in the text ended it, where the engine had not (the completion is then cut
    before the string, finish_reason "stop"). record_logprobs(completion, position, token): the log-probs of each
    token (None: none asked)."""
    stops = params.stop
    if not (stops or record_logprobs):  # tokens and text alone (most steps)
        completion.token_ids.extend(tokens)
        if detokenizer is not None:
            for token in tokens:
                detokenizer.add(token)
            completion.text = detokenizer.text
    else:
        ended_by_token = finish_reason == "stop"  # a stop token id or EOS: no stop string is looked for
        last = len(tokens) - 1
        for position, token in enumerate(tokens):
            completion.token_ids.append(token)
            if record_logprobs is not None:
                record_logprobs(completion, position, token)
            if detokenizer is None:
                continue
            delta = detokenizer.add(token)
            if not (stops and delta) or (ended_by_token and position == last):
                continue
            completion.text = detokenizer.text
            # vLLM: no stop string ends it before min_tokens
            early = len(completion.token_ids) <= params.min_tokens
            if not early and stop_string(completion, params, delta):
                return finish_reason is None
        if detokenizer is not None:
            completion.text = detokenizer.text
    if finish_reason is not None:
        completion.finish_reason, completion.stop_reason = finish_reason, stop_reason
    elif stops:
        # Hold back what could be the start of a stop string, so a stream never shows text it takes back.
        held = max(map(len, stops)) - 1
        completion.text = completion.text[: len(completion.text) - held] if held else completion.text
    return False


def stop_string(completion: CompletionOutput, params: SamplingParams, delta: str) -> bool:
    """Whether the text, grown by `delta`, now holds a stop string: then it is cut before it, and the completion ends
    ("stop", the string)."""
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


class OutputProcessor:
    """The unfinished requests, by request_id and by their sequences' ids, and their outputs."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer  # None with skip_tokenizer_init
        self.requests: dict[str, Request] = {}
        self.request_of_seq: dict[int, Request] = {}
        self._ended: list[RequestOutput] = []  # final outputs of requests aborted or failed, for the next step
        self._token_texts: dict[int, str] = {}  # token id -> its text alone (at most the vocabulary)
        self._logprob_lists: dict[int, tuple] = {}  # the latest step's log-probs as lists (_step_logprobs)

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        one_sample = len(request.seqs) == 1 and request.detokenizers[0] is None
        params = request.params
        delta = params.output_kind is RequestOutputKind.DELTA and params.logprobs is None
        request.lean_deltas = request.token_deltas and one_sample and delta
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
        text = self.token_text
        for row, (index, _, position) in enumerate(prompt_logprob_rows(items)):
            request = self.request_of_seq.get(items[index].seq.seq_id)
            if request is None or request.prompt_logprobs is None:
                continue
            token = request.prompt_token_ids[position]
            entry = {token: Logprob(float(target[row]), int(rank[row]), text(token))}
            for r, (tid, value) in enumerate(zip(top_ids[row], top_values[row], strict=True)):
                if r == request.params.prompt_logprobs:
                    break
                entry.setdefault(int(tid), Logprob(float(value), r + 1, text(int(tid))))
            request.prompt_logprobs[position] = entry

    def process(
        self, step_updates: list[tuple[list[SequenceUpdate], object]], now: float
    ) -> tuple[list[RequestOutput | TokenDelta | StepTokens], list[tuple[int, Sequence]]]:
        """(the outputs of the requests that progressed or ended, as their output_kind asks (TokenDeltas where a request
        has token_deltas, those of lean requests in one StepTokens), the sequences a stop string or a failure ended,
        which the engine must finish, with their replicas). `step_updates`: each replica's updates with its
        StepOutput (for log-probs)."""
        progressed: dict[str, Request] = {}
        ended: list[tuple[int, Sequence]] = []
        lean_ids: list[str] = []  # (a StepTokens)
        lean_tokens: list[list[int]] = []
        request_of_seq = self.request_of_seq
        for updates, result in step_updates:
            for update in updates:
                request = request_of_seq.get(update.seq.seq_id)
                if request is None:  # the request failed earlier in this loop
                    continue
                if request.lean_deltas and update.finish_reason is None and request.sent is not None:  # (most of them)
                    request.metrics.last_token_time = now
                    lean_ids.append(request.request_id)
                    lean_tokens.append(update.token_ids)
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
        if lean_ids:
            outputs.append(StepTokens(lean_ids, lean_tokens))
        final_only = RequestOutputKind.FINAL_ONLY
        for request in progressed.values():
            completions = request.completions
            if len(completions) == 1:
                finished = completions[0].finish_reason is not None
            else:
                finished = all(c.finish_reason is not None for c in completions)
            if finished:
                request.metrics.finished_time = now
                self._forget(request)
                final_text(request)
            elif request.params.output_kind is final_only:
                continue
            elif request.token_deltas and request.sent is not None and request.params.logprobs is None:
                outputs.append(request.token_delta())
                continue
            outputs.append(request.output())
        return outputs, ended

    def _add_tokens(self, request: Request, update: SequenceUpdate, result, now: float) -> bool:
        """Adds a sample's new tokens to its completion; whether a stop string ended it (where the scheduler had
        not)."""
        seqs = request.seqs
        index = seqs.index(update.seq) if len(seqs) > 1 else 0
        completion = request.completions[index]
        detokenizer = None if request.detokenized_at_end else request.detokenizers[index]  # (then made at the end)
        params = request.params
        metrics = request.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.last_token_time = now
        record = None
        if params.logprobs is not None and result.logprobs is not None:

            def record(completion: CompletionOutput, position: int, token: int) -> None:
                self._record_logprobs(completion, params.logprobs, token, result, (update.row, position))

        reasons = (update.finish_reason, update.stop_reason)
        return add_tokens(completion, detokenizer, params, update.token_ids, *reasons, record)

    def _record_logprobs(self, completion: CompletionOutput, num: int, token: int, result, at: tuple) -> None:
        logprobs, top_ids, top_values = self._step_logprobs(result)
        row, position = at
        ids, values, text = top_ids[row][position], top_values[row][position], self.token_text
        logprob = logprobs[row][position]
        entry = {token: Logprob(logprob, None, text(token))}
        for rank, (tid, value) in enumerate(zip(ids[:num], values[:num], strict=True), 1):
            entry[tid] = Logprob(value, rank, text(tid))
        if entry[token].rank is None:
            entry[token] = Logprob(logprob, ids.index(token) + 1 if token in ids else None, text(token))
        completion.logprobs.append(entry)
        completion.cumulative_logprob += logprob

    def _step_logprobs(self, result) -> tuple[list, list, list]:
        """A step's log-probs (its StepOutput's: the tokens', the top ids, their log-probs) as Python lists, made
        once a step rather than one number at a time."""
        lists = self._logprob_lists.get(id(result))
        if lists is None or lists[0] is not result:
            lists = (result, result.logprobs.tolist(), result.top_logprob_ids.tolist(), result.top_logprobs.tolist())
            self._logprob_lists = {id(result): lists}
        return lists[1:]

    def token_text(self, token: int) -> str | None:
        """One token's text (tokenizer.decode([token]), as log-probs show it), decoded once per token id."""
        if self.tokenizer is None:
            return None
        text = self._token_texts.get(token)
        if text is None:
            text = self._token_texts[token] = self.tokenizer.decode([token])
        return text

    def end(
        self, request: Request, finish_reason: str, error: str | None = None, samples: list[int] | None = None
    ) -> list[Sequence]:
        """Ends a request outside the normal flow ("abort" or "error"), or only its `samples` (indexes; "stop": a stop
        string found where the text is made, beside an engine process); its final output waits for the next
        `take_ended` once every sample has ended. Returns the sequences it ended, which the engine must finish."""
        unfinished = []
        for index, (seq, completion) in enumerate(zip(request.seqs, request.completions, strict=True)):
            if completion.finish_reason is None and (samples is None or index in samples):
                completion.finish_reason = finish_reason
                unfinished.append(seq)
        if any(completion.finish_reason is None for completion in request.completions):
            return unfinished
        request.error = error
        request.metrics.finished_time = time.time()
        self._forget(request)
        final_text(request)
        self._ended.append(request.output())
        return unfinished

    def take_ended(self) -> list[RequestOutput]:
        ended, self._ended = self._ended, []
        return ended

    def _forget(self, request: Request) -> None:
        del self.requests[request.request_id]
        for seq in request.seqs:
            self.request_of_seq.pop(seq.seq_id, None)
