"""The wire protocol without sockets: bytes in, messages and state out."""

from __future__ import annotations

import math

import msgspec
import pytest

from relay import protocol
from relay.exceptions import FrameError, IllegalTransitionError, VersionMismatchError


def _hello(version: int = protocol.PROTOCOL_VERSION) -> protocol.Hello:
    return protocol.Hello(
        protocol_version=version,
        worker_id="w1",
        token="secret",
        models=[
            protocol.ModelInfo("tiny", 65536, "raw", "hf", {"tokenizer.json": b"{}"}),
        ],
    )


def _open_pair() -> tuple[protocol.ProxyEndpoint, protocol.WorkerEndpoint]:
    proxy, worker = protocol.ProxyEndpoint(), protocol.WorkerEndpoint()
    hello = proxy.receive(worker.hello(_hello()))
    assert isinstance(hello, protocol.Hello)
    worker.receive(proxy.accept(10.0))
    return proxy, worker


def test_ids_and_logprobs_pack_compactly_and_round_trip() -> None:
    """Token ids and logprobs travel as 4-byte packed arrays and decode unchanged."""
    ids = [0, 1, 151_643, 2**31 - 1]
    assert protocol.unpack_ids(protocol.pack_ids(ids)) == ids
    assert len(protocol.pack_ids(ids)) == 16
    lps = [-0.0, -1.5, -12.345678, -1e-7]
    back = protocol.unpack_logprobs(protocol.pack_logprobs(lps))
    assert all(
        math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9) for a, b in zip(lps, back, strict=True)
    )


def test_every_message_round_trips() -> None:
    """Each message type encodes and decodes to an equal message on the right side."""
    sampling = protocol.Sampling(
        max_tokens=5, temperature=0.7, top_p=0.9, top_k=3, seed=4, stop_token_ids=[2]
    )
    proxy_messages: list[protocol.ProxyMessage] = [
        protocol.Generate("r1", "tiny", protocol.pack_ids([1, 2]), sampling),
        protocol.Cancel("r1"),
        protocol.Welcome(1, 5.0),
        protocol.Ping(7),
    ]
    for message in proxy_messages:
        assert protocol.decode_proxy_message(protocol.encode(message)) == message
    worker_messages: list[protocol.WorkerMessage] = [
        _hello(),
        protocol.Delta("r1", protocol.pack_ids([3]), protocol.pack_logprobs([-0.5])),
        protocol.Done("r1", "stop", b"", b"", {"policy_version": 3}),
        protocol.Error("engine_error", "boom", "r1"),
        protocol.Batch(
            [
                protocol.Delta("r1", protocol.pack_ids([3]), protocol.pack_logprobs([-0.5])),
                protocol.Done("r2", "length"),
                protocol.Error("engine_error", "boom", "r3"),
            ]
        ),
        protocol.Pong(7),
    ]
    for wmessage in worker_messages:
        assert protocol.decode_worker_message(protocol.encode(wmessage)) == wmessage


def test_generate_frame_is_binary_not_json_lists() -> None:
    """A 1000-token prompt costs about 4 bytes a token on the wire."""
    ids = list(range(1000))
    frame = protocol.encode(
        protocol.Generate("r", "m", protocol.pack_ids(ids), protocol.Sampling(max_tokens=1))
    )
    assert 4000 <= len(frame) < 4200


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        b"\xc1",
        b"not msgpack at all",
        msgspec.msgpack.encode({"type": "nope"}),
        msgspec.msgpack.encode([1, 2]),
    ],
)
def test_garbage_frames_raise_frame_error(frame: bytes) -> None:
    """Undecodable or unknown frames raise FrameError on both sides."""
    with pytest.raises(FrameError):
        protocol.decode_worker_message(frame)
    with pytest.raises(FrameError):
        protocol.decode_proxy_message(frame)


def test_odd_length_packed_arrays_are_rejected() -> None:
    """A packed array whose length is not a multiple of 4 is a frame error."""
    with pytest.raises(FrameError):
        protocol.unpack_ids(b"\x01\x02\x03")
    with pytest.raises(FrameError):
        protocol.unpack_logprobs(b"\x01")


