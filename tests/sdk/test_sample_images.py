"""Images in samples: each sample carries the images inside its own ids, in order, a cut
never splits one, and the bytes come from the proxy's admin route once per image. The
proxy's two routes are played by a loopback stand-in here (the shape the proxy exports:
``multi_modal_data.images`` with sha256, mime, size and span; ``GET
/sessions/<trial>/images/<sha256>`` with the bytes as sent)."""

from __future__ import annotations

import asyncio
import hashlib
from collections import Counter
from collections.abc import AsyncIterator, Mapping
from typing import Any

import pytest
from aiohttp import web

from sdk.agent_loop import AgentLoopConfig, RemoteAgentLoop
from sdk.client import ProxyClient
from sdk.exceptions import ProxyAuthError, ProxyRequestError, SessionNotFoundError
from sdk.samples import BranchPolicy, OverlongPrompt, SampleImage, build_samples
from sdk.taskserver.base import RunSpec
from sdk.taskserver.inprocess import InProcessTaskServer

PAD = 9  # the image placeholder token
RED, BLUE = b"\x89PNG red", b"\x89PNG blue"  # the proxy serves bytes, whatever they are
TOKEN = "admin-secret"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def entry(data: bytes, start: int, end: int) -> dict[str, Any]:
    return {
        "sha256": sha(data),
        "mime": "image/png",
        "width": 64,
        "height": 48,
        "span": [start, end],
    }


def trajectory() -> dict[str, Any]:
    """A prompt with a red image (ids 2..5), a first reply (2 sampled tokens), then the next
    user turn with a blue image (response ids 4..7: context, mask 0) and a second reply."""
    prompt = [1, 2, PAD, PAD, PAD, PAD, 3]  # image at [2, 6)
    response = [20, 21, 30, 31, PAD, PAD, PAD, PAD, 32, 22, 23]  # blue at [11, 15) overall
    mask = [1, 1, 0, 0, 0, 0, 0, 0, 0, 1, 1]
    return {
        "prompt_ids": prompt,
        "response_ids": response,
        "response_mask": mask,
        "response_logprobs": [-0.5 if m else 0.0 for m in mask],
        "response_versions": [0 if m else -1 for m in mask],
        "turns": [
            {"turn": 0, "parent": None, "response_start": 0, "response_end": 2},
            {"turn": 1, "parent": 0, "response_start": 9, "response_end": 11},
        ],
        "multi_modal_data": {"images": [entry(RED, 2, 6), entry(BLUE, 11, 15)]},
    }


def spans(images: list[SampleImage]) -> list[tuple[str, tuple[int, int]]]:
    return [(i.sha256, i.span) for i in images]


def test_a_sample_carries_its_images_in_order() -> None:
    """Every image of the trajectory, with its span in prompt + response, its type and size;
    the bytes are not in the export."""
    (sample,) = build_samples({"trial_id": "t", "trajectories": [trajectory()]})
    assert spans(sample.images) == [(sha(RED), (2, 6)), (sha(BLUE), (11, 15))]
    ids = sample.prompt_ids + sample.response_ids
    assert all(ids[i] == PAD for image in sample.images for i in range(image.start, image.end))
    assert (sample.images[0].mime, sample.images[0].width, sample.images[0].height) == (
        "image/png",
        64,
        48,
    )
    assert all(i.data is None for i in sample.images)


@pytest.mark.parametrize("data", [None, {}, {"images": []}], ids=["no-key", "empty", "no-images"])
def test_a_trajectory_without_images_gives_a_text_sample(data: Any) -> None:
    traj = trajectory()
    if data is None:
        del traj["multi_modal_data"]
    else:
        traj["multi_modal_data"] = data
    (sample,) = build_samples({"trajectories": [traj]})
    assert sample.images == []


def test_overlapping_spans_are_refused() -> None:
    traj = trajectory()
    traj["multi_modal_data"]["images"][1]["span"] = [5, 9]
    with pytest.raises(ValueError, match="overlap"):
        build_samples({"trajectories": [traj]})


def test_a_response_cut_never_splits_an_image() -> None:
    """``max_response_tokens`` landing inside the blue image cuts the response before it;
    one landing after it keeps it whole."""
    export = {"trajectories": [trajectory()]}
    (inside,) = build_samples(export, max_response_tokens=6)  # would end at overall 13
    assert inside.response_ids == [20, 21, 30, 31]
    assert inside.response_truncated
    assert spans(inside.images) == [(sha(RED), (2, 6))]
    (after,) = build_samples(export, max_response_tokens=9)
    assert spans(after.images) == [(sha(RED), (2, 6)), (sha(BLUE), (11, 15))]
    assert len(after.response_ids) == 9


