"""Building training samples from a session export."""

from __future__ import annotations

from array import array
from collections import Counter
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.sessions.model import Session, TrialId, TurnMeta, TurnNode
from sdk.samples import (
    BranchPolicy,
    OverlongPrompt,
    SharedTurns,
    StaleTokens,
    build_samples,
    scalar_reward,
)


def _traj(
    prompt: list[int], response: list[int], mask: list[int], turns: list[tuple[int, int, int]]
) -> dict[str, Any]:
    return {
        "prompt_ids": prompt,
        "response_ids": response,
        "response_mask": mask,
        "response_logprobs": [-0.1 if m else 0.0 for m in mask],
        "turns": [{"turn": t, "response_start": a, "response_end": b} for t, a, b in turns],
    }


# Turn 0 is shared by the first and the last trajectory (a fork after it).
EXPORT = {
    "trial_id": "t1",
    "reward": {"tests": 1.0, "style": 0.5},
    "trajectories": [
        _traj([1, 2], [3, 4, 5], [1, 0, 1], [(0, 0, 1), (1, 2, 3)]),
        _traj([9], [8, 7, 6, 5, 4], [1, 1, 1, 0, 1], [(2, 0, 3), (3, 4, 5)]),
        _traj([1, 2], [3, 4, 6], [1, 0, 1], [(0, 0, 1), (4, 2, 3)]),
    ],
}


def test_all_policy_gives_one_sample_per_trajectory() -> None:
    """Every branch becomes a sample carrying the summed reward."""
    samples = build_samples(EXPORT)
    assert [s.branch for s in samples] == [0, 1, 2]
    assert all(s.reward == 1.5 for s in samples)
    assert samples[1].num_turns == 2
    assert samples[1].sampled_tokens == 4


def test_longest_and_last_policies() -> None:
    """Per segment (root): LONGEST keeps the most sampled tokens (the first on a tie);
    LAST keeps the branch with the newest turn. Root 2 (trajectory 1) is a segment of its
    own, kept by both."""
    longest = build_samples(EXPORT, policy=BranchPolicy.LONGEST)
    assert [(s.segment, s.branch) for s in longest] == [(0, 0), (2, 1)]
    assert [(s.segment, s.branch) for s in build_samples(EXPORT, policy=BranchPolicy.LAST)] == [
        (2, 1),
        (0, 2),
    ]


def test_reward_key_selects_a_component() -> None:
    """A named reward component can be chosen instead of the sum."""
    assert build_samples(EXPORT, reward_key="style")[0].reward == 0.5
    assert scalar_reward(None) is None
    assert scalar_reward(2) == 2.0


def test_a_shared_turn_is_trained_once_by_default() -> None:
    """Turn 0 is in two trajectories with as many sampled tokens each: the earlier one
    trains it, the later keeps it as context; ``each`` trains it in both."""
    once = build_samples(EXPORT)
    assert [s.response_mask for s in once] == [[1, 0, 1], [1, 1, 1, 0, 1], [0, 0, 1]]
    each = build_samples(EXPORT, shared_turns=SharedTurns.EACH)
    assert [s.response_mask for s in each] == [[1, 0, 1], [1, 1, 1, 0, 1], [1, 0, 1]]
    # The trajectory with more sampled tokens owns a shared turn, whatever its position.
    longer = dict(
        EXPORT,
        trajectories=[
            *EXPORT["trajectories"][:2],
            _traj([1, 2], [3, 4, 6, 7], [1, 0, 1, 1], [(0, 0, 1), (4, 2, 4)]),
        ],
    )
    assert [s.response_mask for s in build_samples(longer)] == [
        [0, 0, 1],
        [1, 1, 1, 0, 1],
        [1, 0, 1, 1],
    ]


