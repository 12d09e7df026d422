"""``python -m bench.images``: what carrying screenshots costs the proxy, turn by turn.

A computer-use agent sends a new screenshot every turn and resends every earlier one in
its history. This runs such a conversation through the real proxy (its own process,
durable, authenticated, as in production) and an ``instant`` worker on the tiny
vision-language model (it takes the images and runs no model, so what is measured is the
proxy's cost, not a vision encoder's): ``--turns`` turns (Chat Completions, not streamed),
each adding a user message with a new 1280x800 PNG screenshot, so turn k's request holds k
screenshots. Beside it, the same conversation with the screenshots left out. For each
turn: the proxy process's CPU time and the request's size.

The claim under test: a turn's cost does not grow with the number of images already in
the history (each image is decoded, hashed, counted and stored once, when it first comes;
the history memory recognises the ones it has seen by their bytes). What does grow is the
request body, which the proxy must still receive and scan.

python -m bench.images --turns 20 --conversations 3 --out bench/IMAGES.md
"""

from __future__ import annotations

import asyncio
import base64
import functools
import io
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench.harness import wait_for_model
from bench.processes import Proc, Processes, wait_http
from bench.standalone import new_session, parser, publish

MODEL = "tiny-vlm"


def screenshot(seed: int, size: tuple[int, int] = (1280, 800)) -> bytes:
    """A PNG that compresses like a screenshot (flat panels, text lines), ~100 kB."""
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    image = Image.new("RGB", size, (245, 245, 245))
    draw = ImageDraw.Draw(image)
    for _ in range(40):  # windows and panels
        x, y = rng.randrange(size[0]), rng.randrange(size[1])
        w, h = rng.randrange(80, 600), rng.randrange(40, 400)
        shade = tuple(rng.randrange(180, 256) for _ in range(3))
        draw.rectangle((x, y, x + w, y + h), fill=shade, outline=(90, 90, 90))
    for line in range(120):  # lines of text
        x, y = rng.randrange(size[0] - 300), rng.randrange(size[1])
        text = " ".join(
            "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randrange(2, 9)))
            for _ in range(rng.randrange(3, 9))
        )
        draw.text((x, y), f"{line}: {text}", fill=(20, 20, 20))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


async def conversation(
    http: aiohttp.ClientSession, proxy: Proc, turns: int, *, images: bool, seed: int
) -> list[dict[str, float]]:
    """One conversation; per turn the proxy's CPU seconds and the request's bytes."""
    session = await new_session(http, proxy)
    headers = {"Authorization": f"Bearer {session['api_key']}"}
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You operate a computer."}]
    rows: list[dict[str, float]] = []
    for turn in range(turns):
        content: list[dict[str, Any]] = [{"type": "text", "text": f"step {turn}: what next?"}]
        if images:
            png = base64.b64encode(screenshot(seed * 1000 + turn)).decode()
            url = f"data:image/png;base64,{png}"
            content.append({"type": "image_url", "image_url": {"url": url}})
        messages.append({"role": "user", "content": content})
        body = json.dumps(
            {"model": MODEL, "messages": messages, "max_tokens": 16, "temperature": 1.0}
        ).encode()
        before = proxy.cpu_seconds()
        started = time.perf_counter()
        async with http.post(
            f"{session['base_url']}/chat/completions",
            data=body,
            headers={**headers, "Content-Type": "application/json"},
        ) as response:
            reply = await response.json()
            if response.status != 200:
                raise RuntimeError(f"turn {turn}: {response.status} {reply}")
        rows.append(
            {
                "cpu_ms": (proxy.cpu_seconds() - before) * 1e3,
                "wall_ms": (time.perf_counter() - started) * 1e3,
                "body_mb": len(body) / 2**20,
                "prompt_tokens": reply["usage"]["prompt_tokens"],
            }
        )
        messages.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"]})
    return rows


