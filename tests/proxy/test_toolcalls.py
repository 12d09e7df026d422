from __future__ import annotations

import itertools
import json
import random
from typing import Any

import pytest

from proxy.chat.harmony import call_markup
from proxy.toolcalls import (
    ContentDelta,
    ParsedOutput,
    ParsedToolCall,
    StreamEvent,
    ToolCallComplete,
    ToolCallParser,
    UnknownToolParserError,
    detect_parser,
    get_parser,
)
from tests.families import FIXTURES

HERMES = get_parser("hermes")
QWEN3 = get_parser("qwen3_coder")
NONE = get_parser("none")


def hermes_call(name: str, arguments: Any) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def qwen3_call(name: str, params: dict[str, str]) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def args(call: ParsedToolCall) -> Any:
    return json.loads(call.arguments)


RUN_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "run",
        "description": "run something",
        "parameters": {
            "type": "object",
            "properties": {
                "count": {"type": "integer"},
                "ratio": {"type": "number"},
                "dry": {"type": "boolean"},
                "options": {"type": "object"},
                "files": {"type": "array", "items": {"type": "string"}},
                "code": {"type": "string"},
            },
        },
    },
}


# ---------------------------------------------------------------------------- hermes


def test_hermes_single_call() -> None:
    """One hermes block becomes one call with its arguments and no content."""
    out = HERMES.parse(hermes_call("get_weather", {"city": "Paris"}))
    assert out == ParsedOutput("", [ParsedToolCall("get_weather", '{"city": "Paris"}')], None)


def test_hermes_multiple_calls_keep_order() -> None:
    """Several consecutive blocks become calls in the order written."""
    text = "\n".join(hermes_call(n, {"i": i}) for i, n in enumerate(["a", "b", "c"]))
    out = HERMES.parse(text)
    assert [c.name for c in out.tool_calls] == ["a", "b", "c"]
    assert [args(c) for c in out.tool_calls] == [{"i": 0}, {"i": 1}, {"i": 2}]
    assert out.content == ""
    assert out.malformed is None


def test_hermes_content_before_call() -> None:
    """Text before the first block is content, minus the whitespace that leads into it."""
    out = HERMES.parse("Let me check the weather.\n\n" + hermes_call("get_weather", {}))
    assert out.content == "Let me check the weather."
    assert [c.name for c in out.tool_calls] == ["get_weather"]


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>',
        '<tool_call>\n\n   {"name": "f", "arguments": {"x": 1}}  \n\n</tool_call>',
        '\n\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n\n',
        ' \t<tool_call>\n{\n  "name": "f",\n  "arguments": {\n    "x": 1\n  }\n}\n</tool_call>\n',
    ],
)
def test_hermes_whitespace_variants(text: str) -> None:
    """Whitespace around and inside a block changes neither the call nor the (empty) content."""
    assert HERMES.parse(text) == ParsedOutput("", [ParsedToolCall("f", '{"x": 1}')], None)


def test_hermes_unicode_and_nested_arguments() -> None:
    """Nested objects and non-ASCII text survive, serialised without ASCII escapes."""
    arguments = {
        "city": "Zürich",
        "note": "日本語 😀",
        "filters": {"range": {"min": 1, "max": [2.5, None, True]}, "tags": ["a", "b"]},
    }
    out = HERMES.parse(hermes_call("search", arguments))
    assert out.malformed is None
    (call,) = out.tool_calls
    assert args(call) == arguments
    assert "Zürich" in call.arguments
    assert "😀" in call.arguments


def test_hermes_call_without_arguments_gets_empty_object() -> None:
    """A block with only a name is a call with arguments ``{}``."""
    out = HERMES.parse('<tool_call>{"name": "now"}</tool_call>')
    assert out.tool_calls == [ParsedToolCall("now", "{}")]


def test_hermes_arguments_given_as_json_string() -> None:
    """Arguments written as a JSON string holding an object are decoded to that object."""
    out = HERMES.parse('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>')
    assert out.tool_calls == [ParsedToolCall("f", '{"a": 1}')]