def test_version_mismatch_is_refused() -> None:
    """A hello with another protocol version raises VersionMismatchError."""
    proxy, worker = protocol.ProxyEndpoint(), protocol.WorkerEndpoint()
    with pytest.raises(VersionMismatchError):
        proxy.receive(worker.hello(_hello(version=protocol.PROTOCOL_VERSION + 1)))
    assert proxy.state is protocol.ConnectionState.AWAITING_HELLO


def test_a_version_1_worker_is_welcomed_in_version_1() -> None:
    """Workers not yet upgraded keep working with an upgraded proxy."""
    proxy, worker = protocol.ProxyEndpoint(), protocol.WorkerEndpoint()
    proxy.receive(worker.hello(_hello(version=1)))
    welcome = worker.receive(proxy.accept(10.0))
    assert isinstance(welcome, protocol.Welcome)
    assert welcome.protocol_version == 1
    assert proxy.version == worker.version == 1


def _with_requests(*rids: str) -> tuple[protocol.ProxyEndpoint, protocol.WorkerEndpoint]:
    proxy, worker = _open_pair()
    for rid in rids:
        sampling = protocol.Sampling(max_tokens=4)
        worker.receive(proxy.generate(protocol.Generate(rid, "tiny", b"", sampling)))
    return proxy, worker


def test_a_batch_is_checked_frame_by_frame() -> None:
    """A batch's finished requests leave the in-flight set; its deltas keep theirs open."""
    proxy, _worker = _with_requests("r1", "r2")
    delta = protocol.Delta("r1", protocol.pack_ids([5]), protocol.pack_logprobs([-1.0]))
    batch = proxy.receive(protocol.encode(protocol.Batch([delta, protocol.Done("r2", "stop")])))
    assert isinstance(batch, protocol.Batch)
    assert proxy.in_flight == {"r1"}


@pytest.mark.parametrize(
    ("frames", "error"),
    [
        ([], FrameError),
        ([protocol.Done("nobody", "stop")], IllegalTransitionError),
        ([protocol.Done("r1", "stop"), protocol.Error("engine_error", "oops")], FrameError),
    ],
    ids=["empty", "unknown request", "connection error inside"],
)
def test_bad_batches_are_protocol_errors(
    frames: list[protocol.RequestFrame], error: type[Exception]
) -> None:
    proxy, _worker = _with_requests("r1")
    with pytest.raises(error):
        proxy.receive(protocol.encode(protocol.Batch(frames)))


def test_a_batch_needs_version_2() -> None:
    """A worker that said version 1 may not send one (it was promised single frames)."""
    proxy, worker = protocol.ProxyEndpoint(), protocol.WorkerEndpoint()
    proxy.receive(worker.hello(_hello(version=1)))
    worker.receive(proxy.accept(10.0))
    with pytest.raises(IllegalTransitionError):
        proxy.receive(protocol.encode(protocol.Batch([protocol.Done("r1", "stop")])))


def test_worker_rejects_welcome_of_other_version() -> None:
    """The worker refuses a proxy that speaks another version."""
    worker = protocol.WorkerEndpoint()
    worker.hello(_hello())
    with pytest.raises(VersionMismatchError):
        worker.receive(protocol.encode(protocol.Welcome(protocol.PROTOCOL_VERSION + 1, 1.0)))


def test_messages_before_hello_are_illegal() -> None:
    """Only a hello may open a connection."""
    proxy = protocol.ProxyEndpoint()
    with pytest.raises(IllegalTransitionError):
        proxy.receive(protocol.encode(protocol.Done("r", "stop")))
    with pytest.raises(IllegalTransitionError):
        proxy.generate(protocol.Generate("r", "m", b"", protocol.Sampling(max_tokens=1)))


def test_second_hello_is_illegal() -> None:
    """A hello after the connection opened is a protocol error."""
    proxy, _worker = _open_pair()
    with pytest.raises(IllegalTransitionError):
        proxy.receive(protocol.encode(_hello()))


