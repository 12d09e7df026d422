"""The proxy⇄worker wire protocol, without I/O.

Workers dial out to the proxy (GPU nodes accept no inbound traffic) and keep one WebSocket
open. Every WebSocket binary message carries exactly one protocol message, encoded with
MessagePack (``msgspec``); a ``Batch`` is one message that carries the request frames a
worker had ready together (one engine step's tokens for every running request), so a
step costs the proxy one frame to receive, not one per request. Token ids travel as
packed little-endian ``int32`` arrays and logprobs as packed little-endian ``float32``
arrays: a 4k-token completion is 32 KiB on the wire instead of a JSON list of floats.

Conversation::

    worker                         proxy
      | -- Hello(version, token, models+tokenizer files) -> |
      | <------------- Welcome | Error ------------------- |
      | <------------- Generate(request_id, prompt) ------- |
      | -- Delta(request_id, ids, logprobs) ... ----------> |
      | -- Done(request_id, finish_reason, tail) ---------> |   (or Error(request_id))
      | -- Batch([Delta | Done | Error, ...]) ------------> |   (version 2: several at once)
      | <------------- Cancel(request_id) ----------------- |   (agent went away)
      | <-> Ping / Pong (either side, liveness) <---------> |

    weight update (version 3), one round per phase, each answered by UpdateAck:
      | <------------- Pause(update_id, mode) ------------- |   hold new requests; drain or abort
      | <------------- Load(update_id, version, path) ----- |   read and check the checkpoint
      | <------------- Commit(update_id) | Rollback -------- |   serve it as `version`, or not
      | -- UpdateAck(update_id, phase, ok, message) ------> |
      | -- Weights(version, path) ------------------------> |   the engine serves new weights
                                                                (to every proxy it serves)

    images (version 4), each image's bytes once per connection, before the first request
    that needs them; the proxy decides what the worker keeps:
      | <------------- Image(sha256, data) ---------------- |   keep these bytes by their hash
      | <------------- Generate(..., images=[ImageRef]) --- |   the image at [start, end) of
      |                                                     |   the (expanded) prompt ids
      | <------------- ImageDrop([sha256, ...]) ----------- |   forget them (no request uses them)

    routing (version 5), for a mixture-of-experts model whose engine can report it
    (``ModelInfo.routing``), asked per request from a position on:
      | <------------- Generate(..., routed_experts_from=k)  |   the experts of positions k..
      | -- Done(..., routed_experts=RoutedExperts) -------> |   rows [start, start + rows)

    scoring (version 6), teacher forcing by a model announced ``ModelInfo.teacher``:
      | <------------- Score(request_id, ids, start) ------ |   logprobs of ids[start:]
      | -- Done(request_id, "scored", ids[start:], lps) --> |   (or Error(request_id))

States of a connection (``ConnectionState``): AWAITING_HELLO → OPEN → CLOSED. The two
endpoint classes (``ProxyEndpoint``, ``WorkerEndpoint``) check every message against the
state and the set of requests in flight, and raise ``ProtocolError`` on anything else.

Versions: a proxy speaks every version in ``SUPPORTED_VERSIONS`` and welcomes a worker in
the version of its hello; a worker sends ``Batch`` only when welcomed in version 2. So a
proxy upgraded first keeps serving the workers that are not yet upgraded. Weight updates
need version 3 on both sides: a proxy refuses an update while an older worker is connected
(it could not be brought to the new weights). Images need version 4: a worker announces a
vision-language model with the id of its image placeholder (``ModelInfo.image_token_id``),
and a proxy sends images only to a worker welcomed in version 4. Routing needs version 5: a
worker announces what its engine can report (``ModelInfo.routing``) and a proxy asks for
rows (``Generate.routed_experts_from``) only of a worker welcomed in version 5. Scoring
needs version 6: a worker announces a teacher (``ModelInfo.teacher``: a model that scores,
which agents reach only by its exact name) and a proxy sends ``Score`` only to a worker
welcomed in version 6. A ``Score`` is a request like a ``Generate`` (in flight until its
``Done`` or ``Error``, cancelled with ``Cancel``, its images sent and placed the same way);
its ``Done`` has ``finish_reason`` ``"scored"`` and carries the scored ids with their
logprobs, as a reply carries its sampled ones.

Routing rows: position ``p`` of a request's ``prompt_ids + generated ids`` has one row, the
experts each MoE layer chose for the token at ``p`` (``[layers, top_k]``, in the order the
router ranked them), for every position the engine ran forward: all but the last generated
token. ``routed_experts_from=k`` asks for rows ``k`` onwards only (the proxy holds the
earlier ones from the turns before); the engine may give rows from an earlier start, never
a later one. Rows travel as one C-order array, uint8 when the model has at most 256
experts, else uint16 (``RoutingShape.dtype``), never as lists of ints.

Policy versions: ``Hello`` says which weights the worker serves (``policy_version``, and the
checkpoint ``weights_path`` it loaded last); a ``Done`` carries the version that sampled its
request's tokens in ``extra["policy_version"]``, and ``extra["preempted"]`` when the request
was aborted by a weight update (the proxy continues it from its tokens on the new weights).

A version describes the weights only when the commit that set it completed. A worker whose
``Commit`` failed part-way (its engine had begun to swap the new weights in) answers
``ok=False`` and serves again under its previous version, which its weights may no longer
be: the proxy takes it out of service. When it reconnects, its hello still says that
previous version: it is brought back to known weights only by loading a checkpoint, as a
worker behind a newer pool version does; if no worker committed, the pool's version did
not move, and such a worker is served under it as it is. Restart it, or run the next
update (which loads the whole checkpoint), before trusting what it samples.
"""

