"""Samples of a session that recorded routing (R3): each carries the rows of its own ids,
cut and shifted with them; a turn sampled after a row the engine could not give is left
out as an undelivered one is; a malformed export is refused."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from sdk.samples import (
    BranchPolicy,
    OverlongPrompt,
    build_samples,
    encode_routing,
    export_routing,
)

LAYERS, TOP_K = 2, 2


def _rows(count: int, dtype: Any = np.uint16) -> np.ndarray[Any, Any]:
    """Row i names expert i (layer 0) and i + 1000 (layer 1): each row tells its position."""
    rows = np.zeros((count, LAYERS, TOP_K), dtype)
    rows[:, 0, :] = np.arange(count)[:, None]
    rows[:, 1, :] = np.arange(count)[:, None] + (1000 if dtype == np.uint16 else 100)
    return rows


def _traj(
    prompt: int,
    turns: list[tuple[int, int]],
    length: int,
    missing: list[tuple[int, int]] | None = None,
    **turn_fields: dict[int, Any],
) -> dict[str, Any]:
    """A trajectory of ``prompt`` ids and ``length`` response ids; each turn samples
    ``[start, end)`` of the response, the rest is context."""
    mask = [0] * length
    for start, end in turns:
        mask[start:end] = [1] * (end - start)
    entries = []
    for index, (start, end) in enumerate(turns):
        entry: dict[str, Any] = {"turn": index, "response_start": start, "response_end": end}
        if index:
            entry["parent"] = index - 1
        for key, by_turn in turn_fields.items():
            if index in by_turn:
                entry[key] = by_turn[index]
        entries.append(entry)
    traj = {
        "prompt_ids": list(range(100, 100 + prompt)),
        "response_ids": list(range(500, 500 + length)),
        "response_mask": mask,
        "response_logprobs": [-0.5 if m else 0.0 for m in mask],
        "turns": entries,
        "routed_experts": encode_routing(_rows(prompt + length - 1), missing or []),
    }
    return traj


def _export(*trajectories: dict[str, Any]) -> dict[str, Any]:
    return {"trial_id": "t", "reward": 1.0, "trajectories": list(trajectories)}


def test_rows_are_aligned_with_the_samples_ids() -> None:
    """Row i of a sample is position i of its prompt + response, one row per id but the
    last; uint8 and uint16 both decode; an export without routing gives None."""
    (sample,) = build_samples(_export(_traj(5, [(0, 3), (5, 8)], 8)))
    assert sample.routed_experts is not None
    assert sample.routed_experts.shape == (5 + 8 - 1, LAYERS, TOP_K)
    np.testing.assert_array_equal(sample.routed_experts, _rows(12))
    small = _traj(3, [(0, 2)], 2)
    small["routed_experts"] = encode_routing(_rows(4, np.uint8))
    (narrow,) = build_samples(_export(small))
    assert narrow.routed_experts is not None
    np.testing.assert_array_equal(narrow.routed_experts, _rows(4, np.uint8))
    del small["routed_experts"]
    assert build_samples(_export(small))[0].routed_experts is None


def test_rows_are_cut_with_the_response_and_shifted_with_a_cut_prompt() -> None:
    """A response cut at max_response_tokens keeps the rows of what is left; a prompt cut
    to max_prompt_tokens (a sample that trains nothing) drops the rows of the cut ids."""
    export = _export(_traj(5, [(0, 3), (5, 8)], 8))
    (short,) = build_samples(export, max_response_tokens=4)
    assert short.routed_experts is not None
    np.testing.assert_array_equal(short.routed_experts, _rows(5 + 4 - 1))
    (cut,) = build_samples(export, max_prompt_tokens=3, overlong_prompt=OverlongPrompt.MASK)
    assert cut.prompt_truncated
    assert len(cut.prompt_ids) == 3
    assert cut.routed_experts is not None
    np.testing.assert_array_equal(cut.routed_experts, _rows(12)[2:])
    assert cut.routed_experts.shape[0] == len(cut.prompt_ids) + len(cut.response_ids) - 1


def test_an_undelivered_turn_cuts_the_rows_with_the_trajectory() -> None:
    (sample,) = build_samples(_export(_traj(5, [(0, 3), (5, 8)], 8, delivered={1: False})))
    assert sample.response_ids == list(range(500, 503))
    assert sample.routed_experts is not None
    np.testing.assert_array_equal(sample.routed_experts, _rows(5 + 3 - 1))


@pytest.mark.parametrize("keep_undelivered", [False, True])
def test_turns_sampled_after_a_missing_row_are_left_out(keep_undelivered: bool) -> None:
    """Turn 1 samples after missing row 9 (in its context), so the trajectory ends after
    turn 0, whose tokens need only rows before 7; a turn the proxy marks
    ``routing_missing`` ends it too; a trajectory whose first turn is affected is dropped,
    the longest branch then being the one that is left."""
    options = {"keep_undelivered": keep_undelivered}
    (sample,) = build_samples(_export(_traj(5, [(0, 3), (5, 8)], 8, [(9, 10)])), **options)
    assert sample.response_ids == list(range(500, 503))
    assert sample.routed_experts is not None
    np.testing.assert_array_equal(sample.routed_experts, _rows(7))
    # Turn 0 samples positions 5-7 from rows 0-6: row 7 missing leaves it, and its rows.
    (edge,) = build_samples(_export(_traj(5, [(0, 3), (5, 8)], 8, [(7, 8)])), **options)
    assert edge.response_ids == list(range(500, 503))
    assert edge.routed_experts is not None
    np.testing.assert_array_equal(edge.routed_experts, _rows(7))
    (flagged,) = build_samples(
        _export(_traj(5, [(0, 3), (5, 8)], 8, routing_missing={1: True})), **options
    )
    assert flagged.response_ids == list(range(500, 503))
    dropped = _traj(5, [(0, 3), (5, 8)], 8, [(2, 4)])
    kept = _traj(4, [(0, 2)], 2)
    samples = build_samples(_export(dropped, kept), policy=BranchPolicy.LONGEST, **options)
    assert [s.branch for s in samples] == [1]


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"dtype": "int32"}, "unknown dtype"),
        ({"shape": [11, LAYERS, TOP_K]}, "expected \\[12, layers, top_k\\]"),
        ({"shape": [12, LAYERS]}, "expected"),
        ({"data": encode_routing(_rows(3))["data"]}, "bytes for shape"),
        ({"missing": [[10, 13]]}, "outside 12 rows"),
    ],
)
def test_malformed_routing_is_refused(change: dict[str, Any], match: str) -> None:
    traj = _traj(5, [(0, 3), (5, 8)], 8)
    traj["routed_experts"] = {**traj["routed_experts"], **change}
    with pytest.raises(ValueError, match=match):
        export_routing(traj)
    with pytest.raises(ValueError, match=match):
        build_samples(_export(traj))


async def test_create_session_asks_for_routing_only_when_told() -> None:
    """``routed_experts=True`` goes to ``POST /sessions``; left out otherwise (an older
    proxy never sees the key)."""
    from sdk.client import ProxyClient

    sent: list[dict[str, Any]] = []

    async def request(method: str, path: str, payload: Any = None, **_: Any) -> Any:
        sent.append(payload)
        return {"trial_id": "t", "base_url": "http://x/t/v1", "api_key": "k"}

    client = ProxyClient("http://127.0.0.1:9")
    client._request = request  # type: ignore[method-assign]
    try:
        await client.create_session(routed_experts=True)
        await client.create_session()
    finally:
        await client.aclose()
    assert sent[0]["routed_experts"] is True
    assert "routed_experts" not in sent[1]
