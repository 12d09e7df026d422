"""Wire models of the Anthropic Messages API and their translation to the internal model.

Validated at the boundary only, leniently: fields the proxy has no use for (``metadata``,
``thinking``, ``context_management``, ``output_config``, ``cache_control`` on blocks, ...)
are ignored. Translation rules, chosen so that a reply the proxy returned comes back as
exactly the assistant message it recorded (otherwise the session would branch):

* ``system`` (a string or text blocks) becomes the first message, role ``system``; blocks
  are joined with a blank line (``"\\n\\n"``). A message with role ``system`` inside
  ``messages`` (Claude Code sends one mid-conversation) stays a system message there.
* A user message's ``tool_result`` blocks become ``tool`` messages, in order; its text
  and image blocks become one user message after them: its text is the text blocks
  joined with a blank line, its ``parts`` that text and the images in order (a run of text
  blocks joined the same way).
* Images (``image`` blocks with a ``base64`` or ``url`` source) are taken in user messages
  and in a ``tool_result``'s content (Claude Code's Read of a screenshot), through the
  request's ``ImageIntake``, which checks them; an image in a system prompt, a system
  message or an assistant message is refused (400 ``invalid_message``).
* An assistant message's text blocks are concatenated with no separator (they are pieces
  of one sampled reply: a streamed reply can carry text after its ``tool_use`` blocks),
  and its ``tool_use`` blocks become tool calls with ``json.dumps(input)`` arguments.
* An assistant message's ``thinking`` block is its reasoning: it must carry its text and
  the ``signature`` the proxy gave it (checked by the caller's ``signed``), else 400.
  ``redacted_thinking`` blocks are dropped (the proxy never returns any), and so are
  thinking blocks in user messages or system prompts. ``is_error`` on a tool result is
  ignored (agents say so in the result's text).
  Documents and every other block type are refused with a 400.
* Tools with a ``type`` other than ``custom`` are Anthropic server tools
  (``web_search_20250305``, ...) that a chat template cannot run: they are skipped.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from proxy.api.bodies import MessageBody
from proxy.api.errors import parse_json
from proxy.api.images import image_at, message_parts
from proxy.chat.history import HistoryMemory
from proxy.chat.messages import ChatMessage, ImagePart, Tool, ToolCall
from proxy.exceptions import BadRequestError
from proxy.images import ImageIntake
from proxy.sampling import AgentSampling

# Between the text blocks of a system prompt, a user message or a tool result.
BLOCK_SEPARATOR = "\n\n"

_DROPPED_BLOCKS = {"thinking", "redacted_thinking"}


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ContentBlock(_Lenient):
    """Any content block; which fields a type needs is checked during translation."""

    type: str
    text: str | None = None
    # tool_use
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    # tool_result
    tool_use_id: str | None = None
    content: str | list[ContentBlock] | None = None
    is_error: bool | None = None
    # thinking
    thinking: str | None = None
    signature: str | None = None
    # image (read by ``_image``: other blocks with a source, documents, are refused)
    source: dict[str, Any] | None = None


# (thinking text, signature) -> whether the proxy signed it for this trial
SignatureCheck = Callable[[str, str], bool]


class MessageIn(_Lenient):
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]


class ToolIn(_Lenient):
    type: str | None = None  # absent or "custom": a client tool; anything else: a server tool
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any] | None = None

    @property
    def is_custom(self) -> bool:
        return self.type in {None, "custom"}


class ToolChoiceIn(_Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None


def _unsupported(where: str, kind: str) -> BadRequestError:
    return BadRequestError(
        f"{where}: {kind} blocks are not supported by this proxy", code="unsupported_content"
    )


def _text_of(block: ContentBlock, where: str) -> str:
    if block.text is None:
        raise BadRequestError(f"{where}: a text block needs text", code="invalid_request")
    return block.text


def _not_here(at: str) -> BadRequestError:
    return BadRequestError(
        f"{at}: images are taken in user messages and tool results only", code="invalid_message"
    )


def _joined_text(content: str | list[ContentBlock], where: str) -> str:
    """A system prompt or a system message: text blocks only."""
    if isinstance(content, str):
        return content
    texts: list[str] = []
    for j, block in enumerate(content):
        if block.type == "text":
            texts.append(_text_of(block, f"{where}.{j}"))
        elif block.type == "image":
            raise _not_here(f"{where}.{j}")
        elif block.type not in _DROPPED_BLOCKS:
            raise _unsupported(f"{where}.{j}", block.type)
    return BLOCK_SEPARATOR.join(texts)


def _image(block: ContentBlock, at: str, intake: ImageIntake) -> ImagePart:
    """An image block's image, taken through ``intake``."""
    source = block.source
    if source is None:
        raise BadRequestError(f"{at}: an image block needs a source", code="invalid_request")
    kind = source.get("type")
    if kind == "base64":
        data = source.get("data")
        if not isinstance(data, str):
            raise BadRequestError(
                f"{at}: a base64 image source needs its data", code="invalid_request"
            )
        with image_at(at):
            return intake.base64(data)
    if kind == "url":
        url = source.get("url")
        if not isinstance(url, str) or not url:
            raise BadRequestError(f"{at}: a url image source needs its url", code="invalid_request")
        with image_at(at):
            return intake.url(url)
    raise BadRequestError(
        f"{at}: image sources of type {kind!r} are not supported (send base64 or url)",
        code="unsupported_content",
    )


