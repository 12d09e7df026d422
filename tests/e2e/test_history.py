"""A long conversation through the real proxy, relay, worker and tiny model with the
official ``openai`` client: the session's memory of recent histories changes what a turn
costs, never what is recorded (one trajectory, forks as branches, bad input refused even
when the rest of the history was seen before)."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from openai import AsyncOpenAI

from sdk.client import ProxyClient

pytestmark = pytest.mark.e2e

TURNS = 40


async def _snapshot(client: ProxyClient, trial_id: str) -> tuple[Any, Any]:
    summary = await client.get_session(trial_id)
    summary.pop("updated_at")
    return summary, await client.trajectories(trial_id)


async def _ask(client: AsyncOpenAI, messages: list[dict[str, Any]], seed: int) -> dict[str, Any]:
    """One turn; the reply as the agent appends it to its history."""
    reply = await client.chat.completions.create(
        model="m",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=3,
        seed=seed,
    )
    message: dict[str, Any] = reply.choices[0].message.model_dump(exclude_none=True)
    usage = reply.usage
    assert usage is not None
    message["usage"] = (usage.prompt_tokens, usage.completion_tokens)
    return message


def _sent(message: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in message.items() if k != "usage"}


async def test_a_long_conversation_records_one_trajectory_and_forks_as_branches(
    proxy_client: ProxyClient,
) -> None:
    """40 turns that each append the reply and a user message continue one trajectory;
    an edited earlier message makes a second leaf and leaves the first alone; an invalid
    message in a history otherwise seen is a 400 that changes nothing; the unmodified
    history then continues its last turn."""
    trial = await proxy_client.create_session()
    history: list[dict[str, Any]] = [{"role": "user", "content": "hello there"}]
    usages: list[tuple[int, int]] = []
    async with AsyncOpenAI(base_url=trial.base_url, api_key=trial.api_key, max_retries=0) as ai:
        for turn in range(TURNS):
            reply = await _ask(ai, history, seed=turn)
            usages.append(reply["usage"])
            history.append(_sent(reply))
            for call in reply.get("tool_calls", []):
                history.append({"role": "tool", "tool_call_id": call["id"], "content": "ok"})
            history.append({"role": "user", "content": f"go on with step {turn}"})

        first = await proxy_client.trajectories(trial.trial_id)
        (trajectory,) = first["trajectories"]
        turns = trajectory["turns"]
        assert len(turns) == TURNS
        assert [t["branch_reason"] for t in turns] == ["new_session"] + ["continued"] * (TURNS - 1)
        assert [t["parent"] for t in turns] == [None, *range(TURNS - 1)]
        # Each prompt is exactly the stored ids before it, as the agent was told.
        for t, (prompt, completion) in zip(turns, usages, strict=True):
            assert t["prompt_tokens"] == len(trajectory["prompt_ids"]) + t["response_start"]
            assert (t["prompt_tokens"], t["completion_tokens"]) == (prompt, completion)
        assert len(trajectory["prompt_ids"]) + len(trajectory["response_ids"]) == (
            turns[-1]["prompt_tokens"] + turns[-1]["completion_tokens"]
        )

        # (a) Message 5 edited, the rest resent: a second leaf off an earlier turn.
        edited = [dict(m) for m in history]
        edited[5]["content"] = "an edited message"
        await _ask(ai, [*edited, {"role": "user", "content": "and now?"}], seed=100)
        forked = await proxy_client.trajectories(trial.trial_id)
        assert len(forked["trajectories"]) == 2
        assert forked["trajectories"][0] == trajectory
        branch = forked["trajectories"][1]["turns"]
        assert branch[-1]["turn"] == TURNS
        assert branch[-1]["parent"] in {0, 1, 2}  # a turn before message 5
        assert [t["turn"] for t in branch[:-1]] == [t["turn"] for t in turns[: len(branch) - 1]]

        # (b) Message 7 made invalid in the full history: refused, nothing recorded.
        before = await _snapshot(proxy_client, trial.trial_id)
        bad = [dict(m) for m in history]
        bad[7]["role"] = "bot"
        for _ in range(2):  # and again: the refused history was not remembered
            with pytest.raises(openai.BadRequestError) as refused:
                await _ask(ai, [*bad, {"role": "user", "content": "next"}], seed=101)
            assert refused.value.status_code == 400
            assert refused.value.code == "invalid_request"
            assert "messages.7.role" in refused.value.message
            assert isinstance(refused.value.body, dict)
            assert refused.value.body["type"] == "invalid_request_error"
            assert await _snapshot(proxy_client, trial.trial_id) == before

        # (c) The unmodified history continues the first trajectory's last turn.
        await _ask(ai, [*history, {"role": "user", "content": "next"}], seed=102)
    last = await proxy_client.trajectories(trial.trial_id)
    assert len(last["trajectories"]) == 2
    grown = next(t for t in last["trajectories"] if t["turns"][-1]["turn"] == TURNS + 1)
    assert grown["turns"][-1]["branch_reason"] == "continued"
    assert grown["turns"][-1]["parent"] == TURNS - 1
    assert grown["turns"][:-1] == turns
