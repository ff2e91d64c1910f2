"""OpenAI's request and response bodies for /v1/completions and /v1/chat/completions: to jaxpage and back.

`parse_request(url, body)` turns a request body into a prompt and SamplingParams (raising RequestError, a
ValueError, for anything invalid); jaxpage.entrypoints.openai_responses turns the outputs back into response bodies
and stream chunks (the server's `stream: true`; a batch refuses it).
Every field is honoured (COMMON_FIELDS, ENDPOINT_FIELDS), accepted where it changes nothing (NO_EFFECT_FIELDS:
"user", "metadata", ...) or refused by name (UNSUPPORTED_FIELDS, and any field this server does not know).
"""

from __future__ import annotations

import dataclasses
import math

from jaxpage.entrypoints.json_body import check_unicode, parse_json
from jaxpage.entrypoints.tool_calls import (
    ToolChoice,
    forced_schema,
    parse_tool_choice,
    render_messages_for_template,
)
from jaxpage.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from jaxpage.tokenizers.tokenizer import check_messages, encode_chat
from jaxpage.validation import check_text, describe, is_int

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
ENDPOINTS = (CHAT, COMPLETIONS)
OPENAI_DEFAULT_MAX_TOKENS = 16  # /v1/completions; chat completions generate up to max_model_len by default
MAX_PROMPTS = 1024  # in one /v1/completions request


class RequestError(ValueError):
    """An invalid request: its message says which field and why."""


@dataclasses.dataclass(frozen=True)
class ParsedRequest:
    url: str
    prompt: str | list[int] | None  # /v1/completions: the text or the token ids
    messages: list[dict] | None  # /v1/chat/completions: the conversation
    params: SamplingParams
    top_logprobs: int | None  # logprobs wanted in the response (None: none)
    stream: bool = False  # server-sent chunks as the tokens come
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the token counts
    echo: bool = False  # /v1/completions: the prompt before each choice's text (and its log-probs, with logprobs)
    # stream_options.continuous_usage_stats (vLLM's, with include_usage): every chunk carries the counts so far
    continuous_usage: bool = False
    tool_choice: ToolChoice | None = None  # /v1/chat/completions with tools
    tool_parser: str | None = None  # the server's --tool-call-parser, for tool_choice "auto"
    parallel_tool_calls: bool = True  # false: at most one call per choice
    prompt_logprobs: bool = False  # vLLM's prompt_logprobs: the prompt's log-probs in the response, vLLM's shape
    # max_tokens is the model's default (its generation config's max_new_tokens): not the caller's, so the context
    # bounds it (generation stops there) instead of refusing the request
    default_max_tokens: bool = False


def parse_request(
    url: str,
    body,
    allow_stream: bool = False,
    tool_parser: str | None = None,
    auto_tool_choice: bool = False,
    defaults: dict | None = None,
) -> ParsedRequest:
    """The request a body asks for; RequestError naming the field for anything invalid. tool_parser and
    auto_tool_choice: the server's --tool-call-parser and --enable-auto-tool-choice; defaults: SamplingParams' fields
    that a body leaving them out gets (the model's generation config: GenerationDefaults.sampling_dict)."""
    if url not in ENDPOINTS:
        raise RequestError(f"url must be one of {', '.join(ENDPOINTS)}, got {describe(url)}")
    if not isinstance(body, dict):
        raise RequestError(f"body must be a JSON object, got {describe(body)}")
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise RequestError(f"stream must be true or false, got {describe(stream)}")
    if stream and not allow_stream:
        raise RequestError("stream is not supported in a batch")
    include_usage, continuous_usage = _stream_options(body.get("stream_options"), stream)
    prompt = messages = tool_choice = None
    if url == CHAT:
        messages, tool_choice, max_tokens, top_logprobs = _chat_fields(body, tool_parser, auto_tool_choice)
    else:
        prompt, max_tokens, top_logprobs = _completions_fields(body)
    kwargs = _sampling_kwargs(body, max_tokens, top_logprobs)
    default_max_tokens = False
    for name, value in (defaults or {}).items():
        if name == "max_tokens":  # unset means absent: a null max_tokens asks for the context's length
            default_max_tokens = all(key not in body for key in ("max_tokens", "max_completion_tokens"))
            kwargs[name] = value if default_max_tokens else kwargs[name]
        elif kwargs[name] is None:
            kwargs[name] = value
    if kwargs["prompt_logprobs"] is not None and stream:
        raise RequestError("prompt_logprobs is supported without stream")
    parallel_tool_calls = _optional_bool(body, "parallel_tool_calls") is not False
    if tool_choice is not None:
        kwargs["structured_outputs"] = _forced_tool_call(tool_choice, parallel_tool_calls, kwargs["structured_outputs"])
    _refuse_unsupported(url, body, kwargs["n"] or 1)
    echo = _optional_bool(body, "echo") or False
    if echo and (url == CHAT or stream):
        raise RequestError("echo is supported for /v1/completions without stream")
    show_prompt_logprobs = kwargs["prompt_logprobs"] is not None
    if echo and top_logprobs is not None:  # the prompt's tokens get log-probs too, the first none
        kwargs["prompt_logprobs"] = max(top_logprobs, kwargs["prompt_logprobs"] or 0)
    # A response that is not streamed reads only the final output: the engine builds no other.
    kwargs["output_kind"] = RequestOutputKind.CUMULATIVE if stream else RequestOutputKind.FINAL_ONLY
    try:
        params = SamplingParams(**{k: v for k, v in kwargs.items() if v is not None or k == "max_tokens"})
    except ValueError as e:
        raise RequestError(str(e).replace("SamplingParams.", "")) from None
    return ParsedRequest(
        url,
        prompt,
        messages,
        params,
        top_logprobs,
        stream,
        include_usage,
        echo,
        include_usage and continuous_usage,
        tool_choice,
        tool_parser,
        parallel_tool_calls,
        show_prompt_logprobs,
        default_max_tokens,
    )


