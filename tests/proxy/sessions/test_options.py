"""Session options: validated once at registration, with errors that name the problem."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.exceptions import BadRequestError
from proxy.sessions.options import CapFinish, HistoryPolicy, SessionOptions, validate_options


def test_defaults_keep_history_and_add_no_variables() -> None:
    assert validate_options(None, None) == SessionOptions(HistoryPolicy.KEEP, {})


def test_valid_options_round_trip_through_their_dict() -> None:
    options = validate_options("template", {"enable_thinking": False, "effort": "high"}, "stop")
    assert options.history is HistoryPolicy.TEMPLATE
    assert options.cap_finish is CapFinish.STOP
    assert options.as_dict() == {
        "history": "template",
        "chat_template_kwargs": {"enable_thinking": False, "effort": "high"},
        "cap_finish": "stop",
        "routed_experts": False,
    }
    assert SessionOptions.from_dict(options.as_dict()) == options
    assert SessionOptions.from_dict({}) == SessionOptions()


@pytest.mark.parametrize(
    ("history", "kwargs", "message"),
    [
        ("forget", None, "history must be one of: keep, template"),
        (3, None, "history must be one of"),
        (None, ["enable_thinking"], "must be an object"),
        (None, {"add_generation_prompt": False}, "may not set ['add_generation_prompt']"),
        (None, {"messages": []}, "may not set ['messages']"),
        (None, {"blob": "x" * 5000}, "over 4096 bytes"),
    ],
)
def test_bad_options_are_refused_with_a_clear_message(
    history: Any, kwargs: Any, message: str
) -> None:
    with pytest.raises(BadRequestError) as info:
        validate_options(history, kwargs)
    assert info.value.code == "invalid_option"
    assert message in str(info.value)


def test_cap_finish_must_be_length_or_stop() -> None:
    assert validate_options(None, None).cap_finish is CapFinish.LENGTH
    with pytest.raises(BadRequestError, match="cap_finish must be one of: length, stop"):
        validate_options(None, None, "end_turn")


def test_routed_experts_is_off_unless_asked_and_must_be_a_boolean() -> None:
    """Routing rows are recorded only for a session that asks (kept with its options);
    anything but true or false is refused."""
    assert validate_options(None, None).routed_experts is False
    asked = validate_options(None, None, None, True)
    assert asked.routed_experts is True
    assert SessionOptions.from_dict(asked.as_dict()) == asked
    with pytest.raises(BadRequestError, match="routed_experts must be true or false"):
        validate_options(None, None, None, "yes")
