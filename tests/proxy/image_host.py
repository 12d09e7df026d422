"""What the image tests of the proxy share: encoded test images, and a loopback image host
that counts what it served (so a test can show a host was never asked)."""

from __future__ import annotations

import asyncio
import io
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from aiohttp import web


def encoded(
    size: tuple[int, int] = (64, 48), fmt: str = "PNG", *, frames: int = 1, noise: bool = False
) -> bytes:
    """An image in ``fmt``, not of one colour (so a cut copy is corrupt); ``frames`` > 1
    for an animation; ``noise``: random pixels, which PNG cannot compress."""
    from PIL import Image

    if noise:
        pixels = random.Random(0).randbytes(size[0] * size[1] * 3)
        images = [Image.frombytes("RGB", size, pixels)]
    else:
        images = [Image.new("RGB", size, (40 * i, 90, 200)) for i in range(frames)]
        for x in range(size[0]):
            images[0].putpixel((x, (x * 7) % size[1]), (x % 256, 255 - x % 256, 17))
    out = io.BytesIO()
    if len(images) > 1:
        images[0].save(out, format=fmt, save_all=True, append_images=images[1:])
    else:
        images[0].save(out, format=fmt)
    return out.getvalue()


@dataclass
class ImageHost:
    """A loopback server: ``/shot.png`` (the image), ``/to/<host>/<path>`` (a redirect),
    ``/loop`` (a redirect to itself), ``/big`` (100 kB), ``/slow`` (30 s); ``served`` lists
    what it was asked for, as ``host/path``."""

    served: list[str] = field(default_factory=list)
    port: int = 0

    def url(self, host: str, path: str) -> str:
        return f"http://{host}:{self.port}{path}"


@asynccontextmanager
async def image_host(image: bytes) -> AsyncIterator[ImageHost]:
    state = ImageHost()

    async def handle(request: web.Request) -> web.StreamResponse:
        state.served.append(f"{request.host.split(':')[0]}{request.path}")
        path = request.path
        if path == "/shot.png":
            return web.Response(body=image, content_type="image/png")
        if path.startswith("/to/"):
            _, _, target_host, rest = path.split("/", 3)
            raise web.HTTPFound(f"http://{target_host}:{state.port}/{rest}")
        if path == "/loop":
            raise web.HTTPFound("/loop")
        if path == "/big":
            return web.Response(body=b"\0" * 100_000, content_type="image/png")
        if path == "/slow":
            await asyncio.sleep(30)
        return web.Response(status=404)

    app = web.Application()
    app.router.add_get("/{tail:.*}", handle)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    state.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield state
    finally:
        await runner.cleanup()
