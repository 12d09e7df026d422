"""Tools reach the model on every template: rendered by the template, listed in the system
prompt as the family is served with tools, or refused with a clear error."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from proxy.chat.messages import ChatMessage, Tool
from proxy.chat.renderer import ChatRenderer
from proxy.chat.template_check import check_tools
from proxy.chat.tool_listing import LISTINGS, ToolHandling, decide, with_listing
from proxy.exceptions import ToolsUnsupportedError
from tests.families import FAMILIES, FIXTURES, family_model, tool_aware_deepseek_v31

LISTED = {"deepseek_v31": "deepseek_v31", "deepseek_r1": "deepseek_v3"}
GOLDEN = FIXTURES.parent / "tool_listings"

# The conversation and tools of the golden listings (tests/fixtures/tool_listings).
TOOLS = [
    Tool(
        "bash", "Run a command", {"type": "object", "properties": {"command": {"type": "string"}}}
    ),
    Tool(
        "read_file",
        "Lire un fichier — vite",
        {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    ),
]
MESSAGES = [
    ChatMessage("system", "You are a coding agent."),
    ChatMessage("user", "List the files."),
]
BOS, USER = "<｜begin▁of▁sentence｜>", "<｜User｜>"


def _system_prompt(text: str) -> str:
    return text[text.index(BOS) + len(BOS) : text.index(USER)]


@pytest.mark.parametrize("family", sorted(LISTED))
def test_a_deepseek_template_gets_the_listing_the_engines_tool_templates_render(
    family: str,
) -> None:
    """DeepSeek-V3.1's and R1's templates drop tools: the check says so, and the proxy's
    rendering has exactly the system prompt the engines' tool-aware templates render (the
    model card's ``## Tools`` listing for V3.1), the rest as the official template writes it."""
    renderer = ChatRenderer.from_directory(family_model(family))
    assert renderer.tool_handling is ToolHandling.LISTED
    assert renderer.parser.name == LISTED[family]
    text = renderer.render_text(MESSAGES, TOOLS)
    assert _system_prompt(text) == (GOLDEN / f"{family}.txt").read_text()
    without = renderer.render_text(MESSAGES, [])
    assert text.replace(_system_prompt(text), "") == without.replace("You are a coding agent.", "")
    result = check_tools(renderer)
    assert (result.result, LISTED[family] in (result.reason or "")) == ("listed", True)


@pytest.mark.parametrize("family", sorted(set(FAMILIES) - set(LISTED)))
def test_every_other_family_renders_tools_with_its_own_template(family: str) -> None:
    """Every other family's template renders tools itself: nothing is added to it."""
    renderer = ChatRenderer.from_directory(family_model(family))
    assert renderer.tool_handling is ToolHandling.RENDERED
    assert check_tools(renderer).as_dict() == {"result": "rendered", "reason": None}
    own = renderer._apply(
        [m.template_dict() for m in MESSAGES],
        tools=[t.template_dict() for t in TOOLS],
        add_generation_prompt=True,
    )
    assert renderer.render_text(MESSAGES, TOOLS) == own
    assert "Lire un fichier" in own


def test_the_listing_goes_after_every_system_message_or_opens_the_prompt() -> None:
    """The listing is appended to the last system message after a blank line (the
    templates join system messages into one prompt), or, with none, is a system message of
    its own; the caller's messages are not changed."""
    messages = [
        {"role": "system", "content": "A"},
        {"role": "user", "content": "u"},
        {"role": "system", "content": "B"},
    ]
    out = with_listing(messages, "LIST")
    assert [m["content"] for m in out] == ["A", "u", "B\n\nLIST"]
    assert messages[2]["content"] == "B"
    assert with_listing([{"role": "user", "content": "u"}], "LIST") == [
        {"role": "system", "content": "\n\nLIST"},
        {"role": "user", "content": "u"},
    ]


@pytest.mark.parametrize(
    ("renders", "tool_call_format", "expected"),
    [
        (True, "deepseek_v31", ToolHandling.RENDERED),
        (True, "none", ToolHandling.RENDERED),
        (False, "deepseek_v31", ToolHandling.LISTED),
        (False, "deepseek_v3", ToolHandling.LISTED),
        (False, "hermes", ToolHandling.REFUSED),
        (False, "none", ToolHandling.REFUSED),
    ],
)
def test_the_template_first_then_the_familys_listing_then_refusal(
    renders: bool, tool_call_format: str, expected: ToolHandling
) -> None:
    """A template that renders tools is used as it is (a tool-aware one an operator gave
    included); one that drops them gets a listing only for a format that has one."""
    assert decide(renders, tool_call_format) is expected
    assert set(LISTINGS) == {"deepseek_v31", "deepseek_v3"}


def test_tools_a_template_drops_without_a_listing_are_refused(tiny_model_dir: Path) -> None:
    """A template that ignores tools, of a format with no listing: a request with tools is a
    400 ``tools_unsupported`` that names the way out; one without tools renders."""
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    renderer = ChatRenderer(tokenizer)
    assert renderer.tool_handling is ToolHandling.REFUSED
    result = check_tools(renderer)
    assert result.result == "refused"
    assert "--chat-template" in (result.reason or "")
    with pytest.raises(ToolsUnsupportedError) as refused:
        renderer.render_conversation(MESSAGES, TOOLS)
    assert (refused.value.status, refused.value.code) == (400, "tools_unsupported")
    assert "--chat-template FILE" in refused.value.message
    assert renderer.render_conversation(MESSAGES, [])


def test_a_tool_aware_template_renders_the_tools_itself() -> None:
    """DeepSeek-V3.1 with a tool-aware template (as ``--chat-template`` ships one): the
    check finds that it renders tools, and the proxy adds no listing of its own."""
    directory = family_model("deepseek_v31")
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    tokenizer.chat_template = tool_aware_deepseek_v31()
    renderer = ChatRenderer(tokenizer)
    assert renderer.tool_handling is ToolHandling.RENDERED
    text = renderer.render_text(MESSAGES, TOOLS)
    assert "Tools you may call:\n- bash: Run a command" in text
    assert "## Tools" not in text
