"""The ``hf`` engine on the real tiny model: streaming, sampling, logprob modes, stops,
aborts, window checks, prefix-cache reuse and chunked prefill."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from worker_client.backends.hf import HFEngine
from worker_client.checkpoints import perturbed_checkpoint
from worker_client.engine import FinishReason, LogprobsMode, SamplingParams, TokenChunk
from worker_client.exceptions import (
    EngineError,
    EngineUnavailableError,
    PromptTooLongError,
    WeightsError,
)

_WINDOW = 131072


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.fixture(scope="module")
async def engine(tiny_model_dir: Path) -> AsyncIterator[HFEngine]:
    loaded = HFEngine.load(tiny_model_dir)
    yield loaded
    await loaded.close()


@pytest.fixture(scope="module")
async def make_engine(engine: HFEngine) -> AsyncIterator[Any]:
    """Engines sharing the loaded model's weights, with settings of the test's choosing.
    By default they know no eos token, so only max_tokens ends a generation."""
    made: list[HFEngine] = []

    def make(**kwargs: Any) -> HFEngine:
        kwargs.setdefault("name", "tiny")
        kwargs.setdefault("max_model_len", _WINDOW)
        kwargs.setdefault("eos_token_ids", ())
        made.append(HFEngine(engine.model, **kwargs))
        return made[-1]

    yield make
    for e in made:
        await e.close()


@pytest.fixture(scope="module")
def prompt(tokenizer: Any) -> list[int]:
    text = tokenizer.apply_chat_template(
        [
            {"role": "system", "content": "You help with a small python project."},
            {"role": "user", "content": "Please list the files, then read main.py."},
        ],
        tokenize=False,
        add_generation_prompt=True,
    )
    ids: list[int] = tokenizer.encode(text, add_special_tokens=False)
    return ids


async def _chunks(
    engine: HFEngine, prompt_ids: Sequence[int], sampling: SamplingParams, rid: str = "r"
) -> list[TokenChunk]:
    return [chunk async for chunk in engine.generate(rid, prompt_ids, sampling)]


def _flat(chunks: list[TokenChunk]) -> tuple[list[int], list[float]]:
    return (
        [t for c in chunks for t in c.token_ids],
        [lp for c in chunks for lp in c.logprobs],
    )


def _max_diff(a: Sequence[float], b: Sequence[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def _user_turn(tokenizer: Any, text: str) -> list[int]:
    """The ids that close a reply and ask ``text`` next (ChatML, as the template renders)."""
    ids: list[int] = tokenizer.encode(
        f"<|im_end|>\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n",
        add_special_tokens=False,
    )
    return ids


async def _as_cold(
    warm: HFEngine, cold: HFEngine, ids: Sequence[int], sampling: SamplingParams
) -> None:
    """``warm`` (whatever its cache holds) samples what ``cold`` samples from ``ids``, the
    logprobs within 1e-5."""
    warm_out = _flat(await _chunks(warm, ids, sampling))
    cold_out = _flat(await _chunks(cold, ids, sampling))
    assert warm_out[0] == cold_out[0]
    assert _max_diff(warm_out[1], cold_out[1]) < 1e-5


@contextmanager
def _forward_lengths(model: Any) -> Iterator[list[int]]:
    """Record the number of input tokens of every forward pass of the real model."""
    lengths: list[int] = []

    def hook(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        lengths.append(int(ids.shape[-1]))

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield lengths
    finally:
        handle.remove()


# ---------------------------------------------------------------------------- loading


def test_load_reads_card_and_generation_config(
    engine: HFEngine, tiny_model_dir: Path, tokenizer: Any
) -> None:
    """load() names the model after its directory, uses the config's window, RAW logprobs
    and the eos ids of generation_config.json."""
    assert engine.card.name == tiny_model_dir.name
    assert engine.card.backend == "hf"
    assert engine.card.max_model_len == _WINDOW
    assert engine.card.logprobs_mode is LogprobsMode.RAW
    assert engine.eos_token_ids == {
        tokenizer.convert_tokens_to_ids("<|im_end|>"),
        tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    }


def test_load_refuses_a_directory_without_a_model(tmp_path: Path) -> None:
    """A directory without config.json raises EngineUnavailableError."""
    with pytest.raises(EngineUnavailableError):
        HFEngine.load(tmp_path)


# ---------------------------------------------------------------------------- streaming


async def test_streams_one_chunk_per_token_and_one_final_chunk(
    make_engine: Any, prompt: list[int]
) -> None:
    """Every chunk carries exactly one token and its logprob; only the last chunk has a
    finish_reason."""
    chunks = await _chunks(make_engine(), prompt, SamplingParams(max_tokens=10, seed=1))
    assert len(chunks) == 10
    for chunk in chunks:
        assert len(chunk.token_ids) == 1
        assert len(chunk.logprobs) == 1
        assert chunk.logprobs[0] <= 0.0
    assert [c.finish_reason for c in chunks[:-1]] == [None] * 9
    assert chunks[-1].finish_reason is FinishReason.LENGTH


async def test_seeded_generation_is_deterministic(make_engine: Any, prompt: list[int]) -> None:
    """The same seed gives the same tokens and logprobs; another seed other tokens."""
    e = make_engine()
    first = _flat(await _chunks(e, prompt, SamplingParams(max_tokens=16, seed=11)))
    again = _flat(await _chunks(e, prompt, SamplingParams(max_tokens=16, seed=11)))
    other = _flat(await _chunks(e, prompt, SamplingParams(max_tokens=16, seed=12)))
    assert first[0] == again[0]
    assert _max_diff(first[1], again[1]) < 1e-5
    assert first[0] != other[0]


# ---------------------------------------------------------------------------- logprobs


@pytest.mark.parametrize("temperature", [1.0, 0.7])
async def test_raw_logprobs_equal_teacher_forced_score(
    engine: HFEngine, make_engine: Any, prompt: list[int], temperature: float
) -> None:
    """RAW logprobs are the model's own distribution whatever the temperature: they equal
    score() of the sampled tokens within 1e-4."""
    sampling = SamplingParams(max_tokens=20, temperature=temperature, seed=5)
    tokens, logprobs = _flat(await _chunks(make_engine(), prompt, sampling))
    assert _max_diff(logprobs, engine.score(prompt, tokens)) < 1e-4


async def test_processed_logprobs_are_the_sampling_distribution(
    engine: HFEngine, make_engine: Any, prompt: list[int]
) -> None:
    """PROCESSED logprobs at temperature 0.7 differ from score() and equal the tempered
    distribution the tokens were drawn from; sampling itself is unchanged by the mode."""
    sampling = SamplingParams(max_tokens=20, temperature=0.7, seed=5)
    raw_tokens, _ = _flat(await _chunks(make_engine(), prompt, sampling))
    processed = make_engine(logprobs_mode=LogprobsMode.PROCESSED)
    tokens, logprobs = _flat(await _chunks(processed, prompt, sampling))
    assert tokens == raw_tokens
    assert _max_diff(logprobs, engine.score(prompt, tokens)) > 0.05

    ids = torch.tensor([[*prompt, *tokens]])
    with torch.inference_mode():
        logits = engine.model(input_ids=ids).logits[0].float()
    tempered = torch.log_softmax(logits[len(prompt) - 1 : -1] / 0.7, dim=-1)
    expected = tempered.gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()
    assert _max_diff(logprobs, expected) < 1e-4


async def test_processed_equals_raw_at_temperature_one(
    engine: HFEngine, make_engine: Any, prompt: list[int]
) -> None:
    """At temperature 1 without top-k/top-p, PROCESSED logprobs equal RAW ones."""
    processed = make_engine(logprobs_mode=LogprobsMode.PROCESSED)
    tokens, logprobs = _flat(await _chunks(processed, prompt, SamplingParams(12, seed=8)))
    assert _max_diff(logprobs, engine.score(prompt, tokens)) < 1e-4


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(max_tokens=12, temperature=1.0, top_k=1, seed=3),
        SamplingParams(max_tokens=12, temperature=1.3, top_p=1e-6, seed=4),
    ],
    ids=["top_k=1", "top_p=1e-6"],
)
async def test_top_k_one_equals_greedy(
    engine: HFEngine, make_engine: Any, prompt: list[int], sampling: SamplingParams
) -> None:
    """top_k=1 (and a vanishing top_p) pick exactly the greedy (temperature 0) tokens,
    and RAW logprobs still equal score()."""
    e = make_engine()
    greedy, greedy_lp = _flat(await _chunks(e, prompt, SamplingParams(12, temperature=0.0)))
    tokens, logprobs = _flat(await _chunks(e, prompt, sampling))
    assert tokens == greedy
    assert _max_diff(logprobs, greedy_lp) < 1e-5
    assert _max_diff(greedy_lp, engine.score(prompt, greedy)) < 1e-4
    assert len(set(greedy)) > 1


# ---------------------------------------------------------------------------- stopping


async def test_stop_token_is_included_with_finish_stop(make_engine: Any, prompt: list[int]) -> None:
    """A sampled stop token (request stop_token_ids or engine eos) ends the generation
    with STOP and is the last token of the output."""
    e = make_engine()
    tokens, _ = _flat(await _chunks(e, prompt, SamplingParams(max_tokens=24, seed=2)))
    stop = tokens[6]
    cut = tokens.index(stop) + 1

    chunks = await _chunks(e, prompt, SamplingParams(max_tokens=24, seed=2, stop_token_ids=(stop,)))
    assert _flat(chunks)[0] == tokens[:cut]
    assert chunks[-1].finish_reason is FinishReason.STOP
    assert chunks[-1].token_ids == [stop]

    with_eos = make_engine(eos_token_ids=(stop,))
    chunks = await _chunks(with_eos, prompt, SamplingParams(max_tokens=24, seed=2))
    assert _flat(chunks)[0] == tokens[:cut]
    assert chunks[-1].finish_reason is FinishReason.STOP


async def test_frequent_stop_tokens_stop_at_first_occurrence(
    make_engine: Any, prompt: list[int], tokenizer: Any
) -> None:
    """With most of the vocabulary as stop tokens, generation stops at the first token
    that is one of them, with STOP."""
    stops = tuple(range(0, len(tokenizer), 2))
    chunks = await _chunks(
        make_engine(), prompt, SamplingParams(max_tokens=40, seed=9, stop_token_ids=stops)
    )
    tokens, _ = _flat(chunks)
    assert chunks[-1].finish_reason is FinishReason.STOP
    assert tokens[-1] % 2 == 0
    assert all(t % 2 == 1 for t in tokens[:-1])


async def test_max_tokens_gives_length_with_exactly_max_tokens(
    make_engine: Any, prompt: list[int]
) -> None:
    """max_tokens ends the generation with LENGTH after exactly max_tokens tokens."""
    for max_tokens in (1, 7):
        chunks = await _chunks(make_engine(), prompt, SamplingParams(max_tokens, seed=4))
        assert len(_flat(chunks)[0]) == max_tokens
        assert chunks[-1].finish_reason is FinishReason.LENGTH


async def test_context_window_caps_the_generation(make_engine: Any, prompt: list[int]) -> None:
    """A generation that reaches the context window ends with LENGTH there, whatever
    max_tokens says."""
    e = make_engine(max_model_len=len(prompt) + 3)
    chunks = await _chunks(e, prompt, SamplingParams(max_tokens=50, seed=4))
    assert len(_flat(chunks)[0]) == 3
    assert chunks[-1].finish_reason is FinishReason.LENGTH


# ---------------------------------------------------------------------------- abort


async def test_abort_mid_stream_ends_promptly(make_engine: Any, prompt: list[int]) -> None:
    """An abort during streaming makes the very next chunk an empty ABORT chunk, and the
    engine then serves the next request."""
    e = make_engine()
    seen: list[TokenChunk] = []
    aborted_at = 0.0
    async for chunk in e.generate("long", prompt, SamplingParams(max_tokens=2000, seed=1)):
        seen.append(chunk)
        if len(seen) == 3:
            aborted_at = time.monotonic()
            await e.abort("long")
    assert len(seen) == 4
    assert seen[-1].finish_reason is FinishReason.ABORT
    assert seen[-1].token_ids == []
    assert time.monotonic() - aborted_at < 2.0
    after = await asyncio.wait_for(_chunks(e, prompt, SamplingParams(3, seed=1), "next"), 10)
    assert after[-1].finish_reason is FinishReason.LENGTH


async def test_abort_of_an_unknown_request_is_a_no_op(make_engine: Any, prompt: list[int]) -> None:
    """Aborting an id the engine is not running leaves no trace: a later request that
    happens to reuse the id (a restarted proxy numbers its requests anew) runs normally."""
    e = make_engine()
    await e.abort("early")
    chunks = await _chunks(e, prompt, SamplingParams(max_tokens=2, seed=1), "early")
    assert [len(c.token_ids) for c in chunks] == [1, 1]
    assert chunks[-1].finish_reason is FinishReason.LENGTH


async def test_abort_of_a_queued_request(make_engine: Any, prompt: list[int]) -> None:
    """A request waiting for the engine behind another one, aborted while it waits,
    ends with ABORT and no tokens."""
    e = make_engine()
    started = asyncio.Event()

    async def first() -> list[TokenChunk]:
        out = []
        async for chunk in e.generate("first", prompt, SamplingParams(2000, seed=1)):
            out.append(chunk)
            started.set()
        return out

    running = asyncio.create_task(first())
    await asyncio.wait_for(started.wait(), 10)
    queued = asyncio.create_task(_chunks(e, prompt, SamplingParams(5, seed=1), "queued"))
    await asyncio.sleep(0.05)
    await e.abort("queued")
    await e.abort("first")
    assert (await asyncio.wait_for(running, 10))[-1].finish_reason is FinishReason.ABORT
    queued_chunks = await asyncio.wait_for(queued, 10)
    assert [(c.token_ids, c.finish_reason) for c in queued_chunks] == [([], FinishReason.ABORT)]


# ---------------------------------------------------------------------------- errors


async def test_prompt_filling_the_window_is_too_long(
    tiny_model_dir: Path, prompt: list[int]
) -> None:
    """With a max_model_len override, a prompt of window tokens raises PromptTooLongError
    while a prompt one token shorter still gets one token."""
    e = HFEngine.load(tiny_model_dir, max_model_len=32)
    try:
        assert e.card.max_model_len == 32
        ids = (prompt * 4)[:32]
        with pytest.raises(PromptTooLongError):
            await _chunks(e, ids, SamplingParams(max_tokens=1))
        chunks = await _chunks(e, ids[:31], SamplingParams(max_tokens=8, seed=1))
        assert len(_flat(chunks)[0]) == 1
        assert chunks[-1].finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
    finally:
        await e.close()


async def test_empty_prompt_is_an_engine_error(engine: HFEngine) -> None:
    """An empty prompt raises EngineError (not a crash, not PromptTooLongError); so does
    scoring without a prompt."""
    with pytest.raises(EngineError) as info:
        await _chunks(engine, [], SamplingParams(max_tokens=4))
    assert not isinstance(info.value, PromptTooLongError)
    with pytest.raises(EngineError):
        engine.score([], [1, 2])


# ---------------------------------------------------------------------------- caching


async def test_prefix_cache_reuse_matches_a_cold_cache(
    engine: HFEngine, make_engine: Any, prompt: list[int], tokenizer: Any
) -> None:
    """A prompt extending a cached sequence only prefills its new tokens and gives the
    same tokens and logprobs (1e-5) as a cold engine; so does a prompt that diverges
    inside the cached sequence (the cache is cropped)."""
    warm = make_engine(cache_entries=4)
    cold = make_engine(cache_entries=0)
    first, _ = _flat(await _chunks(warm, prompt, SamplingParams(max_tokens=12, seed=3)))
    more = _user_turn(tokenizer, "Thanks. Now read README.md.")
    second = [*prompt, *first, *more]
    sampling = SamplingParams(max_tokens=12, seed=4)

    with _forward_lengths(engine.model) as lengths:
        warm_out = _flat(await _chunks(warm, second, sampling))
    # The cache holds prompt + first[:-1] (the last sampled token was never run).
    assert lengths[0] == len(second) - (len(prompt) + len(first) - 1)
    with _forward_lengths(engine.model) as lengths:
        cold_out = _flat(await _chunks(cold, second, sampling))
    assert lengths[0] == len(second)
    assert warm_out[0] == cold_out[0]
    assert _max_diff(warm_out[1], cold_out[1]) < 1e-5

    branch = [*prompt[:-3], *more]
    with _forward_lengths(engine.model) as lengths:
        warm_out = _flat(await _chunks(warm, branch, sampling))
    assert lengths[0] == len(more)
    cold_out = _flat(await _chunks(cold, branch, sampling))
    assert warm_out[0] == cold_out[0]
    assert _max_diff(warm_out[1], cold_out[1]) < 1e-5

    # Back to the longer prompt: the (cropped) cache is extended again.
    await _as_cold(warm, cold, second, sampling)


async def test_a_request_cancelled_mid_step_leaves_a_cache_the_next_turn_can_trust(
    make_engine: Any, prompt: list[int], tokenizer: Any
) -> None:
    """A caller cancelled while a token runs on the engine's thread (a client hanging up)
    leaves a cache entry that still holds exactly what it says: the next turn, reusing it,
    samples what a cold engine samples, logprobs within 1e-5."""
    warm = make_engine(cache_entries=4)
    cold = make_engine(cache_entries=0)
    chunks = warm.generate("cut", prompt, SamplingParams(max_tokens=64, seed=3))
    received: list[int] = []
    five = asyncio.Event()

    async def consume() -> None:
        async for chunk in chunks:
            received.extend(chunk.token_ids)
            if len(received) >= 5:
                five.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(five.wait(), 30)
    task.cancel()  # most likely while the next token runs on the engine's thread
    with pytest.raises(asyncio.CancelledError):
        await task
    await chunks.aclose()
    second = [*prompt, *received, *_user_turn(tokenizer, "Go on.")]
    await _as_cold(warm, cold, second, SamplingParams(max_tokens=12, seed=4))


async def test_a_cache_entry_that_disagrees_with_its_ids_is_never_reused(
    make_engine: Any, prompt: list[int], tokenizer: Any
) -> None:
    """An entry whose KV cache holds more positions than the ids it records (which no
    path should leave) is dropped, not reused: reused, its extra position would sit in
    every later token's context, and the logprobs would be a little off."""
    warm = make_engine(cache_entries=4)
    cold = make_engine(cache_entries=0)
    first, _ = _flat(await _chunks(warm, prompt, SamplingParams(max_tokens=8, seed=3)))
    (entry,) = warm._caches.values()
    entry.ids.pop()  # the cache keeps the last position's keys and values
    second = [*prompt, *first, *_user_turn(tokenizer, "Go on.")]
    with _forward_lengths(warm.model) as lengths:
        await _as_cold(warm, cold, second, SamplingParams(max_tokens=12, seed=4))
    assert lengths[0] == len(second)  # prefilled from nothing