def test_hermes_parameters_key_accepted_for_arguments() -> None:
    """``parameters`` is read as the arguments when ``arguments`` is absent."""
    out = HERMES.parse('<tool_call>{"name": "f", "parameters": {"a": 2}}</tool_call>')
    assert out.tool_calls == [ParsedToolCall("f", '{"a": 2}')]


def test_hermes_does_not_cast_with_schema() -> None:
    """Hermes JSON values are returned as written even when the schema types them."""
    out = HERMES.parse(hermes_call("run", {"count": "5"}), [RUN_TOOL])
    assert args(out.tool_calls[0]) == {"count": "5"}


def test_hermes_invalid_json_is_malformed_and_keeps_text() -> None:
    """Invalid JSON in a block yields no calls, the full text as content, and a reason."""
    text = 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}\n</tool_call>'
    out = HERMES.parse(text)
    assert out.content == text
    assert out.tool_calls == []
    assert out.malformed is not None
    assert "JSON" in out.malformed


def test_hermes_missing_name_is_malformed() -> None:
    """A block without a name is malformed and the text is kept whole."""
    text = '<tool_call>{"arguments": {"x": 1}}</tool_call>'
    out = HERMES.parse(text)
    assert out == ParsedOutput(text, [], "tool call has no name")


@pytest.mark.parametrize(
    "body",
    ['{"name": "f", "arguments": [1, 2]}', '["f", {}]', '"f"', '{"name": 3}'],
)
def test_hermes_unexpected_structure_is_malformed(body: str) -> None:
    """Valid JSON of the wrong shape is malformed, not a call."""
    text = f"<tool_call>{body}</tool_call>"
    out = HERMES.parse(text)
    assert out.tool_calls == []
    assert out.content == text
    assert out.malformed is not None


def test_hermes_one_bad_call_drops_all_calls() -> None:
    """A malformed block after a valid one returns no calls at all."""
    text = hermes_call("good", {"a": 1}) + "\n<tool_call>\n{broken\n</tool_call>"
    out = HERMES.parse(text)
    assert out.tool_calls == []
    assert out.content == text
    assert out.malformed is not None


def test_hermes_truncated_call_is_malformed() -> None:
    """A block cut off mid-JSON (e.g. by max_tokens) is malformed."""
    text = 'Checking.\n<tool_call>\n{"name": "f", "argu'
    assert HERMES.parse(text) == ParsedOutput(text, [], "invalid JSON in tool call")


def test_hermes_unclosed_but_complete_call_is_accepted() -> None:
    """A block whose JSON is complete but whose close tag never came is still a call."""
    out = HERMES.parse('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n')
    assert out == ParsedOutput("", [ParsedToolCall("f", '{"a": 1}')], None)


def test_hermes_stray_close_tag_is_malformed() -> None:
    """A ``</tool_call>`` left in the content marks the output malformed."""
    text = hermes_call("f", {}) + "</tool_call>"
    out = HERMES.parse(text)
    assert out.tool_calls == []
    assert out.content == text
    assert out.malformed is not None


def test_hermes_non_finite_number_is_malformed() -> None:
    """Arguments that cannot be valid JSON (NaN) are malformed rather than passed on."""
    text = '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>'
    out = HERMES.parse(text)
    assert out.tool_calls == []
    assert out.malformed is not None


@pytest.mark.parametrize(
    "text",
    [
        "Hello! How can I help?",
        "\n  leading and trailing whitespace stay  \n\n",
        "if a < b and c > d: use <tag> and <tool_call (not a tag)",
        "",
    ],
)
def test_no_tool_call_is_content_verbatim(text: str) -> None:
    """Without a block the content is exactly the text."""
    assert HERMES.parse(text) == ParsedOutput(text, [], None)


def test_hermes_content_between_and_after_calls() -> None:
    """Text between and after blocks is stripped per gap and appended with newlines."""
    text = (
        "Step one.\n"
        + hermes_call("a", {})
        + "\n  then this  \n"
        + hermes_call("b", {})
        + "\n\nDone.\n"
    )
    out = HERMES.parse(text)
    assert out.content == "Step one.\nthen this\nDone."
    assert [c.name for c in out.tool_calls] == ["a", "b"]


# ---------------------------------------------------------------------------- qwen3_coder


