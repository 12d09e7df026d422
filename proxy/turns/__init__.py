"""A chat turn, in three steps each in its own module: ``plan`` (pure: the prompt, the
agent, sampling, retry and budget decisions), ``generate`` (the plan to a worker and
back as the agent API's events), ``record`` (the turn committed); ``service`` sequences
them."""

from proxy.turns.attempt import PreparedTurn
from proxy.turns.request import (
    EventSink,
    ReasoningDelta,
    TextDelta,
    ToolCallReady,
    TurnDone,
    TurnEvent,
    TurnRequest,
    TurnResult,
)
from proxy.turns.service import TurnService, no_routing

__all__ = [
    "EventSink",
    "PreparedTurn",
    "ReasoningDelta",
    "TextDelta",
    "ToolCallReady",
    "TurnDone",
    "TurnEvent",
    "TurnRequest",
    "TurnResult",
    "TurnService",
    "no_routing",
]
