"""The benchmark-only ``instant`` engine: the Engine interface, determinism, stop/length,
window checks, aborts and loading from the tiny model's tokenizer files."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from worker_client.backends.instant import InstantEngine
from worker_client.engine import Engine, FinishReason, SamplingParams, TokenChunk
from worker_client.exceptions import EngineError, EngineUnavailableError, PromptTooLongError


async def _collect(
    engine: InstantEngine, rid: str, prompt: list[int], sampling: SamplingParams
) -> list[TokenChunk]:
    return [chunk async for chunk in engine.generate(rid, prompt, sampling)]


def _engine(**kwargs: object) -> InstantEngine:
    options: dict[str, object] = {"name": "bench", "vocab": range(10, 50), "eos_token_id": 2}
    options.update(kwargs)
    return InstantEngine(**options)  # type: ignore[arg-type]


def test_is_an_engine() -> None:
    """It implements the same interface as the real backends."""
    assert isinstance(_engine(), Engine)
    assert _engine().card.backend == "instant"


async def test_reply_streams_one_token_per_chunk_and_ends_with_eos() -> None:
    """A reply shorter than max_tokens ends with the eos token and finish reason stop."""
    engine = _engine(reply_tokens=5)
    chunks = await _collect(engine, "r1", [1, 2, 3], SamplingParams(max_tokens=100, seed=3))
    assert [len(c.token_ids) for c in chunks] == [1] * 5
    assert [c.finish_reason for c in chunks] == [None] * 4 + [FinishReason.STOP]
    assert chunks[-1].token_ids == [2]
    assert all(10 <= c.token_ids[0] < 50 for c in chunks[:-1])
    assert all(-4.0 <= c.logprobs[0] <= 0.0 for c in chunks)


async def test_max_tokens_cuts_the_reply_with_length() -> None:
    """max_tokens below the reply length ends the reply with finish reason length."""
    chunks = await _collect(_engine(reply_tokens=16), "r", [1], SamplingParams(max_tokens=3))
    assert len(chunks) == 3
    assert chunks[-1].finish_reason is FinishReason.LENGTH
    assert chunks[-1].token_ids != [2]


async def test_same_seed_same_reply_and_other_seed_differs() -> None:
    """Replies are a function of (seed, prompt length): reproducible benchmarks."""
    engine = _engine(reply_tokens=12)
    a = await _collect(engine, "a", [1, 2], SamplingParams(max_tokens=64, seed=7))
    b = await _collect(engine, "b", [5, 6], SamplingParams(max_tokens=64, seed=7))
    c = await _collect(engine, "c", [1, 2], SamplingParams(max_tokens=64, seed=8))
    assert [x.token_ids for x in a] == [x.token_ids for x in b]
    assert [x.logprobs for x in a] == [x.logprobs for x in b]
    assert [x.token_ids for x in a] != [x.token_ids for x in c]


async def test_window_and_empty_prompt_are_rejected() -> None:
    """Prompts that fill the window or are empty fail like a real engine's."""
    engine = _engine(max_model_len=8)
    with pytest.raises(PromptTooLongError):
        await _collect(engine, "r", list(range(8)), SamplingParams(max_tokens=4))
    with pytest.raises(EngineError):
        await _collect(engine, "r", [], SamplingParams(max_tokens=4))
    short = await _collect(
        _engine(max_model_len=8, reply_tokens=16), "r", [1] * 6, SamplingParams(max_tokens=99)
    )
    assert len(short) == 2
    assert short[-1].finish_reason is FinishReason.LENGTH


async def test_abort_ends_the_stream() -> None:
    """An abort while streaming ends the stream with finish reason abort."""
    engine = _engine(reply_tokens=50)
    stream = engine.generate("r", [1], SamplingParams(max_tokens=64))
    first = await anext(stream)
    assert first.finish_reason is None
    await engine.abort("r")
    rest = [c async for c in stream]
    assert rest[-1].finish_reason is FinishReason.ABORT
    await engine.abort("unknown")  # ignored