def test_a_prompt_cut_never_splits_an_image() -> None:
    """A prompt over ``max_prompt_tokens`` kept (``overlong_prompt=mask``) is cut after the
    image the cut would split; the images after the cut keep their place, moved."""
    (sample,) = build_samples(
        {"trajectories": [trajectory()]}, max_prompt_tokens=4, overlong_prompt=OverlongPrompt.MASK
    )
    assert sample.prompt_truncated
    assert sample.prompt_ids == [3]  # cut at 3 would split [2, 6): cut at 6
    assert spans(sample.images) == [(sha(BLUE), (5, 9))]
    ids = sample.prompt_ids + sample.response_ids
    assert ids[5:9] == [PAD] * 4
    assert sum(sample.response_mask) == 0


def test_what_the_agent_never_received_takes_its_images_with_it() -> None:
    """A second turn that never reached the agent is left out, and the image before it
    (part of its prompt) with it."""
    traj = trajectory()
    traj["turns"][1]["delivered"] = False
    (sample,) = build_samples({"trajectories": [traj]})
    assert sample.response_ids == [20, 21]
    assert spans(sample.images) == [(sha(RED), (2, 6))]


class StandIn:
    """The proxy's session routes a sample needs, on loopback: sessions, trajectories,
    images (admin token required), completion, deletion and the weights version."""

    def __init__(self, images: Mapping[str, bytes], export: dict[str, Any]) -> None:
        self.images = dict(images)
        self.export = export
        self.fetched: Counter[str] = Counter()
        self.deleted: list[str] = []
        self.alive = {"trial-1"}
        self.url = ""
        self.gate: asyncio.Event | None = None
        self.arrived = asyncio.Event()  # an image was asked for
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application(middlewares=[self._auth])
        app.router.add_post("/sessions", self._create)
        app.router.add_get("/sessions/{trial}/trajectories", self._trajectories)
        app.router.add_get("/sessions/{trial}/images/{sha}", self._image)
        app.router.add_post("/sessions/{trial}/complete", self._complete)
        app.router.add_delete("/sessions/{trial}", self._delete)
        app.router.add_get("/weights", self._weights)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if request.headers.get("Authorization") != f"Bearer {TOKEN}":
            return web.json_response({"error": {"type": "auth", "message": "no"}}, status=401)
        response: web.StreamResponse = await handler(request)
        return response

    def _known(self, request: web.Request) -> str:
        trial = request.match_info["trial"]
        if trial not in self.alive:
            raise web.HTTPNotFound(
                text='{"error": {"type": "not_found", "message": "no such trial"}}',
                content_type="application/json",
            )
        return trial

    async def _create(self, request: web.Request) -> web.Response:
        self.alive.add("trial-1")
        return web.json_response(
            {"trial_id": "trial-1", "base_url": f"{self.url}/trial-1/v1", "api_key": "k"}
        )

    async def _trajectories(self, request: web.Request) -> web.Response:
        self._known(request)
        return web.json_response(self.export)

    async def _image(self, request: web.Request) -> web.Response:
        self._known(request)
        digest = request.match_info["sha"]
        self.fetched[digest] += 1
        self.arrived.set()
        if self.gate is not None:
            await self.gate.wait()
        if digest not in self.images:
            raise web.HTTPNotFound(
                text='{"error": {"type": "not_found", "message": "no such image"}}',
                content_type="application/json",
            )
        return web.Response(body=self.images[digest], content_type="image/png")

    async def _complete(self, request: web.Request) -> web.Response:
        return web.json_response({"trial_id": self._known(request)})

    async def _delete(self, request: web.Request) -> web.Response:
        self.deleted.append(self._known(request))
        self.alive.discard(self.deleted[-1])
        return web.json_response({})

    async def _weights(self, request: web.Request) -> web.Response:
        return web.json_response({"version": 0, "workers": []})


def export_of(*trajectories: dict[str, Any]) -> dict[str, Any]:
    return {"trial_id": "trial-1", "reward": 1.0, "trajectories": list(trajectories)}


@pytest.fixture
async def stand_in() -> AsyncIterator[StandIn]:
    server = StandIn({sha(RED): RED, sha(BLUE): BLUE}, export_of(trajectory()))
    await server.start()
    yield server
    await server.stop()


async def test_images_are_fetched_once_each(stand_in: StandIn) -> None:
    """Two branches sharing the red image and a second fill: each image crosses the wire
    once, with the admin token; every sample gets the bytes of its own images."""
    second = trajectory()
    second["response_ids"][9] = 24  # another second turn: a branch, the same images
    second["turns"][1]["turn"] = 2
    async with ProxyClient(stand_in.url, admin_token=TOKEN) as client:
        export = await client.trajectories("trial-1")
        samples = build_samples(export_of(*export["trajectories"], second))
        assert len(samples) == 2
        await client.fill_images("trial-1", samples)
        assert [[i.data for i in s.images] for s in samples] == [[RED, BLUE], [RED, BLUE]]
        again = build_samples(export)
        await client.fill_images("trial-1", again)
        assert [i.data for i in again[0].images] == [RED, BLUE]
        assert await client.image("trial-1", sha(BLUE)) == BLUE
    assert stand_in.fetched == {sha(RED): 1, sha(BLUE): 1}


