"""Session options: validated once at registration, with errors that name the problem."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.exceptions import BadRequestError
from proxy.sessions.options import (
    Budget,
    CapFinish,
    HistoryPolicy,
    SessionOptions,
    validate_options,
)


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
        "budget": None,
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


def test_a_budget_round_trips_and_says_what_is_spent() -> None:
    """A budget of turns and tokens is kept with the options and says which is spent."""
    options = validate_options(None, None, budget={"turns": 3, "tokens": 100})
    assert options.budget == Budget(3, 100)
    assert SessionOptions.from_dict(options.as_dict()) == options
    assert options.budget.spent(2, 99) is None
    assert "3 turns" in (options.budget.spent(3, 0) or "")
    assert "100 sampled tokens" in (options.budget.spent(0, 100) or "")
    assert validate_options(None, None, budget={"tokens": 5}).budget == Budget(None, 5)


@pytest.mark.parametrize(
    "budget",
    [[3], {"turns": 0}, {"turns": True}, {"tokens": 1.5}, {"steps": 3}, {"turns": "3"}],
)
def test_a_bad_budget_is_refused(budget: Any) -> None:
    """A budget that is not positive whole turns and tokens is a 400 naming it."""
    with pytest.raises(BadRequestError, match="budget") as raised:
        validate_options(None, None, budget=budget)
    assert raised.value.code == "invalid_option"
