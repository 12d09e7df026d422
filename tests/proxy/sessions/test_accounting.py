"""Planning raw (token-id) prompts: which earlier turn a prompt continues."""

from __future__ import annotations

from array import array

from proxy.sessions.accounting import plan_raw_prompt, raw_prompt_key
from proxy.sessions.model import Session, TrialId, TurnMeta, TurnNode


def _meta() -> TurnMeta:
    return TurnMeta(
        api="openai.completions",
        model="m",
        requested_model="m",
        worker_id="w",
        finish_reason="stop",
        sampling={},
        created_at=0.0,
        queue_seconds=0.0,
        engine_seconds=0.0,
        branch_reason="new_session",
    )


def _record(session: Session, prompt: list[int], completion: list[int]) -> TurnNode:
    """Plan ``prompt`` and record ``completion`` as the service does."""
    plan = plan_raw_prompt(session, prompt)
    node = TurnNode(
        index=len(session.nodes),
        parent=plan.parent,
        context_ids=array("i", plan.context_ids),
        completion_ids=array("i", completion),
        logprobs=array("f", [0.0] * len(completion)),
        prompt_len=len(plan.prompt_ids),
        key=raw_prompt_key([*plan.prompt_ids, *completion]),
        meta=_meta(),
    )
    session.add_turn(node)
    return node


def test_first_prompt_is_a_new_root() -> None:
    """A prompt in an empty session is the whole context of a new root."""
    plan = plan_raw_prompt(Session(TrialId("t"), "k"), [1, 2, 3])
    assert (plan.parent, plan.context_ids, plan.branch_reason) == (None, [1, 2, 3], "new_session")


def test_prompt_extending_a_turn_continues_it() -> None:
    """Prompt + sampled ids + new ids continues that turn; only the new ids are context."""
    session = Session(TrialId("t"), "k")
    _record(session, [1, 2], [3, 4])
    plan = plan_raw_prompt(session, [1, 2, 3, 4, 5])
    assert (plan.parent, plan.context_ids, plan.branch_reason) == (0, [5], "continued")
    assert plan.prompt_ids == [1, 2, 3, 4, 5]


def test_longest_earlier_context_wins_and_any_turn_may_be_continued() -> None:
    """With a chain of turns, the deepest matching one is continued; an older one can be
    continued too (a resumed point)."""
    session = Session(TrialId("t"), "k")
    _record(session, [1], [2])
    _record(session, [1, 2, 3], [4])
    assert plan_raw_prompt(session, [1, 2, 3, 4, 9]).parent == 1
    older = plan_raw_prompt(session, [1, 2, 7])
    assert (older.parent, older.context_ids) == (0, [7])


def test_a_changed_token_starts_a_new_branch() -> None:
    """A prompt that differs from every recorded context (retokenized, edited) is a root."""
    session = Session(TrialId("t"), "k")
    _record(session, [1, 2], [3, 4])
    plan = plan_raw_prompt(session, [1, 2, 3, 5, 6])
    assert (plan.parent, plan.context_ids, plan.branch_reason) == (
        None,
        [1, 2, 3, 5, 6],
        "new_branch",
    )


def test_raw_keys_never_match_message_keys() -> None:
    """Raw-prompt keys are personalised: different from an unpersonalised hash."""
    assert raw_prompt_key([1, 2]) != raw_prompt_key([2, 1])
    assert len(raw_prompt_key([])) == 16
