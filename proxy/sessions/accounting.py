"""Deciding a turn's prompt: which context it continues and which tokens it adds.

This is where sampled tokens are kept verbatim: a continuation's prompt is built from the
stored ids of the context it extends, never from a re-rendering of the history.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from proxy.chat.messages import ChatMessage, ImagePart, Tool
from proxy.chat.renderer import ChatRenderer, NotPrefixStableError
from proxy.chat.vision import VisionTokens
from proxy.exceptions import ImageError
from proxy.sessions.model import PlacedImage, PromptPlan, Session
from proxy.sessions.options import HistoryPolicy


@dataclass(slots=True, frozen=True)
class Located:
    """Which context a request continues, before anything is rendered."""

    keys: list[bytes]  # keys[k]: the context of the tools and the first k messages
    found: tuple[int, int] | None  # (the turn continued, how many messages it covers)

    def rendered(self, session: Session) -> int:
        """The index of the first message the plan will render: a continuation renders
        from the returned message on, anything else the whole conversation."""
        if self.found is None or session.options.history is HistoryPolicy.TEMPLATE:
            return 0
        return self.found[1] - 1


def locate(
    session: Session,
    messages: Sequence[ChatMessage],
    tools: Sequence[Tool],
    agent: str | None = None,
) -> Located:
    """Which turn the request continues: with ``agent`` (what its headers named), only a
    turn of that agent."""
    keys = session.history.keys(tools, messages)
    return Located(keys, session.find_continuation(keys, agent))


def plan_turn(
    session: Session,
    renderer: ChatRenderer,
    messages: Sequence[ChatMessage],
    tools: Sequence[Tool],
    located: Located | None = None,
    vision: VisionTokens | None = None,
) -> PromptPlan:
    """The turn's prompt. Images are expanded right after rendering (``vision``: the
    model's placeholder and processor), so every id recorded is one the forward saw: a
    continuation expands only the images its new messages bring; the earlier ones are
    among the parent's ids, carried verbatim."""
    if located is None:
        located = locate(session, messages, tools)
    keys, found = located.keys, located.found
    reason = "new_session" if not session.nodes else "new_branch"
    variables = session.options.chat_template_kwargs
    if found is not None and session.options.history is HistoryPolicy.TEMPLATE:
        # The template renders everything; the turn continues its parent only when that
        # rendering starts with the parent's context and sampled ids.
        parent, _ = found
        ids, images = _expanded(
            vision, renderer.render_conversation(messages, tools, variables), messages, 0
        )
        before = session.context_ids(parent)  # ends with the parent's sampled ids
        if ids[: len(before)] == list(before):
            own = tuple(i for i in images if i.start >= len(before))
            return PromptPlan(parent, ids[len(before) :], ids, keys[-1], "continued", own)
        return PromptPlan(None, ids, ids, keys[-1], "template_rewrote_history", images)
    if found is not None:
        parent, covered = found
        try:
            context = renderer.render_continuation(
                messages[covered - 1],
                session.nodes[parent].completion_ids,
                messages[covered:],
                variables,
            )
        except NotPrefixStableError:
            reason = "template_not_prefix_stable"
        else:
            prompt = session.context_ids(parent)
            context, images = _expanded(vision, context, messages[covered:], len(prompt))
            prompt.extend(context)
            return PromptPlan(parent, context, prompt, keys[-1], "continued", images)
    ids, images = _expanded(
        vision, renderer.render_conversation(messages, tools, variables), messages, 0
    )
    return PromptPlan(None, ids, ids, keys[-1], reason, images)


def _expanded(
    vision: VisionTokens | None, ids: list[int], messages: Sequence[ChatMessage], offset: int
) -> tuple[list[int], tuple[PlacedImage, ...]]:
    """``ids`` (rendered from ``messages``, to sit at ``offset`` in the prompt) with each
    image's placeholder expanded, and the images placed in the prompt."""
    images: list[ImagePart] = [image for message in messages for image in message.images]
    if not images:
        return ids, ()
    if vision is None:
        raise ImageError("this model takes no images", code="images_unsupported")
    expanded, spans = vision.expand(ids, images)
    return expanded, tuple(
        PlacedImage(image.sha256, offset + start, offset + end)
        for image, (start, end) in zip(images, spans, strict=True)
    )


_RAW = b"raw-prompt"


def raw_prompt_key(ids: Sequence[int]) -> bytes:
    """The key of a raw-prompt context (legacy completions): a hash of its token ids.

    Personalised so it never equals a message-chain key."""
    hasher = hashlib.blake2b(digest_size=16, person=_RAW)
    hasher.update(array("i", ids).tobytes())
    return hasher.digest()


def plan_raw_prompt(
    session: Session, prompt_ids: Sequence[int], agent: str | None = None
) -> PromptPlan:
    """A raw prompt continues the earlier raw-prompt turn (of ``agent``, when named) whose
    prompt + sampled ids are its longest prefix (the client sent them back verbatim and
    appended new ids); otherwise it starts a new root. It is never re-tokenized."""
    prompt = list(prompt_ids)
    ends = sorted({n.end for n in session.nodes if n.end <= len(prompt)})
    # One pass over the prompt: the hash of every candidate prefix, shortest first.
    hasher = hashlib.blake2b(digest_size=16, person=_RAW)
    at = 0
    keys: list[tuple[int, bytes]] = []
    for end in ends:
        hasher.update(array("i", prompt[at:end]).tobytes())
        at = end
        keys.append((end, hasher.copy().digest()))
    for end, key in reversed(keys):
        index = session.turn_with_key(key, agent)
        if index is not None and session.nodes[index].end == end:
            return PromptPlan(index, prompt[end:], prompt, key, "continued")
    reason = "new_session" if not session.nodes else "new_branch"
    return PromptPlan(None, prompt, prompt, raw_prompt_key(()), reason)
