"""Deciding a turn's prompt: which context it continues and which tokens it adds.

This is where sampled tokens are kept verbatim: a continuation's prompt is built from the
stored ids of the context it extends, never from a re-rendering of the history.
"""

from __future__ import annotations

from collections.abc import Sequence

from proxy.chat.messages import ChatMessage, Tool, prefix_keys
from proxy.chat.renderer import ChatRenderer, NotPrefixStableError
from proxy.sessions.model import PromptPlan, Session


def plan_turn(
    session: Session,
    renderer: ChatRenderer,
    messages: Sequence[ChatMessage],
    tools: Sequence[Tool],
) -> PromptPlan:
    keys = prefix_keys(tools, messages)
    found = session.find_continuation(keys)
    reason = "new_session" if not session.nodes else "new_branch"
    if found is not None:
        parent, covered = found
        try:
            delta = renderer.render_continuation(messages[covered:])
        except NotPrefixStableError:
            reason = "template_not_prefix_stable"
        else:
            context = renderer.bridge(session.nodes[parent].completion_ids) + delta
            prompt = session.context_ids(parent).tolist() + context
            return PromptPlan(parent, context, prompt, keys[-1], "continued")
    ids = renderer.render_conversation(messages, tools)
    return PromptPlan(None, ids, ids, keys[-1], reason)
