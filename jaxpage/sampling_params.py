"""SamplingParams: how one request is decoded, in vLLM's names and meanings."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class SamplingParams:
    """Per-request decoding settings.

    temperature:    0 for greedy decoding; higher values flatten the distribution.
    top_p:          keep the smallest set of tokens whose probability adds up to top_p, in (0, 1].
    top_k:          keep the k most likely tokens; 0 or -1 keeps all.
    min_p:          drop tokens whose probability is below min_p times the top token's, in [0, 1].
    seed:           makes the request's samples reproducible, whatever else shares its batch.
    max_tokens:     most tokens to generate (default 16, as in vLLM).
    stop:           strings that end generation; they are cut from the returned text.
    stop_token_ids: token ids that end generation (kept in token_ids, not shown in the text).
    ignore_eos:     keep generating past the model's end-of-sequence tokens.
    logprobs:       also return the log-probabilities of the sampled token and the top `logprobs` tokens.
    n:              number of independent samples of the same prompt.
    skip_special_tokens: leave special tokens out of the text.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True

    MAX_LOGPROBS = 20

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._check()

    def _check(self) -> None:
        def fail(field: str, requirement: str) -> None:
            raise ValueError(f"SamplingParams.{field} must be {requirement}, got {getattr(self, field)!r}")

        if not _is_int(self.n) or self.n < 1:
            fail("n", "an integer >= 1")
        if not _is_number(self.temperature) or self.temperature < 0:
            fail("temperature", "a number >= 0")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            fail("top_p", "in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < 0:
            fail("top_k", "an integer >= 0 (0 or -1: disabled)")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            fail("min_p", "in [0, 1]")
        if self.seed is not None and not _is_int(self.seed):
            fail("seed", "an integer or None")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            fail("max_tokens", "an integer >= 1 or None")
        if not all(isinstance(s, str) and s for s in self.stop):
            fail("stop", "a non-empty string or a list of them")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            fail("stop_token_ids", "a list of token ids")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= self.MAX_LOGPROBS):
            fail("logprobs", f"an integer in [0, {self.MAX_LOGPROBS}] or None")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and x == x  # x == x rejects NaN
