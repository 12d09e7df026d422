"""Packing a session's tree: each path's tokens at their own positions, seeing exactly
their own path, weighted as the flat samples train them, and one forward of the tiny model
scoring every token as a forward of its trajectory alone does."""

from __future__ import annotations

import random
from array import array
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from proxy.sessions.model import PlacedImage, Session, TrialId, TurnNode
from proxy.sessions.tree import session_tree
from sdk.samples import BranchPolicy, SharedTurns, build_samples
from sdk.tree import PackedTree, export_nodes, pack_tree, tree_nodes
from tests.proxy.sessions.test_tree import SHAPES, _add, _meta


def _check_paths(packed: PackedTree, export: dict[str, Any]) -> None:
    """Every trajectory, read through ``paths``: its ids, positions 0.., each token's
    predecessor the one before it, and the keys it sees exactly the ones before it."""
    allowed = packed.attention_mask()
    ids = np.asarray(packed.input_ids)
    for tokens, traj in zip(packed.paths, export["trajectories"], strict=True):
        assert ids[tokens].tolist() == traj["prompt_ids"] + traj["response_ids"]
        assert [packed.position_ids[t] for t in tokens] == list(range(len(tokens)))
        assert [packed.predecessor[t] for t in tokens] == [-1, *tokens[:-1]]
        for p, t in enumerate(tokens):
            assert np.flatnonzero(allowed[t]).tolist() == sorted(tokens[: p + 1])


