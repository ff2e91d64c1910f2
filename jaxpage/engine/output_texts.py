"""OutputTexts: the text of the outputs of an engine that gives token ids alone (an engine process, whose server makes
the text: jaxpage.entrypoints.engine_process). Host-only (no jax).

The engine runs each request without detokenizers and gives what each step added (RequestOutputKind.DELTA; a
FINAL_ONLY request without stop strings, its one final output): token ids, their log-probs, finish reasons, as a
RequestOutput where it carries more than token ids (a request's first and last outputs, log-probs), else as a
TokenDelta (jaxpage.engine.output_processor: plain values, cheap to build and to pickle). Here, in
the server's process, each request's own detokenizers turn them into text, stop strings are looked for in it (a
sample a stop string ends is cut there, and the engine must stop it: `apply` says which), and the request's outputs
are built as its output_kind asks, the same as the engine's own OutputProcessor would build them (the same
`add_tokens`). Outputs the engine gives after a sample or request ended here are passed over. A request whose own
text fails here (its detokenizer raising) ends with finish_reason "error" and the engine stops it; the others go on.
"""

from __future__ import annotations

import logging

from jaxpage.engine.output_processor import Request, TokenDelta, add_tokens, final_text
from jaxpage.outputs import CompletionOutput, RequestOutput
from jaxpage.sampling_params import RequestOutputKind

logger = logging.getLogger("jaxpage")


def request_id_of(output: RequestOutput | TokenDelta) -> str:
    """The request an output of the engine (a RequestOutput or a TokenDelta) is of."""
    return output[0] if isinstance(output, tuple) else output.request_id


def engine_output_kind(request: Request) -> RequestOutputKind:
    """What the engine is asked to give for `request`: its final output alone where the text is wanted only at its
    end and no stop string is looked for in it, else what each step added."""
    return RequestOutputKind.FINAL_ONLY if request.detokenized_at_end else RequestOutputKind.DELTA


class OutputTexts:
    def __init__(self):
        self.requests: dict[str, Request] = {}  # the unfinished requests, as their caller's process prepared them

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request

    def forget(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def apply(self, output: RequestOutput | TokenDelta) -> tuple[RequestOutput | None, list[int]]:
        """(the request's output with its text, as its output_kind asks, or None where there is none to give; the
        samples, by index, that a stop string ended here, which the engine must stop). `output`: the engine's, of
        token ids alone (a TokenDelta after a request's first)."""
        request = self.requests.get(request_id_of(output))
        if request is None:  # it ended here already
            return None, []
        try:
            return self._apply(request, output)
        except Exception as e:  # this request's own failure (its detokenization, say): it ends, the others go on
            logger.exception("request %r failed", request.request_id)
            unfinished = [i for i, c in enumerate(request.completions) if c.finish_reason is None]
            for index in unfinished:
                request.completions[index].finish_reason = "error"
            request.error = f"{type(e).__name__}: {e}"
            del self.requests[request.request_id]
            return request.output(), unfinished

    def _apply(self, request: Request, output: RequestOutput | TokenDelta) -> tuple[RequestOutput | None, list[int]]:
        if isinstance(output, tuple):  # a TokenDelta: (request_id, (token ids, finish_reason, stop_reason) a sample)
            given = [(index, *delta, None) for index, delta in enumerate(output[1])]
        else:
            request.metrics, request.error = output.metrics, output.error
            if output.prompt_logprobs is not None:
                request.prompt_logprobs = output.prompt_logprobs
            for seq in request.seqs:
                seq.num_cached_tokens = output.num_cached_tokens
            given = [
                (c.index, c.token_ids, c.finish_reason, c.stop_reason, None if c.logprobs is None else _recorder(c))
                for c in output.outputs
            ]
        stopped = []
        for index, token_ids, finish_reason, stop_reason, record in given:
            completion = request.completions[index]
            if completion.finish_reason is not None:  # ended here by a stop string: the engine's late tokens
                continue
            detokenizer = None if request.detokenized_at_end else request.detokenizers[index]
            if add_tokens(completion, detokenizer, request.params, token_ids, finish_reason, stop_reason, record):
                stopped.append(index)
        if all(c.finish_reason is not None for c in request.completions):
            del self.requests[request.request_id]
            final_text(request)
        elif request.params.output_kind is RequestOutputKind.FINAL_ONLY:
            return None, stopped
        return request.output(), stopped


def _recorder(given: CompletionOutput):
    """record_logprobs for add_tokens: the engine's entry of each token (its text decoded there, once per id)."""

    def record(completion: CompletionOutput, position: int, token: int) -> None:
        entry = given.logprobs[position]
        completion.logprobs.append(entry)
        completion.cumulative_logprob += entry[token].logprob

    return record