from __future__ import annotations

import enum
import sys
from array import array
from collections.abc import Sequence
from typing import Any

import msgspec

from relay.exceptions import FrameError, IllegalTransitionError, VersionMismatchError

PROTOCOL_VERSION = 6
SUPPORTED_VERSIONS = frozenset({1, 2, 3, 4, 5, 6})
BATCH_VERSION = 2  # the first version with Batch frames
WEIGHTS_VERSION = 3  # the first version with weight updates
IMAGES_VERSION = 4  # the first version with images
ROUTING_VERSION = 5  # the first version with routed experts
SCORING_VERSION = 6  # the first version with teachers and Score requests

# Keys of ``Done.extra`` this protocol gives a meaning to.
POLICY_VERSION = "policy_version"  # the weights version that sampled the request's tokens
PREEMPTED = "preempted"  # 1: aborted by a weight update, to be continued on the new weights
# ``Done.finish_reason`` of a ``Score`` request.
SCORED = "scored"

_LITTLE = sys.byteorder == "little"


def pack_ids(ids: Sequence[int]) -> bytes:
    """Pack token ids as little-endian int32 (an int32 array is copied as it is)."""
    arr = ids if isinstance(ids, array) and ids.typecode == "i" else array("i", ids)
    if not _LITTLE:  # pragma: no cover - no big-endian CI machine
        arr = array("i", arr)  # never the caller's array
        arr.byteswap()
    return arr.tobytes()


def unpack_id_array(data: bytes) -> array[int]:
    """Packed token ids as an int32 array: a copy of the bytes, no Python int per id (a
    prompt of 100k tokens is 400 kB, not 100k objects)."""
    if len(data) % 4:
        raise FrameError("packed token ids must be a multiple of 4 bytes")
    arr = array("i")
    arr.frombytes(data)
    if not _LITTLE:  # pragma: no cover
        arr.byteswap()
    return arr


def unpack_ids(data: bytes) -> list[int]:
    return unpack_id_array(data).tolist()


def pack_logprobs(values: Sequence[float]) -> bytes:
    """Pack logprobs as little-endian float32 (ample for a logprob's precision)."""
    arr = array("f", values)
    if not _LITTLE:  # pragma: no cover
        arr.byteswap()
    return arr.tobytes()


def unpack_logprobs(data: bytes) -> list[float]:
    if len(data) % 4:
        raise FrameError("packed logprobs must be a multiple of 4 bytes")
    arr = array("f")
    arr.frombytes(data)
    if not _LITTLE:  # pragma: no cover
        arr.byteswap()
    return arr.tolist()


# --------------------------------------------------------------------------- messages


