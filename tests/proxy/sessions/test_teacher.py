"""A teacher's logprobs in a session: which forcings score what, and what the export gets."""

from __future__ import annotations

from array import array

from proxy.sessions.model import Session, TrialId, TurnMeta, TurnNode
from proxy.sessions.teacher import (
    TurnTeacher,
    export_teacher,
    plan_scoring,
    turn_teacher_logprobs,
)


def _add(session: Session, parent: int | None, context: list[int], completion: list[int]) -> None:
    prompt_len = len(context) + (session.nodes[parent].end if parent is not None else 0)
    meta = TurnMeta("openai.chat", "tiny", "gpt-x", "w1", "stop", {}, 0.0, 0.0, 0.0, "continued")
    session.add_turn(
        TurnNode(
            index=len(session.nodes),
            parent=parent,
            context_ids=array("i", context),
            completion_ids=array("i", completion),
            logprobs=array("f", [-1.0] * len(completion)),
            prompt_len=prompt_len,
            key=bytes([len(session.nodes)]) * 16,
            meta=meta,
        )
    )


def _tree() -> Session:
    """A root and its two branches (a continuation, and a retry from the root), then a
    turn that sampled nothing as a root of its own."""
    s = Session(TrialId("t"), "rr-t.x", model="tiny")
    _add(s, None, [1, 2, 3], [10, 11])  # 0: positions 3, 4
    _add(s, 0, [4], [12, 13, 14])  # 1: positions 6..8
    _add(s, 0, [5, 6], [15])  # 2: positions 7
    _add(s, None, [7], [])  # 3: nothing sampled
    return s


def _score_all(s: Session, model: str) -> None:
    """Give every planned turn ``model``'s score: -(position) for each sampled token."""
    for plan in plan_scoring(s, model):
        logprobs = [-float(p) for p in range(plan.start, len(plan.ids))]
        for index, values in plan.split(s, logprobs).items():
            s.nodes[index].teacher = TurnTeacher(model, values)


def test_each_sampled_turn_is_scored_once_in_one_forcing_per_path() -> None:
    """The first path scores its turns from the root's first sampled token; the branch's
    path scores only its own turn; a turn that sampled nothing needs no forcing."""
    s = _tree()
    first, second = plan_scoring(s, "big")
    assert (first.turns, first.start, first.scored) == ((0, 1), 3, 5)
    assert first.ids.tolist() == [1, 2, 3, 10, 11, 4, 12, 13, 14]
    assert (second.turns, second.start, second.scored) == ((2,), 7, 1)
    assert second.ids.tolist() == [1, 2, 3, 10, 11, 5, 6, 15]
    split = first.split(s, [-float(p) for p in range(3, 9)])
    assert split[0].tolist() == [-3.0, -4.0]
    assert split[1].tolist() == [-6.0, -7.0, -8.0]


def test_a_scored_session_plans_nothing_for_its_teacher_and_all_for_another() -> None:
    """Asked again, the teacher that scored every turn has nothing left; another teacher
    scores every turn anew."""
    s = _tree()
    _score_all(s, "big")
    assert plan_scoring(s, "big") == []
    assert [p.turns for p in plan_scoring(s, "other")] == [(0, 1), (2,)]
    _add(s, 1, [8], [16, 17])  # a new turn after the teacher scored
    (new,) = plan_scoring(s, "big")
    assert (new.turns, new.start, new.scored) == ((4,), 10, 2)


def test_the_export_aligns_teacher_logprobs_with_the_response() -> None:
    """Each trajectory's teacher logprobs line up with its response ids: the teacher's at
    sampled tokens, 0.0 on the context between turns; a path with a turn not scored, or
    scored by two teachers, has none."""
    s = _tree()
    assert export_teacher(s.path(1)) is None
    _score_all(s, "big")
    trajectories = {t["turns"][-1]["turn"]: t for t in s.export()["trajectories"]}
    branch = trajectories[1]
    assert branch["teacher_model"] == "big"
    assert branch["teacher_logprobs"] == [-3.0, -4.0, 0.0, -6.0, -7.0, -8.0]
    assert len(branch["teacher_logprobs"]) == len(branch["response_ids"])
    pairs = zip(branch["teacher_logprobs"], branch["response_mask"], strict=True)
    assert all(t == 0.0 for t, m in pairs if not m)
    assert "teacher_logprobs" not in trajectories[3]  # it sampled nothing
    s.nodes[2].teacher = TurnTeacher("other", array("f", [-1.0]))
    assert export_teacher(s.path(2)) is None


def test_a_turns_own_tokens_get_zeros_then_the_teachers_logprobs() -> None:
    """A turn's tokens as a tree node holds them: 0.0 on its context, the teacher's on
    what it sampled; none before a teacher scored it."""
    s = _tree()
    assert turn_teacher_logprobs(s.nodes[1]) is None
    _score_all(s, "big")
    assert turn_teacher_logprobs(s.nodes[1]) == [0.0, -6.0, -7.0, -8.0]
