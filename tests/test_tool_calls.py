"""Tool calling (jaxpage.entrypoints.tool_calls): tools and tool_choice checked field by field, the schemas that force
"named" and "required" outputs (validated with jsonschema and compiled by llguidance, the engine's backend), the
hermes and llama3_json parsers on well-formed, malformed and cut outputs, a stream that gives the same content and
calls however the text is split into deltas, and conversations with tool calls rendered by real chat templates."""

from __future__ import annotations

import copy
import json
import re

import jinja2.sandbox
import jsonschema
import llguidance
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jaxpage.entrypoints.tool_calls import (
    TOOL_CALL_PARSERS,
    ToolCall,
    ToolCallStream,
    ToolChoice,
    forced_schema,
    parse_tool_choice,
    render_messages_for_template,
    tool_calls_from_output,
)
from jaxpage.sampling_params import StructuredOutputsParams
from jaxpage.structured.grammar import grammar_text

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
NO_PARAMETERS = {"type": "function", "function": {"name": "get-time"}}
# As pydantic writes a nested model (the openai client's pydantic_function_tool): a $ref into the schema's $defs.
ADDRESS = {
    "type": "function",
    "function": {
        "name": "send_letter",
        "parameters": {
            "$defs": {"Address": {"type": "object", "properties": {"zip": {"type": "integer"}}, "required": ["zip"]}},
            "type": "object",
            "properties": {"to": {"$ref": "#/$defs/Address"}},
            "required": ["to"],
        },
        "strict": True,
    },
}
TOOLS = [WEATHER, NO_PARAMETERS, ADDRESS]


def choice(mode: str, name: str | None = None) -> ToolChoice:
    return ToolChoice(tuple(TOOLS), mode, name)


AUTO, REQUIRED, NONE = choice("auto"), choice("required"), choice("none")
NAMED = choice("named", "get_weather")


# parse_tool_choice


@pytest.mark.parametrize(
    "body", [{}, {"tools": None}, {"tools": []}, {"tool_choice": "none"}, {"tools": [], "tool_choice": None}]
)
def test_no_tools_is_none(body):
    assert parse_tool_choice(body, "hermes", auto_enabled=True) is None
    assert parse_tool_choice(body, None, auto_enabled=False) is None


def test_tool_choice_defaults_to_auto_with_tools():
    parsed = parse_tool_choice({"tools": TOOLS}, "hermes", auto_enabled=True)
    assert parsed == ToolChoice(tuple(TOOLS), "auto")


@pytest.mark.parametrize("mode", ["none", "auto", "required"])
def test_tool_choice_modes(mode):
    assert parse_tool_choice({"tools": TOOLS, "tool_choice": mode}, "llama3_json", True) == choice(mode)