class Sampling(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """Sampling settings as sent to a worker. ``top_k <= 0`` means off."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: list[int] = []


class RoutingShape(msgspec.Struct, frozen=True, array_like=True):
    """What a mixture-of-experts model's routing rows hold: ``layers`` MoE layers choosing
    ``top_k`` of ``experts`` experts each, per position."""

    layers: int
    top_k: int
    experts: int

    @property
    def dtype(self) -> str:
        """The element type of its rows: ``uint8`` up to 256 experts, else ``uint16``."""
        return "uint8" if self.experts <= 256 else "uint16"

    @property
    def itemsize(self) -> int:
        return 1 if self.experts <= 256 else 2

    @property
    def row_bytes(self) -> int:
        """The bytes of one position's row."""
        return self.layers * self.top_k * self.itemsize


class RoutedExperts(msgspec.Struct, frozen=True):
    """Routing rows of positions ``[start, start + rows)``: C-order ``[rows, layers,
    top_k]`` of the model's ``RoutingShape.dtype``, little-endian."""

    start: int
    rows: int
    data: bytes


class ModelInfo(msgspec.Struct, frozen=True):
    """A model a worker serves. ``tokenizer_files`` maps file names (tokenizer.json,
    tokenizer_config.json, chat_template.jinja, ...) to their bytes so the proxy needs no
    model files or hub access of its own."""

    name: str
    max_model_len: int
    logprobs_mode: str
    backend: str
    tokenizer_files: dict[str, bytes]
    # A vision-language model: the token its template writes once per image and its forward
    # fills with the image's features (its files then include preprocessor_config.json).
    # None: text only.
    image_token_id: int | None = None
    # A mixture-of-experts model whose engine can report the experts it routed each token
    # to (protocol 5). None: a dense model, or an engine that cannot.
    routing: RoutingShape | None = None
    # The engine's settings that decide what it computes (vLLM: the dtype it serves,
    # enforce_eager, max_model_len, the engine arguments given), shown in /v1/models.
    engine: dict[str, Any] = {}
    # Why its engine cannot report this mixture-of-experts model's routing (None: it can,
    # or the model is dense), named when a session asking for routing is refused.
    routing_unavailable: str | None = None
    # A teacher (protocol 6): it scores recorded tokens (``Score``), takes no weight
    # updates, and an agent reaches it only by naming it exactly.
    teacher: bool = False


class Hello(msgspec.Struct, frozen=True, tag="hello"):
    protocol_version: int
    worker_id: str
    token: str
    models: list[ModelInfo]
    max_concurrency: int = 8
    # The weights the worker serves: their version (0: the ones it started with) and the
    # checkpoint it loaded them from (None: its startup model, or stamped without a path).
    policy_version: int = 0
    weights_path: str | None = None


class Welcome(msgspec.Struct, frozen=True, tag="welcome"):
    protocol_version: int
    heartbeat_interval: float


class ImageRef(msgspec.Struct, frozen=True, array_like=True):
    """An image of a prompt: its hash (its bytes came in an ``Image``) and the half-open
    range of its placeholder tokens in the prompt ids, which are expanded (one placeholder
    per image token the forward fills)."""

    sha256: str
    start: int
    end: int


class Generate(msgspec.Struct, frozen=True, tag="generate"):
    request_id: str
    model: str
    prompt_ids: bytes
    sampling: Sampling
    stream: bool = True
    images: list[ImageRef] = []
    # Routing rows wanted from this position on (protocol 5); None: none (nothing costs).
    routed_experts_from: int | None = None


class Score(msgspec.Struct, frozen=True, tag="score"):
    """Teacher forcing (protocol 6): the logprob (raw: ``log_softmax`` of the model's
    logits) of each of ``ids[start:]`` given every id before it, and the images placed as
    a ``Generate``'s are, under ``model``. ``0 < start < len(ids)``: the first id has no
    logprob. Answered by ``Done(request_id, SCORED, ids[start:], logprobs)`` or ``Error``."""

    request_id: str
    model: str
    ids: bytes
    start: int
    images: list[ImageRef] = []


class Image(msgspec.Struct, frozen=True, tag="image"):
    """An image's bytes as the agent sent them, kept by the worker under their sha256 until
    the proxy drops them (protocol 4)."""

    sha256: str
    data: bytes


class ImageDrop(msgspec.Struct, frozen=True, tag="image_drop"):
    """The worker may forget these images: no request it runs or will be sent uses them."""

    sha256s: list[str]


class Delta(msgspec.Struct, frozen=True, tag="delta"):
    request_id: str
    token_ids: bytes
    logprobs: bytes


class Done(msgspec.Struct, frozen=True, tag="done"):
    """End of a request. May carry the last tokens, so a short reply is one frame."""

    request_id: str
    finish_reason: str
    token_ids: bytes = b""
    logprobs: bytes = b""
    extra: dict[str, str | int | float] = {}
    # The routing rows asked for (``Generate.routed_experts_from``); None when none were
    # asked or the engine could give none.
    routed_experts: RoutedExperts | None = None


class Error(msgspec.Struct, frozen=True, tag="error"):
    """An error for one request (``request_id`` set) or for the connection (None)."""

    code: str
    message: str
    request_id: str | None = None


# ``Error.code`` of a request that names an image the worker does not hold: the worker
# answers it for that request and keeps serving; the proxy forgets the request's images
# (``ImageDrop``) and sends them again.
IMAGE_MISSING = "image_missing"


RequestFrame = Delta | Done | Error


class Batch(msgspec.Struct, frozen=True, tag="batch"):
    """Request frames sent together, in the order they are handled (a request's tokens
    before its ``Done``). Never empty, never nested."""

    frames: list[RequestFrame]


class Cancel(msgspec.Struct, frozen=True, tag="cancel"):
    request_id: str


class PauseMode(enum.StrEnum):
    """How a weight update treats requests that are running when it starts."""

    WAIT = "wait"  # they finish on the old weights first; no reply spans two versions
    ABORT = "abort"  # they stop now and continue from their tokens on the new weights


class UpdatePhase(enum.StrEnum):
    PAUSED = "paused"  # nothing runs; new requests wait in the worker
    LOADED = "loaded"  # the checkpoint was read and checked; still serving nothing
    COMMITTED = "committed"  # the new weights serve, as the new version
    ROLLED_BACK = "rolled_back"  # the old weights serve again, as the old version


class Pause(msgspec.Struct, frozen=True, tag="pause"):
    """Phase 1 of a weight update: hold new requests, finish or abort running ones."""

    update_id: str
    mode: PauseMode = PauseMode.WAIT


class Load(msgspec.Struct, frozen=True, tag="load"):
    """Phase 2: read ``path`` (a Hugging Face model directory) and check it fits the
    engine, without serving it yet; None loads nothing (the trainer updated the engine
    itself, the version is only stamped)."""

    update_id: str
    version: int
    path: str | None = None


class Commit(msgspec.Struct, frozen=True, tag="commit"):
    """Phase 3: serve the loaded weights as the new version."""

    update_id: str


class Rollback(msgspec.Struct, frozen=True, tag="rollback"):
    """Phase 3 when another worker failed: drop what was loaded, serve the old weights."""

    update_id: str


# ``UpdateAck.code`` of a pause refused because another update (another proxy replica's)
# holds the worker: the same update may succeed once that one is done.
ACK_BUSY = "busy"


class UpdateAck(msgspec.Struct, frozen=True, tag="update_ack"):
    """A worker's answer to one phase (``ok=False`` with the reason in ``message``, and in
    ``code`` what kind of refusal it is: ``ACK_BUSY``, or empty). ``code`` came after
    version 3's first release; a peer that does not know it ignores it."""

    update_id: str
    phase: UpdatePhase
    ok: bool = True
    version: int = 0  # the version the worker serves (or will, once committed)
    message: str = ""
    code: str = ""


class Weights(msgspec.Struct, frozen=True, tag="weights"):
    """The worker's engine serves other weights now (sent on every connection, so every
    proxy replica learns a version that one of them committed)."""

    version: int
    path: str | None = None


class Ping(msgspec.Struct, frozen=True, tag="ping"):
    nonce: int


class Pong(msgspec.Struct, frozen=True, tag="pong"):
    nonce: int


UpdateMessage = Pause | Load | Commit | Rollback

WorkerMessage = Hello | Delta | Done | Error | Batch | UpdateAck | Weights | Ping | Pong
ProxyMessage = (
    Welcome
    | Generate
    | Score
    | Cancel
    | Error
    | Pause
    | Load
    | Commit
    | Rollback
    | Image
    | ImageDrop
    | Ping
    | Pong
)
Message = (
    Hello
    | Welcome
    | Generate
    | Score
    | Delta
    | Done
    | Error
    | Batch
    | Cancel
    | Pause
    | Load
    | Commit
    | Rollback
    | UpdateAck
    | Weights
    | Image
    | ImageDrop
    | Ping
    | Pong
)

_encoder = msgspec.msgpack.Encoder()
_worker_decoder: msgspec.msgpack.Decoder[WorkerMessage] = msgspec.msgpack.Decoder(WorkerMessage)
_proxy_decoder: msgspec.msgpack.Decoder[ProxyMessage] = msgspec.msgpack.Decoder(ProxyMessage)


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode_worker_message(data: bytes) -> WorkerMessage:
    """Decode a frame sent by a worker."""
    try:
        return _worker_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise FrameError(f"undecodable worker frame: {exc}") from None


def decode_proxy_message(data: bytes) -> ProxyMessage:
    """Decode a frame sent by the proxy."""
    try:
        return _proxy_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise FrameError(f"undecodable proxy frame: {exc}") from None


# --------------------------------------------------------------------------- state


_FINAL_PHASES = frozenset({UpdatePhase.COMMITTED, UpdatePhase.ROLLED_BACK})


class ConnectionState(enum.Enum):
    AWAITING_HELLO = "awaiting_hello"
    OPEN = "open"
    CLOSED = "closed"


class _Endpoint:
    def __init__(self) -> None:
        self.state = ConnectionState.AWAITING_HELLO
        self.in_flight: set[str] = set()
        self.version = PROTOCOL_VERSION  # the version agreed in the handshake

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.state.value} in_flight={len(self.in_flight)}>"

    def _require(self, state: ConnectionState, what: str) -> None:
        if self.state is not state:
            raise IllegalTransitionError(f"{what} is not allowed in state {self.state.value}")

    def close(self) -> set[str]:
        """Mark the connection closed; returns the requests that were still in flight."""
        self.state = ConnectionState.CLOSED
        lost, self.in_flight = self.in_flight, set()
        return lost


