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

_QWEN3_PARAMETER_RE: Final = re.compile(_QWEN3_PARAMETER, re.DOTALL)
# What may remain of a function body once its parameters are taken out: whitespace, plus a
# `</function>` when the stream ended before `</tool_call>`.
_QWEN3_RESIDUE_RE: Final = re.compile(r"\s*(?:</function>\s*)?")


class _Malformed(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _arguments_json(arguments: dict[str, Any]) -> str:
    try:
        return json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except ValueError:
        raise _Malformed("non-finite number in tool-call arguments") from None


def _hermes_call(value: Any, body: str) -> ParsedToolCall:
    """A ``json`` region value → a call. Accepts ``parameters`` for ``arguments``, a JSON
    string holding the arguments object, and no arguments at all (``{}``)."""
    del body  # the JSON value says everything
    if not isinstance(value, dict):
        raise _Malformed("tool call is not a JSON object")
    name = value.get("name")
    if not isinstance(name, str) or not name.strip():
        raise _Malformed("tool call has no name")
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            raise _Malformed("tool-call arguments are not a JSON object") from None
    if not isinstance(arguments, dict):
        raise _Malformed("tool-call arguments are not a JSON object")
    return ParsedToolCall(name.strip(), _arguments_json(arguments))


def _qwen3_coder_call(value: Any, body: str) -> ParsedToolCall:
    """A transformed ``xml-inline`` region value → a call. ``xml-inline`` skips text it
    does not recognise, so the raw body is checked to hold nothing but parameters."""
    function = value.get("function") if isinstance(value, dict) else None
    if not isinstance(function, dict):
        raise _Malformed("unknown tool-call structure")
    name = function.get("name")
    arguments = function.get("arguments")
    if not isinstance(name, str) or not name.strip():
        raise _Malformed("tool call has no name")
    if not isinstance(arguments, dict):
        raise _Malformed("unknown tool-call structure")
    if _QWEN3_RESIDUE_RE.fullmatch(_QWEN3_PARAMETER_RE.sub("", body)) is None:
        raise _Malformed("unexpected text inside <function=...>")
    return ParsedToolCall(name.strip(), _arguments_json(arguments))


@dataclass(slots=True, frozen=True)
class _Format:
    name: str
    template: ResponseTemplate | None  # None: no tool calls at all
    make_call: Callable[[Any, str], ParsedToolCall]  # (region value, raw region text)
    decode_error: str  # reason given when the content parser itself rejects a block
    markers: tuple[str, ...]  # markup that must not survive into content
    casts_with_schema: bool  # hand the tools to ResponseParser for value casting


def _no_calls(value: Any, body: str) -> ParsedToolCall:
    raise _Malformed("this format has no tool calls")  # unreachable: no template


_FORMATS: Final[dict[str, _Format]] = {
    "hermes": _Format(
        name="hermes",
        template=load_response_template(_HERMES_SPEC),
        make_call=_hermes_call,
        decode_error="invalid JSON in tool call",
        markers=("<tool_call>", "</tool_call>"),
        casts_with_schema=False,  # JSON already carries types; keep what the model wrote
    ),
    "qwen3_coder": _Format(
        name="qwen3_coder",
        template=load_response_template(_QWEN3_CODER_SPEC),
        make_call=_qwen3_coder_call,
        decode_error="unparseable tool call",
        markers=("<tool_call>", "</tool_call>", "<function="),
        casts_with_schema=True,
    ),
    "none": _Format(
        name="none",
        template=None,
        make_call=_no_calls,
        decode_error="unparseable tool call",
        markers=(),
        casts_with_schema=False,
    ),
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
            tail = "\n".join(p for p in (g.strip() for g in self._gaps) if p)
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
                    call = self._format.make_call(event["value"], "".join(self._body))
                except _Malformed as exc:
                    self._fail(exc.reason)
                    return [e for e in out if isinstance(e, ContentDelta)]
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
    """Guess the tool-call format a chat template teaches its model."""
    if not chat_template:
        return "none"
    if "<function=" in chat_template and "<parameter=" in chat_template:
        return "qwen3_coder"
    if "<tool_call>" in chat_template:
        return "hermes"
    return "none"