def _chat_fields(body: dict, tool_parser: str | None, auto_tool_choice: bool):
    """(messages, tool choice, max_tokens, top_logprobs) of a chat completions body."""
    try:
        messages = check_messages(body.get("messages"))
        tool_choice = parse_tool_choice(body, tool_parser, auto_tool_choice)
    except ValueError as e:
        raise RequestError(str(e)) from None
    max_tokens = _optional_int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _optional_int(body, "max_tokens", 1)
    return messages, tool_choice, max_tokens, _chat_logprobs(body)


def _completions_fields(body: dict):
    """(prompt, max_tokens, top_logprobs) of a completions body with one prompt (split_prompts)."""
    prompt = body.get("prompt")
    is_ids = isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt)
    if not (isinstance(prompt, str) and prompt) and not is_ids:
        raise RequestError(
            f"prompt must be a non-empty string, a list of token ids, or a list of either (several prompts), "
            f"got {describe(prompt)}"
        )
    if isinstance(prompt, str):
        try:
            check_text("prompt", prompt)
        except ValueError as e:
            raise RequestError(str(e)) from None
    max_tokens = _optional_int(body, "max_tokens", 1)
    max_tokens = OPENAI_DEFAULT_MAX_TOKENS if "max_tokens" not in body else max_tokens
    return prompt, max_tokens, _optional_int(body, "logprobs", 0, SamplingParams.MAX_LOGPROBS)


def _sampling_kwargs(body: dict, max_tokens: int | None, top_logprobs: int | None) -> dict:
    """SamplingParams' arguments from the body's fields, each checked for its JSON type (None: not given)."""
    stop = body.get("stop")
    if stop is not None and not (
        isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))
    ):
        raise RequestError(f"stop must be a string or a list of strings, got {describe(stop)}")
    return dict(
        n=_optional_int(body, "n", 1),
        temperature=_optional_number(body, "temperature"),
        top_p=_optional_number(body, "top_p"),
        top_k=_optional_int(body, "top_k", -1),
        min_p=_optional_number(body, "min_p"),
        seed=_optional_int(body, "seed"),
        stop=stop,
        max_tokens=max_tokens,
        logprobs=top_logprobs,
        ignore_eos=_optional_bool(body, "ignore_eos"),  # vLLM's extension
        presence_penalty=_optional_number(body, "presence_penalty"),
        frequency_penalty=_optional_number(body, "frequency_penalty"),
        logit_bias=body.get("logit_bias"),
        # vLLM's extensions
        repetition_penalty=_optional_number(body, "repetition_penalty"),
        min_tokens=_optional_int(body, "min_tokens", 0),
        allowed_token_ids=body.get("allowed_token_ids"),
        bad_words=body.get("bad_words"),
        structured_outputs=_structured_outputs(body),
        stop_token_ids=body.get("stop_token_ids"),
        skip_special_tokens=_optional_bool(body, "skip_special_tokens"),
        prompt_logprobs=_optional_int(body, "prompt_logprobs", 0, SamplingParams.MAX_LOGPROBS),
    )


