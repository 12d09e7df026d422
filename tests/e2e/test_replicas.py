"""Two proxy replicas and two workers on loopback: sessions owned by trial id, served
whichever replica is asked, a worker that joins late serving both, and a replica killed
-9 and restarted without losing an acknowledged turn while the other keeps serving."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.appkeys import POOL
from proxy.cluster import FORWARDED_BY
from proxy.config import ProxyConfig
from relay.cluster import owner
from rollout_relay.embedded import start_proxy
from sdk.client import ProxyClient, TrialSession
from tests.e2e.conftest import TIMEOUT_FACTOR
from tests.e2e.test_processes import _free_port, _status, _wait_until
from worker_client.backends.hf import HFEngine
from worker_client.client import ServedModel
from worker_client.fleet import WorkerFleet

pytestmark = pytest.mark.e2e

MESSAGES = [{"role": "user", "content": "Say something."}]


class Replica:
    """``rollout-relay proxy`` as a real process on its own data directory."""

    def __init__(self, port: int, peers: list[str], data_dir: Path, cache_dir: Path) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.worker_url = f"ws://127.0.0.1:{port}/ws/worker"
        self.args = [
            sys.executable,
            "-m",
            "rollout_relay.cli",
            "--log-level",
            "WARNING",
            "proxy",
            "--no-auth",
            "--port",
            str(port),
            "--public-url",
            self.url,
            "--peers",
            ",".join(peers),
            "--data-dir",
            str(data_dir),
            "--cache-dir",
            str(cache_dir),
            "--max-tokens",
            "8",
        ]
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            self.args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        process = self.process

        def up() -> bool:
            if process.poll() is not None:
                raise RuntimeError(f"the replica exited with {process.returncode}")
            return _status(f"{self.url}/healthz") == 200

        _wait_until(up, 60 * TIMEOUT_FACTOR)

    def kill(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(timeout=60)


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Replica, Replica]]:
    ports = [_free_port(), _free_port()]
    peers = [f"http://127.0.0.1:{p}" for p in ports]
    made = tuple(
        Replica(
            port,
            peers,
            tmp_path_factory.mktemp(f"replica-{i}"),
            tmp_path_factory.mktemp(f"replica-cache-{i}"),
        )
        for i, port in enumerate(ports)
    )
    a, b = made
    try:
        a.start()
        b.start()
        yield a, b
    finally:
        a.stop()
        b.stop()


@pytest.fixture(scope="module")
async def first_worker(
    replicas: tuple[Replica, Replica], tiny_model_dir: Path
) -> AsyncIterator[WorkerFleet]:
    fleet = _fleet([r.worker_url for r in replicas], tiny_model_dir, "first")
    task = asyncio.get_running_loop().create_task(fleet.run())
    for replica in replicas:
        await _until_workers(replica, 1)
    yield fleet
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def _fleet(urls: list[str], model: Path, worker_id: str, **kwargs: Any) -> WorkerFleet:
    engine = HFEngine.load(model)
    return WorkerFleet(
        urls,
        {engine.card.name: ServedModel(engine, model)},
        worker_id=worker_id,
        resolve_seconds=0.5,
        **kwargs,
    )


async def _until_workers(replica: Replica, count: int) -> None:
    async with aiohttp.ClientSession() as http:
        for _ in range(int(600 * TIMEOUT_FACTOR)):
            try:
                async with http.get(f"{replica.url}/readyz") as response:
                    if (await response.json())["workers"] >= count:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise AssertionError(f"{replica.url} never had {count} workers")


async def _chat(
    http: aiohttp.ClientSession, url: str, trial: TrialSession, messages: list[dict[str, Any]]
) -> tuple[int, dict[str, Any]]:
    body = {"model": "m", "messages": messages, "max_tokens": 6, "seed": 2}
    headers = {"Authorization": f"Bearer {trial.api_key}"}
    async with http.post(f"{url}/chat/completions", json=body, headers=headers) as response:
        return response.status, await response.json()


async def _episode(http: aiohttp.ClientSession, trial: TrialSession, via: str) -> None:
    """Two turns, the second continuing the first, sent to ``via``/<trial>/v1."""
    url = f"{via}/{trial.trial_id}/v1"
    status, body = await _chat(http, url, trial, MESSAGES)
    assert status == 200, body
    reply = body["choices"][0]["message"]
    follow = [*MESSAGES, {"role": "assistant", "content": reply["content"] or ""}]
    status, body = await _chat(http, url, trial, [*follow, {"role": "user", "content": "Go on."}])
    assert status == 200, body


async def test_two_replicas_serve_one_workload(
    replicas: tuple[Replica, Replica], first_worker: WorkerFleet, tiny_model_dir: Path
) -> None:
    a, b = replicas
    peers = [a.url, b.url]
    async with ProxyClient(a.url) as via_a, ProxyClient(b.url) as via_b:
        # Registered on each replica: ids it picks are its own; a named trial goes to its
        # owner, whichever replica the client was pointed at.
        trials = [await via_a.create_session() for _ in range(3)]
        trials += [await via_b.create_session() for _ in range(3)]
        trials += [await via_a.create_session(f"named-{i}") for i in range(6)]
        owners = {t.trial_id: owner(t.trial_id, peers) for t in trials}
        assert set(owners.values()) == {a.url, b.url}
        for t in trials:
            assert t.base_url == f"{owners[t.trial_id]}/{t.trial_id}/v1"
        assert all(owners[t.trial_id] == a.url for t in trials[:3])
        assert all(owners[t.trial_id] == b.url for t in trials[3:6])

        async with aiohttp.ClientSession() as http:
            # Agents at their owner, and at the other replica (forwarded), alike.
            for t in trials:
                other = b.url if owners[t.trial_id] == a.url else a.url
                await _episode(http, t, owners[t.trial_id] if t in trials[::2] else other)

            # A streamed turn through the wrong replica streams through.
            t = trials[0]
            body = {"model": "m", "messages": MESSAGES, "max_tokens": 4, "stream": True}
            headers = {"Authorization": f"Bearer {t.api_key}"}
            async with http.post(
                f"{b.url}/{t.trial_id}/v1/chat/completions", json=body, headers=headers
            ) as response:
                assert response.status == 200
                assert response.headers["Content-Type"].startswith("text/event-stream")
                events = [line async for line in response.content if line.startswith(b"data:")]
            assert events[-1].strip() == b"data: [DONE]"

        # Every trajectory reads the same whichever replica is asked.
        for t in trials:
            from_a = await via_a.trajectories(t.trial_id)
            from_b = await via_b.trajectories(t.trial_id)
            assert from_a == from_b
            (trajectory,) = [traj for traj in from_a["trajectories"] if len(traj["turns"]) == 2]
            assert [x["branch_reason"] for x in trajectory["turns"]] == [
                "new_session",
                "continued",
            ]

        # A worker that joins late serves both replicas, and so does each engine's limit.
        late = _fleet([a.worker_url, b.worker_url], tiny_model_dir, "late")
        task = asyncio.get_running_loop().create_task(late.run())
        try:
            await _until_workers(a, 2)
            await _until_workers(b, 2)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def test_a_replica_killed_and_restarted_loses_nothing(
    replicas: tuple[Replica, Replica], first_worker: WorkerFleet
) -> None:
    a, b = replicas
    async with ProxyClient(a.url) as client, aiohttp.ClientSession() as http:
        on_a = await client.create_session()
        on_b = await client.create_session(_an_id_owned_by(b.url, [a.url, b.url]))
        await _episode(http, on_a, a.url)
        await _episode(http, on_b, b.url)
        before = await client.trajectories(on_b.trial_id)
        # A reply's delivery is recorded after the reply, so it may still be queued for
        # b's disk. b writes in order, and a registration is answered once written: when
        # this one is, the delivery is too (a kill before it may lose that mark only).
        await client.create_session(_an_id_owned_by(b.url, [a.url, b.url], prefix="sync"))

        b.kill()
        # The other replica keeps serving its own; the dead one's trials wait for it.
        await _episode(http, on_a, a.url)
        status, body = await _chat(http, f"{a.url}/{on_b.trial_id}/v1", on_b, MESSAGES)
        assert status == 503
        assert body["error"]["code"] == "owner_unavailable"
        async with http.get(f"{a.url}/sessions/{on_b.trial_id}") as response:
            assert response.status == 503
            assert int(response.headers["Retry-After"]) > 0
        # A list of every replica's sessions cannot be whole without it: refused, not cut.
        for listing in ("/sessions", "/ui/api/sessions"):
            async with http.get(f"{a.url}{listing}") as response:
                assert response.status == 503, listing
                assert (await response.json())["error"]["code"] == "replica_unavailable"
                assert int(response.headers["Retry-After"]) > 0

        b.start()  # same port, same data directory
        assert await client.trajectories(on_b.trial_id) == before
        listed = await client.list_sessions(limit=1000)
        assert {on_a.trial_id, on_b.trial_id} <= {s["trial_id"] for s in listed["sessions"]}
        await _until_workers(b, 1)  # the worker found it again by itself
        await _episode(http, on_b, a.url)
        after = await client.trajectories(on_b.trial_id)
        turns = sorted(
            {t["turn"]: t for traj in after["trajectories"] for t in traj["turns"]}.values(),
            key=lambda t: t["turn"],
        )
        assert len(turns) == 4
        assert [t["branch_reason"] for t in turns] == [
            "new_session",
            "continued",
            "new_branch",
            "continued",
        ]


async def test_any_replica_lists_every_replicas_sessions(
    replicas: tuple[Replica, Replica],
) -> None:
    """``GET /sessions`` and the viewer's list, asked of either replica, hold the sessions
    of both: paged in creation order, each once, a cursor on either replica."""
    a, b = replicas
    peers = [a.url, b.url]
    async with ProxyClient(a.url) as client, aiohttp.ClientSession() as http:
        made = [
            (await client.create_session(_an_id_owned_by(url, peers, f"listed{n}"))).trial_id
            for n, url in enumerate([a.url, b.url, b.url, a.url, b.url])
        ]
        own: dict[str, list[dict[str, Any]]] = {}
        for replica in replicas:  # what each holds itself, asked as a replica asks
            async with http.get(
                f"{replica.url}/sessions?limit=1000", headers={FORWARDED_BY: "a test"}
            ) as response:
                own[replica.url] = (await response.json())["sessions"]
        assert {s["trial_id"] for s in own[b.url]} >= set(made[1:3])
        assert not {s["trial_id"] for s in own[a.url]} & {s["trial_id"] for s in own[b.url]}
        everything = sorted(own[a.url] + own[b.url], key=lambda s: (s["created_at"], s["trial_id"]))

        for replica in replicas:
            seen: list[dict[str, Any]] = []
            after: str | None = None
            while True:
                async with ProxyClient(replica.url) as lister:
                    page = await lister.list_sessions(limit=2, after=after)
                assert len(page["sessions"]) <= 2
                seen += page["sessions"]
                after = page["next"]
                if after is None:
                    break
            assert [s["trial_id"] for s in seen] == [s["trial_id"] for s in everything]
            for session in seen:  # each names its owner, wherever it was listed
                assert session["base_url"].startswith(owner(session["trial_id"], peers))

            async with http.get(f"{replica.url}/ui/api/sessions") as response:
                rows = (await response.json())["sessions"]
            assert [r["trial_id"] for r in rows] == [s["trial_id"] for s in everything[::-1]]

        async with http.get(f"{a.url}/sessions?after=nobody-registered-this") as response:
            assert response.status == 400
            assert (await response.json())["error"]["code"] == "invalid_cursor"


def _an_id_owned_by(url: str, peers: list[str], prefix: str = "trial") -> str:
    return next(f"{prefix}-{i}" for i in range(1000) if owner(f"{prefix}-{i}", peers) == url)


async def test_a_forwarded_request_at_a_replica_that_does_not_own_it_is_421(
    replicas: tuple[Replica, Replica], first_worker: WorkerFleet
) -> None:
    """Replicas with different lists would forward in circles: the second hop refuses."""
    a, b = replicas
    trial_id = _an_id_owned_by(b.url, [a.url, b.url])
    async with (
        aiohttp.ClientSession() as http,
        http.get(
            f"{a.url}/sessions/{trial_id}", headers={FORWARDED_BY: "http://127.0.0.1:1"}
        ) as response,
    ):
        assert response.status == 421
        assert (await response.json())["error"]["code"] == "replica_lists_differ"


@pytest.mark.parametrize(
    ("peers", "public_url", "message"),
    [
        ("http://127.0.0.1:1,http://127.0.0.1:2", "http://127.0.0.1:3", "must include this"),
        ("http://127.0.0.1:1,http://127.0.0.1:1/", "http://127.0.0.1:1", "names a replica twice"),
        ("http://127.0.0.1:1", None, "--peers needs --public-url"),
        ("ftp://x", "ftp://x", "is not an http(s) URL"),
    ],
)
def test_bad_replica_lists_are_refused_at_startup(
    peers: str, public_url: str | None, message: str
) -> None:
    args = [sys.executable, "-m", "rollout_relay.cli", "proxy", "--no-auth", "--port", "0"]
    args += ["--peers", peers] + (["--public-url", public_url] if public_url else [])
    done = subprocess.run(args, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr


async def test_a_worker_follows_a_name_that_resolves_to_every_replica(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A --proxy name with several addresses (a headless Service) is one connection per
    address, resolved again: a replica that leaves the name is left."""
    port = _free_port()
    started = []
    for host in ("127.0.0.1", "127.0.0.2"):
        started.append(
            await start_proxy(
                ProxyConfig(host=host, port=port, cache_dir=tmp_path / host, max_tokens=4)
            )
        )
    addresses = ["127.0.0.1", "127.0.0.2"]

    async def resolver(host: str, _port: int) -> list[str]:
        assert host == "replicas.relay.test"
        return list(addresses)

    fleet = _fleet(
        [f"ws://replicas.relay.test:{port}/ws/worker"], tiny_model_dir, "dns", resolver=resolver
    )
    task = asyncio.get_running_loop().create_task(fleet.run())
    try:
        for running in started:
            await running.wait_for_workers(1, within_seconds=60 * TIMEOUT_FACTOR)
        assert sorted(addr for _, addr in fleet.clients) == addresses
        addresses.pop()  # the second replica goes away from the name
        for _ in range(int(100 * TIMEOUT_FACTOR)):
            if not started[1].app[POOL].workers:
                break
            await asyncio.sleep(0.1)
        assert not started[1].app[POOL].workers
        assert [addr for _, addr in fleet.clients] == ["127.0.0.1"]
        assert started[0].app[POOL].workers
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        for running in started:
            await running.stop()