def _add_text(parts: list[str | ImagePart], text: str) -> None:
    """A text block after ``parts``: a run of text blocks is one text part, joined as the
    message's text is."""
    if parts and isinstance(parts[-1], str):
        parts[-1] = f"{parts[-1]}{BLOCK_SEPARATOR}{text}"
    else:
        parts.append(text)


def _tool_result(block: ContentBlock, at: str, intake: ImageIntake) -> ChatMessage:
    """A ``tool_result`` block's tool message: its text blocks joined with a blank line,
    and its images in their places."""
    if not block.tool_use_id:
        raise BadRequestError(
            f"{at}: a tool_result block needs tool_use_id", code="invalid_request"
        )
    content = block.content
    if not content:
        return ChatMessage(role="tool", content="", tool_call_id=block.tool_use_id)
    if isinstance(content, str):
        return ChatMessage(role="tool", content=content, tool_call_id=block.tool_use_id)
    texts: list[str] = []
    parts: list[str | ImagePart] = []
    for k, inner in enumerate(content):
        where = f"{at}.content.{k}"
        if inner.type == "text":
            text = _text_of(inner, where)
            texts.append(text)
            _add_text(parts, text)
        elif inner.type == "image":
            parts.append(_image(inner, where, intake))
        elif inner.type not in _DROPPED_BLOCKS:
            raise _unsupported(where, inner.type)
    return ChatMessage(
        role="tool",
        content=BLOCK_SEPARATOR.join(texts),
        tool_call_id=block.tool_use_id,
        parts=message_parts(parts),
    )


def _user_messages(
    content: str | list[ContentBlock], where: str, intake: ImageIntake
) -> list[ChatMessage]:
    if isinstance(content, str):
        return [ChatMessage(role="user", content=content)]
    results: list[ChatMessage] = []
    texts: list[str] = []
    parts: list[str | ImagePart] = []  # the text blocks (runs joined) and images, in order
    for j, block in enumerate(content):
        at = f"{where}.{j}"
        if block.type == "text":
            text = _text_of(block, at)
            texts.append(text)
            _add_text(parts, text)
        elif block.type == "image":
            parts.append(_image(block, at, intake))
        elif block.type == "tool_result":
            results.append(_tool_result(block, at, intake))
        elif block.type == "tool_use":
            raise BadRequestError(
                f"{at}: only assistant messages carry tool_use blocks", code="invalid_message"
            )
        elif block.type not in _DROPPED_BLOCKS:
            raise _unsupported(at, block.type)
    if parts or not results:
        results.append(
            ChatMessage(
                role="user", content=BLOCK_SEPARATOR.join(texts), parts=message_parts(parts)
            )
        )
    return results


def _thinking_of(block: ContentBlock, at: str, signed: SignatureCheck) -> str:
    if not block.thinking:
        raise BadRequestError(
            f"{at}: a thinking block needs its thinking text", code="invalid_request"
        )
    if not block.signature or not signed(block.thinking, block.signature):
        raise BadRequestError(
            f"{at}: the thinking block's signature is not one this proxy gave",
            code="invalid_signature",
        )
    return block.thinking


def _assistant_message(
    content: str | list[ContentBlock], where: str, signed: SignatureCheck
) -> ChatMessage:
    if isinstance(content, str):
        return ChatMessage(role="assistant", content=content)
    texts: list[str] = []
    calls: list[ToolCall] = []
    thoughts: list[str] = []
    for j, block in enumerate(content):
        at = f"{where}.{j}"
        if block.type == "thinking":
            thoughts.append(_thinking_of(block, at, signed))
        elif block.type == "text":
            texts.append(_text_of(block, at))
        elif block.type == "tool_use":
            if not block.id or not block.name:
                raise BadRequestError(
                    f"{at}: a tool_use block needs id and name", code="invalid_request"
                )
            arguments = json.dumps(block.input or {}, ensure_ascii=False)
            calls.append(ToolCall(block.id, block.name, arguments))
        elif block.type == "tool_result":
            raise BadRequestError(
                f"{at}: tool_result blocks belong in user messages", code="invalid_message"
            )
        elif block.type == "image":
            raise _not_here(at)
        elif block.type != "redacted_thinking":
            raise _unsupported(at, block.type)
    return ChatMessage(
        role="assistant",
        content="".join(texts),
        tool_calls=tuple(calls),
        reasoning="".join(thoughts) or None,
    )