def _forced_tool_call(
    tool_choice: ToolChoice, parallel_tool_calls: bool, structured: StructuredOutputsParams | None
) -> StructuredOutputsParams | None:
    """The structured output of a request with tools: tool_choice "required" or a named function force the call's
    JSON (parallel_tool_calls false: one call); otherwise what the request asked for."""
    forced = forced_schema(tool_choice)
    if forced is None:
        return structured
    if structured is not None:
        raise RequestError("tool_choice required or a named function cannot be combined with response_format")
    if not parallel_tool_calls and tool_choice.mode == "required":
        forced = dict(forced, maxItems=1)
    return StructuredOutputsParams(json=forced)


def split_prompts(url: str, body) -> list:
    """The body of each prompt of a /v1/completions request whose prompt is a list of prompts (strings, or lists of
    token ids), in order; any other body alone. Each prompt is a request of its own, its choices indexed after the
    ones before it (prompt i, sample j: index i * n + j), as OpenAI and vLLM answer."""
    prompt = body.get("prompt") if url == COMPLETIONS and isinstance(body, dict) else None
    if not isinstance(prompt, list) or not prompt or not all(isinstance(p, str | list) for p in prompt):
        return [body]
    if len(prompt) > MAX_PROMPTS:
        raise RequestError(f"prompt may hold at most {MAX_PROMPTS} prompts, got {len(prompt)}")
    return [dict(body, prompt=one) for one in prompt]


def engine_prompt(request: ParsedRequest, tokenizer) -> str | dict:
    """The prompt to give LLMEngine.add_request: a chat rendered by the chat template into token ids, token ids as
    they are, text as it is. RequestError for a chat without a tokenizer; ValueError when the template refuses it."""
    if request.messages is not None:
        if tokenizer is None:
            raise RequestError("chat completions need the tokenizer, which this engine runs without")
        tools = list(request.tool_choice.tools) if request.tool_choice is not None else None
        return {"prompt_token_ids": chat_token_ids(tokenizer, request.messages, tools)}
    if isinstance(request.prompt, list):
        return {"prompt_token_ids": request.prompt}
    return request.prompt


def chat_token_ids(tokenizer, messages, tools: list[dict] | None = None) -> list[int]:
    """A conversation's token ids under the chat template; assistant tool calls and tool results render even
    through a template that knows nothing of tools (tool_calls.render_messages_for_template)."""
    messages = render_messages_for_template(check_messages(messages), tokenizer.chat_template or "")
    return encode_chat(tokenizer, messages, tools)


