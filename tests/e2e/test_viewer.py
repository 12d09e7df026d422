"""The trajectory viewer in a real headless Chromium (Debian's ``chromium``, driven by
Playwright): sign in with the admin token, pick a branched session, read its tree of turns
and a trajectory's tokens, and see a new turn appear while the page is open."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from PIL import Image
from playwright.async_api import async_playwright

from proxy.config import ProxyConfig
from rollout_relay.embedded import RunningProxy, start_hf_worker, start_proxy
from sdk.client import ProxyClient, TrialSession
from tests.e2e.conftest import TIMEOUT_FACTOR

pytestmark = pytest.mark.e2e

ADMIN = "viewer-admin-token"
WORKER = "viewer-worker-token"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


@pytest.fixture(scope="module")
async def secured(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[RunningProxy]:
    config = ProxyConfig(
        port=0,
        admin_token=ADMIN,
        worker_token=WORKER,
        max_tokens=12,
        cache_dir=tmp_path_factory.mktemp("viewer-cache"),
    )
    running = await start_proxy(config)
    start_hf_worker(running, tiny_model_dir, token=WORKER, worker_id="viewer-hf")
    await running.wait_for_workers(within_seconds=60 * TIMEOUT_FACTOR)
    yield running
    await running.stop()


async def _chat(
    http: aiohttp.ClientSession, trial: TrialSession, messages: list[dict[str, Any]]
) -> dict[str, Any]:
    body = {"model": "m", "messages": messages, "max_tokens": 8, "seed": 3}
    headers = {"Authorization": f"Bearer {trial.api_key}"}
    async with http.post(f"{trial.base_url}/chat/completions", json=body, headers=headers) as r:
        assert r.status == 200, await r.text()
        message: dict[str, Any] = (await r.json())["choices"][0]["message"]
        return message


async def _branched_session(running: RunningProxy) -> tuple[TrialSession, list[dict[str, Any]]]:
    """Turn 0, turn 1 continuing it, turn 2 forking from turn 0."""
    async with ProxyClient(running.url, admin_token=ADMIN) as admin:
        trial = await admin.create_session()
    first = [{"role": "user", "content": "Say something."}]
    async with aiohttp.ClientSession() as http:
        reply = await _chat(http, trial, first)
        history = [*first, {"role": "assistant", "content": reply["content"] or ""}]
        await _chat(http, trial, [*history, {"role": "user", "content": "More."}])
        await _chat(http, trial, [*history, {"role": "user", "content": "Something else."}])
    return trial, history


def _coloured_pixels(path: Path) -> int:
    """Pixels of clearly saturated colour (the sampled tokens' logprob backgrounds)."""
    with Image.open(path) as image:
        hsv = np.asarray(image.convert("HSV"))
    return int(((hsv[..., 1] > 60) & (hsv[..., 2] > 150)).sum())


@pytest.fixture(scope="module")
def chromium() -> str:
    """Debian's chromium (``scripts/setup.sh`` installs it); Playwright drives it as is."""
    assert Path(CHROMIUM).exists(), "Debian's chromium is needed: scripts/setup.sh installs it"
    return CHROMIUM


async def test_viewer_data_needs_the_admin_door(secured: RunningProxy) -> None:
    """The viewer's data routes answer 401 without the admin token or the sign-in cookie,
    and to a trial's own key; the page itself is the login form until signed in."""
    trial, _ = await _branched_session(secured)
    url = f"{secured.url}/ui/api/sessions/{trial.trial_id}"
    async with aiohttp.ClientSession() as http:
        async with http.get(url) as response:
            assert response.status == 401
            assert (await response.json())["error"]["code"] == "not_signed_in"
        async with http.get(url, headers={"Authorization": f"Bearer {trial.api_key}"}) as r:
            assert r.status == 401
        async with http.get(url, headers={"Authorization": f"Bearer {ADMIN}"}) as r:
            assert r.status == 200
            assert len((await r.json())["turns"]) == 3
        async with http.get(f"{secured.url}/ui/") as response:
            assert response.status == 401
            assert 'action="/ui/login"' in await response.text()
    forged = {"rr_ui": "99999999999.deadbeef"}
    async with aiohttp.ClientSession(cookies=forged) as forging, forging.get(url) as response:
        assert response.status == 401


async def test_a_branched_session_in_headless_chromium(
    secured: RunningProxy, chromium: str, tmp_path: Path
) -> None:
    """Sign in through the form (a wrong token is refused there), open the session, read
    the tree (turn 0 and its two branches) and the newest trajectory's tokens (the count
    of sampled, context and prompt tokens, a logprob on hover, colour on screen), switch
    branch, and see a turn recorded meanwhile appear."""
    trial, history = await _branched_session(secured)
    async with ProxyClient(secured.url, admin_token=ADMIN) as admin:
        export = await admin.trajectories(trial.trial_id)
    async with async_playwright() as p:
        browser = await p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = await browser.new_page(viewport={"width": 1400, "height": 900})
            await page.goto(f"{secured.url}/ui/")
            # A wrong token is refused on the form; the right one signs in.
            await page.fill("input[name=token]", "not-it")
            await page.click("button[type=submit]")
            assert "not the admin token" in await page.inner_text(".error")
            await page.fill("input[name=token]", ADMIN)
            await page.click("button[type=submit]")
            item = page.locator(f"#session-list li[data-trial='{trial.trial_id}']")
            await item.wait_for()
            await item.click()

            # The tree: turn 0 with its two children, each with its branch reason.
            await page.locator(".turn").nth(2).wait_for()
            assert await page.locator(".turn").count() == 3
            assert await page.locator("#tree > ul > li > ul > li").count() == 2
            tree_text = await page.inner_text("#tree")
            assert "new_session" in tree_text
            assert tree_text.count("continued") == 2
            assert "worker viewer-hf" in tree_text

            # The newest trajectory's tokens: its sampled tokens, each with its logprob.
            newest = max(export["trajectories"], key=lambda t: t["turns"][-1]["turn"])
            sampled = page.locator("#tokens .tok.sampled")
            await sampled.first.wait_for()
            assert await sampled.count() == sum(newest["response_mask"])
            assert await page.locator("#tokens .tok.ctx").count() == newest["response_mask"].count(
                0
            )
            title = await sampled.first.get_attribute("title")
            assert title is not None
            assert title.startswith("sampled · id ")
            assert "logprob -" in title
            assert await page.locator("#tokens .tok.prompt").count() == len(newest["prompt_ids"])

            # Picking the other branch shows that trajectory.
            await page.locator(".turn[data-turn='1']").click()
            other = next(t for t in export["trajectories"] if t is not newest)
            await page.wait_for_function(
                f"document.querySelectorAll('#tokens .tok.sampled').length"
                f" === {sum(other['response_mask'])}"
            )

            # What the eye sees: the tree's boxes and the coloured sampled tokens.
            tree_png, tokens_png = tmp_path / "tree.png", tmp_path / "tokens.png"
            await page.locator("#tree").screenshot(path=str(tree_png))
            await page.locator("#tokens").screenshot(path=str(tokens_png))
            await page.screenshot(path=str(tmp_path / "viewer.png"), full_page=True)
            with Image.open(tree_png) as image:
                assert image.width > 300
                assert image.height > 80
            assert _coloured_pixels(tokens_png) > 200

            # Live: a turn recorded while the page is open appears without a reload.
            async with aiohttp.ClientSession() as http:
                await _chat(http, trial, [*history, {"role": "user", "content": "Again."}])
            await page.locator(".turn").nth(3).wait_for(timeout=15_000 * TIMEOUT_FACTOR)
        finally:
            await browser.close()
