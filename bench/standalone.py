"""What the standalone benchmarks (``python -m bench.images``, ``python -m bench.routing``)
share: their command line, a session on the proxy under test, and where results go."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import aiohttp

from bench.processes import ADMIN_TOKEN, Proc


def parser(prog: str, doc: str, turns: int) -> argparse.ArgumentParser:
    """``--turns``, ``--conversations``, ``--out`` (Markdown) and ``--json`` (raw)."""
    out = argparse.ArgumentParser(prog=prog, description=doc.splitlines()[0])
    out.add_argument("--turns", type=int, default=turns)
    out.add_argument("--conversations", type=int, default=3)
    out.add_argument("--out", type=Path, default=None, help="write the Markdown table here")
    out.add_argument("--json", type=Path, default=None, help="write raw results here")
    return out


def publish(text: str, results: dict[str, Any], args: argparse.Namespace) -> None:
    print(text)
    if args.out:
        args.out.write_text(text)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


async def new_session(
    http: aiohttp.ClientSession, proxy: Proc, body: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A trial registered with the admin token: its ``trial_id``, ``base_url``, ``api_key``."""
    async with http.post(
        f"{proxy.url}/sessions",
        json=body or {},
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
    ) as response:
        response.raise_for_status()
        session: dict[str, Any] = await response.json()
    return session