@pytest.mark.parametrize("merge", [True, False], ids=["merged", "per-turn"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_each_path_reads_as_its_trajectory(shape: str, merge: bool) -> None:
    """Packed from the tree or from the export, every trajectory is found whole at its own
    positions and sees only its own path; the sampled tokens and their logprobs are each
    in the sequence once."""
    s = SHAPES[shape]()
    export = s.export()
    packed = pack_tree(session_tree(s), merge_prefixes=merge)
    _check_paths(packed, export)
    assert pack_tree(export, merge_prefixes=merge) == packed
    assert sum(packed.mask) == s.sampled_tokens
    assert packed.tree_tokens <= s.stored_tokens
    sampled = [
        lp
        for node in session_tree(s)["nodes"]
        for lp, m in zip(node["logprobs"], node["mask"], strict=True)
        if m
    ]
    assert sorted(lp for lp, m in zip(packed.logprobs, packed.mask, strict=True) if m) == sorted(
        sampled
    )


def test_a_rewritten_history_and_a_retry_share_their_common_context() -> None:
    """Two roots that start with the same system prompt, and a retry with its attempt's
    context, are laid out once up to where they differ; sampled tokens never merge."""
    s = SHAPES["rewrite"]()
    merged, apart = pack_tree(session_tree(s)), pack_tree(session_tree(s), merge_prefixes=False)
    assert apart.tree_tokens == s.stored_tokens
    assert merged.tree_tokens == s.stored_tokens - 2  # [1, 2] of the second root
    assert merged.segment_nodes[0] == [0, 2]
    assert merged.input_ids[:2] == [1, 2]
    retry = SHAPES["retry"]()
    packed = pack_tree(session_tree(retry))
    assert packed.tree_tokens == retry.stored_tokens - 2  # the retry's context [20, 21]
    shared = [t for t, seg in enumerate(packed.segment_ids) if len(packed.segment_nodes[seg]) > 1]
    assert [packed.input_ids[t] for t in shared] == [20, 21]
    assert not any(packed.mask[t] for t in shared)


def test_different_images_with_the_same_placeholders_are_not_shared() -> None:
    """Two branches whose contexts hold the same placeholder ids for different images
    share nothing past the first image; each image is once in the packed sequence, its
    span where its placeholders are."""
    s = SHAPES["images"]()
    packed = pack_tree(session_tree(s))
    assert packed.tree_tokens == s.stored_tokens  # [3, 7, 4] and [5, 7, 7] share nothing
    assert [(i.sha256[0], packed.input_ids[i.start : i.end]) for i in packed.images] == [
        ("a", [7, 7]),
        ("b", [7]),
        ("a", [7, 7]),
    ]
    t = Session(TrialId("t"), "k")
    t.images = s.images
    image = s.nodes[0].images
    _add(t, None, [1, 7, 7, 2], [10], images=image)
    _add(t, None, [1, 7, 7, 3], [11], images=(PlacedImage("b" * 64, 1, 3),))
    assert pack_tree(session_tree(t)).tree_tokens == t.stored_tokens - 1  # only [1]


def test_weights_match_the_flat_samples() -> None:
    """From the tree: ``once`` weighs each sampled token 1, ``each`` by the paths through
    it, as ``build_samples(keep_undelivered=True)`` trains them; with samples, the weights
    count exactly what those samples train (the cut attempt nothing by default)."""
    s = SHAPES["retry"]()
    tree, export = session_tree(s), s.export()
    for shared in SharedTurns:
        samples = build_samples(export, keep_undelivered=True, shared_turns=shared)
        from_tree = pack_tree(tree, shared_turns=shared)
        from_samples = pack_tree(tree, samples)
        assert from_tree.loss_weights == from_samples.loss_weights
        assert sum(from_tree.loss_weights) == sum(x.sampled_tokens for x in samples)
    fork = SHAPES["fork"]()
    each = pack_tree(session_tree(fork), shared_turns="each")
    assert [each.loss_weights[t] for t in each.paths[0] if each.mask[t]] == [2, 2, 1, 1]
    received = build_samples(export)
    packed = pack_tree(tree, received, sample_weights=[0.5] * len(received))
    assert sum(packed.loss_weights) == 0.5 * sum(x.sampled_tokens for x in received)
    assert not any(2 in nodes for nodes in packed.segment_nodes)  # the cut attempt: no sample


def test_a_teachers_logprobs_are_packed_with_the_tokens_they_score() -> None:
    """Each trajectory's teacher logprobs read through its path; a session with a sampled
    turn no teacher scored packs none."""
    s = SHAPES["teacher"]()
    export = s.export()
    packed = pack_tree(session_tree(s))
    assert packed.teacher_model == "teacher"
    assert packed.teacher_logprobs is not None
    for tokens, traj in zip(packed.paths, export["trajectories"], strict=True):
        expected = [0.0] * len(traj["prompt_ids"]) + traj["teacher_logprobs"]
        assert [packed.teacher_logprobs[t] for t in tokens] == expected
    assert pack_tree(export) == packed
    s.nodes[1].teacher = None
    assert pack_tree(session_tree(s)).teacher_logprobs is None


def test_samples_pack_only_their_paths() -> None:
    """Packing samples leaves out the branches no sample holds, and each sample's path is
    its own ids (cut where the sample was cut)."""
    s = SHAPES["fork"]()
    export = s.export()
    (longest,) = build_samples(export, policy=BranchPolicy.LONGEST)
    packed = pack_tree(session_tree(s), [longest])
    (tokens,) = packed.paths
    assert [packed.input_ids[t] for t in tokens] == longest.prompt_ids + longest.response_ids
    assert packed.tree_tokens == len(tokens)
    (cut,) = build_samples(export, policy=BranchPolicy.LONGEST, max_response_tokens=3)
    assert len(pack_tree(session_tree(s), [cut]).paths[0]) == len(cut.prompt_ids) + 3


def test_layouts_for_flex_attention_and_varlen_kernels_agree_with_the_mask() -> None:
    """The ancestor matrix and the per-segment root-path keys give the dense mask."""
    packed = pack_tree(session_tree(SHAPES["fork"]()))
    anc, seg = packed.ancestor_matrix(), np.asarray(packed.segment_ids)
    q, k = np.indices((packed.tree_tokens,) * 2)
    assert (anc[seg[q], seg[k]] & (k <= q) == packed.attention_mask()).all()
    varlen = packed.varlen()
    kv, cu_q, cu_k = (
        varlen["tree_kv_index"],
        varlen["tree_cu_seqlens_q"],
        varlen["tree_cu_seqlens_k"],
    )
    for segment in range(len(packed.segment_parents)):
        keys = kv[cu_k[segment] : cu_k[segment + 1]]
        queries = range(cu_q[segment], cu_q[segment + 1])
        for i, query in enumerate(queries):  # causal, aligned to the keys' end
            visible = keys[: len(keys) - len(queries) + i + 1]
            assert visible == np.flatnonzero(packed.attention_mask()[query]).tolist()


def _random_session(rng: random.Random, turns: int) -> Session:
    """Forks, new roots that repeat a system prompt, retries: random lengths and ids."""
    s = Session(TrialId("r"), "k")
    system = [rng.randrange(5, 4000) for _ in range(rng.randrange(1, 12))]
    for _ in range(turns):
        kind = rng.random()
        completion = [rng.randrange(5, 4000) for _ in range(rng.randrange(0, 6))]
        if not s.nodes or kind < 0.15:
            context = system + [rng.randrange(5, 4000) for _ in range(rng.randrange(1, 5))]
            _add(s, None, context, completion)
        elif kind < 0.3:  # a retry: its sibling's context again
            sibling = rng.choice(s.nodes)
            _add(
                s, sibling.parent, sibling.context_ids.tolist(), completion, retry_of=sibling.index
            )
        else:
            parent = rng.choice(s.nodes).index
            _add(
                s, parent, [rng.randrange(5, 4000) for _ in range(rng.randrange(1, 6))], completion
            )
    return s


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), turns=st.integers(1, 14), merge=st.booleans())
def test_any_tree_packs_into_its_trajectories(seed: int, turns: int, merge: bool) -> None:
    """Random trees: every trajectory whole at its positions, seeing exactly its path."""
    s = _random_session(random.Random(seed), turns)
    export = s.export()
    packed = pack_tree(session_tree(s), merge_prefixes=merge)
    _check_paths(packed, export)
    assert pack_tree(export_nodes(export), merge_prefixes=merge) == packed
    assert export_nodes(export) == tree_nodes(session_tree(s))


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir: Path) -> Any:
    torch.manual_seed(0)
    model: Any = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    return model.eval()


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_one_packed_forward_scores_every_token_as_its_trajectory_alone(
    tiny_model: Any, attention: str
) -> None:
    """The tiny model in float32: one forward of the packed tree with its 4D mask gives,
    at every token of every trajectory, the logprob a forward of that trajectory alone
    gives, within 1e-5."""
    tiny_model.set_attn_implementation(attention)
    s = _random_session(random.Random(7), 24)
    export = s.export()
    packed = pack_tree(session_tree(s))
    assert packed.token_ratio < 1
    with torch.no_grad():
        scores = packed.token_logprobs(tiny_model(**packed.model_inputs(), use_cache=False).logits)
        for tokens, traj in zip(packed.paths, export["trajectories"], strict=True):
            ids = torch.tensor([traj["prompt_ids"] + traj["response_ids"]])
            alone = tiny_model(input_ids=ids, use_cache=False).logits[0].log_softmax(-1)
            expected = alone[:-1].gather(-1, ids[0, 1:, None])[:, 0]
            got = scores[torch.tensor(tokens[1:])]
            assert torch.allclose(got, expected, atol=1e-5, rtol=0), (got - expected).abs().max()


def test_a_turn_with_no_tokens_keeps_its_childrens_predecessor() -> None:
    """A node without tokens (nothing added, nothing sampled) leaves its child's first
    token scored after the last token of the path before it."""
    s = Session(TrialId("t"), "k")
    _add(s, None, [1, 2], [3])
    node = TurnNode(1, 0, array("i"), array("i"), array("f"), 3, b"e", _meta())
    s.add_turn(node)
    _add(s, 1, [4], [5])
    packed = pack_tree(session_tree(s))
    _check_paths(packed, s.export())