def test_qwen3_params_are_strings_without_tools() -> None:
    """Without tools every parameter value stays a string."""
    out = QWEN3.parse(qwen3_call("run", {"count": "5", "dry": "true", "code": "print(1)"}))
    assert out.malformed is None
    (call,) = out.tool_calls
    assert call.name == "run"
    assert args(call) == {"count": "5", "dry": "true", "code": "print(1)"}


def test_qwen3_params_cast_with_schema() -> None:
    """With tools, values are cast to the types their schema declares; strings stay strings."""
    params = {
        "count": "5",
        "ratio": "0.25",
        "dry": "false",
        "options": '{"depth": 2, "name": "x"}',
        "files": '["a.py", "b.py"]',
        "code": "007",
        "unknown": "42",
    }
    out = QWEN3.parse(qwen3_call("run", params), [RUN_TOOL])
    assert args(out.tool_calls[0]) == {
        "count": 5,
        "ratio": 0.25,
        "dry": False,
        "options": {"depth": 2, "name": "x"},
        "files": ["a.py", "b.py"],
        "code": "007",
        "unknown": "42",
    }


def test_qwen3_schema_from_anthropic_tool_definition() -> None:
    """An Anthropic-style ``input_schema`` tool definition also drives the casting."""
    tool = {"name": "run", "input_schema": {"properties": {"count": {"type": "integer"}}}}
    out = QWEN3.parse(qwen3_call("run", {"count": "12"}), [tool])
    assert args(out.tool_calls[0]) == {"count": 12}


def test_qwen3_uncastable_value_stays_string() -> None:
    """A value that does not fit its schema type is passed on as text."""
    out = QWEN3.parse(qwen3_call("run", {"count": "many"}), [RUN_TOOL])
    assert args(out.tool_calls[0]) == {"count": "many"}


def test_qwen3_multiline_value_keeps_inner_whitespace() -> None:
    """Only the newline after the open tag and before the close tag is markup."""
    code = "def f(x):\n    return x\n\n"
    text = f"<tool_call>\n<function=write>\n<parameter=code>\n{code}\n</parameter>\n</function>\n</tool_call>"
    out = QWEN3.parse(text)
    assert args(out.tool_calls[0]) == {"code": code}


def test_qwen3_value_may_mention_tool_call_close_tag() -> None:
    """A value containing ``</tool_call>`` does not end the block early."""
    value = "the model writes </tool_call> at the end"
    out = QWEN3.parse(qwen3_call("note", {"text": value}))
    assert out.malformed is None
    assert args(out.tool_calls[0]) == {"text": value}


def test_qwen3_multiple_calls_with_content() -> None:
    """Content before and several blocks parse into content plus calls in order."""
    text = (
        "I'll look at both files.\n\n"
        + qwen3_call("read", {"path": "a.py"})
        + "\n"
        + qwen3_call("read", {"path": "b.py"})
    )
    out = QWEN3.parse(text)
    assert out.content == "I'll look at both files."
    assert [args(c) for c in out.tool_calls] == [{"path": "a.py"}, {"path": "b.py"}]


def test_qwen3_call_without_parameters() -> None:
    """A function with no parameters is a call with arguments ``{}``."""
    out = QWEN3.parse("<tool_call>\n<function=now>\n</function>\n</tool_call>")
    assert out == ParsedOutput("", [ParsedToolCall("now", "{}")], None)


def test_qwen3_json_body_is_malformed() -> None:
    """A hermes-style JSON block is not a Qwen3-Coder call: malformed, text kept."""
    text = hermes_call("f", {"a": 1})
    out = QWEN3.parse(text)
    assert out.tool_calls == []
    assert out.content == text
    assert out.malformed is not None


def test_qwen3_junk_inside_function_is_malformed() -> None:
    """Text in a function body that is not a parameter makes the output malformed."""
    text = "<tool_call>\n<function=f>\nsome junk\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>"
    out = QWEN3.parse(text)
    assert out == ParsedOutput(text, [], "unexpected text inside <function=...>")


def test_qwen3_unclosed_parameter_is_malformed() -> None:
    """A parameter without its close tag (truncated output) is malformed."""
    text = "<tool_call>\n<function=f>\n<parameter=a>\nhalf a val"
    out = QWEN3.parse(text)
    assert out.tool_calls == []
    assert out.content == text
    assert out.malformed is not None