async def test_concurrent_requests_for_one_image_share_one_fetch(stand_in: StandIn) -> None:
    stand_in.gate = asyncio.Event()
    async with ProxyClient(stand_in.url, admin_token=TOKEN) as client:
        waiting = [asyncio.ensure_future(client.image("trial-1", sha(RED))) for _ in range(3)]
        await stand_in.arrived.wait()
        stand_in.gate.set()
        assert await asyncio.gather(*waiting) == [RED] * 3
    assert stand_in.fetched[sha(RED)] == 1


async def test_the_cache_keeps_at_most_its_bytes(stand_in: StandIn) -> None:
    """Past ``image_cache_bytes`` the least recently used image is fetched again."""
    async with ProxyClient(
        stand_in.url, admin_token=TOKEN, image_cache_bytes=len(RED) + 1
    ) as client:
        for digest in (sha(RED), sha(BLUE), sha(RED)):
            await client.image("trial-1", digest)
    assert stand_in.fetched == {sha(RED): 2, sha(BLUE): 1}


async def test_wrong_bytes_missing_images_and_no_token_are_errors(stand_in: StandIn) -> None:
    """Bytes that are not the image named, an image the proxy does not have and a missing
    admin token each raise the SDK's error; nothing wrong is cached."""
    stand_in.images[sha(BLUE)] = RED
    async with ProxyClient(stand_in.url, admin_token=TOKEN) as client:
        with pytest.raises(ProxyRequestError, match="not that image") as info:
            await client.image("trial-1", sha(BLUE))
        assert info.value.code == "image_mismatch"
        stand_in.images[sha(BLUE)] = BLUE
        assert await client.image("trial-1", sha(BLUE)) == BLUE  # asked again, not cached
        with pytest.raises(SessionNotFoundError):
            await client.image("trial-1", "0" * 64)
    async with ProxyClient(stand_in.url, admin_token="wrong") as client:
        with pytest.raises(ProxyAuthError):
            await client.image("trial-1", sha(RED))


async def test_the_agent_loop_fills_the_bytes_before_deleting_the_session(
    stand_in: StandIn,
) -> None:
    """``RemoteAgentLoop.run`` returns samples whose images carry their bytes, fetched
    while the trial still existed."""

    async def agent(spec: RunSpec) -> Mapping[str, float]:
        return {"reward": 1.0}

    async with ProxyClient(stand_in.url, admin_token=TOKEN) as client:
        loop = RemoteAgentLoop(
            client,
            InProcessTaskServer(agent),
            AgentLoopConfig(agent="a", branch_policy=BranchPolicy.LONGEST, max_attempts=1),
        )
        result = await loop.run("task")
    (sample,) = result.samples
    assert [i.data for i in sample.images] == [RED, BLUE]
    assert stand_in.deleted == ["trial-1"]


async def test_trl_refuses_an_episode_with_images(stand_in: StandIn, tmp_path: Any) -> None:
    """TRL's rollout_func cannot carry images to its forward: RelayRollout refuses a
    vision-language episode with a clear error instead of returning ids without pixels;
    a text episode goes through."""
    from types import SimpleNamespace

    from sdk.exceptions import VisionRolloutError
    from sdk.trl import BackgroundLoop, RelayRollout, rollout_output

    async def agent(spec: RunSpec) -> Mapping[str, float]:
        return {"reward": 1.0}

    trainer = SimpleNamespace(
        accelerator=SimpleNamespace(wait_for_everyone=lambda: None, is_main_process=True),
        state=SimpleNamespace(global_step=0),
        tools=None,
        environment_factories=None,
    )
    with BackgroundLoop() as loop:
        client = ProxyClient(stand_in.url, admin_token=TOKEN)
        config = AgentLoopConfig(agent="a", branch_policy=BranchPolicy.LONGEST, max_attempts=1)
        rollout = RelayRollout(
            loop, client, RemoteAgentLoop(client, InProcessTaskServer(agent), config), tmp_path
        )
        try:
            # The rollout blocks its caller (TRL's thread) while the stand-in answers here.
            with pytest.raises(VisionRolloutError, match="cannot pass images"):
                await asyncio.to_thread(rollout, ["task"], trainer)
            text = trajectory()
            del text["multi_modal_data"]
            stand_in.export = export_of(text)
            output = await asyncio.to_thread(rollout, ["task"], trainer)
            assert output["completion_ids"] == [text["response_ids"]]
        finally:  # its sockets closed whatever failed
            await asyncio.wrap_future(loop.submit(client.aclose()))
    (sample,) = build_samples(export_of(trajectory()))
    with pytest.raises(VisionRolloutError):
        rollout_output([sample])
