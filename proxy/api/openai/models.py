"""Wire models of the OpenAI chat completions API (validated at the boundary only)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from proxy.chat.messages import ChatMessage, Tool, ToolCall
from proxy.exceptions import BadRequestError


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ContentPart(_Lenient):
    type: str
    text: str | None = None


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

    def to_internal(self, index: int) -> ChatMessage:
        if isinstance(self.content, list):
            texts: list[str] = []
            for part in self.content:
                if part.type not in {"text", "input_text", "output_text"} or part.text is None:
                    raise BadRequestError(
                        f"messages.{index}.content: only text parts are supported, got {part.type!r}",
                        code="unsupported_content",
                    )
                texts.append(part.text)
            content = "".join(texts)
        else:
            content = self.content or ""
        if self.role == "tool" and self.tool_call_id is None:
            raise BadRequestError(
                f"messages.{index}: a tool message needs tool_call_id", code="invalid_message"
            )
        calls = tuple(
            ToolCall(c.id, c.function.name, str(c.function.arguments))
            for c in self.tool_calls or ()
        )
        if calls and self.role != "assistant":
            raise BadRequestError(
                f"messages.{index}: only assistant messages carry tool_calls",
                code="invalid_message",
            )
        return ChatMessage(
            role=self.role,
            content=content,
            tool_calls=calls,
            tool_call_id=self.tool_call_id,
            name=self.name,
        )


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


class ChatCompletionRequest(_Lenient):
    model: str = Field(min_length=1)
    messages: list[MessageIn] = Field(min_length=1)
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

    def internal_messages(self) -> list[ChatMessage]:
        return [m.to_internal(i) for i, m in enumerate(self.messages)]

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if len(stops) > 16:
            raise BadRequestError("at most 16 stop sequences", code="invalid_request")
        return stops

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
