"""In-process agents (``sdk.taskserver.inprocess``) for the SDK's tests: real chat calls
with the official ``openai`` client to the trial's endpoint."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from openai import AsyncOpenAI

from sdk.client import ProxyClient
from sdk.taskserver.base import RunSpec
from sdk.taskserver.inprocess import InProcessTaskServer

# Per trial, the completion tokens of each call a VersionBumpAgent made (read by tests
# whose agent is built by a factory they do not hold, e.g. through verl's config).
CALL_TOKENS: dict[str, list[int]] = {}


def trial_of(spec: RunSpec) -> str:
    return spec.base_url.rstrip("/").split("/")[-2]


async def chat_calls(spec: RunSpec, calls: int, between: Any = None) -> list[int]:
    """``calls`` chained chat calls; ``between()`` is awaited after each but the last.
    Returns each call's completion tokens."""
    client = AsyncOpenAI(base_url=spec.base_url, api_key=spec.api_key, max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"Work on {spec.task}."}]
    tokens: list[int] = []
    try:
        for call in range(calls):
            response = await client.chat.completions.create(
                model="tiny",
                messages=messages,  # type: ignore[arg-type]
                max_tokens=8,
            )
            assert response.usage is not None
            tokens.append(response.usage.completion_tokens)
            messages.append({"role": "assistant", "content": response.choices[0].message.content})
            messages.append({"role": "user", "content": "Go on."})
            if between is not None and call < calls - 1:
                await between()
    finally:
        await client.close()
    return tokens


async def one_call(spec: RunSpec) -> Mapping[str, float]:
    """One chat call, reward 1."""
    await chat_calls(spec, 1)
    return {"reward": 1.0}


def one_call_server() -> InProcessTaskServer:
    return InProcessTaskServer(one_call)


@dataclass(slots=True)
class VersionBumpAgent:
    """Two chat calls with a weight update to ``to_version`` (the checkpoint in
    ``model_dir``) between them: the first call's tokens are then that many versions old."""

    proxy_url: str
    admin_token: str | None
    to_version: int
    model_dir: str
    calls: dict[str, list[int]] = field(default_factory=dict)

    async def __call__(self, spec: RunSpec) -> Mapping[str, float]:
        async def bump() -> None:
            async with ProxyClient(self.proxy_url, admin_token=self.admin_token) as proxy:
                await proxy.update_weights(self.to_version, path=self.model_dir)

        tokens = await chat_calls(spec, 2, bump)
        self.calls[trial_of(spec)] = tokens
        CALL_TOKENS[trial_of(spec)] = tokens
        return {"reward": 1.0}


def version_bump_server(
    proxy_url: str, to_version: int, model_dir: str, admin_token: str | None = None
) -> InProcessTaskServer:
    return InProcessTaskServer(VersionBumpAgent(proxy_url, admin_token, to_version, model_dir))
