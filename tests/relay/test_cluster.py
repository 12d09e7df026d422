"""Trial ownership across proxy replicas: derivable from the id and the list alone."""

from __future__ import annotations

from collections import Counter

import pytest

from relay.cluster import ClusterError, normalize_url, owner, validate_peers

PEERS = ["http://relay-0:8080", "http://relay-1:8080", "http://relay-2:8080"]


def test_the_owner_depends_on_the_id_and_the_set_of_replicas_only() -> None:
    for i in range(50):
        assert owner(f"t{i}", PEERS) == owner(f"t{i}", list(reversed(PEERS)))
        assert owner(f"t{i}", PEERS) == owner(f"t{i}", [p + "/" for p in PEERS])


def test_trials_spread_over_the_replicas() -> None:
    counts = Counter(owner(f"trial-{i}", PEERS) for i in range(3000))
    assert set(counts) == set(PEERS)
    assert min(counts.values()) > 800  # about 1000 each


def test_adding_a_replica_moves_only_the_trials_it_wins() -> None:
    more = [*PEERS, "http://relay-3:8080"]
    moved = [i for i in range(2000) if owner(f"t{i}", PEERS) != owner(f"t{i}", more)]
    assert all(owner(f"t{i}", more) == "http://relay-3:8080" for i in moved)
    assert 300 < len(moved) < 700  # about a quarter


def test_urls_are_normalized() -> None:
    assert normalize_url("HTTP://Relay-0:8080/") == "http://relay-0:8080"
    assert normalize_url("https://x/prefix/") == "https://x/prefix"
    with pytest.raises(ClusterError, match="not an http"):
        normalize_url("relay-0:8080")


def test_a_replica_list_must_include_this_replica_once() -> None:
    assert validate_peers("http://relay-1:8080/", PEERS) == tuple(PEERS)
    assert validate_peers(None, []) == ()
    with pytest.raises(ClusterError, match="must include this replica"):
        validate_peers("http://relay-9:8080", PEERS)
    with pytest.raises(ClusterError, match="twice"):
        validate_peers(PEERS[0], [*PEERS, PEERS[0] + "/"])
    with pytest.raises(ClusterError, match="needs --public-url"):
        validate_peers(None, PEERS)
    with pytest.raises(ClusterError, match="no replicas"):
        owner("t", [])