def test_request_lifecycle_and_unknown_request() -> None:
    """Deltas are legal only for requests in flight; Done ends the request."""
    proxy, worker = _open_pair()
    frame = proxy.generate(protocol.Generate("r1", "tiny", b"", protocol.Sampling(max_tokens=1)))
    generate = worker.receive(frame)
    assert isinstance(generate, protocol.Generate)
    assert proxy.in_flight == {"r1"}
    assert worker.in_flight == {"r1"}
    delta = protocol.encode(
        protocol.Delta("r1", protocol.pack_ids([5]), protocol.pack_logprobs([-1.0]))
    )
    assert isinstance(proxy.receive(delta), protocol.Delta)
    proxy.receive(worker.finish(protocol.Done("r1", "stop")))
    assert proxy.in_flight == set()
    assert worker.in_flight == set()
    with pytest.raises(IllegalTransitionError):
        proxy.receive(delta)
    with pytest.raises(IllegalTransitionError):
        proxy.receive(protocol.encode(protocol.Done("never-sent", "stop")))


def test_duplicate_request_id_is_illegal() -> None:
    """The same request id cannot be in flight twice on one connection."""
    proxy, _ = _open_pair()
    message = protocol.Generate("r1", "tiny", b"", protocol.Sampling(max_tokens=1))
    proxy.generate(message)
    with pytest.raises(IllegalTransitionError):
        proxy.generate(message)


def test_late_frames_after_cancel_are_tolerated_then_forgotten() -> None:
    """After Cancel, the worker's late deltas and final Done are accepted once."""
    proxy, worker = _open_pair()
    worker.receive(
        proxy.generate(protocol.Generate("r1", "m", b"", protocol.Sampling(max_tokens=9)))
    )
    cancel = proxy.cancel("r1")
    assert cancel is not None
    assert isinstance(worker.receive(cancel), protocol.Cancel)
    assert proxy.cancel("r1") is None
    proxy.receive(protocol.encode(protocol.Delta("r1", b"", b"")))
    proxy.receive(worker.finish(protocol.Done("r1", "abort")))
    with pytest.raises(IllegalTransitionError):
        proxy.receive(protocol.encode(protocol.Delta("r1", b"", b"")))


def test_close_returns_requests_in_flight() -> None:
    """Closing reports what was lost so the pool can re-dispatch it."""
    proxy, _ = _open_pair()
    proxy.generate(protocol.Generate("a", "m", b"", protocol.Sampling(max_tokens=1)))
    proxy.generate(protocol.Generate("b", "m", b"", protocol.Sampling(max_tokens=1)))
    assert proxy.close() == {"a", "b"}
    assert proxy.state is protocol.ConnectionState.CLOSED
    assert "closed" in repr(proxy)


def _open_pair_at(version: int) -> tuple[protocol.ProxyEndpoint, protocol.WorkerEndpoint]:
    proxy, worker = protocol.ProxyEndpoint(), protocol.WorkerEndpoint()
    proxy.receive(worker.hello(_hello(version=version)))
    worker.receive(proxy.accept(10.0))
    return proxy, worker


def test_weight_update_messages_round_trip() -> None:
    """Pause, Load, Commit and Rollback decode on the worker's side, UpdateAck, Weights and
    a hello's weights on the proxy's, equal to what was sent."""
    phases: list[protocol.UpdateMessage] = [
        protocol.Pause("u1", protocol.PauseMode.ABORT),
        protocol.Pause("u1"),
        protocol.Load("u1", 3, "/ckpt/step-3"),
        protocol.Load("u1", 4),
        protocol.Commit("u1"),
        protocol.Rollback("u1"),
    ]
    for message in phases:
        assert protocol.decode_proxy_message(protocol.encode(message)) == message
    hello = msgspec.structs.replace(_hello(), policy_version=7, weights_path="/ckpt/step-7")
    answers: list[protocol.WorkerMessage] = [
        protocol.UpdateAck("u1", protocol.UpdatePhase.LOADED, True, 3),
        protocol.UpdateAck("u1", protocol.UpdatePhase.PAUSED, False, 2, "no such file"),
        protocol.UpdateAck("u1", protocol.UpdatePhase.PAUSED, False, 2, "busy", protocol.ACK_BUSY),
        protocol.Weights(3, "/ckpt/step-3"),
        protocol.Weights(4),
        hello,
    ]
    for wmessage in answers:
        decoded = protocol.decode_worker_message(protocol.encode(wmessage))
        assert decoded == wmessage
    back = protocol.decode_worker_message(protocol.encode(hello))
    assert isinstance(back, protocol.Hello)
    assert (back.policy_version, back.weights_path) == (7, "/ckpt/step-7")


