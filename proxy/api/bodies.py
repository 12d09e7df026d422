"""Taking a conversation request's body apart, so a turn costs what it adds.

An agent resends its whole history with every request. The body is scanned once by
msgspec, in C: each message's JSON text is kept as it is (no Python object per message),
and so is each other field the API's model reads. The other fields are validated by that
model; the messages one by one, in order, and only those the session's ``HistoryMemory``
has not seen before, byte for byte (an error names the first bad message; a whole-body
validation could name a later one first). A body that does not come apart this way (not
JSON, not an object, no message list) is for the caller to validate whole, which names
its error.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

import msgspec
from pydantic import BaseModel, ValidationError

from proxy.api.errors import parse_json, validation_message
from proxy.chat.history import HistoryMemory
from proxy.chat.messages import ChatMessage
from proxy.exceptions import BadRequestError

FieldsT = TypeVar("FieldsT", bound=BaseModel)
MessageT = TypeVar("MessageT", bound=BaseModel)


class MessageBody(Generic[FieldsT, MessageT]):
    """One API's body: ``messages`` (a list of ``message`` objects) and ``fields``."""

    def __init__(self, api: str, fields: type[FieldsT], message: type[MessageT]) -> None:
        self.api = api
        self.fields = fields
        self.message = message
        self._names = tuple(fields.model_fields)
        parts = msgspec.defstruct(
            f"_{fields.__name__}Parts",
            [("messages", list[msgspec.Raw])]
            + [(name, msgspec.Raw | msgspec.UnsetType, msgspec.UNSET) for name in self._names],
        )
        self._decoder = msgspec.json.Decoder(parts)

    def parse(
        self,
        body: bytes,
        memory: HistoryMemory,
        convert: Callable[[MessageT, int], Sequence[ChatMessage]],
    ) -> tuple[FieldsT, list[ChatMessage]] | None:
        """The fields and the internal messages (``convert(message, index)`` makes those
        of a validated message not seen before), or None when the body does not come
        apart. Bad fields or a bad new message raise ``BadRequestError``."""
        try:
            parts = self._decoder.decode(body)
        except msgspec.DecodeError:
            return None
        items: list[object] = parts.messages  # type: ignore[attr-defined]
        if not items:
            return None
        given = {name: getattr(parts, name) for name in self._names}
        rest = {name: text for name, text in given.items() if text is not msgspec.UNSET}
        fields = parse_json(self.fields, msgspec.json.encode(rest))

        def message(raw: object, index: int) -> Sequence[ChatMessage]:
            assert isinstance(raw, msgspec.Raw)
            try:
                validated = self.message.model_validate_json(bytes(raw))
            except ValidationError as exc:
                if exc.errors()[0]["type"] == "json_invalid":  # msgspec left its text as is
                    raise BadRequestError(
                        "the request body is not valid JSON", code="invalid_json"
                    ) from None
                raise BadRequestError(
                    validation_message(exc, at=("messages", index)), code="invalid_request"
                ) from None
            return convert(validated, index)

        return fields, memory.expand(items, message, api=self.api)
