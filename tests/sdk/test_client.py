"""The session API client against a real proxy behind a front that injects network
faults: whatever goes wrong on the way is one of the SDK's own errors."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from relay.cluster import owner
from rollout_relay.embedded import RunningProxy
from sdk.client import ProxyClient
from sdk.exceptions import ProxyConnectionError, ProxyRequestError, SessionNotFoundError
from tests.e2e.conftest import TIMEOUT_FACTOR
from tests.sdk.faults import Fault, FaultyFront

CREATE = "POST /sessions"


@pytest.fixture
async def front(stack: RunningProxy, request: pytest.FixtureRequest) -> AsyncIterator[FaultyFront]:
    front = FaultyFront(stack.url, request.param, CREATE, times=1)
    await front.start()
    yield front
    await front.stop()


@pytest.mark.parametrize(
    ("front", "error", "text"),
    [
        (Fault.RESET, ProxyConnectionError, "ServerDisconnectedError"),
        (Fault.HTML, ProxyRequestError, "502 invalid_response: Bad Gateway: not JSON"),
        (Fault.HANG, ProxyConnectionError, "TimeoutError"),
    ],
    indirect=["front"],
)
async def test_a_network_fault_is_an_sdk_error_and_the_next_call_works(
    front: FaultyFront, error: type[Exception], text: str
) -> None:
    """A dropped connection, an HTML error page and a timeout raise the SDK's errors
    (never aiohttp's or json's); the same client's next call goes through."""
    async with ProxyClient(front.url, timeout_seconds=2 * TIMEOUT_FACTOR) as client:
        with pytest.raises(error, match=text) as info:
            await client.create_session()
        assert type(info.value) is error
        trial = await client.create_session()
        await client.delete(trial.trial_id)
    assert front.seen[CREATE] == 2


async def test_a_trial_whose_owner_cannot_be_reached_goes_through_the_given_replica(
    stack: RunningProxy,
) -> None:
    """The owner's own URL refuses connections (a port-forward from outside the cluster):
    the call goes to the replica the client was given, which answers it."""
    unreachable = "http://127.0.0.1:1"
    peers = (unreachable, stack.url)
    trial_id = next(f"t{i}" for i in range(1000) if owner(f"t{i}", peers) == unreachable)
    async with ProxyClient(stack.url) as client:
        client._peers = peers  # what GET /cluster would have said
        with pytest.raises(SessionNotFoundError):
            await client.get_session(trial_id)


@pytest.mark.parametrize(
    ("fault", "text"), [(Fault.RESET, "ServerDisconnectedError"), (Fault.HANG, "TimeoutError")]
)
async def test_ready_without_an_answer_raises_the_sdks_error(fault: Fault, text: str) -> None:
    """A readiness probe that gets no answer (a dropped connection, a timeout, a refused
    connection) raises ProxyConnectionError, never aiohttp's errors; an error page is an
    answer: not ready."""
    # Every attempt meets the fault: aiohttp itself sends a GET again once on a dropped
    # connection.
    front = FaultyFront("http://127.0.0.1:1", fault, "GET /readyz", times=5)
    await front.start()
    try:
        async with ProxyClient(front.url, timeout_seconds=1 * TIMEOUT_FACTOR) as client:
            with pytest.raises(ProxyConnectionError, match=text) as info:
                await client.ready()
            assert not info.value.refused
    finally:
        await front.stop()
    async with ProxyClient("http://127.0.0.1:1") as client:
        with pytest.raises(ProxyConnectionError) as refused:
            await client.ready()
        assert refused.value.refused
    front = FaultyFront("http://127.0.0.1:1", Fault.HTML, "GET /readyz", times=1)
    await front.start()
    try:
        async with ProxyClient(front.url) as client:
            assert await client.ready() is False
    finally:
        await front.stop()