def test_an_update_runs_through_both_endpoints_and_its_final_phase_forgets_it() -> None:
    """Each phase the proxy sends reaches the worker; the worker's acks are legal until a
    final phase (committed or rolled back), after which the update is unknown."""
    proxy, worker = _open_pair()
    assert proxy.can_update
    steps: list[tuple[protocol.UpdateMessage, protocol.UpdatePhase]] = [
        (protocol.Pause("u1", protocol.PauseMode.ABORT), protocol.UpdatePhase.PAUSED),
        (protocol.Load("u1", 1, "/ckpt"), protocol.UpdatePhase.LOADED),
        (protocol.Commit("u1"), protocol.UpdatePhase.COMMITTED),
    ]
    for message, phase in steps:
        assert worker.receive(proxy.update(message)) == message
        assert proxy.updates == {"u1"}
        ack = protocol.UpdateAck("u1", phase, True, 1)
        assert proxy.receive(worker.control(ack)) == ack
    assert proxy.updates == set()
    late = protocol.UpdateAck("u1", protocol.UpdatePhase.COMMITTED, True, 1)
    with pytest.raises(IllegalTransitionError):
        proxy.receive(worker.control(late))
    with pytest.raises(IllegalTransitionError):
        proxy.update(protocol.Commit("u1"))
    # A rollback is final too.
    proxy.update(protocol.Pause("u2"))
    proxy.update(protocol.Rollback("u2"))
    proxy.receive(worker.control(protocol.UpdateAck("u2", protocol.UpdatePhase.ROLLED_BACK)))
    assert proxy.updates == set()
    notice = protocol.Weights(1, "/ckpt")
    assert proxy.receive(worker.control(notice)) == notice


@pytest.mark.parametrize(
    "messages",
    [
        [protocol.Pause("u1"), protocol.Pause("u1")],
        [protocol.Commit("u1")],
        [protocol.Load("u1", 1, "/ckpt")],
        [protocol.Rollback("u1")],
        [protocol.Pause("u1"), protocol.Load("u2", 1)],
    ],
    ids=[
        "pause twice",
        "commit without pause",
        "load without pause",
        "rollback without pause",
        "load of another update",
    ],
)
def test_update_phases_out_of_order_are_illegal(messages: list[protocol.UpdateMessage]) -> None:
    """An update starts with Pause, once; its later phases name a started update."""
    proxy, _worker = _open_pair()
    *before, last = messages
    for message in before:
        proxy.update(message)
    with pytest.raises(IllegalTransitionError):
        proxy.update(last)


def test_an_ack_for_an_unknown_update_is_illegal() -> None:
    """A worker may only answer updates the proxy started."""
    proxy, worker = _open_pair()
    ack = protocol.UpdateAck("never", protocol.UpdatePhase.PAUSED)
    with pytest.raises(IllegalTransitionError):
        proxy.receive(worker.control(ack))


def test_updates_need_an_open_connection() -> None:
    """No phase goes out before the handshake or after close, and a worker answers only
    on an open connection."""
    proxy, worker = protocol.ProxyEndpoint(), protocol.WorkerEndpoint()
    with pytest.raises(IllegalTransitionError):
        proxy.update(protocol.Pause("u1"))
    with pytest.raises(IllegalTransitionError):
        worker.control(protocol.Weights(1))
    proxy, worker = _open_pair()
    proxy.close()
    with pytest.raises(IllegalTransitionError):
        proxy.update(protocol.Pause("u1"))