# ---------------------------------------------------------------------------- none


def test_none_parser_treats_everything_as_content() -> None:
    """The ``none`` format never finds calls, even in tool-call markup."""
    text = "x " + hermes_call("f", {})
    assert NONE.parse(text) == ParsedOutput(text, [], None)


def test_none_stream_passes_text_through_at_once() -> None:
    """The ``none`` stream emits every delta unchanged, even a lone ``<``."""
    stream = NONE.stream()
    assert stream.feed("a <") == [ContentDelta("a <")]
    assert stream.feed("tool_call>") == [ContentDelta("tool_call>")]
    assert stream.finish() == ([], ParsedOutput("a <tool_call>", [], None))


# ---------------------------------------------------------------------------- streaming

HERMES_SAMPLES = [
    "Plain answer with a < sign, <b>html</b> and a trailing newline.\n",
    hermes_call("get_weather", {"city": "Paris", "unit": "c"}),
    "Let me check.\n\n"
    + hermes_call("a", {"x": [1, {"y": "ü"}]})
    + "\n"
    + hermes_call("b", {})
    + "\n\nDone.",
    'Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}\n</tool_call>',
    hermes_call("good", {}) + "\n<tool_call>\n{broken}\n</tool_call>\ntail",
    'Checking.\n<tool_call>\n{"name": "f", "argu',
    '<tool_call>{"name": "f"}\n',
    "oops </tool_call> stray",
    "ends with a partial tag <tool_ca",
    "   \n",
]

QWEN3_SAMPLES = [
    "Reading it now.\n" + qwen3_call("read", {"path": "a.py", "count": "3"}),
    qwen3_call("write", {"code": "x = 1\n\n  y = 2\n"})
    + "\n"
    + qwen3_call("run", {"count": "7", "dry": "true"}),
    "<tool_call>\n<function=f>\njunk\n</function>\n</tool_call>",
    hermes_call("f", {}),
    "<tool_call>\n<function=f>\n<parameter=a>\nhalf",
    "no calls, just a <function that is not one",
]

STREAM_CASES = [(HERMES, t) for t in HERMES_SAMPLES] + [(QWEN3, t) for t in QWEN3_SAMPLES]
# The other families' formats (their samples are defined with their tests below).
FAMILY_SAMPLES: dict[str, list[str]] = {}
STREAM_IDS = [f"{p.name}-{i}" for i, (p, _) in enumerate(STREAM_CASES)]


def run_stream(
    parser: ToolCallParser, chunks: list[str], tools: list[dict[str, Any]] | None = None
) -> tuple[list[StreamEvent], ParsedOutput]:
    stream = parser.stream(tools)
    events: list[StreamEvent] = []
    for chunk in chunks:
        events.extend(stream.feed(chunk))
    final_events, result = stream.finish()
    return events + final_events, result


def check_stream(parser: ToolCallParser, text: str, chunks: list[str]) -> None:
    expected = parser.parse(text, [RUN_TOOL])
    events, result = run_stream(parser, chunks, [RUN_TOOL])
    assert result == expected, chunks
    assert "".join(e.text for e in events if isinstance(e, ContentDelta)) == result.content, chunks
    if result.malformed is None:
        completed = [e for e in events if isinstance(e, ToolCallComplete)]
        assert [e.index for e in completed] == list(range(len(result.tool_calls)))
        assert [e.call for e in completed] == result.tool_calls


@pytest.mark.parametrize(("parser", "text"), STREAM_CASES, ids=STREAM_IDS)
def test_stream_split_at_every_boundary_matches_parse(parser: ToolCallParser, text: str) -> None:
    """Two-chunk feeds split at every position give parse()'s result and its content."""
    for i in range(len(text) + 1):
        check_stream(parser, text, [text[:i], text[i:]])


@pytest.mark.parametrize(("parser", "text"), STREAM_CASES, ids=STREAM_IDS)
def test_stream_one_character_at_a_time_matches_parse(parser: ToolCallParser, text: str) -> None:
    """Feeding one character at a time gives parse()'s result and its content."""
    check_stream(parser, text, list(text))


