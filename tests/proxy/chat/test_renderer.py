"""Rendering with the model's own chat template, and the rule that keeps sampled ids verbatim."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from proxy.chat.messages import ChatMessage, Tool, ToolCall
from proxy.chat.renderer import ChatRenderer, NotPrefixStableError
from proxy.exceptions import TemplateError

TOOLS = [
    Tool("bash", "run a command", {"type": "object", "properties": {"command": {"type": "string"}}})
]


@pytest.fixture(scope="module")
def renderer(tiny_model_dir: Path) -> ChatRenderer:
    return ChatRenderer.from_directory(tiny_model_dir)


CLOSE = "<|im_end|>\n"  # the tiny template's end of an assistant turn


def _assistant_ids(renderer: ChatRenderer, message: ChatMessage) -> list[int]:
    """The ids a model would have sampled to produce ``message``: content + stop token."""
    user = {"role": "user", "content": "x"}
    text = renderer._apply([user, message.template_dict()], add_generation_prompt=False)
    body = text[len(renderer._apply([user], add_generation_prompt=True)) :]
    stop = renderer.stop_token_ids[0]
    assert body.endswith(CLOSE)
    assert CLOSE.startswith(renderer.tokenizer.decode([stop]))
    return [*renderer.encode(body[: len(body) - len(CLOSE)]), stop]


@pytest.mark.parametrize(
    "tail",
    [
        [ChatMessage("user", "and now?")],
        [
            ChatMessage("tool", "a.py\nb.py", tool_call_id="c1"),
            ChatMessage("tool", "done", tool_call_id="c2"),
        ],
        [ChatMessage("system", "mid-conversation note"), ChatMessage("user", "héllo ✓ 你好")],
    ],
)
def test_continuation_equals_full_rendering(
    renderer: ChatRenderer, tail: list[ChatMessage]
) -> None:
    """prompt + sampled ids + bridge + delta == the full rendering, token for token, for
    plain, tool-result and mid-conversation-system continuations."""
    head = [ChatMessage("system", "be brief"), ChatMessage("user", "list files")]
    reply = ChatMessage("assistant", "Sure.", (ToolCall("c1", "bash", '{"command": "ls"}'),))
    prompt = renderer.render_conversation(head, TOOLS)
    sampled = _assistant_ids(renderer, reply)
    continued = prompt + sampled + renderer.render_continuation(reply, sampled, tail)
    assert continued == renderer.render_conversation([*head, reply, *tail], TOOLS)


def test_a_truncated_reply_is_closed_before_the_next_message(renderer: ChatRenderer) -> None:
    """Without a sampled stop token the continuation starts with the template's whole
    close; after one, with the rest of the close only."""
    tail = [ChatMessage("user", "go on")]
    reply = ChatMessage("assistant", "half a sent")
    truncated = renderer.encode("half a sent")
    opened = renderer.tokenizer.decode(renderer.render_continuation(reply, truncated, tail))
    assert opened == CLOSE + "<|im_start|>user\ngo on<|im_end|>\n<|im_start|>assistant\n"
    stopped = [*truncated, renderer.stop_token_ids[0]]
    rest = renderer.tokenizer.decode(renderer.render_continuation(reply, stopped, tail))
    assert "<|im_end|>" + rest == opened


def test_completion_text_drops_only_a_final_stop_token(renderer: ChatRenderer) -> None:
    """The agent gets the sampled text without the trailing stop token, nothing else removed."""
    ids = renderer.encode("hello <tool_call>")
    stop = renderer.stop_token_ids[0]
    assert renderer.completion_text([*ids, stop]) == "hello <tool_call>"
    assert renderer.completion_text([stop, *ids]).endswith("hello <tool_call>")


def test_parse_uses_the_detected_hermes_parser(renderer: ChatRenderer) -> None:
    """The tiny model's template selects the hermes tool-call parser."""
    assert renderer.parser.name == "hermes"
    parsed = renderer.parse(
        'ok\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>', TOOLS
    )
    assert parsed.content == "ok"
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("bash", '{"command": "ls"}')]


def test_template_errors_are_typed(renderer: ChatRenderer) -> None:
    """A template failure becomes TemplateError, not a raw jinja exception."""

    class Broken:
        chat_template = "{{ raise_exception('nope') }}"
        eos_token_id = 0
        name_or_path = ""

        def decode(self, ids: object) -> str:
            return ""

        def apply_chat_template(self, *args: object, **kwargs: object) -> str:
            raise RuntimeError("template exploded")

    with pytest.raises(TemplateError):
        ChatRenderer(Broken())


def test_non_prefix_stable_template_is_detected(tiny_model_dir: Path) -> None:
    """A template that rewrites the close of an earlier assistant turn is refused for delta
    rendering; one that rewrites only what precedes its content is not."""
    renderer = ChatRenderer.from_directory(tiny_model_dir)
    reply = ChatMessage("assistant", "sure")
    sampled = renderer.encode("sure")
    renderer.tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}"
        "{% if loop.last %}[last]{% endif %}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    with pytest.raises(NotPrefixStableError):
        renderer.render_continuation(reply, sampled, [ChatMessage("user", "next")])
    renderer.tokenizer.chat_template = (
        "{% for m in messages %}{% if loop.last %}[last]{% endif %}"
        "{{ m['role'] }}:{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    added = renderer.render_continuation(reply, sampled, [ChatMessage("user", "next")])
    assert renderer.tokenizer.decode(added) == "\n[last]user:next\nassistant:"


@pytest.mark.parametrize(
    "text",
    [
        "",
        "plain words and   spaces\n\n",
        '<|im_start|>user\nhi<|im_end|>\n<tool_call>\n{"a": 1}\n</tool_call>',
        "ünïcödé ✓ 日本語 🙂",
        "<|endoftext|><|endoftext|>x",
    ],
)
def test_encode_matches_the_tokenizer(renderer: ChatRenderer, text: str) -> None:
    """The fast path through the backend tokenizer gives exactly the tokenizer's ids,
    special and added tokens included."""
    assert renderer._backend is not None
    assert renderer.encode(text) == renderer.tokenizer.encode(text, add_special_tokens=False)


def test_a_plain_replys_anchor_is_rendered_once(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Continuations after plain replies share the anchor's rendering alone: one template
    call per later turn instead of two, and the same ids as a renderer rendering both."""
    cached = ChatRenderer.from_directory(tiny_model_dir)
    fresh = ChatRenderer.from_directory(tiny_model_dir)
    calls: list[int] = []
    apply = cached._apply

    def counted(*args: Any, **kwargs: Any) -> str:
        calls.append(len(args[0]))
        return apply(*args, **kwargs)

    monkeypatch.setattr(cached, "_apply", counted)
    for turn in range(3):
        reply = ChatMessage("assistant", f"reply {turn}")
        sampled = cached.encode(f"reply {turn}")
        new = [ChatMessage("user", f"next {turn}")]
        assert cached.render_continuation(reply, sampled, new) == fresh.render_continuation(
            reply, sampled, new
        )
        fresh._anchors.clear()
    assert calls == [2, 3, 3, 3]  # the anchor alone once, then only the followed render
    other = {"enable_thinking": False}
    cached.render_continuation(
        ChatMessage("assistant", "x"), cached.encode("x"), [ChatMessage("user", "y")], other
    )
    assert calls[-2:] == [2, 3]  # other template variables: their own anchor rendering
