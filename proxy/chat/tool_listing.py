"""Tool listings for chat templates that do not render ``tools``.

Some official templates ignore the ``tools`` argument: DeepSeek-V3.1's and R1's render the
same prompt with and without it. For those families the tool definitions reach the model
the way the family is served with tools: as a listing written into the system prompt, in
the call format the family's parser reads. The serving engines (vLLM, SGLang) ship
separate tool-aware templates for exactly this; the listings here produce the same
system-prompt text:

* ``deepseek_v31`` (DeepSeek-V3.1): the ``## Tools`` listing of DeepSeek-V3.1's model card
  (one ``### NAME`` / ``Description:`` / ``Parameters:`` block per tool, then the call
  format and its rules).
* ``deepseek_v3`` (DeepSeek-V3 / R1, calls as ``function<｜tool▁sep｜>NAME`` and a JSON
  block): the listing of the engines' tool-aware R1 template (the call format, then each
  tool's definition as JSON). R1's model card prescribes none.

Both are appended to the system prompt after a blank line, as those templates append
them, so the rendered prompt is the one a tool-aware template would render. A family
with neither a rendering template nor a listing here has its requests with tools refused
(``ToolsUnsupportedError``): tools are never dropped silently.

Pure functions: nothing here renders a template or touches a tokenizer.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable, Sequence
from typing import Any

from proxy.chat.messages import Tool

Listing = Callable[[Sequence[Tool]], str]


class ToolHandling(enum.Enum):
    """How a model's requests with tools reach it (decided once, when the worker brings
    the model)."""

    RENDERED = "rendered"  # the chat template renders ``tools`` itself
    LISTED = "listed"  # the family's listing is written into the system prompt
    REFUSED = "refused"  # neither: requests with tools are refused (tools_unsupported)


def decide(renders_tools: bool, tool_call_format: str) -> ToolHandling:
    """The template's own rendering first; else the family's listing; else refusal."""
    if renders_tools:
        return ToolHandling.RENDERED
    if tool_call_format in LISTINGS:
        return ToolHandling.LISTED
    return ToolHandling.REFUSED


def _json(value: Any) -> str:
    # As Hugging Face templates' ``tojson`` writes it (non-ASCII kept, default separators).
    return json.dumps(value, ensure_ascii=False)


_V31_CALL_FORMAT = (
    "IMPORTANT: ALWAYS adhere to this exact format for tool use:\n"
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>tool_call_name<｜tool▁sep｜>"
    "tool_call_arguments<｜tool▁call▁end｜>{{additional_tool_calls}}<｜tool▁calls▁end｜>\n"
    "\n"
    "Where:\n"
    "\n"
    "- `tool_call_name` must be an exact match to one of the available tools\n"
    "- `tool_call_arguments` must be valid JSON that strictly follows the tool's "
    "Parameters Schema\n"
    "- For multiple tool calls, chain them directly without separators or spaces\n"
)


def deepseek_v31_listing(tools: Sequence[Tool]) -> str:
    """DeepSeek-V3.1's ``## Tools`` listing (its model card's tool-calling format)."""
    blocks = "".join(
        f"\n### {t.name}\nDescription: {t.description}\n\nParameters: {_json(t.parameters)}\n"
        for t in tools
    )
    return "## Tools\nYou have access to the following tools:\n" + blocks + "\n" + _V31_CALL_FORMAT


_R1_CALL_FORMAT = (
    "You are a helpful assistant with tool calling capabilities. When a tool call is "
    "needed, you MUST use the following format to issue the call:\n"
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>FUNCTION_NAME\n"
    '```json\n{"param1": "value1", "param2": "value2"}\n```'
    "<｜tool▁call▁end｜><｜tool▁calls▁end｜>\n"
    "\n"
    # No blank line before the heading: the engines' template has none.
    "Make sure the JSON is valid."
    "## Tools\n\n### Function\n\nYou have the following functions available:\n\n"
)


def deepseek_r1_listing(tools: Sequence[Tool]) -> str:
    """DeepSeek-V3/R1's listing, as the serving engines' tool-aware R1 template writes it."""
    return _R1_CALL_FORMAT + "".join(f"\n```json\n{_json(t.template_dict())}\n```\n" for t in tools)


# Keyed by the tool-call format the listing teaches: the parser that reads the replies.
LISTINGS: dict[str, Listing] = {
    "deepseek_v31": deepseek_v31_listing,
    "deepseek_v3": deepseek_r1_listing,
}


def listing_for(tool_call_format: str) -> Listing | None:
    """The listing of the family whose calls ``tool_call_format`` reads, if it has one."""
    return LISTINGS.get(tool_call_format)


def with_listing(messages: Sequence[dict[str, Any]], listing: str) -> list[dict[str, Any]]:
    """The template messages with ``listing`` appended to the system prompt after a blank
    line: to the last system message (these templates join every system message into one
    prompt), or as a system message of its own before the others when there is none."""
    out = [dict(m) for m in messages]
    for message in reversed(out):
        if message.get("role") == "system":
            message["content"] = f"{message.get('content') or ''}\n\n{listing}"
            return out
    return [{"role": "system", "content": f"\n\n{listing}"}, *out]