@pytest.mark.parametrize(("parser", "text"), STREAM_CASES, ids=STREAM_IDS)
def test_stream_random_chunkings_match_parse(parser: ToolCallParser, text: str) -> None:
    """Random chunkings give parse()'s result and its content."""
    rng = random.Random(f"{parser.name}:{text}")
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 8))))
        bounds = [0, *cuts, len(text)]
        check_stream(parser, text, [text[a:b] for a, b in itertools.pairwise(bounds)])


def test_sample_outputs_cover_calls_and_malformed() -> None:
    """The streaming samples include well-formed calls and malformed output for both formats."""
    results = [p.parse(t) for p, t in STREAM_CASES]
    for parser in (HERMES, QWEN3):
        mine = [r for (p, _), r in zip(STREAM_CASES, results, strict=True) if p is parser]
        assert any(r.tool_calls for r in mine)
        assert any(r.malformed for r in mine)
        assert any(not r.tool_calls and not r.malformed for r in mine)


def test_stream_holds_back_possible_tag_start() -> None:
    """Text that may begin a ``<tool_call>`` tag, and whitespace before it, is not emitted."""
    stream = HERMES.stream()
    assert stream.feed("Hello <tool_") == [ContentDelta("Hello")]
    assert stream.feed("ca") == []


def test_stream_releases_lt_that_is_not_a_tag() -> None:
    """A held ``<`` is released once the next characters rule out a tag."""
    stream = HERMES.stream()
    assert stream.feed("a <") == [ContentDelta("a")]
    assert stream.feed(" b") == [ContentDelta(" < b")]


def test_stream_releases_held_text_at_finish() -> None:
    """Text held back at the end of the stream is released by finish()."""
    stream = HERMES.stream()
    assert stream.feed("x <tool") == [ContentDelta("x")]
    assert stream.finish() == ([ContentDelta(" <tool")], ParsedOutput("x <tool", [], None))


def test_stream_hermes_call_emitted_when_block_closes() -> None:
    """A hermes call is emitted by the feed that completes ``</tool_call>``, before finish()."""
    stream = HERMES.stream()
    assert stream.feed('Hi\n<tool_call>{"name": "f", "arguments": {}}</tool_') == [
        ContentDelta("Hi")
    ]
    assert stream.feed("call>") == [ToolCallComplete(0, ParsedToolCall("f", "{}"))]


def test_stream_qwen3_call_emitted_by_finish_at_the_latest() -> None:
    """A Qwen3-Coder call closing at the very end of the stream is emitted by finish()."""
    stream = QWEN3.stream([RUN_TOOL])
    events = stream.feed(qwen3_call("run", {"count": "2"}))
    final_events, result = stream.finish()
    call = ParsedToolCall("run", '{"count": 2}')
    assert [e for e in events + final_events if isinstance(e, ToolCallComplete)] == [
        ToolCallComplete(0, call)
    ]
    assert result.tool_calls == [call]


def test_stream_content_after_a_call_waits_for_finish() -> None:
    """Content after the first block is emitted only by finish()."""
    stream = HERMES.stream()
    events = stream.feed(hermes_call("f", {}) + "\nAfterwards.")
    assert not any(isinstance(e, ContentDelta) for e in events)
    final_events, result = stream.finish()
    assert final_events == [ContentDelta("Afterwards.")]
    assert result.content == "Afterwards."


def test_stream_malformed_finish_returns_remaining_raw_text() -> None:
    """After a malformed block, finish() emits the not-yet-sent raw text as one delta."""
    text = "Sure: <tool_call>{oops}</tool_call> and more"
    stream = HERMES.stream()
    fed: list[StreamEvent] = []
    for ch in text:
        fed.extend(stream.feed(ch))
    assert fed == [ContentDelta(c) for c in "Sure:"]
    final_events, result = stream.finish()
    assert final_events == [ContentDelta(" <tool_call>{oops}</tool_call> and more")]
    assert result == ParsedOutput(text, [], "invalid JSON in tool call")


