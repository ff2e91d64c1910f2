"""What a request gives back, in vLLM's names: RequestOutput, CompletionOutput, Logprob, RequestMetrics; a pooling
model's PoolingRequestOutput, and as LLM.embed, classify and score give them, EmbeddingRequestOutput,
ClassificationRequestOutput and ScoringRequestOutput."""

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
class PoolingOutput:
    """A pooling model's output for one input: an embedding, or a classifier's class probabilities."""

    data: list[float]


@dataclasses.dataclass
class PoolingRequestOutput:
    """What a pooling model's engine gives back for one input (vLLM's PoolingRequestOutput)."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    error: str | None = None  # why its step failed (its data is then empty); None otherwise


@dataclasses.dataclass
class EmbeddingOutput:
    """One input's embedding (vLLM's EmbeddingOutput)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclasses.dataclass
class EmbeddingRequestOutput:
    """LLM.embed's output for one input (vLLM's EmbeddingRequestOutput)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> EmbeddingRequestOutput:
        return cls(output.request_id, EmbeddingOutput(output.outputs.data), output.prompt_token_ids, output.finished)


@dataclasses.dataclass
class ClassificationOutput:
    """One input's class probabilities, in the order of the model's labels (vLLM's ClassificationOutput)."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclasses.dataclass
class ClassificationRequestOutput:
    """LLM.classify's output for one input (vLLM's ClassificationRequestOutput)."""

    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> ClassificationRequestOutput:
        probs = ClassificationOutput(output.outputs.data)
        return cls(output.request_id, probs, output.prompt_token_ids, output.finished)


@dataclasses.dataclass
class ScoringOutput:
    """One pair's score: a cross-encoder's relevance, or the cosine similarity of two embeddings."""

    score: float


@dataclasses.dataclass
class ScoringRequestOutput:
    """LLM.score's output for one pair (vLLM's ScoringRequestOutput)."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True