def test_response_truncation_is_explicit() -> None:
    """A response over the limit is cut at its end and flagged; others are not."""
    long = build_samples(EXPORT, policy=BranchPolicy.LONGEST, max_response_tokens=2)[1]
    assert long.response_ids == [8, 7]
    assert long.response_mask == [1, 1]
    assert len(long.response_logprobs) == 2
    assert long.response_truncated
    for short in build_samples(EXPORT, policy=BranchPolicy.LAST, max_response_tokens=10):
        assert not short.response_truncated
        assert not short.prompt_truncated


def test_an_overlong_prompt_is_never_cut_and_trained() -> None:
    """A prompt over ``max_prompt_tokens`` drops its sample by default; with ``mask`` the
    sample stays, cut to fit, and trains nothing."""
    assert [s.branch for s in build_samples(EXPORT, max_prompt_tokens=1)] == [1]
    masked = build_samples(EXPORT, max_prompt_tokens=1, overlong_prompt=OverlongPrompt.MASK)
    assert [s.prompt_ids for s in masked] == [[2], [9], [2]]
    assert [s.prompt_truncated for s in masked] == [True, False, True]
    assert [s.sampled_tokens for s in masked] == [0, 4, 0]


def test_empty_export_gives_no_samples() -> None:
    """A session without turns yields nothing."""
    assert build_samples({"trial_id": "x", "reward": 1.0, "trajectories": []}) == []


def test_missing_reward_component_raises() -> None:
    """Asking for a component that does not exist is an error, not a silent zero."""
    with pytest.raises(KeyError):
        build_samples(EXPORT, reward_key="nope")


def test_a_branched_session_trains_every_sampled_token_exactly_once() -> None:
    """A real session tree (a fork after the first turn, another after the second): the
    samples of all its trajectories train each turn's sampled tokens exactly once."""
    session = Session(TrialId("t"), "key")
    shape = [(None, 3, 4), (0, 2, 5), (0, 1, 2), (1, 2, 3), (1, 1, 6)]  # parent, context, reply
    for index, (parent, context, reply) in enumerate(shape):
        session.add_turn(
            TurnNode(
                index=index,
                parent=parent,
                context_ids=array("i", [100 + index] * context),
                completion_ids=array("i", [index] * reply),
                logprobs=array("f", [-0.5] * reply),
                prompt_len=context + (session.nodes[parent].end if parent is not None else 0),
                key=bytes([index]) * 16,
                meta=TurnMeta("openai.chat", "m", "m", "w", "stop", {}, 0.0, 0.0, 0.0, "x"),
            )
        )
    export = session.export()
    assert len(export["trajectories"]) == 3
    trained: Counter[int] = Counter()
    for sample in build_samples(export):
        for token, bit in zip(sample.response_ids, sample.response_mask, strict=True):
            trained[token] += bit
    assert +trained == {index: reply for index, (_, _, reply) in enumerate(shape)}
    repeated = sum(s.sampled_tokens for s in build_samples(export, shared_turns=SharedTurns.EACH))
    assert repeated > sum(reply for _, _, reply in shape)


def _versioned(
    versions: list[int], mask: list[int], turns: list[tuple[int, int, int]] | None = None
) -> dict[str, Any]:
    traj = _traj([1], list(range(10, 10 + len(mask))), mask, turns or [(0, 0, len(mask))])
    traj["response_versions"] = versions
    return {"trial_id": "t", "reward": 1.0, "trajectories": [traj]}


def test_samples_carry_each_tokens_version_aligned_with_the_response() -> None:
    """``response_versions`` has one entry per response id, -1 where the mask is 0, and
    its minimum and maximum over the trained tokens; a sample that trains nothing has
    neither."""
    (sample,) = build_samples(_versioned([1, -1, 2, 3], [1, 0, 1, 1]))
    assert sample.response_versions == [1, -1, 2, 3]
    assert len(sample.response_versions) == len(sample.response_ids)
    assert (sample.min_version, sample.max_version) == (1, 3)
    (cut,) = build_samples(_versioned([1, -1, 2, 3], [1, 0, 1, 1]), max_response_tokens=2)
    assert cut.response_versions == [1, -1]
    assert (cut.min_version, cut.max_version) == (1, 1)
    (idle,) = build_samples(_versioned([-1, -1], [0, 0]))
    assert (idle.min_version, idle.max_version) == (None, None)


