"""Templates that drop tools, end to end with worker processes: a tool-aware template given
to ``rollout-relay worker --chat-template FILE`` renders the agent's tools, and a model
whose template drops them with no known listing refuses requests with tools in each API's
error format, recording nothing. Tools never silently disappear."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from openai import AsyncOpenAI
from transformers import AutoTokenizer

from proxy.config import ProxyConfig
from rollout_relay.embedded import RunningProxy, start_proxy
from sdk.client import ProxyClient
from tests.e2e.conftest import TIMEOUT_FACTOR, wait_until_joined, worker_command
from tests.families import family_model, tool_aware_deepseek_v31

pytestmark = pytest.mark.e2e

TOOL_TEMPLATE = "deepseek-tool-template"  # DeepSeek-V3.1 with a tool-aware template
PLAIN = "plain"  # the tiny model with a template that ignores tools, in no known format
# ChatML without tools and without tool-call markup: no listing is known for it.
PLAIN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOL = {
    "name": "bash",
    "description": "Run a command",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
}


@pytest.fixture(scope="module")
async def templated(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[RunningProxy]:
    folder = tmp_path_factory.mktemp("templates")
    (folder / "tools.jinja").write_text(tool_aware_deepseek_v31())
    (folder / "plain.jinja").write_text(PLAIN_TEMPLATE)
    running = await start_proxy(
        ProxyConfig(
            port=0,
            max_tokens=8,
            worker_wait_seconds=30 * TIMEOUT_FACTOR,
            cache_dir=folder / "cache",
        )
    )
    env = os.environ | {"RELAY_WORKER_TOKEN": ""}
    workers: list[asyncio.subprocess.Process] = []
    try:
        for name, model, template in [
            (TOOL_TEMPLATE, family_model("deepseek_v31"), folder / "tools.jinja"),
            (PLAIN, tiny_model_dir, folder / "plain.jinja"),
        ]:
            options = ["--name", name, "--worker-id", f"w-{name}", "--chat-template"]
            workers.append(
                await asyncio.create_subprocess_exec(
                    *worker_command(running.worker_url, model, *options, str(template)), env=env
                )
            )
        for process, name in zip(workers, [TOOL_TEMPLATE, PLAIN], strict=True):
            await wait_until_joined(running, process, f"w-{name}")
        yield running
    finally:
        for process in workers:
            process.terminate()
            await process.wait()
        await running.stop()


async def test_a_template_given_to_the_worker_renders_the_agents_tools(
    templated: RunningProxy,
) -> None:
    """``--chat-template FILE`` replaces DeepSeek-V3.1's template: the join check finds
    that it renders tools (``/v1/models``), and the recorded prompt holds the tools as that
    template writes them, not the proxy's own listing; the plain template is reported as
    refusing tools."""
    async with ProxyClient(templated.url) as proxy:
        trial = await proxy.create_session(model=TOOL_TEMPLATE)
        async with AsyncOpenAI(
            base_url=trial.base_url, api_key=trial.api_key, max_retries=0
        ) as client:
            models = await client.models.list()
            await client.chat.completions.create(
                model=TOOL_TEMPLATE,
                messages=[{"role": "user", "content": "List the files."}],
                tools=[{"type": "function", "function": TOOL}],  # type: ignore[list-item]
                max_tokens=4,
            )
        export = await proxy.trajectories(trial.trial_id)
    tools = {m.id: (m.model_extra or {})["tools"]["result"] for m in models.data}
    assert tools == {TOOL_TEMPLATE: "rendered", PLAIN: "refused"}
    (trajectory,) = export["trajectories"]
    tokenizer = AutoTokenizer.from_pretrained(str(family_model("deepseek_v31")))
    prompt = tokenizer.decode(trajectory["prompt_ids"])
    assert "Tools you may call:\n- bash: Run a command" in prompt
    assert "## Tools" not in prompt


def _request(api: str, trial: Any, tools: bool) -> tuple[str, dict[str, Any]]:
    user = {"role": "user", "content": "List the files."}
    if api == "anthropic":
        body: dict[str, Any] = {"model": PLAIN, "max_tokens": 4, "messages": [user]}
        if tools:
            body["tools"] = [
                {"name": TOOL["name"], "description": "Run", "input_schema": TOOL["parameters"]}
            ]
        return f"{trial.anthropic_base_url}/v1/messages", body
    if api == "responses":
        body = {"model": PLAIN, "max_output_tokens": 4, "input": [user]}
        if tools:
            body["tools"] = [{"type": "function", **TOOL}]
        return f"{trial.base_url}/responses", body
    body = {"model": PLAIN, "max_tokens": 4, "messages": [user]}
    if tools:
        body["tools"] = [{"type": "function", "function": TOOL}]
    return f"{trial.base_url}/chat/completions", body


@pytest.mark.parametrize("api", ["chat", "anthropic", "responses"])
async def test_tools_a_template_drops_are_refused_in_the_callers_format(
    templated: RunningProxy, api: str
) -> None:
    """A request with tools for a model whose template drops them, with no listing known
    for its format: a 400 in the API's own error shape (``tools_unsupported`` where the
    shape has a code) that says how to give a tool-aware template; the session records
    nothing. The same request without tools is served."""
    async with ProxyClient(templated.url) as proxy, aiohttp.ClientSession() as http:
        trial = await proxy.create_session(model=PLAIN)
        before = await proxy.get_session(trial.trial_id)
        headers = {"Authorization": f"Bearer {trial.api_key}", "x-api-key": trial.api_key}
        url, body = _request(api, trial, tools=True)
        async with http.post(url, json=body, headers=headers) as response:
            assert response.status == 400
            error = await response.json()
        assert await proxy.get_session(trial.trial_id) == before
        url, body = _request(api, trial, tools=False)
        async with http.post(url, json=body, headers=headers) as response:
            assert response.status == 200, await response.text()
    if api == "anthropic":
        assert error["type"] == "error"
        assert error["error"]["type"] == "invalid_request_error"
    else:
        assert (error["error"]["type"], error["error"]["code"]) == (
            "invalid_request_error",
            "tools_unsupported",
        )
    message = error["error"]["message"]
    assert "does not render tools" in message
    assert "--chat-template FILE" in message
