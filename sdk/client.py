"""An async client for the proxy's session API.

One ``aiohttp.ClientSession`` is reused for every call (connection pooling); create one
``ProxyClient`` per process and share it. Use it as an async context manager or call
``aclose()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import ssl
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp

from relay.cluster import owner
from sdk.exceptions import (
    ProxyAuthError,
    ProxyConnectionError,
    ProxyRequestError,
    SessionNotFoundError,
)
from sdk.http import HttpClient

if TYPE_CHECKING:
    from sdk.samples import Sample

# How long ``update_weights`` keeps asking by default: the proxy's worst case for one update
# (three phases of its --weights-phase-seconds, 600 s by default: pause, load, commit or
# rollback) and a minute for the answer to travel and a retry to join.
UPDATE_SECONDS = 3 * 600.0 + 60.0
# How long ``score_with_teacher`` keeps asking by default: an hour of teacher forcing.
TEACHER_SECONDS = 3600.0


@contextlib.contextmanager
def _no_answer(method: str, url: str) -> Iterator[None]:
    """aiohttp's errors for a call that got no answer, as ``ProxyConnectionError``:
    ``refused`` when no connection was made at all."""
    try:
        yield
    except aiohttp.ClientConnectorError as exc:
        raise ProxyConnectionError(f"{method} {url}: {exc}", refused=True) from exc
    except (aiohttp.ClientError, TimeoutError) as exc:
        detail = str(exc) or "no answer in time"
        raise ProxyConnectionError(f"{method} {url}: {type(exc).__name__}: {detail}") from exc


_ERRORS: dict[int, type[ProxyRequestError]] = {
    401: ProxyAuthError,
    403: ProxyAuthError,
    404: SessionNotFoundError,
}

# How many bytes of images ``ProxyClient.image`` keeps (by sha256): every turn of an
# episode repeats the screenshots of its history, and the branches of a session share them.
IMAGE_CACHE_BYTES = 64 * 1024 * 1024


@dataclass(slots=True, frozen=True)
class TrialSession:
    """What an agent needs to talk to the proxy for one trial."""

    trial_id: str
    base_url: str  # <proxy>/<trial_id>/v1: give it to the agent as its OpenAI base URL
    api_key: str

    @property
    def anthropic_base_url(self) -> str:
        """For agents that append ``/v1/messages`` themselves (ANTHROPIC_BASE_URL)."""
        return self.base_url.removesuffix("/v1")


class ProxyClient(HttpClient):
    def __init__(
        self,
        proxy_url: str,
        *,
        admin_token: str | None = None,
        timeout_seconds: float = 60.0,
        http: aiohttp.ClientSession | None = None,
        ssl_context: ssl.SSLContext | None = None,
        image_cache_bytes: int = IMAGE_CACHE_BYTES,
    ) -> None:
        self.proxy_url = proxy_url.rstrip("/")
        # The proxy's admin token; RELAY_ADMIN_TOKEN (the proxy's own variable) by default.
        token = admin_token if admin_token is not None else os.environ.get("RELAY_ADMIN_TOKEN")
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._timeout = aiohttp.ClientTimeout(total=timeout_seconds)
        super().__init__(http)
        # https only: verify the proxy against this context (e.g. a private CA).
        self._ssl: ssl.SSLContext | bool = ssl_context if ssl_context is not None else True
        # The proxy replicas' public URLs (GET /cluster); None: not asked yet.
        self._peers: tuple[str, ...] | None = None
        # Image bytes by sha256, least recently used first, and the fetches under way.
        self._images: OrderedDict[str, bytes] = OrderedDict()
        self._image_cache_bytes = image_cache_bytes
        self._image_fetches: dict[str, asyncio.Future[bytes]] = {}

    def __repr__(self) -> str:
        return f"<ProxyClient {self.proxy_url}>"

    def _new_session(self) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(timeout=self._timeout, headers=self._headers)

    async def _owner(self, trial_id: str) -> str:
        """The replica that owns ``trial_id``: the proxies say who they all are
        (``GET /cluster``, asked once) and the owner follows from the id alone. A single
        proxy (or replica), or one that does not say, is asked everything."""
        if self._peers is None:
            try:
                async with self._session().get(
                    f"{self.proxy_url}/cluster", ssl=self._ssl
                ) as response:
                    info = await response.json(content_type=None) if response.ok else {}
                self._peers = tuple(info.get("peers") or ())
            except (aiohttp.ClientError, ValueError):
                return self.proxy_url  # not cached: asked again next time
        return owner(trial_id, self._peers) if len(self._peers) > 1 else self.proxy_url

    async def _trial_request(
        self,
        method: str,
        trial_id: str,
        path: str,
        payload: Any = None,
        *,
        raw: bool = False,
        total_seconds: float | None = None,
    ) -> Any:
        """A request about one trial, sent to the replica that owns it; through the
        replica this client was given (which forwards it) when the owner's own URL cannot
        be reached from here (a port-forward from outside the cluster)."""
        base = await self._owner(trial_id)
        options: dict[str, Any] = {"raw": raw, "total_seconds": total_seconds}
        if base == self.proxy_url:
            return await self._request(method, path, payload, **options)
        try:
            return await self._request(method, path, payload, base=base, **options)
        except ProxyConnectionError as exc:
            if not exc.refused:
                raise
            return await self._request(method, path, payload, **options)

    async def _request(
        self,
        method: str,
        path: str,
        payload: Any = None,
        *,
        base: str | None = None,
        total_seconds: float | None = None,
        raw: bool = False,
    ) -> Any:
        """One call; every failure is an ``SdkError``: an answer that is not the API's
        (a load balancer's HTML error page) a ``ProxyRequestError`` with its status, no
        answer at all (refused, reset, timed out) a ``ProxyConnectionError``. ``raw``: a
        successful answer's body is returned as bytes, not parsed as JSON."""
        url = f"{base or self.proxy_url}{path}"
        options: dict[str, Any] = {"json": payload, "ssl": self._ssl}
        if total_seconds is not None:
            options["timeout"] = aiohttp.ClientTimeout(total=total_seconds)
        with _no_answer(method, url):
            async with self._session().request(method, url, **options) as response:
                body = await response.read()
                status, reason, headers = response.status, response.reason, response.headers
        if raw and status < 400:
            return body
        try:
            data = json.loads(body) if body else None
        except ValueError:
            text = body[:200].decode("utf-8", "replace")
            raise ProxyRequestError(
                status, "invalid_response", "not_json", f"{reason}: not JSON: {text!r}"
            ) from None
        if status >= 400:
            error = data.get("error", {}) if isinstance(data, dict) else {}
            cls = _ERRORS.get(status, ProxyRequestError)
            should_retry = headers.get("x-should-retry")
            retry_after = headers.get("Retry-After", "")
            raise cls(
                status,
                str(error.get("type", "error")),
                error.get("code"),
                str(error.get("message", reason)),
                should_retry=None if should_retry is None else should_retry == "true",
                retry_after=float(retry_after) if retry_after.isdigit() else None,
                details={k: v for k, v in error.items() if k not in ("type", "code", "message")},
            )
        return data

    # ------------------------------------------------------------------ API

    async def create_session(
        self,
        trial_id: str | None = None,
        *,
        metadata: dict[str, Any] | None = None,
        sampling: dict[str, Any] | None = None,
        model: str | None = None,
        history: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        cap_finish: str | None = None,
        routed_experts: bool = False,
        budget: dict[str, int] | None = None,
    ) -> TrialSession:
        """Register a trial. ``history`` (``"keep"``, the default, or ``"template"``),
        ``chat_template_kwargs`` and ``cap_finish`` (``"length"``, the default, or
        ``"stop"``) are session options: see the README. ``routed_experts``: record which
        experts a mixture-of-experts policy routed every token to (rollout routing
        replay; the export's ``routed_experts``, ``Sample.routed_experts``). ``budget``
        (``{"turns": N, "tokens": M}``): what the trial may spend; a request after it is
        refused and the trial's outcome is ``budget_exhausted``."""
        payload: dict[str, Any] = {"metadata": metadata or {}}
        options = {
            "sampling": sampling,
            "model": model,
            "history": history,
            "chat_template_kwargs": chat_template_kwargs,
            "cap_finish": cap_finish,
            "routed_experts": True if routed_experts else None,
            "budget": budget,
        }
        payload.update({k: v for k, v in options.items() if v is not None})
        if trial_id is not None:
            data = await self._trial_request("POST", trial_id, f"/sessions/{trial_id}", payload)
        else:
            data = await self._request("POST", "/sessions", payload)
        return TrialSession(data["trial_id"], data["base_url"], data["api_key"])

    async def get_session(self, trial_id: str) -> dict[str, Any]:
        result: dict[str, Any] = await self._trial_request("GET", trial_id, f"/sessions/{trial_id}")
        return result

    async def trajectories(self, trial_id: str) -> dict[str, Any]:
        result: dict[str, Any] = await self._trial_request(
            "GET", trial_id, f"/sessions/{trial_id}/trajectories"
        )
        return result

    async def tree(self, trial_id: str) -> dict[str, Any]:
        """The trial's tree (``GET /sessions/<trial>/tree``): ``{"trial_id", "nodes"}``,
        one node per turn, each token of the session once; ``sdk.tree.pack_tree`` packs
        it into one sequence for a trainer."""
        result: dict[str, Any] = await self._trial_request(
            "GET", trial_id, f"/sessions/{trial_id}/tree"
        )
        return result

    async def agents(self, trial_id: str) -> list[dict[str, Any]]:
        """The trial's agents (``GET /sessions/<trial>/agents``): each with its id,
        parent, kind, the call that spawned it and its turns."""
        result: dict[str, Any] = await self._trial_request(
            "GET", trial_id, f"/sessions/{trial_id}/agents"
        )
        return list(result["agents"])

    async def image(self, trial_id: str, sha256: str) -> bytes:
        """The bytes of an image the trial's agent sent, as it sent them
        (``GET /sessions/<trial>/images/<sha256>``), checked against their sha256. Each
        image is fetched once per client: the bytes are kept by hash (at most
        ``image_cache_bytes`` of them), and a fetch under way is joined, not repeated.
        Raises ``ProxyRequestError`` (``image_mismatch``) when the bytes are not the
        image named."""
        cached = self._images.get(sha256)
        if cached is not None:
            self._images.move_to_end(sha256)
            return cached
        running = self._image_fetches.get(sha256)
        if running is not None:
            return await asyncio.shield(running)
        fetch = asyncio.ensure_future(self._fetch_image(trial_id, sha256))
        self._image_fetches[sha256] = fetch
        # Forgotten once done (a failed fetch is tried again by the next caller); a
        # cancelled caller leaves it running for the others that joined it.
        fetch.add_done_callback(lambda done: self._forget_fetch(sha256, done))
        return await asyncio.shield(fetch)

    def _forget_fetch(self, sha256: str, fetch: asyncio.Future[bytes]) -> None:
        if self._image_fetches.get(sha256) is fetch:
            del self._image_fetches[sha256]
        if not fetch.cancelled():
            fetch.exception()  # retrieved: nobody may be left to await it

    async def _fetch_image(self, trial_id: str, sha256: str) -> bytes:
        path = f"/sessions/{trial_id}/images/{sha256}"
        data: bytes = await self._trial_request("GET", trial_id, path, raw=True)
        if hashlib.sha256(data).hexdigest() != sha256.lower():
            raise ProxyRequestError(
                502,
                "invalid_response",
                "image_mismatch",
                f"GET {path}: the {len(data)} bytes answered are not that image",
            )
        if len(data) <= self._image_cache_bytes:
            self._images[sha256] = data
            held = sum(len(b) for b in self._images.values())
            while held > self._image_cache_bytes:
                _, dropped = self._images.popitem(last=False)
                held -= len(dropped)
        return data

    async def fill_images(self, trial_id: str, samples: Iterable[Sample]) -> None:
        """Give every image of ``samples`` (built from ``trial_id``'s trajectories) its
        bytes, each distinct image fetched once (``image``)."""
        missing = [i for s in samples for i in s.images if i.data is None]
        hashes = list(dict.fromkeys(i.sha256 for i in missing))
        fetched = await asyncio.gather(*(self.image(trial_id, h) for h in hashes))
        found = dict(zip(hashes, fetched, strict=True))
        for image in missing:
            image.data = found[image.sha256]

    async def complete(
        self,
        trial_id: str,
        reward: float | dict[str, float] | None = None,
        *,
        outcome: str | None = None,
        agent_rewards: Mapping[str, float] | None = None,
    ) -> dict[str, Any]:
        """End the trial. ``outcome``: ``completed`` (with a reward), ``agent_error``,
        ``infra_error``, ``timeout`` or ``budget_exhausted`` (None: ``budget_exhausted``
        when the budget was spent, else ``completed``). ``agent_rewards``: rewards for
        single agents by id (the others get ``reward``)."""
        payload: dict[str, Any] = {} if reward is None else {"reward": reward}
        if outcome is not None:
            payload["outcome"] = outcome
        if agent_rewards:
            payload["agent_rewards"] = dict(agent_rewards)
        result: dict[str, Any] = await self._trial_request(
            "POST", trial_id, f"/sessions/{trial_id}/complete", payload
        )
        return result

    async def score_with_teacher(
        self, trial_id: str, model: str, *, within_seconds: float = TEACHER_SECONDS
    ) -> dict[str, Any]:
        """Have the teacher ``model`` (a worker's model started with ``--teacher``) score
        every token the policy sampled in the trial (``POST /sessions/<trial>/teacher``);
        the export then carries ``teacher_logprobs`` and ``teacher_model`` per trajectory
        (``Sample.teacher_logprobs``). Returns ``{"model", "scored_tokens", "seconds",
        "done"}``, ``scored_tokens`` summed over the calls it made.

        Scoring runs on the proxy whoever waits for it, and asked again it scores only
        what is not scored yet, so this asks again, until ``within_seconds`` have passed,
        when the connection drops or times out, when the proxy says to retry, and while
        it answers ``done: false`` (past ``within_seconds``, such an answer is returned
        as it is). A refusal (an unknown teacher, one whose tokenizer or images are not the
        policy's) raises ``ProxyRequestError`` at once."""
        deadline = time.monotonic() + within_seconds
        scored = 0
        attempt = 0
        path = f"/sessions/{trial_id}/teacher"
        while True:
            remaining = deadline - time.monotonic()
            try:
                result: dict[str, Any] = await self._trial_request(
                    "POST", trial_id, path, {"model": model}, total_seconds=max(remaining, 1.0)
                )
                scored += int(result.get("scored_tokens", 0))
                if result.get("done", True):
                    return {**result, "scored_tokens": scored}
                if time.monotonic() >= deadline:  # partial, and no time left to ask again
                    return {**result, "scored_tokens": scored}
                pause = 0.0  # partial: its figures are in; ask for the rest at once
            except (ProxyRequestError, ProxyConnectionError) as exc:
                # A dropped call, or one past its time: the proxy scores on, and asking
                # again waits for it, then scores what is left.
                pause = _retry_pause(exc, attempt, deadline)
            attempt += 1
            await asyncio.sleep(pause)

    async def delete(self, trial_id: str) -> None:
        await self._trial_request("DELETE", trial_id, f"/sessions/{trial_id}")

    async def list_sessions(self, *, limit: int = 100, after: str | None = None) -> dict[str, Any]:
        query = f"?limit={limit}" + (f"&after={after}" if after else "")
        result: dict[str, Any] = await self._request("GET", f"/sessions{query}")
        return result

    async def update_weights(
        self,
        version: int,
        path: str | None = None,
        mode: str = "wait",
        *,
        within_seconds: float = UPDATE_SECONDS,
    ) -> dict[str, Any]:
        """Every connected worker serves ``version``, loaded from the Hugging Face model
        directory ``path`` (written by the trainer where the workers can read it; None:
        the trainer updated the engines itself and the version is only stamped). Returns
        once they all do. ``mode``: ``"wait"`` lets running replies finish on the old
        weights first, ``"abort"`` stops them and continues them on the new weights.

        The update runs on the proxy whoever waits for it, and the same update asked
        again (version and path) is answered with its outcome, so this asks again, until
        ``within_seconds`` have passed, when the connection drops and when the proxy says
        to retry (503 with ``Retry-After``: another update runs, or a worker is in another
        replica's update). The default covers the proxy's worst case with its default
        ``--weights-phase-seconds`` (600: three phases); give at least three times that
        flag plus a minute when it is larger.

        Raises ``ProxyRequestError``: with ``commit_failed`` (502) the workers listed in
        its ``details["workers"]`` could not commit and are out of service while the
        others serve ``version``; on any other error every worker still serves the
        previous version."""
        payload: dict[str, Any] = {"version": version, "mode": mode}
        if path is not None:
            payload["path"] = str(path)
        deadline = time.monotonic() + within_seconds
        attempt = 0
        while True:
            remaining = deadline - time.monotonic()
            try:
                result: dict[str, Any] = await self._request(
                    "POST", "/weights", payload, total_seconds=max(remaining, 1.0)
                )
                return result
            except (ProxyRequestError, ProxyConnectionError) as exc:
                # A connection dropped or refused (a load balancer, a restarting proxy):
                # the update goes on and asking again joins it.
                pause = _retry_pause(exc, attempt, deadline)
            attempt += 1
            await asyncio.sleep(pause)

    async def weights(self) -> dict[str, Any]:
        """The policy version the workers serve, and each worker's."""
        result: dict[str, Any] = await self._request("GET", "/weights")
        return result

    async def ready(self) -> bool:
        """Whether the proxy is ready to serve (``GET /readyz`` answers 200); a proxy that
        does not answer at all raises ``ProxyConnectionError``."""
        url = f"{self.proxy_url}/readyz"
        with _no_answer("GET", url):
            async with self._session().get(url, ssl=self._ssl) as response:
                return response.status == 200


def _retry_pause(
    exc: ProxyRequestError | ProxyConnectionError, attempt: int, deadline: float
) -> float:
    """How long to wait before asking the proxy again for an operation that goes on
    whoever waits for it (a weight update, a teacher's scoring): its ``Retry-After``, or
    a backoff after a dropped connection. Re-raises ``exc`` when it is a refusal, or when
    the pause would end past ``deadline``."""
    if isinstance(exc, ProxyRequestError):
        if not exc.should_retry:
            raise exc
        pause = exc.retry_after if exc.retry_after is not None else 1.0
    else:
        pause = min(0.5 * 2**attempt, 8.0)
    if time.monotonic() + pause >= deadline:
        raise exc
    return pause