def conversion_ms(turns: int) -> list[float]:
    """Per turn, the proxy's own work on a request's messages and images, in this process:
    the body taken apart, new messages converted (a new screenshot decoded, checked and
    hashed), the history recognised from the session's memory. CPU time, median of three
    rounds."""
    from proxy.api.images import ImageSources, take_images
    from proxy.api.openai.models import parse_chat_completion
    from proxy.images import ImageChecker, ImageFetcher, ImageLimits
    from proxy.sessions.model import Session, TrialId

    shots = [base64.b64encode(screenshot(turn)).decode() for turn in range(turns)]
    rounds: list[list[float]] = []
    for _ in range(3):
        checker = ImageChecker(ImageLimits())  # a fresh one: nothing known yet
        sources = ImageSources(checker, ImageFetcher([], checker))
        session = Session(TrialId("bench"), "key")
        messages: list[dict[str, Any]] = [{"role": "system", "content": "You operate a computer."}]
        times: list[float] = []
        for turn in range(turns):
            url = f"data:image/png;base64,{shots[turn]}"
            content = [{"type": "text", "text": f"step {turn}: what next?"}]
            messages.append(
                {
                    "role": "user",
                    "content": [*content, {"type": "image_url", "image_url": {"url": url}}],
                }
            )
            body = json.dumps({"model": MODEL, "messages": messages, "max_tokens": 16}).encode()
            parse = functools.partial(parse_chat_completion, body, session.history)
            started = time.thread_time()  # CPU time: other processes' load does not count
            _, _, taken = asyncio.run(take_images(sources, session, parse))
            times.append((time.thread_time() - started) * 1e3)
            session.images.update(taken)  # as the recorded turn keeps them
            messages.append({"role": "assistant", "content": "ok"})
        rounds.append(times)
    return [statistics.median(r[t] for r in rounds) for t in range(turns)]


def _by_turn(runs: list[list[dict[str, float]]], key: str) -> list[float]:
    return [statistics.median(run[t][key] for run in runs) for t in range(len(runs[0]))]


async def measure(turns: int, conversations: int, log_dir: Path) -> dict[str, Any]:
    from worker_client.tiny_vlm import SHIPPED_TINY_VLM

    with Processes(log_dir) as procs:
        proxy = procs.proxy(["--max-body-bytes", str(256 * 2**20)])
        wait_http(proxy, "/healthz")
        procs.instant_worker(proxy, SHIPPED_TINY_VLM, reply_tokens=16, name=MODEL)
        await wait_for_model(proxy.url, MODEL)
        results: dict[str, Any] = {}
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            await conversation(http, proxy, 3, images=True, seed=999)  # warm up
            for images in (False, True):
                runs = [
                    await conversation(http, proxy, turns, images=images, seed=seed)
                    for seed in range(conversations)
                ]
                results["images" if images else "text"] = {
                    key: _by_turn(runs, key)
                    for key in ("cpu_ms", "wall_ms", "body_mb", "prompt_tokens")
                }
    return results


def report(results: dict[str, Any], turns: int, conversations: int) -> str:
    edge = max(1, turns // 4)
    lines = [
        "# Screenshots in every turn: proxy CPU per turn",
        "",
        f"`python -m bench.images --turns {turns} --conversations {conversations}`: the "
        "proxy's own process, median over the conversations; turn k's request holds k "
        "1280x800 PNG screenshots (each new), or none. The instant backend runs no model.",
        "",
        "| turn | CPU ms, text | CPU ms, screenshots | messages and images alone, CPU ms "
        "| request MB, screenshots | prompt tokens |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    text, images = results["text"], results["images"]
    for t in range(turns):
        lines.append(
            f"| {t + 1} | {text['cpu_ms'][t]:.2f} | {images['cpu_ms'][t]:.2f} "
            f"| {results['conversion_ms'][t]:.2f} "
            f"| {images['body_mb'][t]:.2f} | {images['prompt_tokens'][t]:.0f} |"
        )
    first = statistics.median(images["cpu_ms"][1 : 1 + edge])
    last = statistics.median(images["cpu_ms"][-edge:])
    first_text = statistics.median(text["cpu_ms"][1 : 1 + edge])
    last_text = statistics.median(text["cpu_ms"][-edge:])
    conversion = results["conversion_ms"]
    first_conv = statistics.median(conversion[1 : 1 + edge])
    last_conv = statistics.median(conversion[-edge:])
    lines += [
        "",
        f"Median CPU per turn, turns 2-{1 + edge} vs the last {edge}: with screenshots "
        f"{first:.2f} -> {last:.2f} ms ({last / first:.2f}x), text only "
        f"{first_text:.2f} -> {last_text:.2f} ms ({last_text / first_text:.2f}x); the work on "
        f"messages and images alone {first_conv:.2f} -> {last_conv:.2f} ms "
        f"({last_conv / first_conv:.2f}x).",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parser("python -m bench.images", __doc__ or "", turns=20).parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-images-") as log_dir:
        results = asyncio.run(measure(args.turns, args.conversations, Path(log_dir)))
    results["conversion_ms"] = conversion_ms(args.turns)
    publish(report(results, args.turns, args.conversations), results, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