async def test_an_unknown_trial_is_404_from_its_owner_whichever_replica_is_asked(
    replicas: tuple[Replica, Replica], first_worker: WorkerFleet
) -> None:
    """Every id has an owner (the hash always picks one); one nobody registered is a 404
    in the caller's format from that owner, asked directly or through the other."""
    a, b = replicas
    trial_id = _an_id_owned_by(b.url, [a.url, b.url], prefix="nobody")
    async with aiohttp.ClientSession() as http:
        for via in (a.url, b.url):
            async with http.get(f"{via}/sessions/{trial_id}") as response:
                assert response.status == 404
                assert (await response.json())["error"]["code"] == "trial_not_found"
            body = {"model": "m", "messages": MESSAGES}
            async with http.post(f"{via}/{trial_id}/v1/messages", json=body) as response:
                assert response.status == 404
                assert (await response.json())["type"] == "error"  # Anthropic's shape


async def test_the_sdk_falls_back_to_its_replica_when_an_owner_is_out_of_reach(
    replicas: tuple[Replica, Replica], first_worker: WorkerFleet
) -> None:
    """From outside a cluster (a port-forward to one replica) the replicas' own URLs do
    not resolve: the SDK then sends a trial's calls through the replica it was given,
    which forwards them to the owner."""
    a, b = replicas
    async with ProxyClient(a.url) as client:
        # What a client outside the cluster sees: an owner it cannot connect to.
        client._peers = ("http://127.0.0.1:9", a.url)
        trial_id = next(
            f"outside-{i}"
            for i in range(1000)
            if owner(f"outside-{i}", list(client._peers)) == "http://127.0.0.1:9"
        )
        created = await client.create_session(trial_id)
        assert created.base_url == f"{owner(trial_id, [a.url, b.url])}/{trial_id}/v1"
        assert (await client.get_session(trial_id))["trial_id"] == trial_id
        await client.complete(trial_id, reward=1.0)
        assert (await client.trajectories(trial_id))["reward"] == 1.0


