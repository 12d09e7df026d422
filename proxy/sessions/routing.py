"""Mixture-of-experts routing rows (rollout routing replay, R3) as a session keeps them.

Position ``p`` of a trajectory's ``prompt_ids + response_ids`` has one row: the experts each
MoE layer routed the token at ``p`` to (``[layers, top_k]``), for every position run forward,
which is all but the last sampled token. A chain of turns holds each row once: a turn keeps
the rows of positions ``[start, end - 1)``, where ``start`` is its parent's ``end - 1`` (0 for
a root) and ``end`` its own: its context tokens' rows from its prefill, its sampled tokens'
from its decode, all but its last sampled token, whose row the next turn's prefill makes.
So each turn asks the engine only for rows from ``start`` on.

Rows that never came (the worker was lost and nobody finished the request, the reply was
cut, an engine gave fewer) are zeros in the array and named in ``missing``: a trainer
replaying routing must leave such a turn out, as it leaves out a reply the agent never
received.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any

import msgspec

from relay import protocol

# (start, end): half-open ranges of positions; (version, start, end): the policy version
# whose forward made the rows of those positions.
Span = tuple[int, int]
VersionSpan = tuple[int, int, int]


class TurnRouting(msgspec.Struct, frozen=True, gc=False):
    """The routing rows one turn added: positions ``[start, start + rows)``, C-order
    ``[rows, layers, top_k]`` of ``dtype`` (little-endian) in ``data``, zeros in the
    ``missing`` ranges."""

    start: int
    rows: int
    layers: int
    top_k: int
    experts: int
    data: bytes = b""
    missing: tuple[Span, ...] = ()
    versions: tuple[VersionSpan, ...] = ()

    @property
    def shape(self) -> protocol.RoutingShape:
        return protocol.RoutingShape(self.layers, self.top_k, self.experts)

    @property
    def end(self) -> int:
        return self.start + self.rows

    def head(self) -> RoutingHead:
        """Everything but the rows (what the store keeps as JSON beside the BLOB)."""
        return RoutingHead(
            self.start,
            self.rows,
            self.layers,
            self.top_k,
            self.experts,
            self.missing,
            self.versions,
        )

    @classmethod
    def from_head(cls, head: RoutingHead, data: bytes) -> TurnRouting:
        shape = protocol.RoutingShape(head.layers, head.top_k, head.experts)
        if len(data) != head.rows * shape.row_bytes:
            raise ValueError(f"{len(data)} bytes of routing rows are not {head.rows} rows")
        return cls(
            head.start,
            head.rows,
            head.layers,
            head.top_k,
            head.experts,
            data,
            head.missing,
            head.versions,
        )


class RoutingHead(msgspec.Struct, frozen=True, gc=False):
    start: int
    rows: int
    layers: int
    top_k: int
    experts: int
    missing: tuple[Span, ...] = ()
    versions: tuple[VersionSpan, ...] = ()


def turn_routing(
    shape: protocol.RoutingShape,
    start: int,
    end: int,
    got_start: int,
    data: bytes | bytearray,
    got_missing: Sequence[Span] = (),
    got_versions: Sequence[VersionSpan] = (),
) -> TurnRouting:
    """A turn's rows of positions ``[start, end)`` from the rows a call gathered
    (positions from ``got_start`` on, with their own missing ranges and versions): rows
    past ``end`` are dropped, rows not there are zeros and missing."""
    size = shape.row_bytes
    rows = max(0, end - start)
    have_end = got_start + len(data) // size
    lo, hi = max(start, got_start), min(end, have_end)
    out = bytearray(rows * size)
    missing: list[Span] = []
    if hi > lo:
        out[(lo - start) * size : (hi - start) * size] = data[
            (lo - got_start) * size : (hi - got_start) * size
        ]
        missing.extend((max(a, lo), min(b, hi)) for a, b in got_missing if min(b, hi) > max(a, lo))
    else:
        lo = hi = start
    if lo > start:
        missing.insert(0, (start, lo))
    if end > hi and rows:
        missing.append((hi, end))
    versions = tuple(
        (v, max(a, lo), min(b, hi)) for v, a, b in got_versions if min(b, hi) > max(a, lo)
    )
    return TurnRouting(
        start,
        rows,
        shape.layers,
        shape.top_k,
        shape.experts,
        bytes(out),
        _merged(missing),
        versions,
    )


def _merged(spans: Sequence[Span]) -> tuple[Span, ...]:
    out: list[Span] = []
    for a, b in sorted(spans):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(b, out[-1][1]))
        else:
            out.append((a, b))
    return tuple(out)


def export_routing(parts: Sequence[tuple[int, int, TurnRouting | None]]) -> dict[str, Any]:
    """The ``routed_experts`` of a trajectory from its turns' ``(start, end, routing)``,
    root first (each turn's rows run from where its parent's end): one array of every row
    in order, with the missing ranges and which version made which rows."""
    known = next((r for _, _, r in parts if r is not None), None)
    shape = known.shape if known is not None else protocol.RoutingShape(0, 0, 0)
    size = shape.row_bytes
    data = bytearray()
    missing: list[Span] = []
    versions: list[VersionSpan] = []
    for start, end, routing in parts:
        if routing is None or routing.shape != shape or routing.start != start:
            # Recorded without rows (or, never expected, with rows of another model).
            data.extend(bytes(max(0, end - start) * size))
            if end > start:
                missing.append((start, end))
            continue
        data.extend(routing.data)
        missing.extend(routing.missing)
        for version, lo, hi in routing.versions:
            if versions and versions[-1][0] == version and versions[-1][2] == lo:
                versions[-1] = (version, versions[-1][1], hi)
            else:
                versions.append((version, lo, hi))
    rows = parts[-1][1] if parts else 0
    return {
        "dtype": shape.dtype,
        "shape": [rows, shape.layers, shape.top_k],
        "data": base64.b64encode(data).decode(),
        "missing": [list(span) for span in _merged(missing)],
        "versions": [list(span) for span in versions],
    }
