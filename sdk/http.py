"""One aiohttp session per client object, reused for every call: given by the caller
(shared, never closed here) or opened on first use (owned, closed by ``aclose``)."""

from __future__ import annotations

from types import TracebackType
from typing import Self

import aiohttp


class HttpClient:
    """Base of the SDK's HTTP clients. Subclasses say how to open their session."""

    def __init__(self, http: aiohttp.ClientSession | None) -> None:
        self._http = http
        self._owns_http = http is None

    def _new_session(self) -> aiohttp.ClientSession:
        raise NotImplementedError

    def _session(self) -> aiohttp.ClientSession:
        if self._http is None or self._http.closed:
            self._http = self._new_session()
            self._owns_http = True
        return self._http

    async def aclose(self) -> None:
        if self._http is not None and self._owns_http:
            await self._http.close()
        self._http = None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