async def _until_version(client: ProxyClient, version: int) -> None:
    """Wait until the replica behind ``client`` reports ``version`` (the worker tells each
    replica on its own connection: the other replica hears it a moment after the answer)."""
    for _ in range(int(100 * TIMEOUT_FACTOR)):
        if (await client.weights())["version"] >= version:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the replica never reported version {version}")


async def test_an_update_through_any_replica_reaches_every_worker(
    replicas: tuple[Replica, Replica],
    first_worker: WorkerFleet,
    tiny_model_dir: Path,
    tmp_path: Path,
) -> None:
    """POST /weights through one replica loads the checkpoint on the worker every replica
    shares; the replica asked reports the new version at once, the other as soon as the
    worker's notice reaches it on its own connection, and its trials' turns are sampled by
    the new weights."""
    from sdk.fidelity import check_fidelity
    from tests.e2e.test_weights import write_checkpoint

    a, b = replicas
    checkpoint = write_checkpoint(tiny_model_dir, tmp_path / "step", seed=5)
    async with ProxyClient(a.url) as via_a, ProxyClient(b.url) as via_b:
        version = (await via_b.weights())["version"] + 1
        report = await via_b.update_weights(version, str(checkpoint))
        assert report["version"] == version
        await _until_version(via_a, version)
        for client in (via_a, via_b):
            seen = await client.weights()
            assert (seen["version"], seen["path"]) == (version, str(checkpoint))
            assert [(w["worker_id"], w["version"]) for w in seen["workers"]] == [("first", version)]
        trial_id = next(
            f"after-{i}" for i in range(1000) if owner(f"after-{i}", [a.url, b.url]) == a.url
        )
        trial = await via_a.create_session(trial_id, sampling={"temperature": 1.0})
        async with aiohttp.ClientSession() as http:
            status, body = await _chat(http, trial.base_url, trial, MESSAGES)
        assert status == 200, body
        export = await via_a.trajectories(trial.trial_id)
    (traj,) = export["trajectories"]
    assert {
        v for v, m in zip(traj["response_versions"], traj["response_mask"], strict=True) if m
    } == {version}
    assert check_fidelity(export, HFEngine.load(checkpoint).score).max_abs_error <= 1e-4