async def test_paced_requests_started_apart_step_together() -> None:
    """With tokens_per_second, a request's tokens come one engine step apart, and a
    request that starts later joins the same steps: both get their tokens together."""
    engine = _engine(reply_tokens=4, tokens_per_second=20.0)  # a step every 50 ms
    loop = asyncio.get_running_loop()
    arrivals: dict[str, list[float]] = {"a": [], "b": []}

    async def run(rid: str, delay: float) -> None:
        await asyncio.sleep(delay)
        async for _chunk in engine.generate(rid, [1], SamplingParams(max_tokens=8)):
            arrivals[rid].append(loop.time())

    await asyncio.gather(run("a", 0.0), run("b", 0.012))
    steps_a = [round(t / 0.05) for t in arrivals["a"]]
    assert len(steps_a) == 4
    assert steps_a == list(range(steps_a[0], steps_a[0] + 4))
    # b started 12 ms later but waited for a's steps: its tokens arrive with a's (or,
    # when it started just after a step was taken, one step later).
    assert [round(t / 0.05) - s for t, s in zip(arrivals["b"], steps_a, strict=True)] in (
        [0] * 4,
        [1] * 4,
    )
    assert all(abs(t - round(t / 0.05) * 0.05) < 0.02 for t in arrivals["a"] + arrivals["b"])


def test_load_takes_vocab_and_eos_from_the_tiny_model(tiny_model_dir: Path) -> None:
    """Loading reads tokenizer.json and config.json; added tokens are never produced."""
    engine = InstantEngine.load(tiny_model_dir, name="bench")
    added = {
        t["id"] for t in json.loads((tiny_model_dir / "tokenizer.json").read_text())["added_tokens"]
    }
    assert (
        engine.eos_token_id
        == json.loads((tiny_model_dir / "config.json").read_text())["eos_token_id"]
    )
    assert not added & set(engine.vocab)
    assert engine.card.name == "bench"


def test_bad_settings_and_missing_files_are_refused(tmp_path: Path) -> None:
    """Settings that cannot work and directories without a tokenizer fail at startup."""
    with pytest.raises(EngineUnavailableError):
        _engine(reply_tokens=0)
    with pytest.raises(EngineUnavailableError):
        _engine(vocab=[])
    with pytest.raises(EngineUnavailableError):
        _engine(tokens_per_second=-1.0)
    with pytest.raises(EngineUnavailableError):
        InstantEngine.load(tmp_path)


async def test_a_vision_model_directory_takes_images_and_a_text_one_refuses_them(
    tiny_model_dir: Path,
) -> None:
    """The tiny VLM's directory makes a card with its image token, whose requests may carry
    images (ignored: no model runs); the text model's refuses them."""
    from worker_client.engine import ImageSpan
    from worker_client.tiny_vlm import SHIPPED_TINY_VLM

    config = json.loads((SHIPPED_TINY_VLM / "config.json").read_text())
    vision = InstantEngine.load(SHIPPED_TINY_VLM, reply_tokens=3)
    assert vision.card.image_token_id == config["image_token_id"]
    assert vision.eos_token_id == config["text_config"]["eos_token_id"]
    pad = config["image_token_id"]
    image = ImageSpan("a" * 64, b"png bytes", 1, 5)
    sampling = SamplingParams(max_tokens=8, seed=1)
    chunks = [c async for c in vision.generate("r", [1, pad, pad, pad, pad, 2], sampling, [image])]
    assert sum(len(c.token_ids) for c in chunks) == 3
    text = InstantEngine.load(tiny_model_dir)
    assert text.card.image_token_id is None
    with pytest.raises(EngineError, match="does not take images"):
        [c async for c in text.generate("r", [1, 2, 3], sampling, [image])]


async def test_a_moe_directory_reports_made_up_routing_of_the_asked_rows() -> None:
    """The tiny MoE's directory makes a card with its routing shape; a request that asks
    gets one row per position run forward from the asked start, every id an expert."""
    from worker_client.routing import unpack_rows
    from worker_client.tiny_moe import SHIPPED_TINY_MOE

    engine = InstantEngine.load(SHIPPED_TINY_MOE, reply_tokens=3)
    shape = engine.card.routing
    assert shape is not None
    assert (shape.layers, shape.top_k, shape.experts) == (2, 2, 8)
    sampling = SamplingParams(max_tokens=8, seed=1)
    chunks = [c async for c in engine.generate("r", [1, 2, 3, 4, 5], sampling, (), 2)]
    routed = chunks[-1].routed_experts
    assert routed is not None
    assert (routed.start, routed.rows) == (2, 5 + 3 - 1 - 2)
    assert int(unpack_rows(routed, shape).max()) < shape.experts
    plain = [c async for c in engine.generate("r2", [1, 2, 3], sampling)]
    assert plain[-1].routed_experts is None