def test_tokens_older_than_the_staleness_limit_are_masked() -> None:
    """With a current version, sampled tokens more than ``max_staleness`` versions older
    are masked (only those; context stays as it was) and counted; the rest still train."""
    export = _versioned([1, -1, 2, 3, 1], [1, 0, 1, 1, 1])
    (sample,) = build_samples(export, current_version=3)
    assert sample.response_mask == [0, 0, 1, 1, 0]
    assert sample.response_versions == [-1, -1, 2, 3, -1]
    assert sample.stale_tokens == 2
    assert (sample.min_version, sample.max_version) == (2, 3)
    (lenient,) = build_samples(export, current_version=3, max_staleness=2)
    assert lenient.response_mask == [1, 0, 1, 1, 1]
    assert lenient.stale_tokens == 0
    (strict,) = build_samples(export, current_version=3, max_staleness=0)
    assert strict.response_mask == [0, 0, 0, 1, 0]
    assert strict.stale_tokens == 3


def test_drop_removes_samples_with_a_stale_token() -> None:
    """``stale=drop`` drops a sample with any stale token and keeps fresh ones whole."""
    stale = _versioned([1, -1, 3], [1, 0, 1])
    fresh = _versioned([2, -1, 3], [1, 0, 1], turns=[(1, 0, 3)])
    export = dict(stale, trajectories=[*stale["trajectories"], *fresh["trajectories"]])
    samples = build_samples(export, current_version=3, stale=StaleTokens.DROP)
    assert [s.branch for s in samples] == [1]
    assert samples[0].response_mask == [1, 0, 1]
    assert samples[0].stale_tokens == 0


def test_without_a_current_version_nothing_is_stale() -> None:
    """A synchronous trainer passes no current version: however old, every token trains."""
    (sample,) = build_samples(_versioned([0, 0, 7], [1, 1, 1]))
    assert sample.response_mask == [1, 1, 1]
    assert sample.stale_tokens == 0
    (dropped_none,) = build_samples(_versioned([0, 0, 7], [1, 1, 1]), stale=StaleTokens.DROP)
    assert dropped_none.response_mask == [1, 1, 1]


def test_an_export_without_token_versions_uses_each_turns_policy_version() -> None:
    """An export from before versions were kept per token gets each turn's
    ``extra["policy_version"]`` on its sampled tokens, 0 for a turn without one."""
    traj = _traj([1], [10, 11, 12, 13, 14], [1, 1, 0, 1, 1], [(0, 0, 2), (1, 3, 5)])
    traj["turns"][0]["extra"] = {"policy_version": 4}
    (sample,) = build_samples({"trial_id": "t", "reward": 1.0, "trajectories": [traj]})
    assert sample.response_versions == [4, 4, -1, 0, 0]
    (stale,) = build_samples(
        {"trial_id": "t", "reward": 1.0, "trajectories": [traj]}, current_version=4
    )
    assert stale.response_mask == [1, 1, 0, 0, 0]


def _turns(traj: dict[str, Any], **fields: dict[int, Any]) -> dict[str, Any]:
    for turn in traj["turns"]:
        turn["parent"] = None
        for name, values in fields.items():
            if turn["turn"] in values:
                turn[name] = values[turn["turn"]]
    return traj


