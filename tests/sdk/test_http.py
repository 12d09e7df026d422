"""The SDK clients' session handling: a shared session is reused and left open, an owned
one is opened on first use, reopened if closed, and closed by ``aclose``."""

from __future__ import annotations

import aiohttp

from sdk.http import HttpClient


class _Client(HttpClient):
    def __init__(self, http: aiohttp.ClientSession | None = None) -> None:
        super().__init__(http)
        self.opened = 0

    def _new_session(self) -> aiohttp.ClientSession:
        self.opened += 1
        return aiohttp.ClientSession()


async def test_owned_session_is_opened_once_and_closed() -> None:
    async with _Client() as client:
        first = client._session()
        assert client._session() is first
        assert client.opened == 1
    assert first.closed
    reopened = client._session()  # usable again after aclose
    assert reopened is not first
    assert client.opened == 2
    await client.aclose()
    assert reopened.closed


async def test_shared_session_is_left_open() -> None:
    async with aiohttp.ClientSession() as shared:
        async with _Client(shared) as client:
            assert client._session() is shared
        assert not shared.closed
        assert client.opened == 0
