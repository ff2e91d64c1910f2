"""OpenAI tool calling for /v1/chat/completions, as vLLM does it.

A request's `tools` and `tool_choice` become a ToolChoice (`parse_tool_choice`). "named" and "required" force the
output with a JSON schema (`forced_schema`), so it always parses; "auto" lets the model write free text and a
parser (`--tool-call-parser`: hermes or llama3_json) finds the calls in it; "none" leaves the text alone.
`tool_calls_from_output` splits a finished text into content and calls, a ToolCallStream does the same delta by
delta, and `render_messages_for_template` prepares a conversation that holds tool calls for the chat template.

No jax here: pure functions over text, property-tested with hypothesis (tests/test_tool_calls.py).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import uuid

from jaxpage.entrypoints.json_body import check_unicode, parse_json
from jaxpage.validation import describe, fail

TOOL_CALL_PARSERS = ("hermes", "llama3_json")
_TOOL_CHOICE_MODES = ("none", "auto", "required")  # and "named": {"type": "function", "function": {"name": ...}}
_FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for function names
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_BLOCK = re.compile(f"{_HERMES_OPEN}(.*?){_HERMES_CLOSE}", re.DOTALL)  # to the first closing tag
_PYTHON_TAG = "<|python_tag|>"  # Llama 3.1's start of a tool call
_JSON_DECODER = json.JSONDecoder()


def _new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object, as OpenAI sends it
    id: str = dataclasses.field(default_factory=_new_call_id)

    def to_openai(self, index: int | None = None) -> dict:
        """The call in a response's message.tool_calls; with `index`, as a streamed chunk's delta.tool_calls item."""
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


@dataclasses.dataclass(frozen=True)
class ToolChoice:
    tools: tuple[dict, ...]  # the checked tools, as the request gave them (for the chat template)
    mode: str  # "none" | "auto" | "required" | "named"
    name: str | None = None  # the function's name when mode == "named"


def parse_tool_choice(body: dict, parser: str | None, auto_enabled: bool) -> ToolChoice | None:
    """The `tools` and `tool_choice` of a chat completions request body, or None when it has no tools.

    tool_choice defaults to "auto" when tools are given (as OpenAI and vLLM), which needs the server started with
    --enable-auto-tool-choice (auto_enabled) and a --tool-call-parser (parser). ValueError naming the field for
    anything invalid.
    """
    if parser is not None and parser not in TOOL_CALL_PARSERS:
        fail("tool_call_parser", f"one of {', '.join(TOOL_CALL_PARSERS)}", parser)
    tools = _check_tools(body.get("tools"))
    choice = body.get("tool_choice")
    if not tools:
        if choice is None or choice == "none":
            return None
        raise ValueError(f"tool_choice needs tools: the request has tool_choice {describe(choice)} and no tools")
    if choice is None:
        choice = "auto"
    if isinstance(choice, str) and choice in _TOOL_CHOICE_MODES:
        if choice == "auto" and not (auto_enabled and parser):
            raise ValueError(
                'tool_choice "auto" (the default when tools are given): "auto" tool choice requires '
                "--enable-auto-tool-choice and --tool-call-parser to be set"
            )
        return ToolChoice(tools, choice)
    return ToolChoice(tools, "named", _named_function(choice, [tool["function"]["name"] for tool in tools]))


def _check_tools(tools) -> tuple[dict, ...]:
    """OpenAI's tools list ([{"type": "function", "function": {"name", "description"?, "parameters"?, "strict"?}}]),
    checked; () for none. Keys OpenAI does not define are ignored, as vLLM does."""
    if tools is None:
        return ()
    if not isinstance(tools, list | tuple):
        fail("tools", 'a list of {"type": "function", "function": {...}} tools', tools, wrong_type=True)
    names = set()
    for i, tool in enumerate(tools):
        field = f"tools[{i}]"
        if not isinstance(tool, dict):
            fail(field, 'a {"type": "function", "function": {...}} tool', tool, wrong_type=True)
        if tool.get("type") != "function":
            fail(f"{field}.type", "'function'", tool.get("type"))
        function = tool.get("function")
        if not isinstance(function, dict):
            fail(f"{field}.function", 'a {"name": ..., "parameters": ...} object', function, wrong_type=True)
        name = function.get("name")
        wrong_type = not isinstance(name, str)
        if wrong_type or not _FUNCTION_NAME.fullmatch(name):
            fail(f"{field}.function.name", "1 to 64 letters, digits, _ or -", name, wrong_type=wrong_type)
        if name in names:
            fail(f"{field}.function.name", "unique (another tool has this name)", name)
        names.add(name)
        for key, kind, requirement in (
            ("description", str, "a string"),
            ("parameters", dict, "a JSON schema object"),
            ("strict", bool, "true or false"),
        ):
            value = function.get(key)
            if value is not None and not isinstance(value, kind):
                fail(f"{field}.function.{key}", requirement, value, wrong_type=True)
    return tuple(tools)


def _named_function(choice, names: list[str]) -> str:
    """The function a tool_choice of the form {"type": "function", "function": {"name": ...}} names."""
    modes = ", ".join(f'"{mode}"' for mode in _TOOL_CHOICE_MODES)
    if not isinstance(choice, dict):
        fail("tool_choice", f'{modes} or {{"type": "function", "function": {{"name": ...}}}}', choice)
    if choice.get("type") != "function":
        fail("tool_choice.type", "'function'", choice.get("type"))
    function = choice.get("function")
    if not isinstance(function, dict):
        fail("tool_choice.function", 'a {"name": ...} object', function, wrong_type=True)
    name = function.get("name")
    if name not in names:
        fail("tool_choice.function.name", f"the name of one of the tools ({', '.join(names)})", name)
    return name


def forced_schema(choice: ToolChoice) -> dict | None:
    """The JSON schema the output must follow so that its calls always parse (vLLM's approach), or None when the
    model writes freely ("none", "auto"). "named": the function's parameters (the output is the arguments object);
    "required": an array of one or more {"name": <a tool's name>, "parameters": <its parameters>} objects."""
    if choice.mode == "named":
        (function,) = [tool["function"] for tool in choice.tools if tool["function"]["name"] == choice.name]
        return _parameters_schema(function)
    if choice.mode != "required":
        return None
    calls = []
    for i, tool in enumerate(choice.tools):
        # The parameters move from a schema's root to here, so their local $refs ("#/$defs/...") must follow.
        parameters = _relocate_refs(_parameters_schema(tool["function"]), f"#/items/anyOf/{i}/properties/parameters")
        calls.append(
            {
                "type": "object",
                "properties": {"name": {"const": tool["function"]["name"]}, "parameters": parameters},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    return {"type": "array", "minItems": 1, "items": {"anyOf": calls}}


def _parameters_schema(function: dict) -> dict:
    return function.get("parameters") or {"type": "object"}


def _relocate_refs(schema, pointer: str):
    """A copy of `schema` whose local "$ref"s ("#...") point into it where it sits at `pointer` in a larger one."""
    if isinstance(schema, dict):
        return {
            key: pointer + value[1:]
            if key == "$ref" and isinstance(value, str) and value.startswith("#")
            else _relocate_refs(value, pointer)
            for key, value in schema.items()
        }
    if isinstance(schema, list):
        return [_relocate_refs(item, pointer) for item in schema]
    return schema


def tool_calls_from_output(choice: ToolChoice, text: str, parser: str | None) -> tuple[str | None, list[ToolCall]]:
    """(content, tool calls) of a finished completion's text. "named": the text is the arguments (kept as it is if
    max_tokens cut it); "required": the text is the array of calls, or content when it does not parse; "auto": the
    parser's calls in order, and the text outside their markup, stripped (None when empty); markup that does not
    parse stays in the content. "none": the text as it is."""
    if choice.mode == "none":
        return text, []
    if choice.mode == "named":
        return None, [ToolCall(choice.name, _arguments_text(text))]
    if choice.mode == "required":
        return _required_calls(text)
    _check_parser(parser)
    outside, calls = _hermes_calls(text) if parser == "hermes" else _llama3_calls(text)
    return outside.strip() or None, calls


def _check_parser(parser: str | None) -> None:
    if parser not in TOOL_CALL_PARSERS:
        fail("tool_call_parser", f'one of {", ".join(TOOL_CALL_PARSERS)} for tool_choice "auto"', parser)


def _arguments_text(text: str) -> str:
    """A "named" output as the arguments: re-serialized when it is a JSON object, as it is otherwise."""
    try:
        arguments = json.loads(text)
    except json.JSONDecodeError:
        return text
    return json.dumps(arguments, ensure_ascii=False) if isinstance(arguments, dict) else text


def _required_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """A "required" output ([{"name": ..., "parameters": {...}}, ...]) as calls; (text, []) when it is not one."""
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return text, []
    calls = [_call_from_json(item, ("parameters",)) for item in items] if isinstance(items, list) else []
    if not calls or None in calls:
        return text, []
    return None, calls


def _call_from_json(value, argument_keys: tuple[str, ...], arguments_optional: bool = False) -> ToolCall | None:
    """The call a parsed JSON value spells ({"name": "...", <one of argument_keys>: {...}}), or None."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    key = next((key for key in argument_keys if key in value), None)
    if key is not None:
        arguments = value[key]
    else:
        arguments = {} if arguments_optional else None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _hermes_call(block: str) -> ToolCall | None:
    """The call inside <tool_call>...</tool_call>: {"name": ..., "arguments": {...}} (arguments may be left out)."""
    try:
        value = json.loads(block)
    except json.JSONDecodeError:
        return None
    return _call_from_json(value, ("arguments",), arguments_optional=True)


def _hermes_calls(text: str) -> tuple[str, list[ToolCall]]:
    """Hermes / Qwen markup: the text outside the blocks that parse, and their calls."""
    outside, calls, start = [], [], 0
    for block in _HERMES_BLOCK.finditer(text):
        call = _hermes_call(block[1])
        if call is not None:
            outside.append(text[start : block.start()])
            calls.append(call)
            start = block.end()
    outside.append(text[start:])
    return "".join(outside), calls


def _llama3_calls(text: str) -> tuple[str, list[ToolCall]]:
    """Llama 3's JSON calls: [<|python_tag|>] {"name": ..., "parameters": {...}} [; {...}]... at the start of the
    text. The calls that parse, and the text from the first thing that is not one (all of it when none is)."""
    start = _llama3_calls_start(text)
    if start is None:
        return text, []
    calls, position = [], start
    while text.startswith("{", position := _skip_whitespace(text, position)):
        try:
            value, end = _JSON_DECODER.raw_decode(text, position)
        except json.JSONDecodeError:
            break
        call = _call_from_json(value, ("parameters", "arguments"))
        if call is None:
            break
        calls.append(call)
        position = _skip_whitespace(text, end)
        if not text.startswith(";", position):
            break
        position += 1
    return (text[position:], calls) if calls else (text, [])


def _llama3_calls_start(text: str) -> int | None:
    """Where Llama 3's first call starts: after the leading whitespace and <|python_tag|>; None when the text does
    not start with either that tag or "{" (it is all content)."""
    head = text.lstrip()
    if head.startswith(_PYTHON_TAG):
        return len(text) - len(head) + len(_PYTHON_TAG)
    return len(text) - len(head) if head.startswith("{") else None


def _skip_whitespace(text: str, position: int) -> int:
    return len(text) - len(text[position:].lstrip())


class ToolCallStream:
    """tool_calls_from_output, delta by delta, for streamed chat completions.

    `feed(delta_text)` and, at the end, `finish()` return (content delta, completed calls). Text that may still
    become markup (a trailing "<tool_c", an unclosed block, a JSON call not yet closed) and trailing whitespace are
    held back until they are known; each call comes once, whole. All content deltas joined, and all calls, are what
    tool_calls_from_output gives for the whole text, however it was split. "named" and "required" outputs are
    parsed at the end (a cut one is content then).
    """

    def __init__(self, choice: ToolChoice, parser: str | None):
        self._scanner = None
        if choice.mode == "auto":
            _check_parser(parser)
            self._scanner = _HermesScanner() if parser == "hermes" else _Llama3Scanner()
        self._choice, self._parser = choice, parser
        self._content = _StrippedContent()
        self._forced_text = ""  # "named" and "required": the output so far
        self._finished = False

    def feed(self, delta_text: str) -> tuple[str, list[ToolCall]]:
        assert not self._finished, "feed after finish"
        return self._advance(delta_text, final=False)

    def finish(self) -> tuple[str, list[ToolCall]]:
        assert not self._finished, "finish twice"
        self._finished = True
        return self._advance("", final=True)

    def _advance(self, delta_text: str, final: bool) -> tuple[str, list[ToolCall]]:
        if self._choice.mode == "none":
            return delta_text, []
        if self._choice.mode == "auto":
            outside, calls = self._scanner.scan(delta_text, final)
            return self._content.add(outside), calls
        self._forced_text += delta_text
        if not final:
            return "", []
        content, calls = tool_calls_from_output(self._choice, self._forced_text, self._parser)
        return content or "", calls


class _StrippedContent:
    """Content deltas that join to the whole content stripped: leading whitespace is dropped, and trailing
    whitespace waits for text after it (dropped if none comes)."""

    def __init__(self):
        self._started = False
        self._whitespace = ""  # held: it ends the content so far

    def add(self, text: str) -> str:
        if not self._started:
            text = text.lstrip()
            self._started = bool(text)
        body = text.rstrip()
        if not body:
            self._whitespace += text
            return ""
        delta, self._whitespace = self._whitespace + body, text[len(body) :]
        return delta


class _HermesScanner:
    """_hermes_calls on a stream: the text outside <tool_call>...</tool_call> blocks as soon as it cannot be the
    start of one, each block's call when it closes."""

    def __init__(self):
        self._pending = ""  # an unclosed block, or a tail that may be the start of _HERMES_OPEN

    def scan(self, delta_text: str, final: bool) -> tuple[str, list[ToolCall]]:
        text = self._pending + delta_text
        outside, calls = [], []
        while True:
            start = text.find(_HERMES_OPEN)
            if start < 0:
                keep = 0 if final else _partial_tag_length(text, _HERMES_OPEN)
                outside.append(text[: len(text) - keep])
                self._pending = text[len(text) - keep :]
                break
            outside.append(text[:start])
            close = text.find(_HERMES_CLOSE, start + len(_HERMES_OPEN))
            if close < 0:
                if final:
                    outside.append(text[start:])
                self._pending = "" if final else text[start:]
                break
            end = close + len(_HERMES_CLOSE)
            call = _hermes_call(text[start + len(_HERMES_OPEN) : close])
            if call is None:
                outside.append(text[start:end])
            else:
                calls.append(call)
            text = text[end:]
        return "".join(outside), calls


def _partial_tag_length(text: str, tag: str) -> int:
    """The length of the longest end of `text` that starts `tag` (without being all of it)."""
    return next((n for n in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:n])), 0)


class _Llama3Scanner:
    """_llama3_calls on a stream. Until the text's start is known, it is held; text that does not start a call is
    content from then on; otherwise each call comes when its JSON closes, and the text from the first thing that
    is not a call (all of it when no call came) becomes content."""

    def __init__(self):
        self._text = ""
        self._position = 0  # content mode: what is not yet given out; calls mode: where the next call or ";" starts
        self._mode = "start"  # "start" | "calls" | "content"
        self._after_call = False  # calls mode: a ";" or the end must come next
        self._any_call = False

    def scan(self, delta_text: str, final: bool) -> tuple[str, list[ToolCall]]:
        self._text += delta_text
        calls = []
        if self._mode == "start":
            start = _llama3_calls_start(self._text)
            if start is not None:
                self._mode, self._position = "calls", start
            elif final or not _PYTHON_TAG.startswith(self._text.lstrip()):
                self._mode = "content"
        if self._mode == "calls":
            self._scan_calls(calls, final)
        if self._mode != "content":
            return "", calls
        content, self._position = self._text[self._position :], len(self._text)
        return content, calls

    def _scan_calls(self, calls: list[ToolCall], final: bool) -> None:
        """Appends the calls that completed; switches to content mode at the first thing that is not a call."""
        text = self._text
        while True:
            position = _skip_whitespace(text, self._position)
            if position == len(text) and not final:
                return
            if self._after_call:
                if not text.startswith(";", position):
                    break
                self._position, self._after_call = position + 1, False
                continue
            if not text.startswith("{", position):
                break
            try:
                value, end = _JSON_DECODER.raw_decode(text, position)
            except json.JSONDecodeError:  # not closed yet, or not JSON
                if final:
                    break
                return
            call = _call_from_json(value, ("parameters", "arguments"))
            if call is None:
                break
            calls.append(call)
            self._position, self._after_call, self._any_call = end, True, True
        self._mode, self._position = "content", position if self._any_call else 0


def render_messages_for_template(messages: list[dict], chat_template: str) -> list[dict]:
    """The conversation (check_messages' output) ready for the chat template, without changing `messages`.

    Assistant messages may carry OpenAI's tool_calls (content None) and "tool" messages the results. A template
    that knows tool calls (its source mentions "tool_calls") gets them as they are, each call's arguments parsed
    into an object when they are a JSON one (Qwen's and Llama 3's templates apply `tojson` to them, as vLLM
    prepares them). Any other template would fail on content None: the calls are written into the content in
    hermes form instead, so the model still sees what it called. ValueError naming the field for malformed calls.
    """
    knows_tool_calls = "tool_calls" in chat_template
    rendered = []
    for i, message in enumerate(messages):
        message = copy.deepcopy(message)
        rendered.append(message)
        if message.get("role") != "assistant" or not message.get("tool_calls"):
            continue
        functions = _checked_functions(f"messages[{i}].tool_calls", message["tool_calls"])
        if knows_tool_calls:
            for call, (_, arguments) in zip(message["tool_calls"], functions, strict=True):
                if isinstance(arguments, dict):
                    call["function"]["arguments"] = arguments
            continue
        blocks = [
            f"{_HERMES_OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{_HERMES_CLOSE}"
            for name, arguments in functions
        ]
        message["content"] = "\n".join(part for part in [message.get("content") or "", *blocks] if part)
        del message["tool_calls"]
    return rendered


def _checked_functions(field: str, tool_calls) -> list[tuple[str, dict | str]]:
    """(name, arguments) of each of an assistant message's tool calls; the arguments parsed when they are a JSON
    object, the string as it is otherwise (JSON nested too deep too). JSON that holds a lone surrogate is refused
    (json_body.check_unicode): the template would write it into a prompt no tokenizer takes."""
    if not isinstance(tool_calls, list | tuple):
        fail(field, 'a list of {"type": "function", "function": {...}} calls', tool_calls, wrong_type=True)
    functions = []
    for j, call in enumerate(tool_calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            fail(f"{field}[{j}].function", 'a {"name", "arguments"} object', function, wrong_type=True)
        name, arguments = function.get("name"), function.get("arguments")
        if not isinstance(name, str) or not name:
            fail(f"{field}[{j}].function.name", "a non-empty string", name, wrong_type=not isinstance(name, str))
        if not isinstance(arguments, str):
            fail(f"{field}[{j}].function.arguments", "a JSON string", arguments, wrong_type=True)
        try:
            parsed = parse_json(arguments, f"{field}[{j}].function.arguments")
        except ValueError:
            parsed = None
        check_unicode(parsed, f"{field}[{j}].function.arguments")
        functions.append((name, parsed if isinstance(parsed, dict) else arguments))
    return functions
