"""A turn's plan: everything decided before any I/O, as one value.

From the session's turns and the request: the turn it continues and the prompt ids with
their images placed (``proxy.sessions.accounting``: sampled ids carried verbatim), the
agent and the call that spawned it (``proxy.turns.attribution``), the sampling the
worker gets (the trainer's settings over the agent's, capped by the context window, the
session's storage limit and its token budget), whether the request retries an earlier
attempt, and whether the trial's budget is spent. ``plan`` awaits nothing and writes
nothing but the session's caches; a refusal is an exception in the caller's API format
(``proxy.exceptions``) and leaves the session as it was.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass

from proxy.chat.messages import ChatMessage
from proxy.exceptions import ImageError
from proxy.limits import Limits, session_token_room
from proxy.models import ServedModel
from proxy.sampling import resolve_sampling
from proxy.sessions.accounting import Located, locate, plan_raw_prompt, plan_turn
from proxy.sessions.agents import TurnAgent
from proxy.sessions.model import PromptPlan, Session, TurnNode
from proxy.sessions.retries import RetryAction, RetryDecision, decide
from proxy.turns.attribution import attribute, request_view
from proxy.turns.request import TurnRequest
from relay import protocol

__all__ = ["TurnPlan", "large_render", "locate_request", "plan", "plan_prompt"]

_CONTENT = operator.attrgetter("content")


@dataclass(slots=True, frozen=True)
class TurnPlan:
    """What a turn will do: sample ``prompt`` with ``sampling`` as ``agent``, or answer a
    retry with the recorded ``replay`` (or wait for the attempt in flight: ``join``)."""

    prompt: PromptPlan
    agent: TurnAgent
    sampling: protocol.Sampling
    retry: RetryDecision
    # The recorded turn a retry is answered with (nothing is sampled then).
    replay: TurnNode | None = None
    # Why the trial takes no more requests (its budget is spent); None: it does.
    budget_spent: str | None = None

    @property
    def join(self) -> bool:
        """A retry of an attempt still in flight: it waits for that one, then plans again."""
        return self.retry.action is RetryAction.JOIN


def plan(
    session: Session,
    request: TurnRequest,
    served: ServedModel,
    *,
    limits: Limits,
    global_max_tokens: int,
    prompt: PromptPlan | None = None,
    live_request_id: str | None = None,
) -> TurnPlan:
    """The turn's plan. ``prompt``: its prompt, where the caller rendered it already
    (``plan_prompt``, in a thread for a large render: everything else is decided here, on
    the event loop, against the session as it is now); ``live_request_id``: the client
    request id of an attempt of the same body still in flight, if any."""
    session.require_active()
    if prompt is None:
        prompt = plan_prompt(session, request, served)
    agent = _agent(session, request, prompt)
    sampling = _sampling(session, request, served, prompt, limits, global_max_tokens)
    retry = _retry(session, request, live_request_id)
    replay = _replayed(session, retry, served)
    spent = None
    budget = session.options.budget
    if replay is None and budget is not None:  # a retry answered from its record spends nothing
        spent = budget.spent(len(session.nodes), session.sampled_tokens)
    return TurnPlan(prompt, agent, sampling, retry, replay, spent)


def plan_prompt(
    session: Session, request: TurnRequest, served: ServedModel, located: Located | None = None
) -> PromptPlan:
    """Which turn it continues, and the prompt's ids with its images placed (the costly
    part of a plan: it renders the messages the session does not hold yet)."""
    _check_model(request, served)
    return _prompt(session, request, served, located)


def _check_model(request: TurnRequest, served: ServedModel) -> None:
    if served.vision is None and request.images and request.prompt_ids is None:
        raise ImageError(
            f"model {served.name!r} takes no images (it has no vision encoder); "
            "send text only, or serve a vision-language model",
            code="images_unsupported",
        )


def locate_request(session: Session, request: TurnRequest) -> Located | None:
    """Which turn a chat request continues, of the agent its headers name (None: a raw
    prompt, which finds its parent by ids)."""
    if request.prompt_ids is not None:
        return None
    named = request.agent.id if request.agent is not None else None
    return locate(session, request.messages, request.tools, named)


def large_render(session: Session, request: TurnRequest, located: Located | None) -> bool:
    """Whether the messages to render are big enough that planning goes to a thread, so
    it does not stall other sessions' streams."""
    if located is None:
        return False
    messages: Sequence[ChatMessage] = request.messages[located.rendered(session) :]
    return sum(map(len, map(_CONTENT, messages))) > 200_000


def _prompt(
    session: Session, request: TurnRequest, served: ServedModel, located: Located | None
) -> PromptPlan:
    """Which turn it continues and the prompt's ids."""
    if request.prompt_ids is not None:
        named = request.agent.id if request.agent is not None else None
        return plan_raw_prompt(session, request.prompt_ids, named)
    if located is None:
        located = locate_request(session, request)
    return plan_turn(
        session,
        served.renderer,
        request.messages,
        request.tools,
        located,
        served.vision,
    )


def _agent(session: Session, request: TurnRequest, prompt: PromptPlan) -> TurnAgent:
    spawns = session.spawns()
    view = request_view(request.messages, request.tools, spawns)
    parent = session.nodes[prompt.parent].agent if prompt.parent is not None else None
    return attribute(request.agent, parent, view, spawns, session.agents)


def _sampling(
    session: Session,
    request: TurnRequest,
    served: ServedModel,
    prompt: PromptPlan,
    limits: Limits,
    global_max_tokens: int,
) -> protocol.Sampling:
    """The worker's sampling: capped by the room the session's storage limit and its token
    budget leave (a reply gets at least one token until the budget is spent)."""
    room = session_token_room(limits, session.stored_tokens, len(prompt.context_ids))
    budget = session.options.budget
    if budget is not None and budget.tokens is not None:
        left = max(budget.tokens - session.sampled_tokens, 1)
        room = left if room is None else min(room, left)
    return resolve_sampling(
        request.sampling,
        session.sampling,
        global_max_tokens=global_max_tokens if room is None else min(global_max_tokens, room),
        prompt_len=len(prompt.prompt_ids),
        max_model_len=served.max_model_len,
        stop_token_ids=served.renderer.stop_token_ids,
    )


def _retry(session: Session, request: TurnRequest, live_request_id: str | None) -> RetryDecision:
    """Whether the request retries an earlier attempt (``proxy.sessions.retries``); a
    replay of a reply recorded by a model no longer served samples anew instead."""
    marks = request.marks
    if marks is None:
        return RetryDecision(RetryAction.SAMPLE)
    index = session.by_request.get(marks.request_hash)
    earlier: TurnNode | None = session.nodes[index] if index is not None else None
    return decide(marks, live_request_id=live_request_id, earlier=earlier)


def _replayed(session: Session, retry: RetryDecision, served: ServedModel) -> TurnNode | None:
    """The recorded turn a retry is answered with; a reply recorded by a model no longer
    served is sampled anew instead (the new turn then replaces it: ``retry_of``)."""
    if retry.action is not RetryAction.REPLAY or retry.retry_of is None:
        return None
    node = session.nodes[retry.retry_of]
    return node if node.meta.model == served.name else None
