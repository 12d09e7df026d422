"""What a chat template does to the conversation shapes agents produce, checked once when a
worker brings a model.

Each shape is an assistant reply the proxy returned and the messages an agent appends to
it. A shape *continues* when its next prompt can be built from the sampled ids (see
``proxy.chat.continuation``); otherwise every such turn is rendered in full as a new
branch, and the reason says why. The result is served with the model (``GET
/<trial>/v1/models``) and logged, so a template that breaks chains is seen before a
training run, not after.

The check also asks whether the template renders ``tools`` at all (a conversation rendered
with and without a tool must differ): one that drops them (DeepSeek's) would have the
policy sample without ever seeing the agent's tools. Such a model's tools are listed in
the system prompt as its family prescribes, or its requests with tools are refused
(``proxy.chat.tool_listing``); the result says which.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from proxy.chat.continuation import NotPrefixStableError
from proxy.chat.messages import ChatMessage, ToolCall
from proxy.chat.renderer import ChatRenderer
from proxy.chat.tool_listing import ToolHandling
from proxy.exceptions import TemplateError


@dataclass(slots=True, frozen=True)
class ShapeResult:
    shape: str
    result: str  # "continued" | "full_render" | "unsupported" (the template refuses it)
    reason: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"shape": self.shape, "result": self.result, "reason": self.reason}


@dataclass(slots=True, frozen=True)
class ToolsResult:
    result: str  # a ToolHandling value: "rendered" | "listed" | "refused"
    reason: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"result": self.result, "reason": self.reason}


@dataclass(slots=True, frozen=True)
class _Shape:
    name: str
    returned: ChatMessage
    appended: tuple[ChatMessage, ...]


def _call(index: int, name: str) -> ToolCall:
    return ToolCall(f"call_check{index}", name, '{"path": "a.py"}')


SHAPES: tuple[_Shape, ...] = (
    _Shape(
        "tool_call",
        ChatMessage("assistant", "", (_call(0, "read_file"),)),
        (ChatMessage("tool", "print('hi')", tool_call_id="call_check0"),),
    ),
    _Shape(
        "text_and_tool_call",
        ChatMessage("assistant", "Reading it.", (_call(0, "read_file"),)),
        (ChatMessage("tool", "print('hi')", tool_call_id="call_check0"),),
    ),
    _Shape(
        "parallel_tool_calls",
        ChatMessage("assistant", "", (_call(0, "read_file"), _call(1, "list_files"))),
        (
            ChatMessage("tool", "print('hi')", tool_call_id="call_check0"),
            ChatMessage("tool", "a.py", tool_call_id="call_check1"),
        ),
    ),
    _Shape(
        "user_turn",
        ChatMessage("assistant", "It prints hi."),
        (ChatMessage("user", "And the tests?"),),
    ),
    _Shape(
        "reasoning_sent_back",
        ChatMessage("assistant", "It prints hi.", reasoning="The file has one print."),
        (ChatMessage("user", "And the tests?"),),
    ),
    _Shape(
        "reasoning_with_tool_call",
        ChatMessage("assistant", "", (_call(0, "read_file"),), reasoning="Read it first."),
        (ChatMessage("tool", "print('hi')", tool_call_id="call_check0"),),
    ),
)


def check_template(renderer: ChatRenderer) -> list[ShapeResult]:
    """Every shape through the renderer's continuation, as a one-token reply (its stop
    token) would go through it."""
    sampled: Sequence[int] = renderer.stop_token_ids[:1]
    results = []
    for shape in SHAPES:
        try:
            renderer.render_continuation(shape.returned, sampled, shape.appended)
        except NotPrefixStableError as exc:
            results.append(ShapeResult(shape.name, "full_render", str(exc)))
        except TemplateError as exc:
            results.append(ShapeResult(shape.name, "unsupported", exc.message))
        else:
            results.append(ShapeResult(shape.name, "continued"))
    return results


def check_tools(renderer: ChatRenderer) -> ToolsResult:
    """Whether the agent's tools reach the model, and how."""
    handling = renderer.tool_handling
    if handling is ToolHandling.RENDERED:
        return ToolsResult(handling.value)
    if handling is ToolHandling.LISTED:
        return ToolsResult(
            handling.value,
            "the template ignores tools; they are listed in the system prompt in the "
            f"{renderer.parser.name} format",
        )
    return ToolsResult(
        handling.value,
        "the template ignores tools and no listing is known for the "
        f"{renderer.parser.name} format: requests with tools are refused (tools_unsupported); "
        "give the worker a tool-aware template (--chat-template FILE)",
    )


def summary_line(results: Sequence[ShapeResult], tools: ToolsResult | None = None) -> str:
    """One log line: what happens to tools, then each shape and what happens to it."""
    parts = []
    if tools is not None:
        parts.append(f"tools {tools.result}" + (f" ({tools.reason})" if tools.reason else ""))
    for r in results:
        parts.append(f"{r.shape} {r.result}" + (f" ({r.reason})" if r.reason else ""))
    return "; ".join(parts)