def test_named_tool_choice():
    body = {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    assert parse_tool_choice(body, None, auto_enabled=False) == NAMED


@pytest.mark.parametrize("mode", ["none", "required", {"type": "function", "function": {"name": "get-time"}}])
def test_forced_and_none_need_no_parser(mode):
    assert parse_tool_choice({"tools": TOOLS, "tool_choice": mode}, None, auto_enabled=False) is not None


@pytest.mark.parametrize(
    ("body", "parser", "auto_enabled"),
    [
        ({"tools": TOOLS}, "hermes", False),
        ({"tools": TOOLS}, None, True),
        ({"tools": TOOLS, "tool_choice": "auto"}, None, False),
    ],
)
def test_auto_needs_the_server_flags(body, parser, auto_enabled):
    with pytest.raises(ValueError, match="--enable-auto-tool-choice and --tool-call-parser") as error:
        parse_tool_choice(body, parser, auto_enabled)
    assert str(error.value).startswith("tool_choice ")


def tools_with(**function) -> list[dict]:
    """TOOLS with the first function's fields changed."""
    return [{"type": "function", "function": {"name": "f", **function}}, *TOOLS[1:]]


BAD_BODIES = [
    ({"tools": "get_weather"}, "tools"),
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": [WEATHER, "get-time"]}, "tools[1]"),
    ({"tools": [{"type": "tool", "function": {"name": "f"}}]}, "tools[0].type"),
    ({"tools": [{"function": {"name": "f"}}]}, "tools[0].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [{"type": "function", "function": "f"}]}, "tools[0].function"),
    ({"tools": tools_with(name="")}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
    ({"tools": tools_with(name="get weather")}, "tools[0].function.name"),
    ({"tools": tools_with(name="f" * 65)}, "tools[0].function.name"),
    ({"tools": tools_with(name="f\n")}, "tools[0].function.name"),
    ({"tools": tools_with(name=3)}, "tools[0].function.name"),
    ({"tools": [WEATHER, NO_PARAMETERS, WEATHER]}, "tools[2].function.name"),
    ({"tools": tools_with(description=3)}, "tools[0].function.description"),
    ({"tools": tools_with(parameters="object")}, "tools[0].function.parameters"),
    ({"tools": tools_with(parameters=[])}, "tools[0].function.parameters"),
    ({"tools": tools_with(strict="yes")}, "tools[0].function.strict"),
    ({"tools": TOOLS, "tool_choice": "any"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": 1}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": ["auto"]}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool", "function": {"name": "get_weather"}}}, "tool_choice.type"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice.function"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": "get_weather"}}, "tool_choice.function"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {}}}, "tool_choice.function.name"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": [], "tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
]


@pytest.mark.parametrize(("body", "field"), BAD_BODIES)
def test_bad_tools_and_tool_choice_are_refused_by_field(body, field):
    with pytest.raises(ValueError) as error:
        parse_tool_choice(body, "hermes", auto_enabled=True)
    assert str(error.value).startswith(f"{field} "), str(error.value)


def test_unknown_parser_is_refused():
    with pytest.raises(ValueError, match=r"^tool_call_parser must be one of hermes, llama3_json, got 'mistral'"):
        parse_tool_choice({"tools": TOOLS}, "mistral", auto_enabled=True)


# forced_schema


def test_free_modes_have_no_schema():
    assert forced_schema(AUTO) is None
    assert forced_schema(NONE) is None


def test_named_schema_is_the_parameters():
    assert forced_schema(NAMED) == WEATHER["function"]["parameters"]
    assert forced_schema(choice("named", "get-time")) == {"type": "object"}


def validates(schema: dict, value) -> bool:
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError:
        return False
    return True


GOOD_CALLS = [
    [{"name": "get_weather", "parameters": {"city": "Paris"}}],
    [
        {"name": "get-time", "parameters": {}},
        {"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}},
    ],
    [{"name": "send_letter", "parameters": {"to": {"zip": 75001}}}],
]
BAD_CALLS = [
    [],
    {"name": "get_weather", "parameters": {"city": "Paris"}},
    [{"name": "get_weather", "parameters": {"city": 3}}],  # the function's own schema applies
    [{"name": "get_weather", "parameters": {"town": "Paris"}}],
    [{"name": "get_weather", "arguments": {"city": "Paris"}}],
    [{"name": "get_weather"}],
    [{"name": "nope", "parameters": {}}],
    [{"name": "get-time", "parameters": {}, "id": 1}],
    [{"name": "send_letter", "parameters": {"to": {"zip": "75001"}}}],  # the $ref still points at Address
]


def test_required_schema():
    schema = forced_schema(REQUIRED)
    jsonschema.Draft202012Validator.check_schema(schema)
    for calls in GOOD_CALLS:
        assert validates(schema, calls), calls
    for calls in BAD_CALLS:
        assert not validates(schema, calls), calls
    assert REQUIRED.tools[2] == ADDRESS  # the tools keep their own $refs


def test_named_schema_validates_arguments():
    schema = forced_schema(NAMED)
    assert validates(schema, {"city": "Paris"})
    assert not validates(schema, {"city": "Paris", "country": "FR"})
    assert not validates(schema, [{"city": "Paris"}])


@pytest.mark.parametrize("forced", [REQUIRED, NAMED, choice("named", "get-time"), choice("named", "send_letter")])
def test_forced_schemas_compile_in_the_grammar_backend(forced):
    grammar = grammar_text(StructuredOutputsParams(json=forced_schema(forced)))
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    assert not is_error, messages


# tool_calls_from_output


def summary(calls: list[ToolCall]) -> list[tuple[str, dict]]:
    """Each call's name and arguments as the client reads them (json.loads)."""
    return [(call.name, json.loads(call.arguments)) for call in calls]


def test_call_ids_and_openai_form():
    _, calls = tool_calls_from_output(REQUIRED, json.dumps(GOOD_CALLS[1]), None)
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", call.id) for call in calls)
    assert len({call.id for call in calls}) == 2
    call = calls[1]
    function = {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}
    assert call.to_openai() == {"id": call.id, "type": "function", "function": function}
    assert call.to_openai(index=1) == {"index": 1, "id": call.id, "type": "function", "function": function}


@pytest.mark.parametrize("parser", [None, *TOOL_CALL_PARSERS])
def test_none_leaves_the_text(parser):
    text = ' <tool_call>{"name": "get_weather", "arguments": {}}</tool_call> '
    assert tool_calls_from_output(NONE, text, parser) == (text, [])


def test_named():
    content, calls = tool_calls_from_output(NAMED, '{"city":"Zürich"}', None)
    assert content is None
    assert [(call.name, call.arguments) for call in calls] == [("get_weather", '{"city": "Zürich"}')]


def test_named_cut_by_max_tokens_keeps_the_text():
    content, calls = tool_calls_from_output(NAMED, '{"city": "Zür', None)
    assert content is None
    assert [(call.name, call.arguments) for call in calls] == [("get_weather", '{"city": "Zür')]


def test_required():
    text = '[{"name": "get-time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Zürich"}}]'
    content, calls = tool_calls_from_output(REQUIRED, text, "hermes")
    assert content is None
    assert [(call.name, call.arguments) for call in calls] == [
        ("get-time", "{}"),
        ("get_weather", '{"city": "Zürich"}'),  # ensure_ascii=False: as the model wrote it
    ]


@pytest.mark.parametrize(
    "text",
    [
        '[{"name": "get_weather", "parameters": {"city": "Par',  # cut by max_tokens
        "[]",
        '{"name": "get_weather", "parameters": {}}',
        '[{"name": "get_weather"}]',
        '[{"name": "get_weather", "parameters": "Paris"}]',
        '[{"name": "get-time", "parameters": {}}, 3]',
        "",
    ],
)
def test_required_that_does_not_parse_is_content(text):
    assert tool_calls_from_output(REQUIRED, text, None) == (text, [])


def hermes_block(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


HERMES_CASES = [
    ("Hello there.", "Hello there.", []),
    ("  Hello there.\n", "Hello there.", []),
    ("", None, []),
    (" \n ", None, []),
    (hermes_block("get_weather", {"city": "Paris"}), None, [("get_weather", {"city": "Paris"})]),
    (
        "Let me check.\n" + hermes_block("get_weather", {"city": "Paris"}) + "\n" + hermes_block("get-time", {}),
        "Let me check.",
        [("get_weather", {"city": "Paris"}), ("get-time", {})],
    ),
    (
        "A " + hermes_block("get-time", {}) + " B " + hermes_block("get-time", {}) + " C",
        "A  B  C",
        [("get-time", {}), ("get-time", {})],
    ),
    ('<tool_call>  {"name": "f", "arguments": {"x": [1, 2]}}\t</tool_call>', None, [("f", {"x": [1, 2]})]),
    ('<tool_call>{"name": "get-time"}</tool_call>', None, [("get-time", {})]),  # arguments left out
    ('<tool_call>{"name": "é", "arguments": {"s": "中文"}}</tool_call>', None, [("é", {"s": "中文"})]),
    # malformed markup stays in the content
    (
        '<tool_call>{"name": "f", "arguments": {"x": </tool_call>',
        '<tool_call>{"name": "f", "arguments": {"x": </tool_call>',
        [],
    ),
    ("<tool_call>not JSON</tool_call>", "<tool_call>not JSON</tool_call>", []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    (
        '<tool_call>{"name": "f", "arguments": "x"}</tool_call>',
        '<tool_call>{"name": "f", "arguments": "x"}</tool_call>',
        [],
    ),
    ('<tool_call>["f"]</tool_call>', '<tool_call>["f"]</tool_call>', []),
    ('Hi <tool_call>{"name": "f", "arguments": {"x": 1', 'Hi <tool_call>{"name": "f", "arguments": {"x": 1', []),
    (
        '<tool_call>{"name": "f"}</tool_call> then <tool_call>{"name": "g", "argu',
        'then <tool_call>{"name": "g", "argu',
        [("f", {})],
    ),
    (
        "<tool_call>bad</tool_call>" + hermes_block("g", {"a": 1}),
        "<tool_call>bad</tool_call>",
        [("g", {"a": 1})],
    ),
    ("a </tool_call> b <tool_call", "a </tool_call> b <tool_call", []),
]


@pytest.mark.parametrize(("text", "content", "calls"), HERMES_CASES)
def test_hermes(text, content, calls):
    parsed_content, parsed_calls = tool_calls_from_output(AUTO, text, "hermes")
    assert (parsed_content, summary(parsed_calls)) == (content, calls)


def llama3_call(name: str, parameters: dict, key: str = "parameters") -> str:
    return json.dumps({"name": name, key: parameters})


LLAMA3_CASES = [
    ("The weather is fine.", "The weather is fine.", []),
    ("", None, []),
    (llama3_call("get_weather", {"city": "Paris"}), None, [("get_weather", {"city": "Paris"})]),
    ("\n " + llama3_call("get_weather", {"city": "Paris"}) + "\n", None, [("get_weather", {"city": "Paris"})]),
    ("<|python_tag|>" + llama3_call("get-time", {}), None, [("get-time", {})]),
    (llama3_call("get-time", {}, key="arguments"), None, [("get-time", {})]),
    (
        llama3_call("get-time", {}) + "; " + llama3_call("get_weather", {"city": "Zürich"}) + ";",
        None,
        [("get-time", {}), ("get_weather", {"city": "Zürich"})],
    ),
    (
        llama3_call("f", {}) + ";\n" + llama3_call("g", {}) + " ;" + llama3_call("h", {}),
        None,
        [("f", {}), ("g", {}), ("h", {})],
    ),
    # the text from the first thing that is not a call is content
    (llama3_call("get-time", {}) + " Done.", "Done.", [("get-time", {})]),
    (
        llama3_call("get-time", {}) + "; " + '{"name": "get_weather", "param',
        '{"name": "get_weather", "param',
        [("get-time", {})],
    ),
    (llama3_call("f", {}) + llama3_call("g", {}), '{"name": "g", "parameters": {}}', [("f", {})]),
    # JSON that is not a call: all content
    ('{"answer": 42}', '{"answer": 42}', []),
    ('{"name": "f"}', '{"name": "f"}', []),
    ('{"name": "f", "parameters": [1]}', '{"name": "f", "parameters": [1]}', []),
    ('{"name": "get_weather", "parameters": {"city": "Par', '{"name": "get_weather", "parameters": {"city": "Par', []),
    ("<|python_tag|>print(1)", "<|python_tag|>print(1)", []),
    ("<|python_tag|>", "<|python_tag|>", []),
    ("Sure: " + llama3_call("get-time", {}), "Sure: " + llama3_call("get-time", {}), []),  # not at the start
]


@pytest.mark.parametrize(("text", "content", "calls"), LLAMA3_CASES)
def test_llama3_json(text, content, calls):
    parsed_content, parsed_calls = tool_calls_from_output(AUTO, text, "llama3_json")
    assert (parsed_content, summary(parsed_calls)) == (content, calls)


def test_auto_without_a_parser_is_refused():
    with pytest.raises(ValueError, match="^tool_call_parser"):
        tool_calls_from_output(AUTO, "hi", None)
    with pytest.raises(ValueError, match="^tool_call_parser"):
        ToolCallStream(AUTO, None)


# ToolCallStream

HERMES_FRAGMENTS = [
    "Sure, ",
    "let me check.",
    " ",
    "\n",
    "中文 é",
    "<",
    "<tool",
    "<tool_call",
    "tool_call>",
    "<tool_call>",
    "</tool_call>",
    "</tool_",
    hermes_block("get_weather", {"city": "Paris"}),
    '<tool_call>{"name": "get-time"}</tool_call>',
    '<tool_call>{"name": "f", "arguments": {"x": </tool_call>',
    "<tool_call>not JSON</tool_call>",
    '{"name": "get_weather", "arguments": {"city": "Zürich"}}',
    '{"x": 1}',
]
LLAMA3_FRAGMENTS = [
    "<|python_tag|>",
    "<|python",
    "_tag|>",
    llama3_call("get_weather", {"city": "Paris"}),
    llama3_call("get-time", {}, key="arguments"),
    '{"name": "get_weather", "parameters": {"city": ',
    "; ",
    ";",
    " ",
    "\n",
    "{",
    "}",
    '"}}',
    '{"answer": 42}',
    "[1, 2]",
    "Hello",
    "中文 é",
]


@st.composite
def split_texts(draw, fragments: list[str]) -> tuple[str, list[str]]:
    """A text made of fragments (markup, pieces of it, prose, whitespace), and a split of it into deltas (some
    empty)."""
    text = "".join(draw(st.lists(st.sampled_from(fragments), max_size=10)))
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=8)))
    bounds = [0, *cuts, len(text)]
    return text, [text[start:end] for start, end in zip(bounds, bounds[1:], strict=False)]


def streamed(forced: ToolChoice, parser: str | None, deltas: list[str]) -> tuple[str, list[ToolCall]]:
    stream = ToolCallStream(forced, parser)
    contents, calls = [], []
    for delta in deltas:
        content, completed = stream.feed(delta)
        contents.append(content)
        calls += completed
    content, completed = stream.finish()
    return "".join([*contents, content]), calls + completed


def assert_stream_matches_whole(forced: ToolChoice, parser: str | None, text: str, deltas: list[str]) -> None:
    content, calls = streamed(forced, parser, deltas)
    whole_content, whole_calls = tool_calls_from_output(forced, text, parser)
    assert content == (whole_content or "")
    assert [(call.name, call.arguments) for call in calls] == [(call.name, call.arguments) for call in whole_calls]
    assert len({call.id for call in calls}) == len(calls)


@given(split_texts(HERMES_FRAGMENTS + LLAMA3_FRAGMENTS[:4]))
def test_hermes_stream_matches_whole_text(case):
    assert_stream_matches_whole(AUTO, "hermes", *case)


@given(split_texts(LLAMA3_FRAGMENTS + HERMES_FRAGMENTS[:4]))
def test_llama3_stream_matches_whole_text(case):
    assert_stream_matches_whole(AUTO, "llama3_json", *case)


@given(st.sampled_from([NONE, NAMED, REQUIRED]), split_texts(HERMES_FRAGMENTS + ['[{"name": "get-time", ', "]"]))
def test_other_modes_stream_matches_whole_text(forced, case):
    assert_stream_matches_whole(forced, "hermes", *case)


@given(st.sampled_from(TOOL_CALL_PARSERS), st.text(max_size=40), st.data())
def test_stream_on_any_text(parser, text, data):
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    bounds = [0, *cuts, len(text)]
    assert_stream_matches_whole(AUTO, parser, text, [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)])


@pytest.mark.parametrize(
    ("parser", "text", "content", "calls"),
    [("hermes", *case) for case in HERMES_CASES] + [("llama3_json", *case) for case in LLAMA3_CASES],
)
def test_stream_one_character_at_a_time(parser, text, content, calls):
    streamed_content, streamed_calls = streamed(AUTO, parser, list(text))
    assert (streamed_content, summary(streamed_calls)) == (content or "", calls)


def test_hermes_stream_holds_back_only_what_may_be_markup():
    stream = ToolCallStream(AUTO, "hermes")
    assert stream.feed("\nLet me") == ("Let me", [])  # leading whitespace is dropped
    assert stream.feed(" check <tool_c") == (" check", [])  # the space waits: it may end the content
    assert stream.feed("ool, really. <tool_ca") == (" <tool_cool, really.", [])
    content, calls = stream.feed('ll>{"name": "get-time"}</tool_call>')
    assert (content, summary(calls)) == ("", [("get-time", {})])
    assert stream.feed(" Done. ") == ("  Done.", [])
    assert stream.finish() == ("", [])


def test_llama3_stream_gives_calls_as_they_close():
    stream = ToolCallStream(AUTO, "llama3_json")
    assert stream.feed('<|python_tag|>{"name": "get-time", "parameters": {') == ("", [])
    content, calls = stream.feed("}}")
    assert (content, summary(calls)) == ("", [("get-time", {})])
    assert stream.feed(" ; ") == ("", [])
    content, calls = stream.feed('{"name": "f", "parameters": {"a": 1}} and more')
    assert (content, summary(calls)) == ("and more", [("f", {"a": 1})])


def test_llama3_stream_gives_prose_at_once():
    stream = ToolCallStream(AUTO, "llama3_json")
    assert stream.feed(" <|py") == ("", [])
    assert stream.feed("thon is great") == ("<|python is great", [])


def test_stream_refuses_feed_after_finish():
    stream = ToolCallStream(NONE, None)
    stream.finish()
    with pytest.raises(AssertionError):
        stream.feed("x")


# render_messages_for_template

SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Qwen 2.5's way with tool calls, cut down.
QWEN_LIKE_TEMPLATE = """{% for message in messages %}
<|im_start|>{{ message.role }}
{% if message.content %}{{ message.content }}{% endif %}
{% for tool_call in message.tool_calls or [] %}
<tool_call>
{"name": "{{ tool_call.function.name }}", "arguments": {{ tool_call.function.arguments | tojson }}}
</tool_call>
{% endfor %}
<|im_end|>
{% endfor %}
{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def render(template: str, messages: list[dict]) -> str:
    """As transformers renders a chat template (its environment, and its tojson that keeps non-ASCII)."""
    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    environment.filters["tojson"] = lambda value: json.dumps(value, ensure_ascii=False)
    return environment.from_string(template).render(messages=messages, add_generation_prompt=True)


def call_message(content: str | None, *calls: tuple[str, str]) -> dict:
    tool_calls = [
        {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": arguments}}
        for i, (name, arguments) in enumerate(calls)
    ]
    return {"role": "assistant", "content": content, "tool_calls": tool_calls}


CONVERSATION = [
    {"role": "user", "content": "Weather in Zürich, and the time?"},
    call_message(None, ("get_weather", '{"city": "Zürich"}'), ("get-time", "{}")),
    {"role": "tool", "tool_call_id": "call_0", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_1", "content": "noon"},
    call_message("Also this:", ("get-time", "not JSON")),
    {"role": "tool", "tool_call_id": "call_0", "content": "noon"},
    {"role": "assistant", "content": "Sunny at noon."},
]


def test_template_without_tool_calls_gets_them_in_the_content():
    before = copy.deepcopy(CONVERSATION)
    messages = render_messages_for_template(CONVERSATION, SMOLLM2_TEMPLATE)
    assert CONVERSATION == before
    assert all("tool_calls" not in message for message in messages)
    assert messages[2] == CONVERSATION[2]
    assert messages[1]["content"] == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get-time", "arguments": {}}\n</tool_call>'
    )
    assert messages[4]["content"] == (
        'Also this:\n<tool_call>\n{"name": "get-time", "arguments": "not JSON"}\n</tool_call>'
    )
    text = render(SMOLLM2_TEMPLATE, messages)
    assert "<|im_start|>tool\nsunny<|im_end|>" in text
    assistant_turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    _, calls = tool_calls_from_output(AUTO, assistant_turn, "hermes")  # what the model reads, it could have written
    assert summary(calls) == [("get_weather", {"city": "Zürich"}), ("get-time", {})]


def test_template_with_tool_calls_gets_parsed_arguments():
    before = copy.deepcopy(CONVERSATION)
    messages = render_messages_for_template(CONVERSATION, QWEN_LIKE_TEMPLATE)
    assert CONVERSATION == before
    assert [call["function"]["arguments"] for call in messages[1]["tool_calls"]] == [{"city": "Zürich"}, {}]
    assert messages[1]["content"] is None
    assert messages[4]["tool_calls"][0]["function"]["arguments"] == "not JSON"
    assert {k: v for k, v in messages[1].items() if k != "tool_calls"} == {"role": "assistant", "content": None}
    text = render(QWEN_LIKE_TEMPLATE, messages)
    assert '{"name": "get_weather", "arguments": {"city": "Zürich"}}' in text  # an object, not a quoted string
    assert '{"name": "get-time", "arguments": "not JSON"}' in text


def test_messages_without_tool_calls_pass_as_they_are():
    messages = [{"role": "user", "content": "hi", "name": "ann"}, {"role": "assistant", "content": "hello"}]
    for template in (SMOLLM2_TEMPLATE, QWEN_LIKE_TEMPLATE):
        assert render_messages_for_template(messages, template) == messages


@pytest.mark.parametrize(
    ("tool_calls", "field"),
    [
        ("get_weather", "messages[0].tool_calls"),
        (["get_weather"], "messages[0].tool_calls[0].function"),
        ([{"function": {"arguments": "{}"}}], "messages[0].tool_calls[0].function.name"),
        ([{"function": {"name": "f", "arguments": {}}}], "messages[0].tool_calls[0].function.arguments"),
        ([{"function": {"name": "f"}}], "messages[0].tool_calls[0].function.arguments"),
    ],
)
def test_malformed_tool_calls_are_refused_by_field(tool_calls, field):
    messages = [{"role": "assistant", "content": None, "tool_calls": tool_calls}]
    for template in (SMOLLM2_TEMPLATE, QWEN_LIKE_TEMPLATE):
        with pytest.raises(ValueError) as error:
            render_messages_for_template(messages, template)
        assert str(error.value).startswith(f"{field} "), str(error.value)