def test_stream_feed_after_finish_raises() -> None:
    """A finished stream refuses more text and a second finish()."""
    stream = HERMES.stream()
    stream.finish()
    with pytest.raises(RuntimeError):
        stream.feed("x")
    with pytest.raises(RuntimeError):
        stream.finish()


# ---------------------------------------------------------------------------- registry


FORMAT_NAMES = [
    "hermes",
    "qwen3_coder",
    "glm45",
    "deepseek_v31",
    "deepseek_v3",
    "kimi_k2",
    "llama3_json",
    "mistral",
    "harmony",
    "none",
]


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_get_parser_by_name(name: str) -> None:
    """Each supported format name gives a parser with that name."""
    parser = get_parser(name)
    assert isinstance(parser, ToolCallParser)
    assert parser.name == name


def test_get_parser_unknown_name_raises_typed_error() -> None:
    """An unknown format name raises UnknownToolParserError, a ValueError."""
    with pytest.raises(UnknownToolParserError, match="pythonic") as info:
        get_parser("pythonic")
    assert isinstance(info.value, ValueError)


QWEN25_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}# Tools\\n<tools>{% for tool in tools %}"
    "{{- tool | tojson }}{% endfor %}</tools>\\nFor each function call, return a json object "
    "with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call>{%- endif %}'
)
QWEN3_CODER_TEMPLATE = (
    "{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}"
    "{%- for args_name, args_value in tool_call.arguments|items %}"
    "{{- '<parameter=' + args_name + '>\\n' }}{{- args_value }}{{- '\\n</parameter>\\n' }}"
    "{%- endfor %}{{- '</function>\\n</tool_call>' }}"
)
LLAMA_TEMPLATE = (
    "{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\\n\\n"
    "{{ message['content'] }}<|eot_id|>{% endfor %}"
)


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        (QWEN25_TEMPLATE, "hermes"),
        (QWEN3_CODER_TEMPLATE, "qwen3_coder"),
        (LLAMA_TEMPLATE, "none"),
        ("", "none"),
        (None, "none"),
    ],
    ids=["qwen2.5", "qwen3-coder", "llama", "empty", "missing"],
)
def test_detect_parser_from_template(template: str | None, expected: str) -> None:
    """The format is picked from the markup the chat template teaches."""
    assert detect_parser(template) == expected


def test_detect_parser_on_every_family_fixture() -> None:
    """Each real family template in the fixtures is recognised as its own format."""
    expected = {
        "qwen3": "hermes",
        "qwen25": "hermes",
        "qwen3_coder": "qwen3_coder",
        "glm45": "glm45",
        "deepseek_v31": "deepseek_v31",
        "deepseek_r1": "deepseek_v3",
        "kimi_k2": "kimi_k2",
        "llama31": "llama3_json",
        "gpt_oss": "harmony",
    }
    found = {
        name: detect_parser((FIXTURES / name / "chat_template.jinja").read_text())
        for name in expected
    }
    assert found == expected


def test_detect_parser_mistral_markup() -> None:
    """A template writing ``[TOOL_CALLS]`` teaches Mistral's format."""
    template = "{{- '[TOOL_CALLS]' + tool_call.function.name + '[ARGS]' + arguments }}"
    assert detect_parser(template) == "mistral"


# ---------------------------------------------------------------------------- families

GLM = get_parser("glm45")
DSV31 = get_parser("deepseek_v31")
DSV3 = get_parser("deepseek_v3")
KIMI = get_parser("kimi_k2")
LLAMA = get_parser("llama3_json")
MISTRAL = get_parser("mistral")


def glm_call(name: str, params: dict[str, str]) -> str:
    pairs = "".join(
        f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in params.items()
    )
    return f"<tool_call>{name}\n{pairs}</tool_call>"


def deepseek_v31_calls(*calls: tuple[str, dict[str, Any]]) -> str:
    inner = "".join(
        f"<｜tool▁call▁begin｜>{n}<｜tool▁sep｜>{json.dumps(a)}<｜tool▁call▁end｜>"
        for n, a in calls
    )
    return f"<｜tool▁calls▁begin｜>{inner}<｜tool▁calls▁end｜>"


