"""The prompt check every backend runs before generating."""

from __future__ import annotations

import pytest

from worker_client.engine import LogprobsMode, ModelCard, check_prompt
from worker_client.exceptions import EngineError, PromptTooLongError

CARD = ModelCard("m", 8, LogprobsMode.RAW, "hf")


def test_room_left_in_the_window() -> None:
    assert check_prompt(CARD, [1, 2, 3]) == 5
    assert check_prompt(CARD, list(range(7))) == 1


def test_empty_and_too_long_prompts_are_refused() -> None:
    with pytest.raises(EngineError, match="empty"):
        check_prompt(CARD, [])
    with pytest.raises(PromptTooLongError, match="8 tokens does not fit the 8-token window"):
        check_prompt(CARD, list(range(8)))
