"""Which proxy replica owns a trial: a pure function of the trial id and the replica list.

Replicas are named by their public URLs (what agents and trainers reach them at). The
owner of a trial is chosen by rendezvous (highest-random-weight) hashing: every replica
gets a score from a hash of its URL and the trial id, the highest score owns the trial.
Anyone holding the list computes the same owner (the proxies, the SDK), with no shared
database; adding or removing a replica moves only the trials it wins or held (about 1/N).
The list's order does not matter.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from urllib.parse import urlsplit

__all__ = ["ClusterError", "normalize_url", "owner", "pick_owner", "validate_peers"]


class ClusterError(ValueError):
    """A replica list that cannot work (named in the message)."""


def normalize_url(url: str) -> str:
    """``scheme://host[:port][/path]`` without a trailing slash, scheme and host lowercase."""
    parts = urlsplit(url.strip())
    if parts.scheme not in {"http", "https"} or not parts.netloc:
        raise ClusterError(f"{url!r} is not an http(s) URL")
    return f"{parts.scheme.lower()}://{parts.netloc.lower()}{parts.path.rstrip('/')}"


def _score(peer: str, trial_id: str) -> bytes:
    return hashlib.blake2b(f"{peer}\0{trial_id}".encode(), digest_size=16).digest()


def owner(trial_id: str, peers: Sequence[str]) -> str:
    """The replica (one of ``peers``, normalized) that owns ``trial_id``."""
    return pick_owner(trial_id, [normalize_url(p) for p in peers])


def pick_owner(trial_id: str, normalized: Sequence[str]) -> str:
    """``owner`` over a list already normalized (a proxy's own, checked at start-up): no
    URL parsing per request."""
    if not normalized:
        raise ClusterError("no replicas")
    return max(normalized, key=lambda p: _score(p, trial_id))


def validate_peers(public_url: str | None, peers: Sequence[str]) -> tuple[str, ...]:
    """The replica list, normalized, checked to name each replica once and to include
    this replica's ``public_url``."""
    if not peers:
        return ()
    if not public_url:
        raise ClusterError("--peers needs --public-url: this replica's own entry in the list")
    normalized = [normalize_url(p) for p in peers]
    if len(set(normalized)) != len(normalized):
        raise ClusterError(f"--peers names a replica twice: {', '.join(normalized)}")
    me = normalize_url(public_url)
    if me not in normalized:
        raise ClusterError(
            f"--peers must include this replica's --public-url {me} (got {', '.join(normalized)})"
        )
    return tuple(normalized)