def deepseek_v3_calls(*calls: tuple[str, dict[str, Any]]) -> str:
    inner = "".join(
        f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{n}\n```json\n{json.dumps(a)}\n```"
        "<｜tool▁call▁end｜>"
        for n, a in calls
    )
    return f"<｜tool▁calls▁begin｜>{inner}<｜tool▁calls▁end｜>"


def kimi_calls(*calls: tuple[str, str, dict[str, Any]]) -> str:
    inner = "".join(
        f"<|tool_call_begin|>{i}<|tool_call_argument_begin|>{json.dumps(a)}<|tool_call_end|>"
        for i, _, a in calls
    )
    return f"<|tool_calls_section_begin|>{inner}<|tool_calls_section_end|>"


def test_glm_calls_with_content_and_schema_casting() -> None:
    """GLM key/value pairs become arguments; values are text unless the schema types them."""
    text = "Let me look.\n" + glm_call("run", {"count": "3", "code": "x = 1\ny = 2"})
    plain = GLM.parse(text)
    assert plain.content == "Let me look."
    assert [(c.name, args(c)) for c in plain.tool_calls] == [
        ("run", {"count": "3", "code": "x = 1\ny = 2"})
    ]
    typed = GLM.parse(text, [RUN_TOOL])
    assert args(typed.tool_calls[0]) == {"count": 3, "code": "x = 1\ny = 2"}


def test_glm_call_without_arguments_and_junk_inside() -> None:
    """A GLM call with no pairs has ``{}``; anything but pairs inside a block is malformed."""
    assert GLM.parse("<tool_call>ls\n</tool_call>").tool_calls == [ParsedToolCall("ls", "{}")]
    junk = "<tool_call>ls\nnot a pair\n</tool_call>"
    out = GLM.parse(junk)
    assert (out.content, out.tool_calls) == (junk, [])
    assert out.malformed is not None


def test_deepseek_v31_calls_and_section_end() -> None:
    """DeepSeek-V3.1's section becomes calls in order; its closing marker is not content."""
    text = "Checking." + deepseek_v31_calls(("a", {"i": 1}), ("b", {"s": "x"}))
    out = DSV31.parse(text)
    assert out.content == "Checking."
    assert [(c.name, args(c)) for c in out.tool_calls] == [("a", {"i": 1}), ("b", {"s": "x"})]


def test_deepseek_v3_fenced_json_calls() -> None:
    """DeepSeek-V3/R1's ``function<｜tool▁sep｜>NAME`` + fenced JSON becomes calls."""
    out = DSV3.parse(deepseek_v3_calls(("get_weather", {"city": "Paris"})))
    assert out == ParsedOutput("", [ParsedToolCall("get_weather", '{"city": "Paris"}')], None)


