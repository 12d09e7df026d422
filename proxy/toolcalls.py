"""Turn the text a model sampled into assistant content plus tool calls.

A model writes tool calls in its own native markup; agents want OpenAI/Anthropic tool
calls. This module recognises that markup, once for a whole completion
(:meth:`ToolCallParser.parse`) or incrementally while tokens stream in
(:meth:`ToolCallParser.stream`). Supported formats, by name:

* ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks
  (Qwen2.5, Hermes and our tiny test model).
* ``qwen3_coder``: ``<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...
  </function></tool_call>`` blocks (Qwen3-Coder). Values are text; when the request's
  tools are given, each value is cast to the type its JSON schema declares.
* ``glm45``: ``<tool_call>NAME\n<arg_key>KEY</arg_key>\n<arg_value>VALUE</arg_value>...
  </tool_call>`` blocks (GLM-4.5/4.6). Values are text, cast with the tools' schemas as
  for ``qwen3_coder``.
* ``deepseek_v31``: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}
  <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`` (DeepSeek-V3.1).
* ``deepseek_v3``: the same section with ``function<｜tool▁sep｜>NAME\n```json\n{...}\n```
  `` per call (DeepSeek-V3, R1).
* ``kimi_k2``: ``<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX
  <|tool_call_argument_begin|>{...}<|tool_call_end|>...<|tool_calls_section_end|>``
  (Kimi-K2). The model writes its own call id (``functions.NAME:IDX``); it is kept as the
  call's id, so the agent sends back the id the model saw.
* ``llama3_json``: a reply that *is* a JSON object ``{"name": ..., "parameters": {...}}``
  (optionally after ``<|python_tag|>``) is one call (Llama 3.1/3.2/3.3); any other reply
  is content.
* ``mistral``: ``[TOOL_CALLS]NAME[ARGS]{...}`` per call (Mistral Small 3.2, Devstral,
  Magistral), or ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`` (Mistral 7B
  v0.3, Nemo).
* ``harmony``: ``<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>
  {...}<|call|>`` (gpt-oss). The model writes harmony messages on channels; the proxy's
  harmony splitter (``proxy.chat.harmony``) routes them and hands each tool call on in this
  one form.
* ``none``: no tool calls; everything is content.

The parsing itself is carried by transformers' declarative response parsing
(``transformers.utils.chat_parsing.ResponseParser`` driven by a ``response_template``
spec, the same machinery behind ``tokenizer.parse_response``): it finds the tool-call
delimiters, holds back text that may be the start of a delimiter while streaming, decodes
the JSON (``json`` content parser) or the ``<parameter=...>`` tags (``xml-inline``
content parser), and casts Qwen3-Coder values with the tools' schemas. This module adds
what the spec language does not say: which shapes count as a valid call, the content
whitespace policy, and the all-or-nothing fallback for malformed output.

Content rules:

* Whitespace directly around a tool-call block belongs to the block, not to content.
* Text before the first tool call is content verbatim; so is the whole text when there is
  no tool call.
* Text after the first tool call (between or after blocks, rare in practice) is stripped
  per gap and appended to the content, one ``"\\n"`` between pieces.
* When anything looks like a tool call but cannot be parsed (invalid JSON, no name, an
  unexpected structure, an unclosed block, tool-call markup left in the content), the
  result is *malformed*: no tool calls at all, and the content is the full original text,
  so the caller can return it as a normal text answer and nothing is lost.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, TypeAlias

from transformers.utils.chat_parsing import ResponseParser
from transformers.utils.chat_parsing.response_templates import (
    ResponseTemplate,
    load_response_template,
)

__all__ = [
    "ContentDelta",
    "ParsedOutput",
    "ParsedToolCall",
    "StreamEvent",
    "ToolCallComplete",
    "ToolCallParser",
    "ToolCallStream",
    "UnknownToolParserError",
    "detect_parser",
    "get_parser",
]


# ---------------------------------------------------------------------------- results


@dataclass(slots=True, frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # a JSON object as text: json.dumps(args, ensure_ascii=False)
    id: str | None = None  # the call id the model wrote itself (Kimi-K2), if any


@dataclass(slots=True, frozen=True)
class ParsedOutput:
    content: str
    tool_calls: list[ParsedToolCall]
    malformed: str | None = None  # why tool-call-like text could not be parsed


@dataclass(slots=True, frozen=True)
class ContentDelta:
    """Content that is safe to show the client now."""

    text: str


@dataclass(slots=True, frozen=True)
class ToolCallComplete:
    """A tool call whose block has closed; ``index`` counts calls from 0."""

    index: int
    call: ParsedToolCall


StreamEvent: TypeAlias = ContentDelta | ToolCallComplete


class UnknownToolParserError(ValueError):
    """No tool-call format has this name."""


# ---------------------------------------------------------------------------- formats

# `ResponseParser` only uses the start anchor to cut a prompt prefix; we never pass one
# (the proxy parses the sampled text alone), but the spec loader insists on an anchor.
_UNUSED_ANCHOR: Final = "<|im_start|>assistant\n"

# The implicit region (no `open`): everything outside tool-call blocks. Kept verbatim
# (`strip: False`) so streamed chunks add up to the value; `join` concatenates the
# pieces between blocks instead of letting the last piece overwrite the earlier ones.
_CONTENT_FIELD: Final[dict[str, Any]] = {
    "content": "text",
    "content_args": {"strip": False},
    "repeats": True,
    "join": "",
}

_HERMES_SPEC: Final[dict[str, Any]] = {
    "start_anchor": _UNUSED_ANCHOR,
    "fields": {
        "tool_calls": {
            # The leading \s* makes whitespace before a block part of the block, and makes
            # the streaming parser hold trailing whitespace until it knows what follows.
            "open_pattern": r"\s*<tool_call>",
            "close": "</tool_call>",  # a literal close is committed the moment it is seen
            "repeats": True,
            "content": "json",
        },
        "content": _CONTENT_FIELD,
    },
}

# One parameter; exactly one newline after the open tag and before the close tag belongs
# to the markup (that is how the Qwen3-Coder template writes it), the rest is the value.
_QWEN3_PARAMETER: Final = r"<parameter=(?P<key>[^>\n]+)>\n?(?P<value>.*?)\n?</parameter>"

_QWEN3_CODER_SPEC: Final[dict[str, Any]] = {
    "start_anchor": _UNUSED_ANCHOR,
    "fields": {
        "tool_calls": {
            "open_pattern": r"\s*<tool_call>\s*<function=(?P<name>[^>\n]+)>",
            # Closing on both tags keeps a value that mentions `</tool_call>` intact. A
            # regex close at the end of the buffer is committed only once the next
            # character (or the end of the stream) arrives.
            "close_pattern": r"</function>\s*</tool_call>",
            "repeats": True,
            "content": "xml-inline",
            "content_args": {"tag_pattern": _QWEN3_PARAMETER},
            # This shape is what ResponseParser's schema casting looks for.
            "transform": {
                "type": "function",
                "function": {"name": "{name}", "arguments": "{content}"},
            },
        },
        "content": _CONTENT_FIELD,
    },
}


# GLM-4.5: one key/value pair; the value is written raw (strings) or as JSON (the rest).
_GLM_ARGUMENT: Final = r"<arg_key>(?P<key>.*?)</arg_key>\s*<arg_value>(?P<value>.*?)</arg_value>"

_GLM45_SPEC: Final[dict[str, Any]] = {
    "start_anchor": _UNUSED_ANCHOR,
    "fields": {
        "tool_calls": {
            "open_pattern": r"\s*<tool_call>(?P<name>[^\n<]+?)\s*(?=<arg_key>|</tool_call>)",
            "close": "</tool_call>",
            "repeats": True,
            "content": "xml-inline",
            "content_args": {"tag_pattern": _GLM_ARGUMENT},
            "transform": {
                "type": "function",
                "function": {"name": "{name}", "arguments": "{content}"},
            },
        },
        "content": _CONTENT_FIELD,
    },
}

_DEEPSEEK_SECTION: Final = r"\s*(?:<｜tool▁calls▁begin｜>)?\s*<｜tool▁call▁begin｜>"

_DEEPSEEK_V31_SPEC: Final[dict[str, Any]] = {
    "start_anchor": _UNUSED_ANCHOR,
    "fields": {
        "tool_calls": {
            "open_pattern": _DEEPSEEK_SECTION + r"(?P<name>[^<]+?)<｜tool▁sep｜>",
            "close": "<｜tool▁call▁end｜>",
            "repeats": True,
            "content": "json",
            "transform": {"name": "{name}", "arguments": "{content}"},
        },
        "content": _CONTENT_FIELD,
    },
}

_DEEPSEEK_V3_SPEC: Final[dict[str, Any]] = {
    "start_anchor": _UNUSED_ANCHOR,
    "fields": {
        "tool_calls": {
            "open_pattern": _DEEPSEEK_SECTION
            + r"function<｜tool▁sep｜>(?P<name>[^\n<]+)\n```(?:json)?\n",
            "close_pattern": r"\n?```\s*<｜tool▁call▁end｜>",
            "repeats": True,
            "content": "json",
            "transform": {"name": "{name}", "arguments": "{content}"},
        },
        "content": _CONTENT_FIELD,
    },
}

_KIMI_K2_SPEC: Final[dict[str, Any]] = {
    "start_anchor": _UNUSED_ANCHOR,
    "fields": {
        "tool_calls": {
            "open_pattern": r"\s*(?:<\|tool_calls_section_begin\|>)?\s*<\|tool_call_begin\|>"
            r"\s*(?P<id>[^<]+?)\s*<\|tool_call_argument_begin\|>",
            "close": "<|tool_call_end|>",
            "repeats": True,
            "content": "json",
            "transform": {"id": "{id}", "arguments": "{content}"},
        },
        "content": _CONTENT_FIELD,
    },
}

_LLAMA3_JSON_SPEC: Final[dict[str, Any]] = {
    "start_anchor": _UNUSED_ANCHOR,
    "fields": {
        # Only at the very start of the reply (\A: the parser searches its whole buffer):
        # a reply that opens with a JSON object is a call; the region runs to the end.
        "tool_calls": {
            "open_pattern": r"\A\s*(?:<\|python_tag\|>\s*)?(?=\{)",
            "content": "json",
        },
        "content": _CONTENT_FIELD,
    },
}

_HARMONY_SPEC: Final[dict[str, Any]] = {
    "start_anchor": _UNUSED_ANCHOR,
    "fields": {
        "tool_calls": {
            "open_pattern": r"\s*<\|start\|>assistant to=(?:functions\.)?(?P<name>[^<]+?)"
            r"<\|channel\|>commentary json<\|message\|>",
            "close": "<|call|>",
            "repeats": True,
            "content": "json",
            "transform": {"name": "{name}", "arguments": "{content}"},
        },
        "content": _CONTENT_FIELD,
    },
}

_MISTRAL_SPEC: Final[dict[str, Any]] = {
    "start_anchor": _UNUSED_ANCHOR,
    "fields": {
        # [TOOL_CALLS]NAME[ARGS]{...}: the arguments run to the next call or the end.
        "tool_calls": {
            "open_pattern": r"\s*\[TOOL_CALLS\](?P<name>[^\[\]\s]+)\[ARGS\]",
            "close_pattern": r"(?=\[TOOL_CALLS\])",
            "repeats": True,
            "content": "json",
            "transform": {"name": "{name}", "arguments": "{content}"},
        },
        # [TOOL_CALLS] [{...}, ...]: one JSON list of calls.
        "tool_call_list": {
            "open_pattern": r"\s*\[TOOL_CALLS\]\s*(?=\[)",
            "repeats": True,
            "content": "json",
        },
        "content": _CONTENT_FIELD,
    },
}


class _Malformed(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _arguments_json(arguments: dict[str, Any]) -> str:
    try:
        return json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except ValueError:
        raise _Malformed("non-finite number in tool-call arguments") from None


def _json_call(value: Any, body: str) -> list[ParsedToolCall]:
    """A ``{"name", "arguments"}`` value → a call. Accepts ``parameters`` for
    ``arguments``, a JSON string holding the arguments object, and no arguments at all
    (``{}``)."""
    del body  # the value says everything
    if not isinstance(value, dict):
        raise _Malformed("tool call is not a JSON object")
    name = value.get("name")
    if not isinstance(name, str) or not name.strip():
        raise _Malformed("tool call has no name")
    arguments = _arguments(value.get("arguments", value.get("parameters", {})))
    return [ParsedToolCall(name.strip(), arguments)]


def _arguments(arguments: Any) -> str:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            raise _Malformed("tool-call arguments are not a JSON object") from None
    if not isinstance(arguments, dict):
        raise _Malformed("tool-call arguments are not a JSON object")
    return _arguments_json(arguments)


def _json_calls(value: Any, body: str) -> list[ParsedToolCall]:
    """A JSON list of ``{"name", "arguments"}`` objects → calls (Mistral's list form)."""
    if not isinstance(value, list) or not value:
        raise _Malformed("tool-call list is not a non-empty JSON list")
    return [call for item in value for call in _json_call(item, body)]


def _mistral_calls(value: Any, body: str) -> list[ParsedToolCall]:
    """Either form of Mistral's calls: one ``{"name", "arguments"}`` or a list of them."""
    return _json_calls(value, body) if isinstance(value, list) else _json_call(value, body)


def _kimi_call(value: Any, body: str) -> list[ParsedToolCall]:
    """``{"id": "functions.NAME:IDX", "arguments": {...}}`` → a call keeping that id."""
    del body
    match = _KIMI_ID_RE.fullmatch(value["id"].strip())
    if match is None:
        raise _Malformed("tool-call id names no function")
    call_id = match.group(0)
    return [ParsedToolCall(match.group("name"), _arguments(value["arguments"]), call_id)]


_KIMI_ID_RE: Final = re.compile(r"(?:functions\.)?(?P<name>[^\s:]+)(?::\d+)?")


def _tagged_call(
    argument: str, residue: str, where: str
) -> Callable[[Any, str], list[ParsedToolCall]]:
    """A transformed ``xml-inline`` region value → a call. ``xml-inline`` skips text it
    does not recognise, so the raw body is checked to hold nothing but arguments: once
    every ``argument`` is taken out, only ``residue`` may remain."""
    argument_re = re.compile(argument, re.DOTALL)
    residue_re = re.compile(residue)

    def make(value: Any, body: str) -> list[ParsedToolCall]:
        function = value.get("function") if isinstance(value, dict) else None
        if not isinstance(function, dict):
            raise _Malformed("unknown tool-call structure")
        name = function.get("name")
        arguments = function.get("arguments")
        if not isinstance(name, str) or not name.strip():
            raise _Malformed("tool call has no name")
        if not isinstance(arguments, dict):
            raise _Malformed("unknown tool-call structure")
        if residue_re.fullmatch(argument_re.sub("", body)) is None:
            raise _Malformed(f"unexpected text inside {where}")
        return [ParsedToolCall(name.strip(), _arguments_json(arguments))]

    return make


@dataclass(slots=True, frozen=True)
class _Format:
    name: str
    template: ResponseTemplate | None  # None: no tool calls at all
    make_call: Callable[[Any, str], list[ParsedToolCall]]  # (region value, raw region text)
    decode_error: str  # reason given when the content parser itself rejects a block
    markers: tuple[str, ...]  # markup that must not survive into content
    casts_with_schema: bool  # hand the tools to ResponseParser for value casting
    # Markup closing a group of calls (DeepSeek's and Kimi's section end): dropped from
    # the text after the first call instead of counting as content.
    trailers: tuple[str, ...] = ()


def _no_calls(value: Any, body: str) -> list[ParsedToolCall]:
    raise _Malformed("this format has no tool calls")  # unreachable: no template


# What may remain of a Qwen3-Coder function body once its parameters are taken out:
# whitespace, plus a `</function>` when the stream ended before `</tool_call>`.
_QWEN3_RESIDUE: Final = r"\s*(?:</function>\s*)?"


def _format(
    name: str,
    spec: dict[str, Any] | None,
    make_call: Callable[[Any, str], list[ParsedToolCall]],
    markers: tuple[str, ...],
    *,
    decode_error: str = "invalid JSON in tool call",
    casts_with_schema: bool = False,
    trailers: tuple[str, ...] = (),
) -> _Format:
    template = load_response_template(spec) if spec is not None else None
    return _Format(name, template, make_call, decode_error, markers, casts_with_schema, trailers)


_DEEPSEEK_MARKERS: Final = ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>")
_KIMI_MARKERS: Final = (
    "<|tool_calls_section_begin|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
)

_FORMATS: Final[dict[str, _Format]] = {
    fmt.name: fmt
    for fmt in [
        # JSON already carries types: keep what the model wrote.
        _format("hermes", _HERMES_SPEC, _json_call, ("<tool_call>", "</tool_call>")),
        _format(
            "qwen3_coder",
            _QWEN3_CODER_SPEC,
            _tagged_call(_QWEN3_PARAMETER, _QWEN3_RESIDUE, "<function=...>"),
            ("<tool_call>", "</tool_call>", "<function="),
            decode_error="unparseable tool call",
            casts_with_schema=True,
        ),
        _format(
            "glm45",
            _GLM45_SPEC,
            _tagged_call(_GLM_ARGUMENT, r"\s*", "<tool_call>"),
            ("<tool_call>", "</tool_call>", "<arg_key>", "<arg_value>"),
            decode_error="unparseable tool call",
            casts_with_schema=True,
        ),
        _format(
            "deepseek_v31",
            _DEEPSEEK_V31_SPEC,
            _json_call,
            _DEEPSEEK_MARKERS,
            trailers=("<｜tool▁calls▁end｜>",),
        ),
        _format(
            "deepseek_v3",
            _DEEPSEEK_V3_SPEC,
            _json_call,
            _DEEPSEEK_MARKERS,
            trailers=("<｜tool▁calls▁end｜>",),
        ),
        _format(
            "kimi_k2",
            _KIMI_K2_SPEC,
            _kimi_call,
            _KIMI_MARKERS,
            trailers=("<|tool_calls_section_end|>",),
        ),
        _format("llama3_json", _LLAMA3_JSON_SPEC, _json_call, ("<|python_tag|>",)),
        _format("harmony", _HARMONY_SPEC, _json_call, ("<|call|>", "<|channel|>", "<|start|>")),
        _format("mistral", _MISTRAL_SPEC, _mistral_calls, ("[TOOL_CALLS]", "[ARGS]")),
        _format("none", None, _no_calls, (), decode_error="unparseable tool call"),
    ]
}


def _schema_tools(tools: list[dict[str, Any]]) -> list[Any]:
    """Tools in the shape ResponseParser reads schemas from (``{"name", "parameters"}``),
    from OpenAI (``{"type": "function", "function": {...}}``), bare, or Anthropic
    (``input_schema``) tool definitions."""
    out: list[Any] = []
    for tool in tools:
        function = tool.get("function", tool)
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            continue
        parameters = function.get("parameters", function.get("input_schema"))
        out.append(
            {
                "name": function["name"],
                "parameters": parameters if isinstance(parameters, dict) else {},
            }
        )
    return out


# ---------------------------------------------------------------------------- streaming


class ToolCallStream:
    """Incremental parsing of one completion: :meth:`feed` text deltas as they are
    sampled, then :meth:`finish` once.

    Events:

    * :class:`ContentDelta` carries content the client may see now. Text that could
      still become a tool-call block (a partial ``<tool_call>`` tag, trailing
      whitespace) is held back until it is known not to be one. Content after the first
      tool call is held until :meth:`finish`, since it depends on the whole output.
    * :class:`ToolCallComplete` is emitted when a block closes (``hermes``: as soon as
      ``</tool_call>`` arrives; ``qwen3_coder``: on the character after it, or at
      :meth:`finish`; a block left open at the end of the stream completes in
      :meth:`finish` if it is otherwise whole).

    When nothing is malformed, the ContentDelta texts add up to the final
    ``ParsedOutput.content`` and the ToolCallComplete calls are its ``tool_calls``.

    When the output turns out malformed, parsing stops: later :meth:`feed` calls emit
    nothing, and :meth:`finish` emits all raw text not yet sent as one ContentDelta.
    Content sent before is always a verbatim prefix of the output, so the client has
    received the full text overall, matching ``ParsedOutput.content``. ToolCallComplete
    events already sent for earlier calls are not retracted; the ParsedOutput from
    :meth:`finish` (no tool calls) is what counts.
    """

    __slots__ = (
        "_body",
        "_calls",
        "_emitted",
        "_finished",
        "_format",
        "_gap",
        "_gaps",
        "_malformed",
        "_parser",
        "_raw",
        "_seen_call",
    )

    def __init__(self, fmt: _Format, tools: list[dict[str, Any]] | None = None) -> None:
        self._format = fmt
        self._parser: ResponseParser | None = None
        if fmt.template is not None:
            schema = _schema_tools(tools) if fmt.casts_with_schema and tools else None
            self._parser = ResponseParser(fmt.template, prefix="", tools=schema)
        self._raw: list[str] = []
        self._emitted = 0  # length of the raw prefix already sent as ContentDelta
        self._seen_call = False  # a tool-call block has opened
        self._gaps: list[str] = []  # content between/after blocks, finished pieces
        self._gap: list[str] = []  # the piece being collected
        self._body: list[str] = []  # raw text of the open tool-call block
        self._calls: list[ParsedToolCall] = []
        self._malformed: str | None = None
        self._finished = False

    def feed(self, text_delta: str) -> list[StreamEvent]:
        """Consume the next piece of sampled text; return what can be emitted now."""
        if self._finished:
            raise RuntimeError("ToolCallStream already finished")
        if not text_delta:
            return []
        self._raw.append(text_delta)
        if self._format.template is None:  # `none`: everything is content, at once
            self._emitted += len(text_delta)
            return [ContentDelta(text_delta)]
        if self._parser is None:  # malformed: the rest goes out in finish()
            return []
        try:
            events = self._parser.feed(text_delta)
        except (ValueError, RecursionError):  # the content parser rejected a block
            self._fail(self._format.decode_error)
            return []
        return self._translate(events)

    def finish(self) -> tuple[list[StreamEvent], ParsedOutput]:
        """End of the completion: the remaining events and the final result."""
        if self._finished:
            raise RuntimeError("ToolCallStream already finished")
        self._finished = True
        raw = "".join(self._raw)
        if self._format.template is None:
            return [], ParsedOutput(raw, [], None)

        out: list[StreamEvent] = []
        if self._parser is not None:
            try:
                _, events = self._parser.finalize()
            except (ValueError, RecursionError):
                self._fail(self._format.decode_error)
            else:
                out = self._translate(events)

        content = ""
        if self._malformed is None:
            self._gaps.append("".join(self._gap))
            gaps = self._gaps
            for trailer in self._format.trailers:
                gaps = [g.replace(trailer, "") for g in gaps]
            tail = "\n".join(p for p in (g.strip() for g in gaps) if p)
            head = raw[: self._emitted]  # before the first call, all sent verbatim
            content = head + "\n" + tail if head and tail else head + tail
            marker = next((m for m in self._format.markers if m in content), None)
            if marker is not None:
                self._fail(f"unparsed {marker} markup in content")
            elif tail:
                out.append(ContentDelta(content[len(head) :]))

        if self._malformed is not None:
            out = [e for e in out if isinstance(e, ContentDelta)]
            if self._emitted < len(raw):
                out.append(ContentDelta(raw[self._emitted :]))
            return out, ParsedOutput(raw, [], self._malformed)
        return out, ParsedOutput(content, list(self._calls), None)

    # -------------------------------------------------------------------- internals

    def _fail(self, reason: str) -> None:
        self._malformed = reason
        self._parser = None

    def _translate(self, events: list[dict[str, Any]]) -> list[StreamEvent]:
        """ResponseParser region events → our events. On a malformed block only the
        content deltas already produced are kept (they are a verbatim prefix)."""
        out: list[StreamEvent] = []
        for event in events:
            kind, field = event["type"], event["field"]
            if field == "content":
                if kind != "region_chunk":
                    continue
                if self._seen_call:
                    self._gap.append(event["text"])
                else:
                    self._emitted += len(event["text"])
                    out.append(ContentDelta(event["text"]))
            elif kind == "region_open":
                if self._seen_call:
                    self._gaps.append("".join(self._gap))
                    self._gap = []
                self._seen_call = True
                self._body = []
            elif kind == "region_chunk":
                self._body.append(event["text"])
            elif kind == "region_close":
                try:
                    calls = self._format.make_call(event["value"], "".join(self._body))
                except _Malformed as exc:
                    self._fail(exc.reason)
                    return [e for e in out if isinstance(e, ContentDelta)]
                for call in calls:
                    out.append(ToolCallComplete(len(self._calls), call))
                    self._calls.append(call)
        return out


# ---------------------------------------------------------------------------- parsers


class ToolCallParser:
    """One tool-call format. Stateless; make one stream per completion."""

    __slots__ = ("_format", "name")

    def __init__(self, name: str) -> None:
        fmt = _FORMATS.get(name)
        if fmt is None:
            known = ", ".join(sorted(_FORMATS))
            raise UnknownToolParserError(f"unknown tool parser {name!r} (known: {known})")
        self._format = fmt
        self.name: str = fmt.name

    def parse(self, text: str, tools: list[dict[str, Any]] | None = None) -> ParsedOutput:
        """Parse a whole completion. ``tools`` (OpenAI, bare or Anthropic definitions)
        type ``qwen3_coder`` parameter values; ``hermes`` JSON is returned as written."""
        stream = self.stream(tools)
        stream.feed(text)
        _, result = stream.finish()
        return result

    def stream(self, tools: list[dict[str, Any]] | None = None) -> ToolCallStream:
        """Start incremental parsing of one completion."""
        return ToolCallStream(self._format, tools)

    def __repr__(self) -> str:
        return f"ToolCallParser({self.name!r})"


def get_parser(name: str) -> ToolCallParser:
    """The parser for a format name (``hermes``, ``qwen3_coder``, ``none``)."""
    return ToolCallParser(name)


def detect_parser(chat_template: str | None) -> str:
    """Guess the tool-call format a chat template teaches its model, from the markup it
    writes for the calls in history."""
    if not chat_template:
        return "none"
    if "<|channel|>" in chat_template and "<|call|>" in chat_template:
        return "harmony"
    if "<function=" in chat_template and "<parameter=" in chat_template:
        return "qwen3_coder"
    if "<arg_key>" in chat_template:
        return "glm45"
    if "<tool_call>" in chat_template:
        return "hermes"
    if "<｜tool▁sep｜>" in chat_template:
        return "deepseek_v3" if "```json" in chat_template else "deepseek_v31"
    if "<|tool_call_begin|>" in chat_template:
        return "kimi_k2"
    if "[TOOL_CALLS]" in chat_template:
        return "mistral"
    if "<|eom_id|>" in chat_template or "<|python_tag|>" in chat_template:
        return "llama3_json"
    return "none"
