"""A session's tree as nodes a trainer can pack (``GET /sessions/<trial_id>/tree``).

Every trainer that packs an agent's branches into one sequence (TRL's AsyncGRPO, AReaL's
trie packing, verl's tree attention) rebuilds the tree from token ids; the proxy already
holds it, so it hands it over: ``{"trial_id", "nodes": [...]}``, one node per turn, in turn
order (a parent before its children).

A node is a run of tokens: its turn's context ids (mask 0: a whole rendering for a root,
the bridge and the new messages otherwise) followed by its completion ids (mask 1). Node
boundaries fall at the *end* of each turn's completion, which is what makes a node path
and an exported trajectory the same tokens: a trajectory's ``prompt_ids`` is its root's
context ids and its ``response_ids`` are the root's completion, then each later turn's
context and completion (``Session.trajectory``). So for the path ``nodes`` a trajectory
names, root first:

* ``prompt_ids + response_ids`` == the nodes' ``ids`` concatenated;
* ``[0] * len(prompt_ids) + response_mask`` == their ``mask`` concatenated, and likewise
  ``logprobs`` (0.0 in the prompt), ``versions`` (-1 in the prompt) and, once a teacher
  scored the session, ``teacher_logprobs`` (0.0 where the mask is 0; a node that sampled
  nothing has none, and counts as zeros);
* the trajectory's ``multi_modal_data.images`` == the nodes' ``images`` in path order
  (spans are positions in ``prompt_ids + response_ids``: a node sits at the same position,
  ``start``, in every trajectory through it).

Every stored token is in exactly one node. Tokens two nodes repeat (a rewritten history's
system prompt, a retry's context) stay where the session stored them: ``sdk.tree`` merges
such siblings' common prefixes when it packs.
"""

from __future__ import annotations

from typing import Any

from proxy.sessions.model import Session, TurnNode, node_versions

__all__ = ["node_teacher", "session_tree", "tree_node"]


def session_tree(session: Session) -> dict[str, Any]:
    """The session as ``{"trial_id", "nodes"}``, one node per turn in turn order."""
    return {
        "trial_id": session.trial_id,
        "nodes": [tree_node(session, node) for node in session.nodes],
    }


def tree_node(session: Session, node: TurnNode) -> dict[str, Any]:
    """One turn as a node: its context ids then its completion ids, with per-token mask,
    logprobs and versions, the turns it holds, its agent and its images."""
    context, sampled = len(node.context_ids), len(node.completion_ids)
    ids = node.context_ids.tolist()
    ids.extend(node.completion_ids)
    versions = [-1] * context
    for version, lo, hi in node_versions(node):
        versions.extend([version] * (hi - lo))
    out: dict[str, Any] = {
        "id": node.index,
        "parent": node.parent,
        # Its first token's position in every trajectory through it: its position ids
        # continue from its parent's last, as each path's would.
        "start": node.prompt_len - context,
        "ids": ids,
        "mask": [0] * context + [1] * sampled,
        "logprobs": [0.0] * context + node.logprobs.tolist(),
        "versions": versions,
        "turns": [node.index],
        "agent": node.agent.as_dict(),
        # What sdk.samples needs to cut a path before a turn the agent never received.
        "delivered": node.meta.delivered,
        "retry_of": node.meta.retry_of,
        "images": [session.image_entry(placed) for placed in node.images],
    }
    teacher = node_teacher(node)
    if teacher is not None:
        out["teacher_model"], out["teacher_logprobs"] = teacher
    return out


def node_teacher(node: TurnNode) -> tuple[str, list[float]] | None:
    """The teacher that scored the node's sampled tokens and its logprob of each of the
    node's tokens (0.0 where the mask is 0), or None while no teacher scored it
    (``proxy.sessions.teacher``: ``POST /sessions/<trial>/teacher``). A trajectory's
    ``teacher_logprobs`` are its nodes' concatenated, a node that sampled nothing giving
    zeros."""
    if node.teacher is None:
        return None
    return node.teacher.model, [0.0] * len(node.context_ids) + node.teacher.logprobs.tolist()
