"""SamplingParams: how one request is decoded, in vLLM's names and meanings (StructuredOutputsParams: the grammar its
output must follow)."""

from __future__ import annotations

import dataclasses
import enum
import json
import math

from jaxpage.validation import INT32_MAX, check_bool, check_int, check_number, check_text, describe, fail, is_int


@dataclasses.dataclass
class StructuredOutputsParams:
    """The grammar a request's output must follow, vLLM's names: set exactly one of

    json:        a JSON schema (a dict, or its JSON text): the output is a JSON document valid against it.
    regex:       the output matches this regular expression (whole).
    choice:      the output is one of these strings.
    grammar:     a Lark grammar (llguidance's dialect; GBNF, with `::=`, is converted).
    json_object: True: the output is a JSON object, any.

    Checked here for form; whether the schema, regex or grammar compiles is checked when the request is added
    (ValueError naming the field, nothing queued). The engine constrains sampling with llguidance
    (jaxpage.structured): JSON has no free whitespace (`", "` and `": "` separators), as llama.cpp writes it.
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    KINDS = ("json", "regex", "choice", "grammar", "json_object")

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        def name(field: str) -> str:
            return f"SamplingParams.structured_outputs.{field}"

        given = [kind for kind in self.KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            fail(
                "SamplingParams.structured_outputs",
                f"exactly one of {', '.join(self.KINDS)} set",
                {kind: getattr(self, kind) for kind in given},
            )
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as e:
                    fail(name("json"), f"a JSON schema (as a dict or JSON text; this text does not parse: {e})", schema)
            if not isinstance(schema, dict | bool):
                fail(name("json"), "a JSON schema: an object (dict) or a boolean", self.json, wrong_type=True)
        if self.regex is not None:
            if not isinstance(self.regex, str):
                fail(name("regex"), "a regular expression (a string)", self.regex, wrong_type=True)
            check_text(name("regex"), self.regex)
        if self.choice is not None:
            if not isinstance(self.choice, list | tuple) or not all(isinstance(c, str) for c in self.choice):
                fail(name("choice"), "a non-empty list of strings", self.choice, wrong_type=True)
            if not self.choice:
                fail(name("choice"), "a non-empty list of strings", self.choice)
            for c in self.choice:
                check_text(name("choice"), c, allow_empty=True)
            self.choice = list(self.choice)
        if self.grammar is not None:
            if not isinstance(self.grammar, str):
                fail(name("grammar"), "a Lark or GBNF grammar (a string)", self.grammar, wrong_type=True)
            check_text(name("grammar"), self.grammar)
        if self.json_object is not None:
            check_bool(name("json_object"), self.json_object)

    @property
    def kind(self) -> str:
        """Which one is set: "json", "regex", "choice", "grammar" or "json_object"."""
        return next(kind for kind in self.KINDS if getattr(self, kind) not in (None, False))

    def key(self) -> tuple[str, str]:
        """(kind, its spec as text): equal for specs that compile to the same grammar (the compile cache's key)."""
        kind, value = self.kind, getattr(self, self.kind)
        if kind == "json":
            value = json.loads(value) if isinstance(value, str) else value
            return kind, json.dumps(value, sort_keys=True)
        if kind == "choice":
            return kind, json.dumps(value)
        return kind, str(value)


class RequestOutputKind(enum.Enum):
    """Which outputs of a request LLMEngine.step returns, vLLM's names: CUMULATIVE, each time it progresses, with
    all its text and tokens so far; DELTA, each time it progresses, with only what is new since the last output
    (text, token ids, logprobs); FINAL_ONLY, only its final output. FINAL_ONLY and DELTA spare the engine the work
    of building outputs nobody reads."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


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
    prompt_logprobs: also return each prompt token's log-probability (given the tokens before it) and the top
                    `prompt_logprobs` (0 to 20) tokens there: RequestOutput.prompt_logprobs (None for the first).
    skip_special_tokens: leave special tokens out of the text.
    presence_penalty:  subtracted from the logit of every token the output already holds, in [-2, 2].
    frequency_penalty: subtracted from a token's logit once per time the output holds it, in [-2, 2].
    repetition_penalty: divides the positive logits (multiplies the others) of tokens in the prompt or the output,
                    > 0 (1: off).
    logit_bias:     {token id: bias} added to those logits (clipped to [-100, 100]); at most MAX_LOGIT_BIAS entries.
    allowed_token_ids: only these tokens may be generated.
    bad_words:      words never generated (each as the tokenizer spells it with and without a leading space).
    min_tokens:     EOS and stop_token_ids cannot end the output before it has this many tokens (nor stop strings).
    structured_outputs: the grammar the output follows (StructuredOutputsParams, or a dict of its fields).
    output_kind:    which outputs LLMEngine.step returns (RequestOutputKind; default CUMULATIVE).
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
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    min_tokens: int = 0
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    MAX_LOGPROBS = 20
    MAX_N = 128
    MAX_LOGIT_BIAS = 300  # entries of logit_bias (OpenAI's limit): the sampler takes them as a fixed-width array
    MAX_BIAS = 100.0  # logit_bias values are clipped to [-MAX_BIAS, MAX_BIAS], as vLLM and OpenAI do

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
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = check_int(name("prompt_logprobs"), self.prompt_logprobs, 0, self.MAX_LOGPROBS)
        self.skip_special_tokens = check_bool(name("skip_special_tokens"), self.skip_special_tokens)
        for field in ("presence_penalty", "frequency_penalty"):
            value = check_number(name(field), getattr(self, field), "in [-2, 2]", lambda p: -2 <= p <= 2)
            setattr(self, field, value)
        self.repetition_penalty = check_number(
            name("repetition_penalty"), self.repetition_penalty, "a finite number > 0 (1: off)", lambda p: p > 0
        )
        self.logit_bias = _logit_bias(name("logit_bias"), self.logit_bias, self.MAX_LOGIT_BIAS, self.MAX_BIAS)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _token_id_list(name("allowed_token_ids"), self.allowed_token_ids)
            if not self.allowed_token_ids:
                fail(name("allowed_token_ids"), "a non-empty list of token ids or None", self.allowed_token_ids)
        self.bad_words = _string_list(name("bad_words"), self.bad_words)
        self.min_tokens = check_int(name("min_tokens"), self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail(name("min_tokens"), f"at most max_tokens ({self.max_tokens})", self.min_tokens)
        if not isinstance(self.output_kind, RequestOutputKind):
            fail(name("output_kind"), "a RequestOutputKind", self.output_kind, wrong_type=True)
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as e:  # an unknown field
                fail(name("structured_outputs"), f"a StructuredOutputsParams or a dict of its fields ({e})", None)
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                fail(
                    name("structured_outputs"),
                    "a StructuredOutputsParams, a dict of its fields, or None",
                    self.structured_outputs,
                    wrong_type=True,
                )
            self.structured_outputs.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_penalties(self) -> bool:
        """Whether the sampler needs this request's token history (presence, frequency or repetition penalty)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def uses_logits_processors(self) -> bool:
        """Whether anything changes this request's logits before sampling: a grammar, allowed or bad tokens,
        min_tokens, logit_bias or a penalty."""
        return bool(
            self.structured_outputs is not None
            or self.allowed_token_ids is not None
            or self.bad_words
            or self.min_tokens
            or self.logit_bias
            or self.uses_penalties
        )


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


def _logit_bias(field: str, value, max_entries: int, max_bias: float) -> dict[int, float] | None:
    """{token id: bias} with integer ids (JSON's string keys such as "50256" accepted, as vLLM does) and biases
    clipped to [-max_bias, max_bias]."""
    requirement = f"a dict of at most {max_entries} {{token id: finite bias}} entries, or None"
    if value is None:
        return None
    if not isinstance(value, dict):
        fail(field, requirement, value, wrong_type=True)
    if len(value) > max_entries:
        fail(field, requirement, f"{len(value)} entries")
    bias = {}
    for key, b in value.items():
        token = key
        if isinstance(key, str):  # JSON's keys
            try:
                token = int(key)
            except ValueError:
                pass  # refused just below, by name
        if not is_int(token) or not 0 <= token <= INT32_MAX:
            fail(field, f"keyed by token ids in [0, {INT32_MAX}]", value, wrong_type=not is_int(token))
        if not isinstance(b, int | float) or isinstance(b, bool) or not math.isfinite(b):
            raise ValueError(f"{field}[{token}] must be a finite number, got {describe(b)}")
        bias[int(token)] = min(max(float(b), -max_bias), max_bias)
    return bias


# A sampler row's (temperature, top_k, top_p, min_p) when it is greedy, or padding.
GREEDY_SETTINGS = (0.0, 0, 1.0, 0.0)


def sampler_settings(params: SamplingParams | None) -> tuple[float, int, float, float]:
    """(temperature, top_k, top_p, min_p) of a row sampling with `params` (None: greedy), as the sampler takes them."""
    if params is None:
        return GREEDY_SETTINGS
    return (params.temperature, max(params.top_k, 0), params.top_p, params.min_p)  # top_k -1 and 0 both mean off
