"""Chat-template rendering and token accounting for one model.

Rendering is done by the model's own chat template through transformers'
``apply_chat_template``; nothing here knows a model family. What this module adds is the
rule that keeps sampled tokens verbatim across turns:

* A new branch is rendered in full: ``template(messages, tools) + generation prompt``.
  A template that ignores ``tools`` (DeepSeek's) gets its family's tool listing in the
  system prompt instead, or the request is refused (``proxy.chat.tool_listing``).
* A continuation is ``previous context ids + sampled ids + the text after them``: what
  the template writes after the returned assistant message's content (its close, minus
  the end-of-turn token the model already sampled), the new messages and the generation
  prompt. That text comes from rendering a short probe conversation that ends in the
  returned message, anchored on its content (``proxy.chat.continuation``).

History is never re-rendered or re-tokenized, so the cost of a turn is proportional to
its new tokens, not to the context. The anchor needs a template that does not rewrite an
earlier assistant message's close when messages are appended (what it does *before* the
content, such as dropping old reasoning, does not matter). That is checked for every
continuation; when it does not hold the request is rendered in full as a new branch
instead, and the turn says so.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec

from proxy.chat import reasoning
from proxy.chat.continuation import (
    SENTINEL,
    NotPrefixStableError,
    Split,
    split_after_anchor,
    text_after_completion,
)
from proxy.chat.messages import ChatMessage, Tool
from proxy.chat.tool_listing import ToolHandling, decide, listing_for, with_listing
from proxy.exceptions import TemplateError, ToolsUnsupportedError
from proxy.toolcalls import ParsedOutput, ToolCallParser, detect_parser, get_parser

log = logging.getLogger(__name__)

__all__ = ["ChatRenderer", "NotPrefixStableError"]

_PROBE_USER: dict[str, Any] = {"role": "user", "content": "probe"}
_PROBE_SYSTEM: dict[str, Any] = {"role": "system", "content": "probe"}
_PROBE_TOOL = Tool(
    "probe_tool", "A probe.", {"type": "object", "properties": {"x": {"type": "string"}}}
)
# Anchors whose rendering alone is kept (an agent's plain replies all share one).
_ANCHORS_KEPT = 256
_PROBE_CALL = {"id": "call_probe", "type": "function", "function": {"name": "probe"}}


class ChatRenderer:
    """Messages → token ids and sampled ids → text, for one tokenizer + chat template."""

    def __init__(self, tokenizer: Any, *, tool_parser: str | None = None) -> None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise TemplateError("the model's tokenizer has no chat template")
        self.tokenizer = tokenizer
        # The anchor's rendering alone, per anchor and variables (see ``_alone``).
        self._anchors: OrderedDict[tuple[str, bytes], str] = OrderedDict()
        # A fast tokenizer's own `tokenizers.Tokenizer`: the same ids as `encode` without
        # the transformers wrapper's per-call work, which dominates on short texts (tests
        # check the ids against the wrapper's).
        self._backend: Any = getattr(tokenizer, "backend_tokenizer", None)
        self.parser: ToolCallParser = get_parser(
            tool_parser or detect_parser(tokenizer.chat_template)
        )
        self.stop_token_ids: tuple[int, ...] = self._find_stop_ids()
        # The texts of the tokenizer's special tokens: end-of-turn markers among them.
        self._specials: tuple[str, ...] = tuple(
            t.content
            for t in getattr(tokenizer, "added_tokens_decoder", {}).values()
            if getattr(t, "special", False)
        )
        self._stop_texts = {i: tokenizer.decode([i]) for i in self.stop_token_ids}
        # Think-tag reasoning (Qwen3, DeepSeek, GLM): the template knows the tags.
        template = str(tokenizer.chat_template)
        self.reasons = reasoning.OPEN in template and reasoning.CLOSE in template
        # Harmony (gpt-oss): reasoning, answer and tool calls are messages on channels.
        self.harmony = self.parser.name == "harmony"
        # A template that cannot render a one-message conversation is refused at once.
        self._apply([_PROBE_USER], add_generation_prompt=True)
        # Some templates concatenate tool-call arguments as text (DeepSeek), most render
        # a mapping: which one is found once, by rendering a call both ways.
        self.string_arguments = self._wants_string_arguments()
        # Whether ``tools`` reach the model, and how (see ``proxy.chat.tool_listing``).
        self.tool_handling = decide(self._renders_tools(), self.parser.name)
        self._listing = (
            listing_for(self.parser.name) if self.tool_handling is ToolHandling.LISTED else None
        )

    @classmethod
    def from_directory(cls, path: str | Path, *, tool_parser: str | None = None) -> ChatRenderer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        return cls(tokenizer, tool_parser=tool_parser)

    # ------------------------------------------------------------------ setup

    def _find_stop_ids(self) -> tuple[int, ...]:
        ids: list[int] = []
        eos = self.tokenizer.eos_token_id
        if isinstance(eos, int):
            ids.append(eos)
        config_path = Path(getattr(self.tokenizer, "name_or_path", "")) / "generation_config.json"
        if config_path.is_file():
            value = json.loads(config_path.read_text()).get("eos_token_id")
            for item in value if isinstance(value, list) else [value]:
                if isinstance(item, int) and item not in ids:
                    ids.append(item)
        if not ids:
            raise TemplateError("the tokenizer declares no end-of-sequence token")
        return tuple(ids)

    def _wants_string_arguments(self) -> bool:
        def call(arguments: Any) -> list[dict[str, Any]]:
            function = {"name": "probe", "arguments": arguments}
            return [
                _PROBE_USER,
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [{**_PROBE_CALL, "function": function}],
                },
            ]

        try:
            self._apply(call({"a": 1}), add_generation_prompt=False)
        except TemplateError:
            try:
                self._apply(call('{"a": 1}'), add_generation_prompt=False)
            except TemplateError:
                return False
            return True
        return False

    def _renders_tools(self) -> bool:
        """Whether the template writes ``tools`` into the prompt: a conversation rendered
        with a tool and without must differ, with a system message and without one."""
        tools = [_PROBE_TOOL.template_dict()]
        for messages in ([_PROBE_USER], [_PROBE_SYSTEM, _PROBE_USER]):
            try:
                with_tools = self._apply(messages, tools=tools, add_generation_prompt=True)
            except TemplateError:
                return False
            if with_tools == self._apply(messages, add_generation_prompt=True):
                return False
        return True

    # ------------------------------------------------------------------ rendering

    def _apply(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool,
        variables: Mapping[str, Any] | None = None,
    ) -> str:
        """The template's text; ``variables`` are extra template variables (a session's
        ``chat_template_kwargs``)."""
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tools=tools or None,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **(variables or {}),
            )
        except Exception as exc:  # jinja raises anything the template's author raised
            raise TemplateError(f"chat template rejected the messages: {exc}") from None
        if not isinstance(text, str):
            raise TemplateError("chat template did not produce text")
        return text

    def encode(self, text: str) -> list[int]:
        if self._backend is not None:
            # The batch call without offset tracking: the same ids, about 20% faster.
            (encoding,) = self._backend.encode_batch_fast([text], add_special_tokens=False)
            fast: list[int] = encoding.ids
            return fast
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=False)
        return ids

    def _dict(self, message: ChatMessage) -> dict[str, Any]:
        out = message.template_dict(string_arguments=self.string_arguments)
        if self.harmony and message.tool_calls and message.content and message.reasoning:
            # gpt-oss's template has one analysis message before a call and refuses both
            # fields: the reasoning is what the model wrote there, the content (a preamble
            # on the commentary channel) has no place in its history.
            out["content"] = ""
        return out

    def render_conversation(
        self,
        messages: Sequence[ChatMessage],
        tools: Sequence[Tool],
        variables: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """A full rendering, with the generation prompt (a new branch's prompt)."""
        return self.encode(self.render_text(messages, tools, variables))

    def render_text(
        self,
        messages: Sequence[ChatMessage],
        tools: Sequence[Tool],
        variables: Mapping[str, Any] | None = None,
    ) -> str:
        """The text of a full rendering, with the generation prompt. Tools go to the template, or into the system
        prompt as the family lists them; a request with tools that can reach the model
        neither way is refused (ToolsUnsupportedError)."""
        dicts = [self._dict(m) for m in messages]
        template_tools = [t.template_dict() for t in tools]
        if tools and self.tool_handling is not ToolHandling.RENDERED:
            if self._listing is None:
                raise ToolsUnsupportedError(
                    "this model's chat template does not render tools and no tool listing "
                    f"is known for its tool-call format ({self.parser.name}); the worker "
                    "can bring a tool-aware template (rollout-relay worker --chat-template "
                    "FILE)"
                )
            dicts = with_listing(dicts, self._listing(tools))
            template_tools = []
        return self._apply(
            dicts, tools=template_tools, add_generation_prompt=True, variables=variables
        )

    def render_continuation(
        self,
        returned: ChatMessage,
        completion_ids: Sequence[int],
        messages: Sequence[ChatMessage],
        variables: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """The ids that follow a sampled completion when ``messages`` are appended after
        the assistant message it ``returned``: the rest of the template's close, the new
        messages and the generation prompt. Raises NotPrefixStableError when the template
        cannot be cut this way."""
        split = self._split(returned, messages, variables, in_arguments=False)
        if split is None and returned.tool_calls:
            split = self._split(returned, messages, variables, in_arguments=True)
        if split is None:
            raise NotPrefixStableError("the template does not render the returned message")
        last = completion_ids[-1] if completion_ids else None
        final = self._stop_texts.get(last) if last is not None else None
        return self.encode(text_after_completion(split, final))

    def _split(
        self,
        returned: ChatMessage,
        messages: Sequence[ChatMessage],
        variables: Mapping[str, Any] | None,
        *,
        in_arguments: bool,
    ) -> Split | None:
        """Render the anchor alone and followed by ``messages``; None when the template
        does not show the sentinel where it was put."""
        anchor = self._dict(returned)
        anchor.pop("reasoning_content", None)
        anchor.pop("thinking", None)
        if in_arguments:
            calls = [dict(c) for c in anchor["tool_calls"]]
            arguments = {"anchor": SENTINEL}
            calls[-1]["function"] = {
                **calls[-1]["function"],
                "arguments": json.dumps(arguments) if self.string_arguments else arguments,
            }
            anchor["tool_calls"] = calls
        else:
            anchor["content"] = SENTINEL
        head = [_PROBE_USER, anchor]
        alone = self._alone(head, variables)
        if SENTINEL not in alone:
            return None
        followed = self._apply(
            [*head, *(self._dict(m) for m in messages)],
            add_generation_prompt=True,
            variables=variables,
        )
        return split_after_anchor(alone, followed, self._specials)

    def _alone(self, head: list[dict[str, Any]], variables: Mapping[str, Any] | None) -> str:
        """The probe and the anchor rendered alone. It depends on nothing but them, the
        variables and the template (only what follows the anchor's content is used), so it
        is rendered once per distinct anchor: every plain reply of an agent has the same
        one."""
        try:
            key = (
                str(self.tokenizer.chat_template),
                msgspec.json.encode([head[1], variables], order="sorted"),
            )
        except (TypeError, msgspec.EncodeError):
            return self._apply(head, add_generation_prompt=False, variables=variables)
        alone = self._anchors.get(key)
        if alone is None:
            alone = self._apply(head, add_generation_prompt=False, variables=variables)
            self._anchors[key] = alone
            if len(self._anchors) > _ANCHORS_KEPT:
                self._anchors.popitem(last=False)
        else:
            self._anchors.move_to_end(key)
        return alone

    # ------------------------------------------------------------------ decoding

    def completion_text(self, completion_ids: Sequence[int]) -> str:
        """The text the agent receives: the sampled tokens minus a final stop token."""
        ids = list(completion_ids)
        if ids and ids[-1] in self.stop_token_ids:
            ids.pop()
        text: str = self.tokenizer.decode(ids, skip_special_tokens=False)
        return text

    def opens_reasoning(self, prompt_ids: Sequence[int]) -> bool:
        """Whether the prompt's generation prompt leaves a think block open (the reply
        then starts inside its reasoning)."""
        if not self.reasons:
            return False
        tail: str = self.tokenizer.decode(list(prompt_ids[-8:]), skip_special_tokens=False)
        return reasoning.opens_reasoning(tail)

    def parse(self, text: str, tools: Sequence[Tool]) -> ParsedOutput:
        schema = [t.template_dict() for t in tools] if tools else None
        return self.parser.parse(text, schema)
