"""Wire models of the OpenAI Responses API request, and its translation into the
internal message model (validated at the boundary only).

Only what a chat template can render is accepted. Input items are messages (text parts,
and ``input_image`` parts in user messages),
``function_call``, ``function_call_output`` and ``reasoning`` (its text becomes the
reasoning of the assistant reply that follows it; a reasoning item with no readable text,
such as one carrying only ``encrypted_content`` from another server, adds nothing). Tools are function tools, also inside a ``namespace`` entry; other
tool types (``web_search``, ``file_search``, ``custom``, ``local_shell``, ...) are hosted
or grammar-driven tools a chat template cannot render, so they are left out of the
prompt. A ``function_call_output`` whose output is a list of ``input_text`` and
``input_image`` parts keeps its images in place, as a user message does (Codex's
``view_image``). Images are taken through the request's ``ImageIntake``, which checks
them; ``file_id`` images are refused (files are not stored here). Responses are not stored: ``previous_response_id`` is refused and the agent sends
the whole conversation as ``input`` (Codex does so with ``store: false``).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator

from proxy.api.images import image_at, text_and_images
from proxy.chat.messages import ChatMessage, ImagePart, Tool, ToolCall
from proxy.exceptions import BadRequestError
from proxy.images import ImageIntake


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


def flat_tool_name(namespace: str | None, name: str) -> str:
    """The name a namespaced function has in the prompt. Codex's namespaces end with
    ``__`` (``mcp__server__``), so its functions get their familiar flat names
    (``mcp__server__tool``)."""
    if not namespace:
        return name
    return f"{namespace}{name}" if namespace.endswith("_") else f"{namespace}__{name}"


# ------------------------------------------------------------------------------ input


class ContentPart(_Lenient):
    type: str
    text: str | None = None
    # input_image
    image_url: str | None = None
    file_id: str | None = None
    detail: str | None = None  # the engine decides the resolution; taken and ignored


def _content(
    content: str | list[ContentPart], where: str, intake: ImageIntake | None
) -> tuple[str, tuple[str | ImagePart, ...]]:
    """The text of a content, and its text and images in order (none for text only).
    Images are taken through ``intake``; None: the content may hold none."""
    if isinstance(content, str):
        return content, ()

    def image(part: ContentPart, at: str) -> ImagePart:
        if intake is None:
            raise BadRequestError(
                f"{at}: images are taken in user messages and function_call_output only",
                code="invalid_message",
            )
        return _image(part, at, intake)

    return text_and_images(content, where, "input_image", image)


def _image(part: ContentPart, at: str, intake: ImageIntake) -> ImagePart:
    if part.image_url:
        with image_at(at):
            return intake.url(part.image_url)
    if part.file_id:
        raise BadRequestError(
            f"{at}: file_id images are not supported (files are not stored here); "
            "send the image as a data URL in image_url",
            code="unsupported_content",
        )
    raise BadRequestError(f"{at}: an input_image part needs image_url", code="invalid_request")


class MessageItem(_Lenient):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]


class FunctionCallItem(_Lenient):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    namespace: str | None = None
    arguments: str = "{}"

    @field_validator("arguments", mode="before")
    @classmethod
    def _arguments_text(cls, value: Any) -> Any:
        return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


class FunctionCallOutputItem(_Lenient):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[ContentPart]


class ReasoningText(_Lenient):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(_Lenient):
    type: Literal["reasoning"]
    content: list[ReasoningText] | None = None
    summary: list[ReasoningText] | None = None

    def text(self) -> str:
        parts = self.content or self.summary or []
        return "".join(p.text for p in parts)


class OtherItem(_Lenient):
    """An item type this proxy cannot render (refused with its type named)."""

    type: str


def _item_tag(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    if kind is None:
        return "message"  # EasyInputMessage: {"role", "content"} without a type
    # A non-string type (fuzzed JSON) is "other": its validation then names the field.
    return kind if isinstance(kind, str) and kind in _ITEM_TAGS else "other"


_ITEM_TAGS = {"message", "function_call", "function_call_output", "reasoning"}

InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")]
    | Annotated[OtherItem, Tag("other")],
    Discriminator(_item_tag),
]


def internal_messages(
    instructions: str | None, items: str | list[InputItem], intake: ImageIntake
) -> list[ChatMessage]:
    """Input items as chat messages, in the form the session recorded its replies; images
    are taken through ``intake``.

    A reply is an optional message item followed by its ``function_call`` items (see
    ``output.output_items``); such a run becomes ONE assistant message, so an agent that
    sends the reply back continues the recorded context."""
    messages: list[ChatMessage] = []
    if instructions:
        messages.append(ChatMessage(role="system", content=instructions))
    if isinstance(items, str):
        messages.append(ChatMessage(role="user", content=items))
        return messages
    calls_join = False  # the last message is an assistant reply that calls may extend
    reasoning: str | None = None  # a reasoning item's text, for the reply that follows
    for i, item in enumerate(items):
        where = f"input.{i}"
        if isinstance(item, ReasoningItem):
            reasoning = (reasoning or "") + item.text() or None
            calls_join = False
            continue
        if isinstance(item, OtherItem):
            raise BadRequestError(
                f"{where}: input items of type {item.type!r} are not supported",
                code="unsupported_item",
            )
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            thought = reasoning if role == "assistant" else None
            text, parts = _content(
                item.content, f"{where}.content", intake if role == "user" else None
            )
            messages.append(ChatMessage(role=role, content=text, reasoning=thought, parts=parts))
            calls_join = role == "assistant"
        elif isinstance(item, FunctionCallItem):
            call = ToolCall(item.call_id, flat_tool_name(item.namespace, item.name), item.arguments)
            if calls_join:
                last = messages[-1]
                messages[-1] = ChatMessage(
                    role="assistant",
                    content=last.content,
                    tool_calls=(*last.tool_calls, call),
                    reasoning=last.reasoning,
                )
            else:
                messages.append(
                    ChatMessage(
                        role="assistant", content="", tool_calls=(call,), reasoning=reasoning
                    )
                )
            calls_join = True
        else:
            text, parts = _content(item.output, f"{where}.output", intake)
            messages.append(
                ChatMessage(role="tool", content=text, tool_call_id=item.call_id, parts=parts)
            )
            calls_join = False
        reasoning = None
    if not messages:
        raise BadRequestError("input has no messages", code="invalid_request")
    return messages


# ------------------------------------------------------------------------------ tools


class FunctionToolIn(_Lenient):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamespaceFunctionIn(_Lenient):
    """A function inside a namespace (other tools there are skipped)."""

    type: str
    name: str = ""
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamespaceToolIn(_Lenient):
    type: Literal["namespace"]
    name: str = Field(min_length=1)
    description: str | None = None
    tools: list[NamespaceFunctionIn] = Field(default_factory=list)


class OtherToolIn(_Lenient):
    type: str


def _tool_tag(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if isinstance(kind, str) and kind in {"function", "namespace"} else "other"


ToolIn = Annotated[
    Annotated[FunctionToolIn, Tag("function")]
    | Annotated[NamespaceToolIn, Tag("namespace")]
    | Annotated[OtherToolIn, Tag("other")],
    Discriminator(_tool_tag),
]


# ---------------------------------------------------------------------------- request


class ResponsesRequest(_Lenient):
    """``POST /v1/responses``. Fields that change nothing here (store, include,
    prompt_cache_key, client_metadata, reasoning, text, truncation, metadata, ...) are
    ignored."""

    model: str = Field(min_length=1)
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[ToolIn] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool = False
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    background: bool | None = None

    def check_supported(self) -> None:
        if self.previous_response_id is not None or self.conversation is not None:
            raise BadRequestError(
                "previous_response_id and conversation are not supported: responses are "
                "not stored; send the whole conversation in input (as with store=false)",
                code="unsupported_parameter",
            )
        if self.background:
            raise BadRequestError(
                "background responses are not supported", code="unsupported_parameter"
            )

    def internal_messages(self, intake: ImageIntake) -> list[ChatMessage]:
        return internal_messages(self.instructions, self.input, intake)

    def _functions(self) -> list[tuple[str | None, FunctionToolIn | NamespaceFunctionIn]]:
        out: list[tuple[str | None, FunctionToolIn | NamespaceFunctionIn]] = []
        for tool in self.tools or ():
            if isinstance(tool, FunctionToolIn):
                out.append((None, tool))
            elif isinstance(tool, NamespaceToolIn):
                out.extend((tool.name, f) for f in tool.tools if f.type == "function" and f.name)
        return out

    def internal_tools(self) -> list[Tool]:
        # Tools stay part of the context even with tool_choice "none": the template
        # renders them, and the session's keys include them.
        return [
            Tool(flat_tool_name(ns, f.name), f.description or "", f.parameters or {})
            for ns, f in self._functions()
        ]

    def namespaces(self) -> dict[str, tuple[str, str]]:
        """Flat tool name → (namespace, name), to name calls as the agent declared them."""
        return {flat_tool_name(ns, f.name): (ns, f.name) for ns, f in self._functions() if ns}

    def tool_choice_name(self) -> str:
        """``auto`` | ``none`` | ``required`` | the (flat) name of the forced function."""
        choice = self.tool_choice
        if choice is None:
            return "auto"
        if isinstance(choice, str):
            if choice not in {"auto", "none", "required"}:
                raise BadRequestError(f"unknown tool_choice {choice!r}", code="invalid_request")
            return choice
        if choice.get("type") != "function":
            raise BadRequestError(
                f"tool_choice of type {choice.get('type')!r} is not supported",
                code="unsupported_parameter",
            )
        name = choice.get("name")
        namespace = choice.get("namespace")
        flat = (
            flat_tool_name(namespace if isinstance(namespace, str) else None, name)
            if isinstance(name, str)
            else None
        )
        if flat is None or not any(t.name == flat for t in self.internal_tools()):
            raise BadRequestError(
                "tool_choice names a function that is not among the tools", code="invalid_request"
            )
        return flat

    def tools_echo(self) -> list[dict[str, Any]]:
        """The tools the model was offered, as the response object lists them."""
        out: list[dict[str, Any]] = []
        for tool in self.tools or ():
            if isinstance(tool, FunctionToolIn):
                out.append(_function_echo(tool))
            elif isinstance(tool, NamespaceToolIn):
                out.append(
                    {
                        "type": "namespace",
                        "name": tool.name,
                        "description": tool.description or "",
                        "tools": [
                            _function_echo(f) for f in tool.tools if f.type == "function" and f.name
                        ],
                    }
                )
        return out

    def tool_choice_echo(self) -> str | dict[str, Any]:
        choice = self.tool_choice
        if isinstance(choice, dict):
            return {"type": "function", "name": str(choice.get("name", ""))}
        return choice or "auto"


def _function_echo(tool: FunctionToolIn | NamespaceFunctionIn) -> dict[str, Any]:
    return {
        "type": "function",
        "name": tool.name,
        "description": tool.description,
        "parameters": tool.parameters,
        "strict": tool.strict,
    }