def test_a_version_2_peer_neither_gets_nor_sends_weight_updates() -> None:
    """Updates need protocol 3 on both sides: a proxy cannot update a version 2 worker
    (nor accept its acks or notices), a worker welcomed in version 2 refuses phases and
    sends no answers."""
    proxy, worker = _open_pair_at(2)
    assert not proxy.can_update
    assert proxy.version == worker.version == 2
    phases: list[protocol.UpdateMessage] = [
        protocol.Pause("u1"),
        protocol.Load("u1", 1),
        protocol.Commit("u1"),
    ]
    for message in phases:
        with pytest.raises(IllegalTransitionError):
            proxy.update(message)
        with pytest.raises(IllegalTransitionError):
            worker.receive(protocol.encode(message))
    assert proxy.updates == set()
    answers: list[protocol.UpdateAck | protocol.Weights] = [
        protocol.UpdateAck("u1", protocol.UpdatePhase.PAUSED),
        protocol.Weights(1),
    ]
    for answer in answers:
        with pytest.raises(IllegalTransitionError):
            proxy.receive(protocol.encode(answer))
        with pytest.raises(IllegalTransitionError):
            worker.control(answer)
    # Requests still flow.
    worker.receive(proxy.generate(protocol.Generate("r1", "t", b"", protocol.Sampling(1))))
    assert proxy.in_flight == {"r1"}


def test_packed_ids_unpack_to_an_int32_array() -> None:
    """unpack_id_array gives back the ids packed, as an int32 array, and refuses a length
    that is not a multiple of 4."""
    from array import array

    ids = [0, 1, 151_643, 2**31 - 1, -(2**31)]
    packed = protocol.pack_ids(ids)
    back = protocol.unpack_id_array(packed)
    assert isinstance(back, array)
    assert back.typecode == "i"
    assert back.tolist() == ids
    assert protocol.pack_ids(back) == packed
    assert protocol.unpack_id_array(b"").tolist() == []
    for length in (1, 2, 3, 5, 7):
        with pytest.raises(FrameError):
            protocol.unpack_id_array(packed[:length])


_SHA = "ab" * 32


def _generate_with_images(*refs: protocol.ImageRef, rid: str = "r1") -> protocol.Generate:
    return protocol.Generate(
        rid,
        "tiny",
        protocol.pack_ids(range(20)),
        protocol.Sampling(max_tokens=4),
        images=list(refs),
    )


def test_images_round_trip_and_travel_as_bytes() -> None:
    """An image, a drop and a request with image spans decode unchanged; the image's bytes
    travel as binary, not as base64."""
    data = bytes(range(256)) * 4
    for message in (
        protocol.Image(_SHA, data),
        protocol.ImageDrop([_SHA]),
        _generate_with_images(protocol.ImageRef(_SHA, 2, 6)),
    ):
        assert protocol.decode_proxy_message(protocol.encode(message)) == message
    assert len(protocol.encode(protocol.Image(_SHA, data))) < len(data) + 100
    info = protocol.ModelInfo("vlm", 4096, "raw", "hf", {}, image_token_id=7)
    hello = protocol.Hello(protocol.PROTOCOL_VERSION, "w", "t", [info])
    assert protocol.decode_worker_message(protocol.encode(hello)) == hello


def test_a_request_uses_only_images_the_worker_holds() -> None:
    """Both ends track what the worker holds: an image is sent once, a request may use it
    until it is dropped, and the proxy cannot send a request using an image never sent (or
    dropped). A worker given one anyway takes the request, to fail it alone with
    ``IMAGE_MISSING``: the connection and its other requests go on."""
    proxy, worker = _open_pair()
    ref = protocol.ImageRef(_SHA, 2, 6)
    with pytest.raises(IllegalTransitionError, match="not sent"):
        proxy.generate(_generate_with_images(ref))
    worker.receive(proxy.image(protocol.Image(_SHA, b"png")))
    with pytest.raises(IllegalTransitionError, match="sent already"):
        proxy.image(protocol.Image(_SHA, b"png"))
    received = worker.receive(proxy.generate(_generate_with_images(ref)))
    assert isinstance(received, protocol.Generate)
    assert received.images == [ref]
    worker.receive(proxy.drop_images(protocol.ImageDrop([_SHA])))
    assert proxy.images == worker.images == set()
    with pytest.raises(IllegalTransitionError, match="not held"):
        proxy.drop_images(protocol.ImageDrop([_SHA]))
    received = worker.receive(protocol.encode(_generate_with_images(ref, rid="r2")))
    assert isinstance(received, protocol.Generate)
    assert "r2" in worker.in_flight
    worker.finish(protocol.Error(protocol.IMAGE_MISSING, "not held", "r2"))
    assert "r2" not in worker.in_flight


