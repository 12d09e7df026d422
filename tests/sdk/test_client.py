"""The session API client against a real proxy behind a front that injects network
faults: whatever goes wrong on the way is one of the SDK's own errors."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from rollout_relay.embedded import RunningProxy
from sdk.client import ProxyClient
from sdk.exceptions import ProxyConnectionError, ProxyRequestError
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
