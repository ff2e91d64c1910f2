"""SamplingParams: how one request is decoded, in vLLM's names and meanings."""

from __future__ import annotations

import dataclasses

from jaxpage.validation import INT32_MAX, check_bool, check_int, check_number, check_text, fail, is_int


@dataclasses.dataclass
class SamplingParams:
    """Per-request decoding settings. Every field is checked when the params are built (and again when a request
    is added): a bad value raises ValueError naming the field and the value (ArgumentTypeError, a TypeError too,
    for a value of the wrong type).

    n:              number of independent samples of the same prompt, 1 to MAX_N (128).
    temperature:    0 for greedy decoding (so is anything below 1e-5); higher values flatten the distribution.
    top_p:          keep the smallest set of tokens whose probability adds up to top_p, in (0, 1].
    top_k:          keep the k most likely tokens; 0 or -1 keeps all. At most the vocabulary size (checked when the
                    request is added).
    min_p:          drop tokens whose probability is below min_p times the top token's, in [0, 1].
    seed:           makes the request's samples reproducible, whatever else shares its batch (any integer).
    max_tokens:     most tokens to generate, >= 1 (default 16, as in vLLM); None: up to max_model_len.
    stop:           a string or a list of strings that end generation; they are cut from the returned text.
    stop_token_ids: token ids that end generation (kept in token_ids, not shown in the text).
    ignore_eos:     keep generating past the model's end-of-sequence tokens.
    logprobs:       also return the log-probabilities of the sampled token and the top `logprobs` (0 to 20) tokens.
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
    MAX_N = 128

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Checks every field and brings it to its canonical form (stop a list, top_k -1 as 0, numpy ints as ints).
        Idempotent; the engine calls it again when a request is added, in case a field was changed since."""

        def name(field: str) -> str:
            return f"SamplingParams.{field}"

        self.n = check_int(name("n"), self.n, 1, self.MAX_N)
        self.temperature = check_number(name("temperature"), self.temperature, "a finite number >= 0", lambda t: t >= 0)
        self.top_p = check_number(name("top_p"), self.top_p, "in (0, 1]", lambda p: 0 < p <= 1)
        if is_int(self.top_k) and self.top_k == -1:
            self.top_k = 0
        self.top_k = check_int(name("top_k"), self.top_k, 0, INT32_MAX)
        self.min_p = check_number(name("min_p"), self.min_p, "in [0, 1]", lambda p: 0 <= p <= 1)
        if self.seed is not None:
            self.seed = check_int(name("seed"), self.seed)
        if self.max_tokens is not None:
            self.max_tokens = check_int(name("max_tokens"), self.max_tokens, 1)
        self.stop = _string_list(name("stop"), self.stop)
        self.stop_token_ids = _token_id_list(name("stop_token_ids"), self.stop_token_ids)
        self.ignore_eos = check_bool(name("ignore_eos"), self.ignore_eos)
        if self.logprobs is not None:
            self.logprobs = check_int(name("logprobs"), self.logprobs, 0, self.MAX_LOGPROBS)
        self.skip_special_tokens = check_bool(name("skip_special_tokens"), self.skip_special_tokens)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _string_list(field: str, value) -> list[str]:
    requirement = "a non-empty string, a list of them, or None"
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list | tuple) or not all(isinstance(s, str) for s in items):
        fail(field, requirement, value, wrong_type=True)
    if not all(items):
        fail(field, requirement, value)
    try:
        for item in items:
            check_text(field, item)
    except ValueError:
        fail(field, "valid text (no unpaired surrogates)", value)
    return list(items)


def _token_id_list(field: str, value) -> list[int]:
    requirement = f"a list of token ids in [0, {INT32_MAX}] or None"
    if value is None:
        return []
    if not isinstance(value, list | tuple) or not all(is_int(t) for t in value):
        fail(field, requirement, value, wrong_type=True)
    if not all(0 <= t <= INT32_MAX for t in value):
        fail(field, requirement, value)
    return [int(t) for t in value]