async def test_a_sliding_window_model_branches_past_its_window() -> None:
    """Sliding-window layers (Gemma 3's, gpt-oss's) keep only their window of the past once
    a sequence outgrows it. A prompt continuing a cached sequence still runs only its new
    tokens; one that branches inside it, where that cache can no longer be cut back to,
    runs from the start instead of failing; both sample what a cold engine samples."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_sliding_window=True,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention"],
    )
    model = AutoModelForCausalLM.from_config(config).eval()  # type: ignore[no-untyped-call]
    settings: dict[str, Any] = {"name": "window", "max_model_len": 4096, "eos_token_ids": ()}
    warm = HFEngine(model, cache_entries=4, **settings)
    cold = HFEngine(model, cache_entries=0, **settings)
    try:
        prompt = list(range(3, 43))  # 40 tokens: past the window of 16
        sampling = SamplingParams(max_tokens=8, seed=3)
        first, _ = _flat(await _chunks(warm, prompt, sampling))
        second = [*prompt, *first, 7, 8, 9]
        with _forward_lengths(model) as lengths:
            await _as_cold(warm, cold, second, sampling)
        assert lengths[0] == 4  # the last sampled token and the three new ones
        branch = [*prompt[:-3], 5, 6]
        with _forward_lengths(model) as lengths:
            await _as_cold(warm, cold, branch, sampling)
        assert lengths[0] == len(branch)  # prefilled from nothing
    finally:
        await warm.close()
        await cold.close()


async def test_chunked_prefill_matches_single_pass(
    make_engine: Any, tokenizer: Any, prompt: list[int]
) -> None:
    """prefill_chunk=64 scores and continues a ~600-token sequence like prefill_chunk=4096
    (1e-4), and really runs the model in chunks of at most 64 tokens."""
    text = " ".join(
        f"Step {i}: run the tests, read main.py and fix the bug in module_{i}." for i in range(40)
    )
    long = [*prompt, *tokenizer.encode(text, add_special_tokens=False)][:600]
    assert len(long) == 600
    small = make_engine(prefill_chunk=64)
    big = make_engine(prefill_chunk=4096)

    with _forward_lengths(small.model) as lengths:
        chunked = small.score(long[:5], long[5:])
    assert max(lengths) == 64
    assert len(lengths) == 10  # ceil(599 / 64)
    single = big.score(long[:5], long[5:])
    assert len(chunked) == len(single) == 595
    assert _max_diff(chunked, single) < 1e-4

    sampling = SamplingParams(max_tokens=8, seed=6)
    with _forward_lengths(small.model) as lengths:
        a = _flat(await _chunks(small, long, sampling))
    assert lengths[:10] == [64] * 9 + [600 - 9 * 64]
    b = _flat(await _chunks(big, long, sampling))
    assert a[0] == b[0]
    assert _max_diff(a[1], b[1]) < 1e-4


# ---------------------------------------------------------------------------- new weights


def _write_model(base: Path, out: Path, **config_changes: Any) -> Path:
    """A freshly initialised model of the base's config with ``config_changes``, saved
    as a trainer saves a checkpoint."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(base))
    for key, value in config_changes.items():
        setattr(config, key, value)
    model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    model.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def checkpoint(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return perturbed_checkpoint(tiny_model_dir, tmp_path_factory.mktemp("ckpt") / "step-1", seed=1)


@pytest.fixture
def own_engine(tiny_model_dir: Path) -> Iterator[HFEngine]:
    """An engine with weights of its own (loading changes its model in place)."""
    loaded = HFEngine.load(tiny_model_dir, name="tiny")
    yield loaded
    loaded._executor.shutdown(wait=False)


async def test_a_committed_checkpoint_serves_its_own_logprobs(
    own_engine: HFEngine, checkpoint: Path, prompt: list[int]
) -> None:
    """Staging reads a checkpoint without serving it; committing replaces the weights in
    place: scores and sampled logprobs become the checkpoint's own (1e-5, against the
    checkpoint loaded fresh), and the KV caches of the old weights are dropped."""
    reference = HFEngine.load(checkpoint)
    sampling = SamplingParams(max_tokens=6, seed=5)
    tokens, _ = _flat(await _chunks(own_engine, prompt, sampling))
    before = own_engine.score(prompt, tokens)
    assert own_engine._caches
    await own_engine.stage_weights(str(checkpoint))
    assert _max_diff(own_engine.score(prompt, tokens), before) == 0.0
    await own_engine.commit_weights(1)
    assert not own_engine._caches
    after = own_engine.score(prompt, tokens)
    assert _max_diff(after, reference.score(prompt, tokens)) < 1e-5
    assert _max_diff(after, before) > 1e-2
    new_tokens, new_logprobs = _flat(await _chunks(own_engine, prompt, sampling))
    assert _max_diff(new_logprobs, reference.score(prompt, new_tokens)) < 1e-5


@pytest.mark.parametrize(
    "bad",
    ["missing", "no weights", "other shapes", "untied embeddings"],
)
async def test_a_checkpoint_that_does_not_fit_is_refused_and_changes_nothing(
    bad: str,
    own_engine: HFEngine,
    checkpoint: Path,
    tiny_model_dir: Path,
    tmp_path: Path,
    prompt: list[int],
) -> None:
    """A missing directory, unreadable weights, parameters of other shapes or another
    tie_word_embeddings raise WeightsError at staging; the served weights and what was
    staged before stay as they were."""
    if bad == "missing":
        path = tmp_path / "nowhere"
    elif bad == "no weights":
        path = tmp_path / "empty"
        path.mkdir()
        (path / "config.json").write_bytes((tiny_model_dir / "config.json").read_bytes())
    elif bad == "other shapes":
        path = _write_model(tiny_model_dir, tmp_path / "wide", intermediate_size=128)
    else:
        path = _write_model(tiny_model_dir, tmp_path / "untied", tie_word_embeddings=False)
    tokens = prompt[-4:]
    before = own_engine.score(prompt, tokens)
    await own_engine.stage_weights(str(checkpoint))
    with pytest.raises(WeightsError):
        await own_engine.stage_weights(str(path))
    assert own_engine.score(prompt, tokens) == before
    await own_engine.commit_weights(1)  # what was staged before still loads
    reference = HFEngine.load(checkpoint)
    assert _max_diff(own_engine.score(prompt, tokens), reference.score(prompt, tokens)) < 1e-5


async def test_discarding_a_staged_checkpoint_forgets_it(
    own_engine: HFEngine, checkpoint: Path, prompt: list[int]
) -> None:
    """After discard nothing is staged: a commit has nothing to serve (WeightsError) and
    the old weights keep serving."""
    tokens = prompt[-4:]
    before = own_engine.score(prompt, tokens)
    await own_engine.stage_weights(str(checkpoint))
    await own_engine.discard_weights()
    with pytest.raises(WeightsError, match="no checkpoint"):
        await own_engine.commit_weights(1)
    assert own_engine.score(prompt, tokens) == before
