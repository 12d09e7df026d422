"""Wire models of the OpenAI chat completions and legacy completions APIs (validated at
the boundary only).

A message's content is a string or a list of parts: ``text`` parts, and ``image_url``
parts (``{"url": ..., "detail": ...}``, or the URL alone) in user and tool messages. A
message with images keeps its text and images in order (``ChatMessage.parts``); its images
are taken through the request's ``ImageIntake`` (``proxy.images``), which checks them.
An image in a system, developer or assistant message is refused (no chat template renders
one there), and so is every other part type."""

from __future__ import annotations

import json
from typing import Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, field_validator

from proxy.api.bodies import MessageBody
from proxy.api.errors import parse_json
from proxy.api.images import image_at, text_and_images
from proxy.chat.history import HistoryMemory
from proxy.chat.messages import ChatMessage, ImagePart, Tool, ToolCall
from proxy.exceptions import BadRequestError
from proxy.images import ImageIntake

# The roles whose messages may hold images (chat templates render them there only).
_IMAGE_ROLES = {"user", "tool"}


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = (stop,) if isinstance(stop, str) else tuple(stop)
    if len(stops) > 16:
        raise BadRequestError("at most 16 stop sequences", code="invalid_request")
    return stops


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ImageUrl(_Lenient):
    url: str
    detail: str | None = None  # the engine decides the resolution; taken and ignored


class ContentPart(_Lenient):
    type: str
    text: str | None = None
    # An image_url part: the object, or (as some clients send it) the URL alone.
    image_url: ImageUrl | str | None = None


class FunctionCall(_Lenient):
    name: str
    arguments: str | dict[str, Any] = "{}"

    @field_validator("arguments")
    @classmethod
    def _text(cls, value: str | dict[str, Any]) -> str:
        return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