# Every request-body field this server knows (README.md's field table is tested against these sets). A field outside
# them is refused by name, as is one of UNSUPPORTED_FIELDS: nothing that could change the output is ignored. A field
# sent as null counts as not sent.
COMMON_FIELDS = frozenset(
    {
        "model", "n", "temperature", "top_p", "seed", "stop", "max_tokens", "presence_penalty", "frequency_penalty",
        "logit_bias", "response_format", "stream", "stream_options",
        # vLLM's extensions
        "top_k", "min_p", "ignore_eos", "repetition_penalty", "min_tokens", "allowed_token_ids", "bad_words",
        "structured_outputs", "stop_token_ids", "skip_special_tokens", "prompt_logprobs",
    }
)  # fmt: skip
ENDPOINT_FIELDS = {
    CHAT: frozenset(
        {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls"}
    ),
    COMPLETIONS: frozenset({"prompt", "logprobs", "echo", "best_of"}),
}
# Accepted and without effect on the output: bookkeeping for OpenAI's platform, or a cache hint.
NO_EFFECT_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"})
# Fields that would change the output and that jaxpage does not do: refused, naming what they ask for. (A value that
# asks for nothing, false, "", [], "none" or the modalities ["text"], is accepted.)
UNSUPPORTED_FIELDS = {
    "functions": "the deprecated functions API (use tools)",
    "function_call": "the deprecated functions API (use tool_choice)",
    "suffix": "a suffix (fill in the middle)",
    "audio": "audio output",
    "modalities": "output other than text",
    "prediction": "predicted outputs",
    "reasoning_effort": "reasoning models' effort",
    "verbosity": "reasoning models' verbosity",
    "web_search_options": "web search",
    "guided_json": "guided_json (use response_format or structured_outputs)",
    "guided_regex": "guided_regex (use structured_outputs)",
    "guided_choice": "guided_choice (use structured_outputs)",
    "guided_grammar": "guided_grammar (use structured_outputs)",
}


def _refuse_unsupported(url: str, body: dict, n: int) -> None:
    for field, what in UNSUPPORTED_FIELDS.items():
        value = body.get(field)
        if value not in (None, False, "", [], "none", ["text"]):
            raise RequestError(f"{field} is not supported by this server ({what}), got {describe(value)}")
    known = COMMON_FIELDS | ENDPOINT_FIELDS[url] | NO_EFFECT_FIELDS | UNSUPPORTED_FIELDS.keys()
    for field, value in body.items():
        if field in known or value is None:
            continue
        other = next((u for u, fields in ENDPOINT_FIELDS.items() if field in fields), None)
        where = f"a field of {other}, not of {url}" if other else f"not a field of {url} that this server knows"
        raise RequestError(f"{field} is {where}, got {describe(value)}")
    best_of = body.get("best_of")
    if best_of is not None and best_of != n:
        raise RequestError(
            f"best_of must equal n ({n}) here: ranking extra samples is not supported, got {describe(best_of)}"
        )


def _structured_outputs(body: dict) -> StructuredOutputsParams | None:
    """The grammar the output must follow: OpenAI's response_format ({"type": "json_object"} or {"type":
    "json_schema", "json_schema": {"schema": ...}}) or vLLM's structured_outputs (StructuredOutputsParams' fields);
    not both. Whether it compiles is checked when the request is added (a 400 naming the field)."""
    response_format, structured = body.get("response_format"), body.get("structured_outputs")
    if response_format is not None and structured is not None:
        raise RequestError("response_format and structured_outputs cannot both be given")
    try:
        if structured is not None:
            if not isinstance(structured, dict):
                raise RequestError(f"structured_outputs must be an object, got {describe(structured)}")
            if isinstance(structured.get("json"), str):  # a schema as JSON text: read as strictly as the body
                schema = parse_json(structured["json"], "structured_outputs.json")
                check_unicode(schema, "structured_outputs.json")
                structured = dict(structured, json=schema)
            return StructuredOutputsParams(**structured)
        if response_format is None:
            return None
        kind = response_format.get("type") if isinstance(response_format, dict) else None
        if kind == "text":
            return None
        if kind == "json_object":
            return StructuredOutputsParams(json_object=True)
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if schema is None:
                raise RequestError(f"response_format.json_schema must be an object with a schema, got {describe(spec)}")
            return StructuredOutputsParams(json=schema)
    except TypeError as e:  # a field StructuredOutputsParams does not have
        raise RequestError(f"structured_outputs: {e}") from None
    except ValueError as e:
        raise RequestError(str(e).replace("SamplingParams.", "")) from None
    kinds = '{"type": "text" | "json_object" | "json_schema", ...}'
    raise RequestError(f"response_format must be {kinds}, got {describe(response_format)}")


def _stream_options(options, stream: bool) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats) of stream_options."""
    if options is None:
        return False, False
    if not stream:
        raise RequestError("stream_options needs stream: true")
    keys = {"include_usage", "continuous_usage_stats"}
    if not isinstance(options, dict) or set(options) - keys:
        raise RequestError(
            f"stream_options must be an object with the keys {' and '.join(sorted(keys))}, got {describe(options)}"
        )
    flags = []
    for key in ("include_usage", "continuous_usage_stats"):
        value = options.get(key, False)
        if not isinstance(value, bool):
            raise RequestError(f"stream_options.{key} must be true or false, got {describe(value)}")
        flags.append(value)
    return flags[0], flags[1]


def _chat_logprobs(body: dict) -> int | None:
    wanted = body.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise RequestError(f"logprobs must be true or false for chat completions, got {describe(wanted)}")
    top = _optional_int(body, "top_logprobs", 0, SamplingParams.MAX_LOGPROBS)
    if top is not None and not wanted:
        raise RequestError("top_logprobs needs logprobs: true")
    return (top or 0) if wanted else None


def _optional_int(body: dict, field: str, minimum: int | None = None, maximum: int | None = None) -> int | None:
    value = body.get(field)
    if value is None:
        return None
    if not is_int(value) or (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        bounds = f" >= {minimum}" if maximum is None and minimum is not None else ""
        bounds = f" in [{minimum}, {maximum}]" if maximum is not None else bounds
        raise RequestError(f"{field} must be an integer{bounds}, got {describe(value)}")
    return value


def _optional_bool(body: dict, field: str) -> bool | None:
    value = body.get(field)
    if value is not None and not isinstance(value, bool):
        raise RequestError(f"{field} must be true or false, got {describe(value)}")
    return value


def _optional_number(body: dict, field: str) -> float | None:
    value = body.get(field)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise RequestError(f"{field} must be a number, got {describe(value)}")
    return float(value)