def _retried_export() -> dict[str, Any]:
    """Turn 0 delivered; turn 1 (after it) cut and retried by turn 2; a root turn 3 never
    delivered and never retried; turn 4 a continuation of undelivered turn 5's reply."""
    trajectories = [
        _traj([1], [10, 11, 12, 13], [1, 0, 1, 1], [(0, 0, 1), (1, 2, 4)]),
        _traj([1], [10, 11, 14, 15], [1, 0, 1, 1], [(0, 0, 1), (2, 2, 4)]),
        _traj([5], [50, 51], [1, 1], [(3, 0, 2)]),
        _traj([6], [60, 0, 61], [1, 0, 1], [(5, 0, 1), (4, 2, 3)]),
    ]
    for traj in trajectories:
        traj["response_versions"] = [7] * len(traj["response_ids"])
        _turns(
            traj,
            delivered={0: True, 1: False, 2: True, 3: False, 4: True, 5: False},
            retry_of={2: 1},
        )
    trajectories[0]["turns"][1]["parent"] = 0
    trajectories[1]["turns"][1]["parent"] = 0
    trajectories[3]["turns"][1]["parent"] = 5
    return {"trial_id": "t", "reward": 1.0, "trajectories": trajectories}


def test_only_what_the_agent_received_is_trained() -> None:
    """A trajectory ends before a turn that was not delivered or was retried (its part
    before it is dropped when another trajectory holds it, so nothing is trained twice);
    a turn a later turn continues was received whatever its flag says."""
    samples = build_samples(_retried_export())
    assert [s.branch for s in samples] == [1, 3]
    assert [t["turn"] for t in samples[0].turns] == [0, 2]
    assert samples[0].response_ids == [10, 11, 14, 15]
    assert [t["turn"] for t in samples[1].turns] == [5, 4]
    trained = Counter(
        t for s in samples for t, m in zip(s.response_ids, s.response_mask, strict=True) if m
    )
    assert trained == Counter({10: 1, 14: 1, 15: 1, 60: 1, 61: 1})


def test_a_trajectory_cut_before_an_undelivered_leaf_keeps_its_received_part() -> None:
    """A leaf never delivered and never retried: the trajectory is trained up to it, every
    per-token list cut at the same place."""
    export = _retried_export()
    export["trajectories"] = export["trajectories"][:1]
    (sample,) = build_samples(export)
    assert [t["turn"] for t in sample.turns] == [0]
    assert sample.response_ids == [10]
    assert sample.response_mask == [1]
    assert sample.response_logprobs == [-0.1]


def test_keep_undelivered_trains_the_export_as_it_is() -> None:
    """The option keeps every trajectory whole, as before delivery was recorded; an export
    without delivery fields counts as delivered."""
    assert [s.branch for s in build_samples(_retried_export(), keep_undelivered=True)] == [
        0,
        1,
        2,
        3,
    ]
    assert [s.branch for s in build_samples(EXPORT)] == [0, 1, 2]


def test_the_last_branch_trains_the_turns_it_shares_with_dropped_ones() -> None:
    """``last`` keeps the trajectory with the newest turn of root 0's segment; turn 0,
    which it shares with a dropped branch, is trained in it (the dropped branch trains
    nothing). Root 2's segment is kept whole by both policies."""
    _, last = build_samples(EXPORT, policy=BranchPolicy.LAST)
    assert last.branch == 2
    assert last.response_mask == [1, 0, 1]
    _, longest = build_samples(EXPORT, policy=BranchPolicy.LONGEST)
    assert longest.response_mask == [1, 1, 1, 0, 1]


# A forked trial: per turn, its parent (an earlier turn, or None for a new root), the context
# tokens before its reply, its reply's length, the weights version that sampled it, and
# whether the reply reached the agent.
_TURN = st.tuples(
    st.integers(0, 100),  # picks the parent among the earlier turns (or a new root)
    st.integers(1, 3),
    st.integers(1, 4),
    st.integers(0, 3),
    st.booleans(),
)