class ProxyEndpoint(_Endpoint):
    """The proxy's side of one worker connection."""

    def __init__(self) -> None:
        super().__init__()
        # Requests cancelled by the proxy whose Done/Error has not arrived yet: their late
        # deltas are legal and dropped.
        self.cancelled: set[str] = set()
        self.updates: set[str] = set()  # weight updates sent and not finished
        self.images: set[str] = set()  # the images the worker holds (sent, not dropped)

    @property
    def can_update(self) -> bool:
        """Whether this worker speaks weight updates."""
        return self.version >= WEIGHTS_VERSION

    @property
    def takes_images(self) -> bool:
        """Whether images can be sent to this worker."""
        return self.version >= IMAGES_VERSION

    @property
    def reports_routing(self) -> bool:
        """Whether this worker may be asked for routing rows."""
        return self.version >= ROUTING_VERSION

    @property
    def scores(self) -> bool:
        """Whether ``Score`` requests can be sent to this worker."""
        return self.version >= SCORING_VERSION

    def image(self, message: Image) -> bytes:
        """Encode an image for the worker to keep."""
        self._require(ConnectionState.OPEN, "image")
        self._require_images()
        if message.sha256 in self.images:
            raise IllegalTransitionError(f"image {message.sha256[:12]} was sent already")
        self.images.add(message.sha256)
        return encode(message)

    def drop_images(self, message: ImageDrop) -> bytes:
        """Encode the worker's leave to forget images it holds."""
        self._require(ConnectionState.OPEN, "image_drop")
        self._require_images()
        unknown = [sha for sha in message.sha256s if sha not in self.images]
        if unknown:
            raise IllegalTransitionError(f"image {unknown[0][:12]} is not held by the worker")
        self.images.difference_update(message.sha256s)
        return encode(message)

    def _require_images(self) -> None:
        if self.version < IMAGES_VERSION:
            raise IllegalTransitionError(f"images need protocol {IMAGES_VERSION}")

    def update(self, message: UpdateMessage) -> bytes:
        """Encode one phase of a weight update for this worker."""
        self._require(ConnectionState.OPEN, type(message).__name__.lower())
        self._require_weights(type(message).__name__)
        if isinstance(message, Pause):
            if message.update_id in self.updates:
                raise IllegalTransitionError(f"update {message.update_id!r} already started")
            self.updates.add(message.update_id)
        elif message.update_id not in self.updates:
            raise IllegalTransitionError(f"update {message.update_id!r} was not started")
        return encode(message)

    def receive(self, data: bytes) -> WorkerMessage:
        """Decode and check a frame from the worker (every frame of a batch)."""
        message = decode_worker_message(data)
        if isinstance(message, Hello):
            self._require(ConnectionState.AWAITING_HELLO, "hello")
            if message.protocol_version not in SUPPORTED_VERSIONS:
                raise VersionMismatchError(
                    f"worker speaks protocol {message.protocol_version}, "
                    f"proxy speaks {', '.join(map(str, sorted(SUPPORTED_VERSIONS)))}"
                )
            self.version = message.protocol_version
            return message
        self._require(ConnectionState.OPEN, type(message).__name__.lower())
        if isinstance(message, Batch):
            if self.version < BATCH_VERSION:
                raise IllegalTransitionError(f"batch frames need protocol {BATCH_VERSION}")
            if not message.frames:
                raise FrameError("an empty batch")
            for frame in message.frames:
                self._check_request_frame(frame)
        elif isinstance(message, Delta | Done) or (
            isinstance(message, Error) and message.request_id is not None
        ):
            self._check_request_frame(message)
        elif isinstance(message, UpdateAck | Weights):
            self._require_weights(type(message).__name__)
            if isinstance(message, UpdateAck):
                if message.update_id not in self.updates:
                    raise IllegalTransitionError(f"ack for unknown update {message.update_id!r}")
                if message.phase in _FINAL_PHASES:
                    self.updates.discard(message.update_id)
        return message

    def _require_weights(self, what: str) -> None:
        if self.version < WEIGHTS_VERSION:
            raise IllegalTransitionError(f"{what} needs protocol {WEIGHTS_VERSION}")

    def _check_request_frame(self, message: RequestFrame) -> None:
        request_id = message.request_id
        if request_id is None:
            raise FrameError("a batch carries request frames only")
        if request_id not in self.in_flight and request_id not in self.cancelled:
            raise IllegalTransitionError(f"message for unknown request {request_id!r}")
        if not isinstance(message, Delta):
            self.in_flight.discard(request_id)
            self.cancelled.discard(request_id)

    def accept(self, heartbeat_interval: float) -> bytes:
        self._require(ConnectionState.AWAITING_HELLO, "welcome")
        self.state = ConnectionState.OPEN
        return encode(Welcome(self.version, heartbeat_interval))

    def generate(self, message: Generate) -> bytes:
        self._require(ConnectionState.OPEN, "generate")
        if message.request_id in self.in_flight:
            raise IllegalTransitionError(f"request {message.request_id!r} is already in flight")
        if message.images:
            self._require_images()
            _check_images(message, self.images)
        if message.routed_experts_from is not None and self.version < ROUTING_VERSION:
            raise IllegalTransitionError(f"routed experts need protocol {ROUTING_VERSION}")
        self.in_flight.add(message.request_id)
        return encode(message)

    def score(self, message: Score) -> bytes:
        """Encode a teacher-forcing request (protocol 6)."""
        self._require(ConnectionState.OPEN, "score")
        if self.version < SCORING_VERSION:
            raise IllegalTransitionError(f"score requests need protocol {SCORING_VERSION}")
        if message.request_id in self.in_flight:
            raise IllegalTransitionError(f"request {message.request_id!r} is already in flight")
        _check_score(message)
        if message.images:
            self._require_images()
            _check_images(message, self.images)
        self.in_flight.add(message.request_id)
        return encode(message)

    def cancel(self, request_id: str) -> bytes | None:
        """Cancel a request in flight; None when it already finished."""
        self._require(ConnectionState.OPEN, "cancel")
        if request_id not in self.in_flight:
            return None
        self.in_flight.discard(request_id)
        self.cancelled.add(request_id)
        return encode(Cancel(request_id))


