"""What a request gives back, in vLLM's names: RequestOutput, CompletionOutput, Logprob, RequestMetrics; a pooling
model's EmbeddingRequestOutput."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int | None = None  # 1 for the most likely token
    decoded_token: str | None = None


@dataclasses.dataclass
class CompletionOutput:
    index: int  # which of the request's n samples
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None  # per generated token: sampled and top-N tokens
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"; None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: str | None = None  # why the request failed at run time (its finish_reason is "error"); None otherwise
    # SamplingParams.prompt_logprobs: per prompt token, None for the first, then {its id and the top ids: Logprob}
    # (log-probs of the model's distribution given the tokens before it); None unless asked.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache (OpenAI's usage.cached_tokens)

    def followed_by(self, later: RequestOutput) -> RequestOutput:
        """This output of RequestOutputKind.DELTA and the `later` one of the same request, as one: each completion's
        new text, token ids and log-probs in order, the rest (finish reasons, metrics, cumulative log-prob) as later
        has them, the prompt's log-probs as the first that carries them (vLLM's RequestOutput.add)."""
        outputs = [
            CompletionOutput(
                b.index,
                a.text + b.text,
                a.token_ids + b.token_ids,
                b.cumulative_logprob,
                None if b.logprobs is None else (a.logprobs or []) + b.logprobs,
                b.finish_reason,
                b.stop_reason,
            )
            for a, b in zip(self.outputs, later.outputs, strict=True)
        ]
        prompt_logprobs = self.prompt_logprobs if self.prompt_logprobs is not None else later.prompt_logprobs
        return dataclasses.replace(later, outputs=outputs, prompt_logprobs=prompt_logprobs)


@dataclasses.dataclass
class EmbeddingOutput:
    """One input's embedding (vLLM's EmbeddingOutput)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclasses.dataclass
class EmbeddingRequestOutput:
    """What a pooling model gives back for one input of `LLM.embed` (vLLM's EmbeddingRequestOutput)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
