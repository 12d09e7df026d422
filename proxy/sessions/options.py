"""Per-session options a trainer sets when it registers a trial.

* ``history``: what later contexts hold of earlier turns.

  - ``"keep"`` (the default): the sampled tokens, reasoning included, verbatim. Every
    turn that extends a recorded context continues it: one trajectory per agent loop,
    each token trained in the context it was sampled in.
  - ``"template"``: each request is rendered in full by the chat template, exactly as a
    server without this proxy would render it. Templates that strip old reasoning
    (Qwen3, GLM, gpt-oss, DeepSeek-R1) then give every turn after a stripped one a context
    that does not start with the earlier turn's: that turn starts its own trajectory
    (``branch_reason: "template_rewrote_history"``); the model saw exactly that context.

* ``chat_template_kwargs``: extra variables for the chat template on every rendering of
  the session (Qwen3's ``{"enable_thinking": false}``, DeepSeek-V3.1's
  ``{"thinking": true}``, gpt-oss's ``{"reasoning_effort": "high"}``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from proxy.exceptions import BadRequestError

# apply_chat_template's own parameters: not template variables.
_RESERVED = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)
_MAX_KWARGS_BYTES = 4096


class HistoryPolicy(Enum):
    KEEP = "keep"
    TEMPLATE = "template"


@dataclass(frozen=True, slots=True)
class SessionOptions:
    history: HistoryPolicy = HistoryPolicy.KEEP
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "history": self.history.value,
            "chat_template_kwargs": dict(self.chat_template_kwargs),
        }

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> SessionOptions:
        """Options as stored (already validated when the session was created)."""
        return cls(
            HistoryPolicy(raw.get("history", HistoryPolicy.KEEP.value)),
            dict(raw.get("chat_template_kwargs") or {}),
        )


def validate_options(history: Any, chat_template_kwargs: Any) -> SessionOptions:
    """The options of a session-creation request; BadRequestError (``invalid_option``)
    names what is wrong."""
    policy = HistoryPolicy.KEEP
    if history is not None:
        try:
            policy = HistoryPolicy(history)
        except ValueError:
            allowed = ", ".join(p.value for p in HistoryPolicy)
            raise BadRequestError(
                f"history must be one of: {allowed}", code="invalid_option"
            ) from None
    kwargs: dict[str, Any] = {}
    if chat_template_kwargs is not None:
        if not isinstance(chat_template_kwargs, dict):
            raise BadRequestError("chat_template_kwargs must be an object", code="invalid_option")
        reserved = sorted(set(chat_template_kwargs) & _RESERVED)
        if reserved:
            raise BadRequestError(
                f"chat_template_kwargs may not set {reserved}: the proxy sets them",
                code="invalid_option",
            )
        if len(json.dumps(chat_template_kwargs)) > _MAX_KWARGS_BYTES:
            raise BadRequestError(
                f"chat_template_kwargs is over {_MAX_KWARGS_BYTES} bytes of JSON",
                code="invalid_option",
            )
        kwargs = dict(chat_template_kwargs)
    return SessionOptions(policy, kwargs)