def _check_score(message: Score) -> None:
    """A score request names at least one id after its first."""
    if not 0 < message.start < len(message.ids) // 4:
        raise FrameError(
            f"request {message.request_id!r}: scores from {message.start} of "
            f"{len(message.ids) // 4} ids (the first id has no logprob)"
        )


def _check_images(message: Generate | Score, held: set[str] | None) -> None:
    """A request's images are held by the worker (unless ``held`` is None) and lie, in
    order and apart, inside its prompt (a score request's ids)."""
    length = len(message.prompt_ids if isinstance(message, Generate) else message.ids) // 4
    end = 0
    for ref in message.images:
        if held is not None and ref.sha256 not in held:
            raise IllegalTransitionError(
                f"request {message.request_id!r} uses image {ref.sha256[:12]}, not sent"
            )
        if not end <= ref.start < ref.end <= length:
            raise FrameError(
                f"request {message.request_id!r}: image span [{ref.start}, {ref.end}) is out "
                "of order or outside the prompt"
            )
        end = ref.end


class WorkerEndpoint(_Endpoint):
    """The worker's side of its connection to the proxy."""

    def __init__(self) -> None:
        super().__init__()
        self.images: set[str] = set()  # the images the proxy sent and has not dropped

    def hello(self, message: Hello) -> bytes:
        self._require(ConnectionState.AWAITING_HELLO, "hello")
        return encode(message)

    def receive(self, data: bytes) -> ProxyMessage:
        message = decode_proxy_message(data)
        if isinstance(message, Welcome):
            self._require(ConnectionState.AWAITING_HELLO, "welcome")
            if message.protocol_version not in SUPPORTED_VERSIONS:
                raise VersionMismatchError(
                    f"proxy speaks protocol {message.protocol_version}, "
                    f"worker speaks {', '.join(map(str, sorted(SUPPORTED_VERSIONS)))}"
                )
            self.version = message.protocol_version
            self.state = ConnectionState.OPEN
            return message
        if isinstance(message, Error) and self.state is ConnectionState.AWAITING_HELLO:
            return message  # the proxy refused us; caller closes
        self._require(ConnectionState.OPEN, type(message).__name__.lower())
        uses_images = isinstance(message, Image | ImageDrop) or (
            isinstance(message, Generate | Score) and bool(message.images)
        )
        if uses_images and self.version < IMAGES_VERSION:
            raise IllegalTransitionError(f"images need protocol {IMAGES_VERSION}")
        if (
            isinstance(message, Generate)
            and message.routed_experts_from is not None
            and self.version < ROUTING_VERSION
        ):
            raise IllegalTransitionError(f"routed experts need protocol {ROUTING_VERSION}")
        if isinstance(message, Score):
            if self.version < SCORING_VERSION:
                raise IllegalTransitionError(f"score requests need protocol {SCORING_VERSION}")
            _check_score(message)
        if isinstance(message, Generate | Score):
            if message.request_id in self.in_flight:
                raise IllegalTransitionError(f"request {message.request_id!r} already running")
            # An image the worker lacks fails that request (``IMAGE_MISSING``), not the
            # connection and every request on it.
            _check_images(message, None)
            self.in_flight.add(message.request_id)
        elif isinstance(message, Image):
            if message.sha256 in self.images:
                raise IllegalTransitionError(f"image {message.sha256[:12]} was sent twice")
            self.images.add(message.sha256)
        elif isinstance(message, ImageDrop):
            self.images.difference_update(message.sha256s)
        elif isinstance(message, Pause | Load | Commit | Rollback) and (
            self.version < WEIGHTS_VERSION
        ):
            raise IllegalTransitionError(f"weight updates need protocol {WEIGHTS_VERSION}")
        return message

    def control(self, message: UpdateAck | Weights) -> bytes:
        """Encode a weight-update answer or notice (protocol 3 only)."""
        self._require(ConnectionState.OPEN, type(message).__name__.lower())
        if self.version < WEIGHTS_VERSION:
            raise IllegalTransitionError(f"weight updates need protocol {WEIGHTS_VERSION}")
        return encode(message)

    def finish(self, message: Done | Error) -> bytes:
        """Encode the final message of a request and forget it."""
        return encode(self._forget(message))

    def send_frames(self, frames: list[RequestFrame]) -> list[bytes]:
        """Encode request frames to send together: one ``Batch`` when the proxy speaks
        it and there are several, else one message each. Finished requests are
        forgotten."""
        for frame in frames:
            self._forget(frame)
        if len(frames) > 1 and self.version >= BATCH_VERSION:
            return [encode(Batch(frames))]
        return [encode(frame) for frame in frames]

    def _forget(self, message: RequestFrame) -> RequestFrame:
        if not isinstance(message, Delta) and message.request_id is not None:
            self.in_flight.discard(message.request_id)
        return message