@pytest.mark.parametrize(
    "refs",
    [
        [protocol.ImageRef(_SHA, 4, 2)],
        [protocol.ImageRef(_SHA, 18, 24)],
        [protocol.ImageRef(_SHA, 2, 6), protocol.ImageRef(_SHA, 5, 8)],
        [protocol.ImageRef(_SHA, 8, 10), protocol.ImageRef(_SHA, 2, 6)],
    ],
    ids=["backwards", "past-the-prompt", "overlapping", "out-of-order"],
)
def test_image_spans_must_lie_in_order_inside_the_prompt(refs: list[protocol.ImageRef]) -> None:
    """A span that is empty, reaches past the prompt, overlaps or comes before the previous
    one is refused before it reaches an engine."""
    proxy, _ = _open_pair()
    proxy.image(protocol.Image(_SHA, b"png"))
    with pytest.raises(FrameError, match="out of order or outside"):
        proxy.generate(_generate_with_images(*refs))


def test_a_version_3_peer_neither_gets_nor_sends_images() -> None:
    """Images need protocol 4 on both sides; a version 3 worker still runs text requests."""
    proxy, worker = _open_pair_at(3)
    assert not proxy.takes_images
    with pytest.raises(IllegalTransitionError, match="protocol 4"):
        proxy.image(protocol.Image(_SHA, b"png"))
    with pytest.raises(IllegalTransitionError, match="protocol 4"):
        proxy.generate(_generate_with_images(protocol.ImageRef(_SHA, 2, 6)))
    with pytest.raises(IllegalTransitionError, match="protocol 4"):
        worker.receive(protocol.encode(protocol.Image(_SHA, b"png")))
    worker.receive(proxy.generate(_generate_with_images()))


def test_an_ack_without_a_code_decodes_as_one_with_an_empty_code() -> None:
    """An UpdateAck from a worker that predates ``code`` decodes with an empty code, and
    one with a code decodes on a peer that ignores it: the field changes no version."""
    old = msgspec.msgpack.encode({"type": "update_ack", "update_id": "u1", "phase": "paused"})
    back = protocol.decode_worker_message(old)
    assert isinstance(back, protocol.UpdateAck)
    assert back.code == ""

    class OldAck(msgspec.Struct, frozen=True, tag="update_ack"):
        update_id: str
        phase: str

    new = protocol.encode(protocol.UpdateAck("u1", protocol.UpdatePhase.PAUSED, code="busy"))
    assert msgspec.msgpack.decode(new, type=OldAck) == OldAck("u1", "paused")


def test_routing_rows_need_protocol_5_on_both_sides() -> None:
    """A proxy asks routing rows only of a worker welcomed in version 5, and a worker of an
    older version refuses a request that asks for them; the shape names its element type."""
    from relay.protocol import (
        ROUTING_VERSION,
        Done,
        Generate,
        Hello,
        ProxyEndpoint,
        RoutedExperts,
        RoutingShape,
        Sampling,
        Welcome,
        WorkerEndpoint,
        decode_worker_message,
        encode,
        pack_ids,
    )

    ask = Generate("r1", "m", pack_ids([1, 2, 3]), Sampling(max_tokens=4), routed_experts_from=2)
    proxy = ProxyEndpoint()
    proxy.receive(encode(Hello(ROUTING_VERSION - 1, "w", "", [])))
    proxy.accept(10.0)
    assert not proxy.reports_routing
    with pytest.raises(IllegalTransitionError, match="protocol 5"):
        proxy.generate(ask)
    worker = WorkerEndpoint()
    worker.receive(encode(Welcome(ROUTING_VERSION - 1, 10.0)))
    with pytest.raises(IllegalTransitionError, match="protocol 5"):
        worker.receive(encode(ask))
    current = ProxyEndpoint()
    current.receive(encode(Hello(ROUTING_VERSION, "w", "", [])))
    current.accept(10.0)
    assert current.reports_routing
    current.generate(ask)
    assert RoutingShape(2, 2, 8).dtype == "uint8"
    assert RoutingShape(2, 2, 8).row_bytes == 4
    assert RoutingShape(48, 8, 512).dtype == "uint16"
    done = decode_worker_message(
        encode(Done("r1", "stop", routed_experts=RoutedExperts(2, 1, b"\x01\x02\x03\x04")))
    )
    assert isinstance(done, Done)
    assert done.routed_experts == RoutedExperts(2, 1, b"\x01\x02\x03\x04")