def _forked_trial(shape: list[tuple[int, int, int, int, bool]]) -> dict[str, Any]:
    """A real session tree of that shape; turn i's reply ids are 1000 * (i + 1) + j, so a
    trained token says which turn and position it is."""
    session = Session(TrialId("t"), "key")
    for index, (pick, context, reply, version, delivered) in enumerate(shape):
        parent = None if index == 0 or pick % (index + 1) == index else pick % (index + 1)
        base = 1000 * (index + 1)
        session.add_turn(
            TurnNode(
                index=index,
                parent=parent,
                context_ids=array("i", [7] * context),
                completion_ids=array("i", range(base, base + reply)),
                logprobs=array("f", [-0.5] * reply),
                prompt_len=context + (session.nodes[parent].end if parent is not None else 0),
                key=index.to_bytes(16, "big"),
                meta=TurnMeta(
                    "openai.chat",
                    "m",
                    "m",
                    "w",
                    "stop",
                    {},
                    0.0,
                    0.0,
                    0.0,
                    "x",
                    versions=[[version, 0, reply]],
                    delivered=delivered,
                ),
            )
        )
    export = session.export()
    export["reward"] = 1.0
    return export


@settings(max_examples=150, deadline=None)
@given(
    shape=st.lists(_TURN, min_size=1, max_size=8),
    policy=st.sampled_from(list(BranchPolicy)),
    current=st.one_of(st.none(), st.integers(0, 4)),
    stale=st.sampled_from(list(StaleTokens)),
    limit=st.one_of(st.none(), st.integers(1, 12)),
)
def test_every_kept_sampled_token_is_trained_exactly_once(
    shape: list[tuple[int, int, int, int, bool]],
    policy: BranchPolicy,
    current: int | None,
    stale: StaleTokens,
    limit: int | None,
) -> None:
    """Whatever the branch policy, over any forked trial: every sampled token of a kept
    trajectory (within the response limit, not stale) is trained in exactly one kept
    sample, and no token is trained twice."""
    export = _forked_trial(shape)
    samples = build_samples(
        export,
        policy=policy,
        current_version=current,
        stale=stale,
        max_response_tokens=limit,
    )
    if policy is not BranchPolicy.ALL:  # one per segment (root)
        assert len({s.segment for s in samples}) == len(samples)
    trained: Counter[int] = Counter()
    trainable: set[int] = set()
    for sample in samples:
        for token, bit in zip(sample.response_ids, sample.response_mask, strict=True):
            trained[token] += bit
        for turn in sample.turns:
            start, end = turn["response_start"], turn["response_end"]
            version = turn["versions"][0][0]
            fresh = current is None or version >= current - 1
            if fresh:
                trainable.update(sample.response_ids[start : min(end, len(sample.response_ids))])
    assert all(count <= 1 for count in trained.values())
    assert set(+trained) == trainable


def _scored(traj: dict[str, Any]) -> dict[str, Any]:
    """``traj`` scored by a teacher: -(i + 1) / 10 at sampled token i, 0.0 elsewhere."""
    teacher = [-(i + 1) / 10 if m else 0.0 for i, m in enumerate(traj["response_mask"])]
    return {**traj, "teacher_logprobs": teacher, "teacher_model": "big"}


def test_samples_carry_the_teachers_logprobs_cut_as_the_response() -> None:
    """A scored export's samples carry its teacher's logprobs and name, cut where the
    response is cut (length limit, a turn the agent never received); an unscored one's
    carry none."""
    scored = {**EXPORT, "trajectories": [_scored(t) for t in EXPORT["trajectories"]]}
    samples = build_samples(scored)
    assert [s.teacher_logprobs for s in samples] == [
        t["teacher_logprobs"] for t in scored["trajectories"]
    ]
    assert {s.teacher_model for s in samples} == {"big"}
    (cut,) = build_samples(
        {**scored, "trajectories": scored["trajectories"][1:2]}, max_response_tokens=2
    )
    assert cut.teacher_logprobs == [-0.1, -0.2]
    undelivered = _scored(EXPORT["trajectories"][1])
    undelivered["turns"] = [
        *undelivered["turns"][:1],
        {**undelivered["turns"][1], "delivered": False},
    ]
    (received,) = build_samples({**EXPORT, "trajectories": [undelivered]})
    assert received.response_ids == [8, 7, 6]
    assert received.teacher_logprobs == [-0.1, -0.2, -0.3]
    assert all(
        s.teacher_logprobs is None and s.teacher_model is None for s in build_samples(EXPORT)
    )
