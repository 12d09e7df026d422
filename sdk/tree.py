"""Packing a session's tree into one sequence for a trainer: each token once, one forward.

Every root-to-leaf path of a session is a trajectory, so the flat samples compute a prefix
shared by several paths (the system prompt and tools, every turn before a fork) once per
path. ``pack_tree`` lays the tree out once instead:

* **Input**: the tree (``ProxyClient.tree``: ``GET /sessions/<trial>/tree``), or an
  export's trajectories (``export_nodes`` rebuilds the same nodes from each trajectory's
  ``nodes`` and turn ends). Node ``n``'s tokens are ``ids``; a path's ids concatenated are
  its trajectory's ``prompt_ids + response_ids`` (``proxy.sessions.tree``).
* **Layout**: depth first, a parent before its children, as *segments* (a node, or a prefix
  several nodes share, see below). ``input_ids``, ``position_ids`` (a segment's positions
  continue its parent's last: each token sits at the position it has in every trajectory
  through it), ``segment_ids`` and ``segment_offsets`` (``cu_seqlens``: segment ``k`` is
  ``input_ids[offsets[k]:offsets[k + 1]]``), ``segment_parents``.
* **Attention**: a token sees the tokens before it in its own segment and every token of
  its segment's ancestors, nothing else: ``attention_mask()`` (dense ``[T, T]`` booleans,
  for small trees: transformers takes it as a 4D mask, ``model_inputs()``), ``ancestors()``
  per segment and ``ancestor_matrix()`` (a flex attention ``mask_mod`` is
  ``anc[seg[q], seg[kv]] & (kv <= q)``: ancestors always come first), and ``varlen()``
  (per segment, the key indices of its root path: the layout TRL's AsyncGRPO ``tree_fa3``
  forward takes as ``tree_kv_index``, ``tree_cu_seqlens_q``, ``tree_cu_seqlens_k``).
* **Scoring**: a token's logprob comes from the logits at ``predecessor[t]``, the token
  before it on its path (the last of the parent segment for a segment's first token; -1 for
  a root's first), not at ``t - 1``: ``token_logprobs(logits)`` gathers them.
* **Paths**: ``paths[s]`` is, for sample ``s`` (or trajectory ``s`` without samples), the
  packed index of each of its ``prompt_ids + response_ids``: ``token_logprobs(...)[paths[s]]``
  is what a forward of that sample alone gives, so per-sample loss terms (PPO's clip with
  each sample's advantage) are computed exactly from the one forward.
* **Loss weights**: ``loss_weights[t]`` is how many times the flat samples train token
  ``t`` (times ``sample_weights``, for a loss linear in each sample's coefficient), so
  ``sum(w * loss_t)`` over the packed tokens is the flat samples' ``sum`` over their mask-1
  tokens. With ``samples=`` (what ``build_samples`` returned, any options) it counts the
  samples whose mask is 1 there: exactly the flat samples. From the tree alone it is what
  ``build_samples(export, keep_undelivered=True, shared_turns=...)`` trains:
  ``shared_turns="once"`` weight 1 on every sampled token (a turn shared by k paths trains
  in exactly one sample); ``"each"`` weight k (it trains in each of the k).

Shared prefixes of siblings (``merge_prefixes=True``, the default): the session stores a
root per rewritten history and a turn per retry, so two sibling nodes (or two roots) often
start with the same context tokens (the same system prompt and tools, the same request).
Their common leading context (mask 0, never a sampled token, never cutting an image or
taking a different image's placeholders) becomes a segment of its own, their parent in the
packing: same ids at the same positions after the same ancestors, so the same hidden
states. ``segment_nodes`` names the nodes whose tokens a segment holds.

Images: ``images`` are each image occurrence once, with ``start``/``end`` in packed
indices. A vision-language model's packed forward (placeholder features at those spans,
its own position scheme) is not covered here.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from sdk.samples import SampleImage, SharedTurns, export_images

if TYPE_CHECKING:
    from sdk.samples import Sample

__all__ = ["PackedTree", "TreeNode", "export_nodes", "pack_tree", "tree_nodes"]


@dataclass(slots=True, frozen=True)
class TreeNode:
    """A node of the session's tree: a turn's context then its completion."""

    id: int
    parent: int | None
    ids: list[int]
    mask: list[int]
    logprobs: list[float]
    versions: list[int]
    turns: list[int]
    agent: dict[str, Any] = field(default_factory=dict)
    # Its images, spans in positions of a trajectory's prompt_ids + response_ids.
    images: list[SampleImage] = field(default_factory=list)
    # A teacher's logprob of each token (0.0 where the mask is 0), once one scored it.
    teacher_logprobs: list[float] | None = None
    teacher_model: str | None = None

    @classmethod
    def from_wire(cls, entry: Mapping[str, Any]) -> TreeNode:
        teacher = entry.get("teacher_logprobs")
        return cls(
            id=int(entry["id"]),
            parent=None if entry.get("parent") is None else int(entry["parent"]),
            ids=list(entry["ids"]),
            mask=list(entry["mask"]),
            logprobs=list(entry["logprobs"]),
            versions=list(entry["versions"]),
            turns=list(entry.get("turns") or [entry["id"]]),
            agent=dict(entry.get("agent") or {}),
            images=[SampleImage.from_export(i) for i in entry.get("images") or []],
            teacher_logprobs=None if teacher is None else list(teacher),
            teacher_model=entry.get("teacher_model"),
        )


def tree_nodes(tree: Mapping[str, Any]) -> list[TreeNode]:
    """The nodes of a ``GET /sessions/<trial>/tree`` answer."""
    return [TreeNode.from_wire(entry) for entry in tree["nodes"]]


def export_nodes(export: Mapping[str, Any]) -> list[TreeNode]:
    """The tree's nodes rebuilt from an export: a trajectory's ``prompt_ids +
    response_ids`` split at each turn's ``response_end`` (a node ends with its turn's
    completion), named by its ``nodes`` (the turn indices, for an export without them)."""
    nodes: dict[int, TreeNode] = {}
    for traj in export.get("trajectories", []):
        prompt, response = list(traj["prompt_ids"]), list(traj["response_ids"])
        mask = [0] * len(prompt) + list(traj["response_mask"])
        logprobs = [0.0] * len(prompt) + list(traj["response_logprobs"])
        versions = traj.get("response_versions") or [0 if m else -1 for m in mask[len(prompt) :]]
        versions = [-1] * len(prompt) + list(versions)
        teacher = traj.get("teacher_logprobs")
        teacher = None if teacher is None else [0.0] * len(prompt) + list(teacher)
        images = export_images(traj)
        turns = traj["turns"]
        path = list(traj.get("nodes") or [t["turn"] for t in turns])
        if len(path) != len(turns):
            raise ValueError(f"a trajectory names {len(path)} nodes for {len(turns)} turns")
        ids, start, parent = prompt + response, 0, None
        for node_id, turn in zip(path, turns, strict=True):
            end = len(prompt) + int(turn["response_end"])
            if node_id not in nodes:
                nodes[node_id] = TreeNode(
                    id=node_id,
                    parent=parent,
                    ids=ids[start:end],
                    mask=mask[start:end],
                    logprobs=logprobs[start:end],
                    versions=versions[start:end],
                    turns=[int(turn["turn"])],
                    agent=dict(turn.get("agent") or {}),
                    images=[i for i in images if start <= i.start < end],
                    # As the tree has it: a node that sampled nothing has no score.
                    teacher_logprobs=None
                    if teacher is None or 1 not in mask[start:end]
                    else teacher[start:end],
                    teacher_model=None
                    if teacher is None or 1 not in mask[start:end]
                    else traj.get("teacher_model"),
                )
            start, parent = end, node_id
    return [nodes[k] for k in sorted(nodes)]


@dataclass(slots=True)
class PackedTree:
    """A tree packed into one sequence (see the module's docstring)."""

    input_ids: list[int]
    position_ids: list[int]
    predecessor: list[int]  # the packed index of the token before it on its path (-1: none)
    segment_ids: list[int]
    segment_offsets: list[int]  # cu_seqlens: len(segments) + 1
    segment_parents: list[int]  # -1 for a root
    segment_nodes: list[list[int]]  # the nodes whose tokens each segment holds
    mask: list[int]  # 1 on a sampled token
    logprobs: list[float]  # the recorded logprob of a sampled token, 0.0 elsewhere
    versions: list[int]  # the policy version that sampled it, -1 where the mask is 0
    loss_weights: list[float]
    paths: list[list[int]]  # per sample (or trajectory): packed index of each of its ids
    path_nodes: list[list[int]]  # per sample (or trajectory): its nodes, root first
    images: list[SampleImage] = field(default_factory=list)  # spans in packed indices
    # A teacher's logprobs, when one teacher scored every packed node that sampled.
    teacher_logprobs: list[float] | None = None
    teacher_model: str | None = None

    @property
    def tree_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def flat_tokens(self) -> int:
        """The tokens the flat samples (or trajectories) would run forward together."""
        return sum(len(path) for path in self.paths)

    @property
    def token_ratio(self) -> float:
        """Tree tokens ÷ flat tokens: the share of the flat forward the packed one does."""
        return self.tree_tokens / self.flat_tokens if self.flat_tokens else 1.0

    def ancestors(self) -> list[list[int]]:
        """Per segment, its ancestor segments root first, itself last."""
        out: list[list[int]] = []
        for k, parent in enumerate(self.segment_parents):
            out.append([*out[parent], k] if parent >= 0 else [k])  # a parent comes first
        return out

    def ancestor_matrix(self) -> np.ndarray[Any, np.dtype[np.bool_]]:
        """``[S, S]`` booleans: ``m[a, b]`` when segment ``b`` is ``a`` or an ancestor."""
        matrix = np.zeros((len(self.segment_parents),) * 2, dtype=np.bool_)
        for k, chain in enumerate(self.ancestors()):
            matrix[k, chain] = True
        return matrix

    def attention_mask(self) -> np.ndarray[Any, np.dtype[np.bool_]]:
        """``[T, T]`` booleans, True where query ``q`` may attend to key ``k`` (O(T²): for
        small trees; larger ones take ``ancestor_matrix`` or ``varlen``)."""
        seg = np.asarray(self.segment_ids, dtype=np.int64)
        allowed = self.ancestor_matrix()[seg[:, None], seg[None, :]]
        return np.tril(allowed)

    def varlen(self) -> dict[str, Any]:
        """Per segment, its queries and the keys of its root path, as a varlen attention
        (causal, aligned bottom-right: a segment's own tokens end its keys) takes them:
        ``tree_kv_index`` (key indices, segment after segment), ``tree_cu_seqlens_q``,
        ``tree_cu_seqlens_k``, ``tree_max_seqlens`` ([max q, max k]), TRL AsyncGRPO's names."""
        offsets = self.segment_offsets
        kv: list[int] = []
        cu_k = [0]
        for chain in self.ancestors():
            for k in chain:
                kv.extend(range(offsets[k], offsets[k + 1]))
            cu_k.append(len(kv))
        q_lens = [b - a for a, b in itertools.pairwise(offsets)]
        k_lens = [b - a for a, b in itertools.pairwise(cu_k)]
        return {
            "tree_kv_index": kv,
            "tree_cu_seqlens_q": list(offsets),
            "tree_cu_seqlens_k": cu_k,
            "tree_max_seqlens": [max(q_lens, default=0), max(k_lens, default=0)],
        }

    def model_inputs(self, dtype: Any = None) -> dict[str, Any]:
        """``input_ids``, ``position_ids`` and the 4D float ``attention_mask`` (0 where
        allowed, the dtype's minimum elsewhere) of a transformers causal LM forward
        (batch of one; transformers uses a 4D mask as given)."""
        import torch

        dtype = dtype or torch.float32
        allowed = torch.from_numpy(self.attention_mask())
        bias = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(
            ~allowed, torch.finfo(dtype).min
        )
        return {
            "input_ids": torch.tensor([self.input_ids]),
            "position_ids": torch.tensor([self.position_ids]),
            "attention_mask": bias[None, None],
        }

    def token_logprobs(self, logits: Any) -> Any:
        """Each packed token's logprob from a packed forward's logits (``[1, T, V]`` or
        ``[T, V]``): taken at its predecessor's row, 0.0 for a root's first token."""
        import torch

        rows = logits[0] if logits.dim() == 3 else logits
        before = torch.tensor(self.predecessor, device=rows.device)
        ids = torch.tensor(self.input_ids, device=rows.device)
        scores = rows[before.clamp(min=0)].float().log_softmax(-1)
        return scores.gather(-1, ids[:, None])[:, 0].masked_fill(before < 0, 0.0)


@dataclass(slots=True)
class _Piece:
    """A run of tokens to lay out: ``length`` tokens that each member node holds from its
    offset on (one member, or several whose common prefix it is), and what follows."""

    members: list[tuple[TreeNode, int]]
    length: int
    children: list[_Piece] = field(default_factory=list)


def pack_tree(
    tree: Mapping[str, Any] | Sequence[TreeNode],
    samples: Sequence[Sample] | None = None,
    *,
    shared_turns: SharedTurns | str = SharedTurns.ONCE,
    sample_weights: Sequence[float] | None = None,
    merge_prefixes: bool = True,
) -> PackedTree:
    """The tree (a tree answer, an export, or its nodes) packed into one sequence.

    With ``samples`` (built from this trial's export) only the nodes on their paths are
    packed, ``paths`` follows them and the weights count them (``sample_weights``: each
    sample's factor, 1 by default); a sample whose prompt was cut trains nothing and has
    an empty path. Without, every node is packed, ``paths`` follows the leaves in export
    order, and ``shared_turns`` sets the weights."""
    nodes = _nodes(tree)
    by_id = {node.id: node for node in nodes}
    if samples is not None:
        node_paths = _sample_paths(samples, by_id)
        kept = {n for path in node_paths for n in path}
    else:
        node_paths = _leaf_paths(nodes, by_id)
        kept = set(by_id)
    children: dict[int | None, list[TreeNode]] = {}
    for node in nodes:
        if node.id in kept:
            children.setdefault(node.parent, []).append(node)
    starts = _starts(nodes, by_id)
    spans = {
        node.id: [
            (i.sha256, i.start - starts[node.id], i.end - starts[node.id]) for i in node.images
        ]
        for node in nodes
        if node.images
    }
    sampling = [by_id[n] for n in kept if 1 in by_id[n].mask]
    teachers = {node.teacher_model for node in sampling}
    with_teacher = bool(sampling) and len(teachers) == 1 and None not in teachers
    roots = _pieces(children, spans, merge_prefixes)
    packed, where = _layout(roots, starts, with_teacher)
    packed.teacher_model = teachers.pop() if with_teacher else None
    for s, path in enumerate(node_paths):
        tokens = [i for n in path for i in where[n]]
        if samples is not None and path:
            tokens = tokens[: len(samples[s].prompt_ids) + len(samples[s].response_ids)]
        packed.paths.append(tokens)
        packed.path_nodes.append(path)
    if samples is not None:
        _weigh_samples(packed, samples, sample_weights)
    else:
        _weigh_tree(packed, SharedTurns(shared_turns), sample_weights)
    return packed


def _nodes(tree: Mapping[str, Any] | Sequence[TreeNode]) -> list[TreeNode]:
    if isinstance(tree, Mapping):
        nodes = tree_nodes(tree) if "nodes" in tree else export_nodes(tree)
    else:
        nodes = list(tree)
    known = {node.id for node in nodes}
    for node in nodes:
        if node.parent is not None and node.parent not in known:
            raise ValueError(f"node {node.id}'s parent {node.parent} is not in the tree")
    return nodes


def _path(node_id: int, by_id: Mapping[int, TreeNode]) -> list[int]:
    path: list[int] = []
    at: int | None = node_id
    while at is not None:
        path.append(at)
        at = by_id[at].parent
    return path[::-1]


def _leaf_paths(nodes: Sequence[TreeNode], by_id: Mapping[int, TreeNode]) -> list[list[int]]:
    """One path per leaf, in node order: the export's trajectories, in its order."""
    parents = {node.parent for node in nodes}
    return [_path(node.id, by_id) for node in nodes if node.id not in parents]


def _sample_paths(samples: Sequence[Sample], by_id: Mapping[int, TreeNode]) -> list[list[int]]:
    """Each sample's nodes: the path to the node of its last turn (none for a sample whose
    prompt was cut: it trains nothing)."""
    node_of = {turn: node.id for node in by_id.values() for turn in node.turns}
    paths: list[list[int]] = []
    for sample in samples:
        if sample.prompt_truncated or not sample.turns:
            paths.append([])
            continue
        last = sample.turns[-1]["turn"]
        if last not in node_of:
            raise ValueError(f"sample of turn {last} is not of this tree")
        paths.append(_path(node_of[last], by_id))
    return paths


# Per node, its images' half-open spans relative to the node's first token, with their hash.
_Spans = Mapping[int, list[tuple[str, int, int]]]


def _starts(nodes: Sequence[TreeNode], by_id: Mapping[int, TreeNode]) -> dict[int, int]:
    """Each node's first position in every path through it (its ancestors' tokens)."""
    starts: dict[int, int] = {}
    for node in nodes:
        chain: list[int] = []
        at: int | None = node.id
        while at is not None and at not in starts:
            chain.append(at)
            at = by_id[at].parent
        position = 0 if at is None else starts[at] + len(by_id[at].ids)
        for step in reversed(chain):
            starts[step] = position
            position += len(by_id[step].ids)
    return starts


def _pieces(
    children: Mapping[int | None, list[TreeNode]], spans: _Spans, merge: bool
) -> list[_Piece]:
    """The layout's roots: a piece per node with its children's pieces under it, each
    family's common leading context merged into a piece of its own when asked."""
    pieces = {
        node.id: _Piece([(node, 0)], len(node.ids))
        for family in children.values()
        for node in family
    }
    roots: list[_Piece] = []
    for parent, family in children.items():
        siblings = [pieces[node.id] for node in family]
        laid = _merge(siblings, spans) if merge and len(siblings) > 1 else siblings
        if parent is None:
            roots = laid
        else:
            pieces[parent].children = laid
    return roots


def _merge(siblings: list[_Piece], spans: _Spans) -> list[_Piece]:
    """Siblings (same parent, same start) with their common leading context as a shared
    piece above them, in the order of each group's first member."""
    groups: dict[object, list[_Piece]] = {}
    for position, piece in enumerate(siblings):
        node, offset = piece.members[0]
        key: object = position  # a piece that can share nothing stays alone
        if _mergeable(piece) > 0:
            key = (node.ids[offset], _image_at(spans, node.id, offset))
        groups.setdefault(key, []).append(piece)
    laid: list[_Piece] = []
    for group in groups.values():
        length = _common(group, spans) if len(group) > 1 else 0
        if length == 0:
            laid.extend(group)
            continue
        shared = _Piece([piece.members[0] for piece in group], length)
        for piece in group:
            node, offset = piece.members[0]
            piece.members = [(node, offset + length)]
            piece.length -= length
        shared.children = _merge(group, spans)
        laid.append(shared)
    return laid


def _mergeable(piece: _Piece) -> int:
    """How many of its leading tokens may be shared: its context (mask 0), less its last
    token (a piece keeps one: the path's tokens stay in their nodes' order)."""
    node, offset = piece.members[0]
    end = offset + piece.length - 1
    try:
        return node.mask.index(1, offset, end) - offset
    except ValueError:
        return max(end - offset, 0)


def _image_at(spans: _Spans, node: int, at: int) -> str | None:
    return next((sha for sha, lo, hi in spans.get(node, ()) if lo <= at < hi), None)


def _common(group: list[_Piece], spans: _Spans) -> int:
    """The length of the group's common leading context: equal ids, the same images in
    the same places, no image cut."""
    first, first_offset = group[0].members[0]
    length = min(_mergeable(piece) for piece in group)
    head = np.asarray(first.ids[first_offset : first_offset + length])
    for piece in group[1:]:
        node, offset = piece.members[0]
        other = np.asarray(node.ids[offset : offset + length])
        differ = np.flatnonzero(head[: len(other)] != other[: len(head)])
        length = min(length, int(differ[0]) if differ.size else length)
        head = head[:length]
    while length > 0:
        placed = [
            {(sha, lo - o, hi - o) for sha, lo, hi in spans.get(n.id, ()) if o <= lo < o + length}
            for n, o in (piece.members[0] for piece in group)
        ]
        shared = set.intersection(*placed)
        # An image the cut would split, or one not in every member at the same place,
        # starts after the shared piece.
        cuts = [
            lo
            for each in placed
            for sha, lo, hi in each
            if lo < length < hi or (sha, lo, hi) not in shared
        ]
        if not cuts:
            return length
        length = min(cuts)
    return 0


def _layout(
    roots: list[_Piece], starts: Mapping[int, int], with_teacher: bool
) -> tuple[PackedTree, dict[int, list[int]]]:
    """The pieces depth first into one sequence; where each node's tokens went."""
    packed = PackedTree([], [], [], [], [0], [], [], [], [], [], [], [], [])
    teacher: list[float] = []
    where: dict[int, list[int]] = {}
    last: list[int] = []  # per segment, the packed index of the last token up to its end
    stack: list[tuple[_Piece, int]] = [(piece, -1) for piece in reversed(roots)]
    while stack:
        piece, parent = stack.pop()
        node, offset = piece.members[0]
        segment, begin, end = (
            len(packed.segment_parents),
            len(packed.input_ids),
            offset + piece.length,
        )
        packed.input_ids.extend(node.ids[offset:end])
        packed.mask.extend(node.mask[offset:end])
        packed.logprobs.extend(node.logprobs[offset:end])
        packed.versions.extend(node.versions[offset:end])
        if with_teacher:  # a node that sampled nothing was not scored: zeros
            scored = node.teacher_logprobs or [0.0] * len(node.ids)
            teacher.extend(scored[offset:end])
        first = starts[node.id] + offset
        packed.position_ids.extend(range(first, first + piece.length))
        before = last[parent] if parent >= 0 else -1
        packed.predecessor.extend([before, *range(begin, begin + piece.length - 1)][: piece.length])
        packed.segment_ids.extend([segment] * piece.length)
        packed.segment_offsets.append(begin + piece.length)
        packed.segment_parents.append(parent)
        packed.segment_nodes.append([member.id for member, _ in piece.members])
        last.append(begin + piece.length - 1 if piece.length else before)
        for member, at in piece.members:
            where.setdefault(member.id, [-1] * len(member.ids))[at : at + piece.length] = range(
                begin, begin + piece.length
            )
        packed.images.extend(_packed_images(node, offset, piece.length, begin, starts))
        stack.extend((child, segment) for child in reversed(piece.children))
    packed.teacher_logprobs = teacher if with_teacher else None
    return packed, where


def _packed_images(
    node: TreeNode, offset: int, length: int, begin: int, starts: Mapping[int, int]
) -> list[SampleImage]:
    """The images of ``node`` within the piece's tokens, spans moved to packed indices."""
    by_span = {(i.start - starts[node.id], i.end - starts[node.id]): i for i in node.images}
    return [
        SampleImage(
            image.sha256,
            image.mime,
            image.width,
            image.height,
            begin + lo - offset,
            begin + hi - offset,
        )
        for (lo, hi), image in by_span.items()
        if offset <= lo and hi <= offset + length
    ]


def _weigh_samples(
    packed: PackedTree, samples: Sequence[Sample], factors: Sequence[float] | None
) -> None:
    """Each sampled token's weight: the factors of the samples that train it (mask 1)."""
    weights = [0.0] * len(packed.input_ids)
    for s, (sample, tokens) in enumerate(zip(samples, packed.paths, strict=True)):
        if not tokens:
            continue
        ids = [*sample.prompt_ids, *sample.response_ids]
        if len(tokens) != len(ids) or any(
            packed.input_ids[t] != i for t, i in zip(tokens, ids, strict=True)
        ):
            raise ValueError(f"sample {s}'s ids are not its path's in this tree")
        factor = 1.0 if factors is None else float(factors[s])
        prompt = len(sample.prompt_ids)
        for j, trained in enumerate(sample.response_mask):
            if trained:
                weights[tokens[prompt + j]] += factor
    packed.loss_weights = weights


def _weigh_tree(packed: PackedTree, shared: SharedTurns, factors: Sequence[float] | None) -> None:
    """From the tree alone: ``once`` 1 on every sampled token; ``each`` the factors (1 by
    default) of every path through it."""
    if shared is SharedTurns.ONCE:
        if factors is not None:
            raise ValueError('sample_weights need samples= or shared_turns="each"')
        packed.loss_weights = [float(m) for m in packed.mask]
        return
    weights = [0.0] * len(packed.input_ids)
    for p, tokens in enumerate(packed.paths):
        factor = 1.0 if factors is None else float(factors[p])
        for t in tokens:
            if packed.mask[t]:
                weights[t] += factor
    packed.loss_weights = weights
