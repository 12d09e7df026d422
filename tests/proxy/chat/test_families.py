"""Continuation on the real chat templates of model families: one chain, sampled ids
verbatim, and exactly the template's rendering of everything new."""

from __future__ import annotations

import json
import re

import pytest

from proxy.chat.messages import ChatMessage, Tool, ToolCall
from proxy.chat.renderer import ChatRenderer
from tests.families import FAMILIES, Call, FamilyCase, family_model
from tests.scripted_policy import shows_tool

TOOLS = [
    Tool(
        "bash", "Run a command", {"type": "object", "properties": {"command": {"type": "string"}}}
    ),
    Tool(
        "read_file", "Read a file", {"type": "object", "properties": {"path": {"type": "string"}}}
    ),
]

# (reasoning, content, calls) the policy samples, then the messages the agent appends.
EPISODE: list[tuple[str, str, list[Call], list[ChatMessage]]] = [
    (
        "I should list the files first.",
        "",
        [("bash", {"command": "ls"})],
        [ChatMessage("tool", "main.py\nREADME.md", tool_call_id="{0}")],
    ),
    (
        "Now read it.",
        "Reading main.py.",
        [("read_file", {"path": "main.py"})],
        [ChatMessage("tool", "print('hi')", tool_call_id="{0}")],
    ),
    ("That answers it.", "main.py prints hi.", [], [ChatMessage("user", "Thanks. And README?")]),
    (
        "Read the readme.",
        "",
        [("read_file", {"path": "README.md"})],
        [ChatMessage("tool", "# Demo", tool_call_id="{0}")],
    ),
]

_THINK = re.compile(r"<think>.*?</think>\s*|</?think>\s*", re.DOTALL)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest) -> tuple[FamilyCase, ChatRenderer]:
    case = FAMILIES[request.param]
    return case, ChatRenderer.from_directory(family_model(case.name))


def _returned(
    case: FamilyCase, reasoning: str, content: str, calls: list[Call], send_reasoning: bool
) -> ChatMessage:
    tool_calls = tuple(
        ToolCall(case.call_id(name, i), name, json.dumps(args))
        for i, (name, args) in enumerate(calls)
    )
    return ChatMessage(
        "assistant",
        content,
        tool_calls,
        reasoning=reasoning if send_reasoning and case.reasoning else None,
    )


@pytest.mark.parametrize("send_reasoning", [True, False], ids=["reasoning-sent-back", "dropped"])
def test_an_episode_is_one_chain_on_the_real_template(
    family: tuple[FamilyCase, ChatRenderer], send_reasoning: bool
) -> None:
    """Every turn of a tool-using episode with reasoning continues the previous one: the
    prompt is the previous prompt + its sampled ids verbatim + the new text, and the new
    text is exactly what the family's template renders for the new messages (and its
    generation prompt) after the last assistant turn."""
    case, renderer = family
    messages = [
        ChatMessage("system", "You are a coding agent."),
        ChatMessage("user", "List the files, then read main.py."),
    ]
    prompt = renderer.render_conversation(messages, TOOLS)
    for reasoning, content, calls, appended in EPISODE:
        if case.single_call:
            calls = calls[:1]
        sampled = renderer.encode(case.sample(reasoning, content, calls))
        assert sampled[-1] in renderer.stop_token_ids
        returned = _returned(case, reasoning, content, calls, send_reasoning)
        new = [
            ChatMessage(
                m.role,
                m.content,
                tool_call_id=returned.tool_calls[0].id if m.role == "tool" else None,
            )
            for m in appended
        ]
        added = renderer.render_continuation(returned, sampled, new)
        before = prompt + sampled
        prompt = before + added
        messages = [*messages, returned, *new]
        # The template's own rendering, tools included (DeepSeek's in its listing).
        full = renderer.render_text(messages, TOOLS)
        added_text = renderer.tokenizer.decode(added)
        chain = renderer.tokenizer.decode(prompt)
        if case.deviation:
            full, added_text, chain = (
                t.replace(case.deviation, "") for t in (full, added_text, chain)
            )
        assert full.endswith(added_text), (added_text, full[-300:])
        if case.exact_history:
            assert prompt == renderer.encode(full)
        elif case.coherent_history:
            assert _THINK.sub("", chain) == _THINK.sub("", full)


def test_the_anchor_survives_templates_that_drop_content(
    family: tuple[FamilyCase, ChatRenderer],
) -> None:
    """A reply with a tool call and no content still continues (Llama 3 drops the content
    of a tool-call message; the anchor then goes into the call's arguments)."""
    case, renderer = family
    sampled = renderer.encode(case.sample("", "", [("bash", {"command": "ls"})]))
    returned = _returned(case, "", "", [("bash", {"command": "ls"})], False)
    added = renderer.render_continuation(
        returned, sampled, [ChatMessage("tool", "ok", tool_call_id=case.call_id("bash", 0))]
    )
    assert "ok" in renderer.tokenizer.decode(added)


def test_every_familys_first_prompt_shows_the_policy_its_tools(
    family: tuple[FamilyCase, ChatRenderer],
) -> None:
    """The prompt of an episode's first request shows each tool's name, description and
    parameters, as the family tests' policy requires before it calls one; DeepSeek's bare
    templates show none of it, the proxy's listing shows all of it."""
    case, renderer = family
    messages = [ChatMessage("system", "You are a coding agent."), ChatMessage("user", "Go.")]
    prompt = renderer.tokenizer.decode(renderer.render_conversation(messages, TOOLS))
    bare = renderer._apply(
        [m.template_dict() for m in messages],
        tools=[t.template_dict() for t in TOOLS],
        add_generation_prompt=True,
    )
    for tool in TOOLS:
        definition = (tool.description, *tool.parameters["properties"])
        assert shows_tool(prompt, tool.name, definition)
        assert shows_tool(bare, tool.name, definition) is not case.name.startswith("deepseek")