def internal_message(
    message: MessageIn, i: int, signed: SignatureCheck, intake: ImageIntake
) -> list[ChatMessage]:
    """The internal messages of the conversation's message ``i``; ``signed`` checks the
    signatures of thinking blocks, its images are taken through ``intake``."""
    where = f"messages.{i}.content"
    if message.role == "user":
        return _user_messages(message.content, where, intake)
    if message.role == "assistant":
        return [_assistant_message(message.content, where, signed)]
    return [ChatMessage(role="system", content=_joined_text(message.content, where))]


class ConversationFields(_Lenient):
    """What ``/v1/messages`` and ``/v1/messages/count_tokens`` share, but the messages
    (validated one by one: ``proxy.api.bodies``)."""

    model: str = Field(min_length=1)
    system: str | list[ContentBlock] | None = None
    tools: list[ToolIn] | None = None
    tool_choice: ToolChoiceIn | None = None

    def system_messages(self) -> list[ChatMessage]:
        """The system prompt, as the conversation's first message (if it has text)."""
        if self.system is None:
            return []
        system = _joined_text(self.system, "system")
        return [ChatMessage(role="system", content=system)] if system else []

    def internal_tools(self) -> list[Tool]:
        tools: list[Tool] = []
        for i, tool in enumerate(self.tools or ()):
            if not tool.is_custom:
                continue
            if tool.input_schema is None:
                raise BadRequestError(
                    f"tools.{i}: a custom tool needs input_schema", code="invalid_request"
                )
            tools.append(Tool(tool.name, tool.description or "", tool.input_schema))
        return tools

    def tool_choice_name(self) -> str:
        """``auto`` | ``none`` | ``required`` | the name of the forced tool."""
        choice = self.tool_choice
        if choice is None or choice.type == "auto":
            return "auto"
        if choice.type == "none":
            return "none"
        names = {t.name for t in self.tools or () if t.is_custom}
        if not names:
            raise BadRequestError(
                f"tool_choice {choice.type!r} needs tools", code="invalid_request"
            )
        if choice.type == "any":
            return "required"
        if choice.name not in names:
            raise BadRequestError(
                "tool_choice names a tool that is not among the tools", code="invalid_request"
            )
        return choice.name


class ConversationRequest(ConversationFields):
    """The whole request validated in one piece: what names the error of a body that
    does not come apart."""

    messages: list[MessageIn] = Field(min_length=1)

    def internal_messages(self, signed: SignatureCheck, intake: ImageIntake) -> list[ChatMessage]:
        """The conversation; ``signed`` checks the signatures of thinking blocks, its
        images are taken through ``intake``."""
        out = self.system_messages()
        for i, message in enumerate(self.messages):
            out.extend(internal_message(message, i, signed, intake))
        return out


class MessagesFields(ConversationFields):
    # Required by Anthropic; a missing one leaves the proxy's caps in charge.
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    stop_sequences: list[str] | None = None
    stream: bool = False

    def sampling(self) -> AgentSampling:
        # Anthropic has no seed: a reproducible run sets it in the session's sampling.
        return AgentSampling(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
        )

    def stop_strings(self) -> tuple[str, ...]:
        return tuple(self.stop_sequences or ())


class MessagesRequest(MessagesFields, ConversationRequest):
    """A whole ``/v1/messages`` request."""


class CountTokensRequest(ConversationRequest):
    pass


_BODY = MessageBody("anthropic.messages", MessagesFields, MessageIn)


def parse_messages_request(
    body: bytes, memory: HistoryMemory, signed: SignatureCheck, intake: ImageIntake
) -> tuple[MessagesFields, list[ChatMessage]]:
    """A ``/v1/messages`` body's fields and its conversation, validating and converting
    only the messages ``memory`` has not seen (``proxy.api.bodies``); the images of those
    it converts are taken through ``intake`` (``proxy.api.images.take_images``)."""
    split = _BODY.parse(
        body, memory, lambda message, i: internal_message(message, i, signed, intake)
    )
    if split is None:
        whole = parse_json(MessagesRequest, body)
        return whole, whole.internal_messages(signed, intake)
    fields, messages = split
    return fields, [*fields.system_messages(), *messages]