def test_deepseek_invalid_json_is_malformed_and_keeps_text() -> None:
    """Arguments that are not JSON make the whole reply content, verbatim."""
    text = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>a<｜tool▁sep｜>{oops<｜tool▁call▁end｜>"
    out = DSV31.parse(text)
    assert (out.content, out.tool_calls) == (text, [])
    assert out.malformed == "invalid JSON in tool call"


def test_kimi_keeps_the_model_call_ids() -> None:
    """Kimi-K2's ``functions.NAME:IDX`` is the call's id; the name comes out of it."""
    out = KIMI.parse(
        "On it."
        + kimi_calls(
            ("functions.read:0", "read", {"path": "a"}),
            ("functions.ns.tool:1", "ns.tool", {}),
        )
    )
    assert out.content == "On it."
    assert [(c.id, c.name, args(c)) for c in out.tool_calls] == [
        ("functions.read:0", "read", {"path": "a"}),
        ("functions.ns.tool:1", "ns.tool", {}),
    ]


def test_llama3_json_reply_is_one_call() -> None:
    """A reply that is a ``{"name", "parameters"}`` object is a call, with or without the
    ``<|python_tag|>`` that may lead it; any other reply is content."""
    call = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    expected = ParsedOutput("", [ParsedToolCall("get_weather", '{"city": "Paris"}')], None)
    assert LLAMA.parse(call) == expected
    assert LLAMA.parse(" <|python_tag|>" + call) == expected
    text = 'The call would be {"name": "x"}.'
    assert LLAMA.parse(text) == ParsedOutput(text, [], None)


def test_llama3_json_object_that_is_no_call_stays_content() -> None:
    """A reply that opens with JSON but is no call (or has text after it) is content."""
    for text in ['{"answer": 42}', '{"name": "f", "parameters": {}} and more']:
        out = LLAMA.parse(text)
        assert (out.content, out.tool_calls) == (text, [])
        assert out.malformed is not None


def test_mistral_both_forms() -> None:
    """``[TOOL_CALLS]NAME[ARGS]{...}`` per call, and the older ``[TOOL_CALLS] [...]`` list."""
    new = MISTRAL.parse('Sure.[TOOL_CALLS]a[ARGS]{"i": 1}[TOOL_CALLS]b[ARGS]{}')
    assert new.content == "Sure."
    assert [(c.name, args(c)) for c in new.tool_calls] == [("a", {"i": 1}), ("b", {})]
    old = MISTRAL.parse('[TOOL_CALLS] [{"name": "a", "arguments": {"i": 1}}, {"name": "b"}]')
    assert [(c.name, args(c)) for c in old.tool_calls] == [("a", {"i": 1}), ("b", {})]
    assert old.content == ""


FAMILY_SAMPLES.update(
    {
        "glm45": [
            "\nLooking.\n" + glm_call("run", {"count": "3"}) + "\n" + glm_call("ls", {}),
            glm_call("run", {"code": "a </arg_value> b"}),
            "<tool_call>ls\nnot a pair\n</tool_call>",
            "<tool_call>ls\n<arg_key>a</arg_key>\n<arg_value>half",
        ],
        "deepseek_v31": [
            "Checking." + deepseek_v31_calls(("a", {"i": 1}), ("b", {"s": "x"})),
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>a<｜tool▁sep｜>{oops<｜tool▁call▁end｜>",
            "plain text with a < sign",
        ],
        "deepseek_v3": [
            "ok" + deepseek_v3_calls(("a", {"i": 1}), ("b", {})),
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>a\n```json\n{",
        ],
        "kimi_k2": [
            "On it." + kimi_calls(("functions.a:0", "a", {"i": 1}), ("functions.b:1", "b", {})),
            "<|tool_calls_section_begin|><|tool_call_begin|>functions.a:0"
            "<|tool_call_argument_begin|>[1]<|tool_call_end|>",
        ],
        "llama3_json": [
            '{"name": "get_weather", "parameters": {"city": "Paris"}}',
            '<|python_tag|>{"name": "f", "parameters": {}}',
            "Just an answer { with braces }",
            '{"name": "f"',
        ],
        "harmony": [
            "Listing."
            + call_markup("functions.bash", '{"command": "ls"}')
            + call_markup("functions.read", "{}"),
            call_markup("functions.bash", "{oops"),
            "<|start|>assistant to=functions.x<|channel|>commentary json<|message|>{}",
        ],
        "mistral": [
            'Sure.[TOOL_CALLS]a[ARGS]{"i": 1}[TOOL_CALLS]b[ARGS]{}',
            '[TOOL_CALLS] [{"name": "a", "arguments": {"i": 1}}]',
            "[TOOL_CALLS]a[ARGS]{bad",
        ],
    }
)
FAMILY_CASES = [(get_parser(n), t) for n, texts in FAMILY_SAMPLES.items() for t in texts]
FAMILY_IDS = [f"{p.name}-{i}" for i, (p, _) in enumerate(FAMILY_CASES)]


@pytest.mark.parametrize(("parser", "text"), FAMILY_CASES, ids=FAMILY_IDS)
def test_family_stream_matches_parse_at_every_split(parser: ToolCallParser, text: str) -> None:
    """Every family format streams to parse()'s result: split at every position, and one
    character at a time."""
    for i in range(len(text) + 1):
        check_stream(parser, text, [text[:i], text[i:]])
    check_stream(parser, text, list(text))


def test_family_samples_cover_calls_and_malformed() -> None:
    """Each family's samples include well-formed calls and malformed output."""
    for name, texts in FAMILY_SAMPLES.items():
        results = [get_parser(name).parse(t) for t in texts]
        assert any(r.tool_calls for r in results), name
        assert any(r.malformed for r in results), name
