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

* ``cap_finish``: what the agent is told when a reply stops at a cap it did not ask for
  (the session's or the proxy's ``max_tokens``, smaller than the agent's own limit).

  - ``"length"`` (the default): the API's length finish (``length``, ``max_tokens``,
    ``incomplete``), as for the agent's own limit. Claude Code and Codex then fail the run.
  - ``"stop"``: a normal end of turn (``stop`` / ``tool_calls``, ``end_turn``,
    ``completed``); the agent goes on with what it got.

  Either way the turn's record keeps ``finish_reason: "length"`` and ``capped: true``.

* ``routed_experts``: record the experts a mixture-of-experts policy routed every token to
  (rollout routing replay, R3; ``proxy.sessions.routing``), for a model whose workers can
  report them. Off by default: nothing is asked of the engines or recorded.

* ``budget``: the most turns (``turns``: model calls) and sampled tokens (``tokens``) the
  trial may use. A request once either is spent is refused (``budget_exhausted``, in the
  agent's API format) and the trial's outcome becomes ``budget_exhausted``; a reply is
  capped at the tokens left. None (the default): no budget.

* ``chat_template_kwargs``: extra variables for the chat template on every rendering of
  the session (Qwen3's ``{"enable_thinking": false}``, DeepSeek-V3.1's
  ``{"thinking": true}``, gpt-oss's ``{"reasoning_effort": "high"}``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, TypeVar

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


@dataclass(frozen=True, slots=True)
class Budget:
    """What a trial may spend: model calls and sampled tokens (None: no limit)."""

    turns: int | None = None
    tokens: int | None = None

    def as_dict(self) -> dict[str, int | None]:
        return {"turns": self.turns, "tokens": self.tokens}

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Budget:
        return cls(raw.get("turns"), raw.get("tokens"))

    def spent(self, turns: int, tokens: int) -> str | None:
        """What is spent after ``turns`` turns that sampled ``tokens`` tokens (None:
        nothing yet)."""
        if self.turns is not None and turns >= self.turns:
            return f"the trial's budget of {self.turns} turns is spent"
        if self.tokens is not None and tokens >= self.tokens:
            return f"the trial's budget of {self.tokens} sampled tokens is spent"
        return None


class HistoryPolicy(Enum):
    KEEP = "keep"
    TEMPLATE = "template"


class CapFinish(Enum):
    LENGTH = "length"
    STOP = "stop"


@dataclass(frozen=True, slots=True)
class SessionOptions:
    history: HistoryPolicy = HistoryPolicy.KEEP
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    cap_finish: CapFinish = CapFinish.LENGTH
    routed_experts: bool = False
    budget: Budget | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "history": self.history.value,
            "chat_template_kwargs": dict(self.chat_template_kwargs),
            "cap_finish": self.cap_finish.value,
            "routed_experts": self.routed_experts,
            "budget": self.budget.as_dict() if self.budget is not None else None,
        }

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> SessionOptions:
        """Options as stored (already validated when the session was created)."""
        return cls(
            HistoryPolicy(raw.get("history", HistoryPolicy.KEEP.value)),
            dict(raw.get("chat_template_kwargs") or {}),
            CapFinish(raw.get("cap_finish", CapFinish.LENGTH.value)),
            bool(raw.get("routed_experts", False)),
            Budget.from_dict(raw["budget"]) if raw.get("budget") else None,
        )


E = TypeVar("E", HistoryPolicy, CapFinish)


def _choice(kind: type[E], name: str, value: Any, default: E) -> E:
    if value is None:
        return default
    try:
        return kind(value)
    except ValueError:
        allowed = ", ".join(str(p.value) for p in kind)
        raise BadRequestError(f"{name} must be one of: {allowed}", code="invalid_option") from None


def _budget(raw: Any) -> Budget | None:
    if raw is None:
        return None
    if not isinstance(raw, dict) or not set(raw) <= {"turns", "tokens"}:
        raise BadRequestError(
            'budget must be an object with "turns" and/or "tokens"', code="invalid_option"
        )
    for name in ("turns", "tokens"):
        value = raw.get(name)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise BadRequestError(
                f"budget.{name} must be a positive integer", code="invalid_option"
            )
    if raw.get("turns") is None and raw.get("tokens") is None:
        return None
    return Budget(raw.get("turns"), raw.get("tokens"))


def validate_options(
    history: Any,
    chat_template_kwargs: Any,
    cap_finish: Any = None,
    routed_experts: Any = None,
    budget: Any = None,
) -> SessionOptions:
    """The options of a session-creation request; BadRequestError (``invalid_option``)
    names what is wrong."""
    policy = _choice(HistoryPolicy, "history", history, HistoryPolicy.KEEP)
    cap = _choice(CapFinish, "cap_finish", cap_finish, CapFinish.LENGTH)
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
    if routed_experts is not None and not isinstance(routed_experts, bool):
        raise BadRequestError("routed_experts must be true or false", code="invalid_option")
    return SessionOptions(policy, kwargs, cap, bool(routed_experts), _budget(budget))
