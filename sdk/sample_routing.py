"""An export's routing (rollout routing replay, R3): decoding and checking the
``routed_experts`` of a trajectory (see ``sdk.samples``, "Routing")."""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

# The dtypes an export's routing may come in (at most 256 experts: uint8).
ROUTING_DTYPES: dict[str, np.dtype[Any]] = {"uint8": np.dtype("<u1"), "uint16": np.dtype("<u2")}


@dataclass(slots=True, frozen=True)
class ExportRouting:
    """An exported trajectory's routing: ``rows`` ``[positions, layers, top_k]``, row ``i``
    for position ``i`` of its ``prompt_ids + response_ids``; ``missing``: half-open ranges
    of rows the engine could not give (zeros there)."""

    rows: np.ndarray[Any, Any]
    missing: tuple[tuple[int, int], ...] = ()

    @property
    def first_missing(self) -> int | None:
        return min((start for start, _ in self.missing), default=None)


def encode_routing(
    rows: np.ndarray[Any, Any], missing: Sequence[tuple[int, int]] = ()
) -> dict[str, Any]:
    """The export's ``routed_experts`` entry for ``rows`` (uint8 or uint16)."""
    name = {np.dtype(np.uint8): "uint8", np.dtype(np.uint16): "uint16"}.get(rows.dtype)
    if name is None or rows.ndim != 3:
        raise ValueError(
            f"routing rows must be [rows, layers, top_k] uint8/uint16, not {rows.dtype}"
        )
    data = np.ascontiguousarray(rows, dtype=ROUTING_DTYPES[name]).tobytes()
    return {
        "dtype": name,
        "shape": list(rows.shape),
        "data": base64.b64encode(data).decode("ascii"),
        "missing": [[int(a), int(b)] for a, b in missing],
    }


def export_routing(traj: dict[str, Any]) -> ExportRouting | None:
    """The routing of an exported trajectory (None: it has none), checked against its ids."""
    entry = traj.get("routed_experts")
    if entry is None:
        return None
    if isinstance(entry, ExportRouting):
        return entry
    dtype = ROUTING_DTYPES.get(str(entry.get("dtype")))
    if dtype is None:
        raise ValueError(f"routed_experts: unknown dtype {entry.get('dtype')!r}")
    shape = tuple(int(x) for x in entry["shape"])
    expected = len(traj["prompt_ids"]) + len(traj["response_ids"]) - 1
    if len(shape) != 3 or shape[0] != max(expected, 0):
        raise ValueError(
            f"routed_experts of shape {list(shape)} for {expected + 1} ids: expected "
            f"[{expected}, layers, top_k] (one row per id but the last)"
        )
    raw = base64.b64decode(entry["data"], validate=True)
    if len(raw) != int(np.prod(shape)) * dtype.itemsize:
        raise ValueError(f"routed_experts: {len(raw)} bytes for shape {list(shape)} {dtype}")
    rows = np.frombuffer(bytearray(raw), dtype=dtype).reshape(shape)
    missing: list[tuple[int, int]] = []
    for pair in entry.get("missing") or []:
        start, end = (int(x) for x in pair)
        if not 0 <= start < end <= shape[0]:
            raise ValueError(f"routed_experts: missing range {pair} outside {shape[0]} rows")
        missing.append((start, end))
    return ExportRouting(rows.astype(dtype.newbyteorder("="), copy=False), tuple(sorted(missing)))


def routing_missing(turn: dict[str, Any], prompt_length: int, routing: ExportRouting) -> bool:
    """Whether ``turn`` samples a token after a row its engine could not give (or the proxy
    says so): its logprobs were computed with routing that cannot be replayed."""
    if turn.get("routing_missing"):
        return True
    first = routing.first_missing
    # The token at position p is computed from the rows of positions before p.
    return first is not None and prompt_length + int(turn["response_end"]) - 1 > first