class ToolCallIn(_Lenient):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class MessageIn(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    # An assistant message's reasoning, under either name servers use for it.
    reasoning_content: str | None = None
    reasoning: str | None = None

    def to_internal(self, index: int, intake: ImageIntake) -> ChatMessage:
        """The internal message; its images are taken through ``intake``."""
        parts: tuple[str | ImagePart, ...] = ()
        if isinstance(self.content, list):
            content, parts = self._parts(self.content, index, intake)
        else:
            content = self.content or ""
        if self.role == "tool" and self.tool_call_id is None:
            raise BadRequestError(
                f"messages.{index}: a tool message needs tool_call_id", code="invalid_message"
            )
        calls = (
            tuple(
                ToolCall(c.id, c.function.name, str(c.function.arguments)) for c in self.tool_calls
            )
            if self.tool_calls
            else ()
        )
        if calls and self.role != "assistant":
            raise BadRequestError(
                f"messages.{index}: only assistant messages carry tool_calls",
                code="invalid_message",
            )
        reasoning = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if reasoning and self.role != "assistant":
            raise BadRequestError(
                f"messages.{index}: only assistant messages carry reasoning",
                code="invalid_message",
            )
        return ChatMessage(
            role=self.role,
            content=content,
            tool_calls=calls,
            tool_call_id=self.tool_call_id,
            name=self.name,
            reasoning=reasoning or None,
            parts=parts,
        )

    def _parts(
        self, content: list[ContentPart], index: int, intake: ImageIntake
    ) -> tuple[str, tuple[str | ImagePart, ...]]:
        """The text of a list content, and its text and images in order."""
        return text_and_images(
            content,
            f"messages.{index}.content",
            "image_url",
            lambda part, at: self._image(part, at, index, intake),
        )

    def _image(self, part: ContentPart, at: str, index: int, intake: ImageIntake) -> ImagePart:
        if self.role not in _IMAGE_ROLES:
            raise BadRequestError(
                f"messages.{index}: images go in user and tool messages, not in a "
                f"{self.role} message ({at} is an image)",
                code="invalid_message",
            )
        image = part.image_url
        url = image.url if isinstance(image, ImageUrl) else image
        if not url:
            raise BadRequestError(
                f"{at}: an image_url part needs image_url.url", code="invalid_request"
            )
        with image_at(at):
            return intake.url(url)


class FunctionDef(_Lenient):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolIn(_Lenient):
    type: Literal["function"]
    function: FunctionDef

    def to_internal(self) -> Tool:
        f = self.function
        return Tool(f.name, f.description or "", f.parameters or {})


class StreamOptions(_Lenient):
    include_usage: bool = False


class ChatCompletionFields(_Lenient):
    """A chat completion request but its messages: they are validated one by one, and
    only those a session has not seen before (``parse_chat_completion``)."""

    model: str = Field(min_length=1)
    tools: list[ToolIn] | None = None
    tool_choice: str | dict[str, Any] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    n: int = Field(default=1, ge=1, le=16)
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    def stop_strings(self) -> tuple[str, ...]:
        return stop_strings(self.stop)

    def tool_choice_name(self) -> str:
        """``auto`` | ``none`` | ``required`` | the name of the forced function."""
        choice = self.tool_choice
        if choice is None:
            return "auto"
        if isinstance(choice, str):
            if choice not in {"auto", "none", "required"}:
                raise BadRequestError(f"unknown tool_choice {choice!r}", code="invalid_request")
            return choice
        name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
        if not isinstance(name, str) or not any(t.function.name == name for t in self.tools or ()):
            raise BadRequestError(
                "tool_choice names a function that is not among the tools", code="invalid_request"
            )
        return name

    def internal_tools(self) -> list[Tool]:
        # Tools stay part of the context even with tool_choice "none": the template
        # rendered them, and the session's keys include them.
        return [t.to_internal() for t in self.tools or ()]


class ChatCompletionRequest(ChatCompletionFields):
    """The whole request validated in one piece: what names the error of a body the
    message-by-message path cannot take apart."""

    messages: list[MessageIn] = Field(min_length=1)

    def internal_messages(self, intake: ImageIntake) -> list[ChatMessage]:
        return [m.to_internal(i, intake) for i, m in enumerate(self.messages)]


_BODY = MessageBody("openai.chat", ChatCompletionFields, MessageIn)


def parse_chat_completion(
    body: bytes, memory: HistoryMemory, intake: ImageIntake
) -> tuple[ChatCompletionFields, list[ChatMessage]]:
    """A chat completion body's fields and internal messages, validating and converting
    only the messages ``memory`` has not seen (``proxy.api.bodies``); the images of those
    it converts are taken through ``intake`` (``proxy.api.images.take_images``)."""
    split = _BODY.parse(body, memory, lambda message, index: (message.to_internal(index, intake),))
    if split is not None:
        return split
    whole = parse_json(ChatCompletionRequest, body)
    return whole, whole.internal_messages(intake)


class CompletionRequest(_Lenient):
    """The legacy ``/v1/completions`` request: a raw prompt, no chat template."""

    model: str = Field(min_length=1)
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = None
    n: int = Field(default=1, ge=1, le=16)
    best_of: int | None = Field(default=None, ge=1)
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    # vLLM's extension: the sampled ids (and the prompt's) in each choice, so a client can
    # continue a context with the exact ids instead of re-tokenizing the text.
    return_token_ids: bool = False

    def single_prompt(self) -> str | list[int]:
        """The one prompt of the request; a batch of several is refused."""
        prompt = self.prompt
        single: str | list[int]
        if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
            single = cast(str | list[int], prompt)
        elif len(prompt) == 1:
            single = prompt[0]
        else:
            raise BadRequestError(
                f"prompt: a batch of {len(prompt)} prompts is not supported; "
                "send one prompt per request (use n for several completions of one prompt)",
                code="unsupported",
            )
        if not single:
            raise BadRequestError("prompt: must not be empty", code="invalid_request")
        return single

    def check_supported(self) -> None:
        if self.echo:
            raise BadRequestError("echo is not supported", code="unsupported")
        if self.suffix:
            raise BadRequestError("suffix is not supported", code="unsupported")
        if self.best_of is not None and self.best_of != self.n:
            raise BadRequestError(
                "best_of is not supported (every sampled choice is returned; use n)",
                code="unsupported",
            )

    def stop_strings(self) -> tuple[str, ...]:
        return stop_strings(self.stop)
