"""Ids of replies, tool calls and requests.

These are minted once or more per model call, so they come straight from the OS's random
source as hex (about 1 µs) rather than through a UUID and a base-57 conversion (about
13 µs). Trial ids, which people read and paste, stay shortuuid's (see the registry).
"""

from __future__ import annotations

import secrets


def new_id(prefix: str, separator: str = "_") -> str:
    """``prefix`` + ``separator`` + 24 random hex digits (96 bits)."""
    return f"{prefix}{separator}{secrets.token_hex(12)}"