def test_score_requests_need_protocol_6_on_both_sides() -> None:
    """A proxy sends ``Score`` only to a worker welcomed in version 6, a worker of an older
    version refuses one, and a current pair carries it with its images checked."""
    from relay.protocol import (
        SCORING_VERSION,
        Hello,
        ImageRef,
        ProxyEndpoint,
        Score,
        Welcome,
        WorkerEndpoint,
        encode,
        pack_ids,
    )

    ask = Score("s1", "teacher", pack_ids([1, 2, 3, 4]), 2)
    old = ProxyEndpoint()
    old.receive(encode(Hello(SCORING_VERSION - 1, "w", "", [])))
    old.accept(10.0)
    assert not old.scores
    with pytest.raises(IllegalTransitionError, match="protocol 6"):
        old.score(ask)
    worker = WorkerEndpoint()
    worker.receive(encode(Welcome(SCORING_VERSION - 1, 10.0)))
    with pytest.raises(IllegalTransitionError, match="protocol 6"):
        worker.receive(encode(ask))
    proxy, current = _open_pair()
    assert proxy.scores
    received = current.receive(proxy.score(ask))
    assert received == ask
    assert proxy.in_flight == {"s1"}
    assert current.in_flight == {"s1"}
    with pytest.raises(IllegalTransitionError, match="not sent"):
        proxy.score(Score("s2", "teacher", pack_ids([1, 2, 3]), 1, [ImageRef("ab" * 32, 0, 2)]))


@pytest.mark.parametrize("start", [0, 4, -1])
def test_a_score_request_names_ids_after_the_first(start: int) -> None:
    """Scoring from the first id (it has no logprob) or past the last is a frame error on
    either side."""
    proxy, worker = _open_pair()
    ask = protocol.Score("s1", "teacher", protocol.pack_ids([1, 2, 3, 4]), start)
    with pytest.raises(FrameError, match="the first id has no logprob"):
        proxy.score(ask)
    with pytest.raises(FrameError, match="the first id has no logprob"):
        worker.receive(protocol.encode(ask))


def test_a_scored_done_ends_the_score_request() -> None:
    """The worker's ``Done`` with ``SCORED`` and the scored ids ends a score request as a
    reply's ``Done`` ends a generation."""
    proxy, worker = _open_pair()
    worker.receive(proxy.score(protocol.Score("s1", "t", protocol.pack_ids([5, 6, 7]), 1)))
    done = protocol.Done(
        "s1", protocol.SCORED, protocol.pack_ids([6, 7]), protocol.pack_logprobs([-1.0, -2.0])
    )
    back = proxy.receive(worker.finish(done))
    assert back == done
    assert proxy.in_flight == set()
    assert worker.in_flight == set()


def test_a_hello_without_the_teacher_flag_announces_a_policy() -> None:
    """A model announced by a worker that predates teachers decodes as no teacher; a
    teacher's flag decodes on a proxy that knows it."""

    class OldInfo(msgspec.Struct, frozen=True):
        name: str
        max_model_len: int
        logprobs_mode: str
        backend: str
        tokenizer_files: dict[str, bytes]

    class OldHello(msgspec.Struct, frozen=True, tag="hello"):
        protocol_version: int
        worker_id: str
        token: str
        models: list[OldInfo]

    old = msgspec.msgpack.encode(OldHello(5, "w", "", [OldInfo("tiny", 64, "raw", "hf", {})]))
    hello = protocol.decode_worker_message(old)
    assert isinstance(hello, protocol.Hello)
    assert hello.models[0].teacher is False
    info = protocol.ModelInfo("big", 64, "raw", "hf", {}, teacher=True)
    new = protocol.decode_worker_message(protocol.encode(protocol.Hello(6, "w", "", [info])))
    assert isinstance(new, protocol.Hello)
    assert new.models[0].teacher is True
