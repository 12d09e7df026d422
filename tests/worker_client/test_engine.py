"""The prompt check every backend runs before generating, and the prompt as a list for
engines that take one."""

from __future__ import annotations

from array import array

import pytest

from worker_client.engine import LogprobsMode, ModelCard, check_prompt, id_list
from worker_client.exceptions import EngineError, PromptTooLongError

CARD = ModelCard("m", 8, LogprobsMode.RAW, "hf")


def test_room_left_in_the_window() -> None:
    """check_prompt returns how many tokens fit after the prompt."""
    assert check_prompt(CARD, [1, 2, 3]) == 5
    assert check_prompt(CARD, list(range(7))) == 1


def test_empty_and_too_long_prompts_are_refused() -> None:
    """An empty prompt, or one that leaves no room in the window, is refused."""
    with pytest.raises(EngineError, match="empty"):
        check_prompt(CARD, [])
    with pytest.raises(PromptTooLongError, match="8 tokens does not fit the 8-token window"):
        check_prompt(CARD, list(range(8)))


def test_id_list_of_an_array_and_of_a_list() -> None:
    """id_list gives a list of Python ints for the relay's int32 array, a list, a range,
    and a new list each time (changing it changes nothing the caller holds)."""
    ids = array("i", [5, 0, 2**31 - 1, -1])
    out = id_list(ids)
    assert out == [5, 0, 2**31 - 1, -1]
    assert type(out) is list
    assert all(type(i) is int for i in out)
    plain = [3, 4]
    copied = id_list(plain)
    assert copied == plain
    assert copied is not plain
    copied.append(9)
    out.append(9)
    assert plain == [3, 4]
    assert len(ids) == 4
    assert id_list(range(3)) == [0, 1, 2]
    assert id_list(array("i")) == []
