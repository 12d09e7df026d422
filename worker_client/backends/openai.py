"""The ``openai`` backend: an existing vLLM or SGLang OpenAI-compatible server upstream.

The worker stays token-in/token-out: it POSTs ``/v1/completions`` with the prompt as a
list of token ids (no re-tokenization upstream), ``return_token_ids: true`` (vLLM's
extension: each choice carries the sampled ``token_ids``) and ``logprobs: 0`` (the
sampled token's logprob per position, in ``logprobs.token_logprobs``), streaming, and
``skip_special_tokens: false``. Stopping follows ``SamplingParams``: the model's own EOS
and ``stop_token_ids``; the stop token is part of ``token_ids``.

Which distribution the logprobs come from is the upstream's setting (vLLM's
``--logprobs-mode``); announce it with ``logprobs_mode``. Aborting closes the stream, which
vLLM and SGLang treat as a cancellation.

Weight updates (``WeightLoader``) go through the upstream server's own routes, chosen by
``weights_api`` (the worker's ``--weights-api``); the checkpoint path is read by the
server, on its storage:

* ``sglang``: ``POST /update_weights_from_disk`` with ``model_path``, ``weight_version``
  and ``flush_cache``; its answer's ``success`` says whether the weights were replaced.
* ``vllm`` (a server started with ``VLLM_SERVER_DEV_MODE=1``): ``POST /pause?mode=wait``,
  ``POST /collective_rpc`` of the workers' ``reload_weights`` with ``weights_path``,
  ``POST /reset_prefix_cache``, ``POST /update_weight_version``, then ``POST /resume``
  (also after a failure, so the server is never left paused).

The worker is idle when it commits (every request of this worker has finished or was
aborted). The server loads at commit, so a checkpoint it cannot read fails that commit
and the worker is taken out of service; ``stage_weights`` refuses at once a path that the
worker can see and that holds no ``config.json``.

Images (a vision-language model, ``images_api``: the worker's ``--images-api``): token-id
prompts with images need a server route that takes both. ``/v1/completions`` carries no
images in vLLM or SGLang, and vLLM's OpenAI-compatible server has no route that takes
token ids and images together, so a worker in front of a vLLM server serves text only: its
card names no image token (the proxy refuses images for the model), and images that reach it
fail the request. With ``images_api="sglang"`` the card names the ``image_token_id`` of the
model's ``config.json``, and a request with images goes to SGLang's native ``POST
/generate`` (the server's root, beside the admin routes): ``input_ids`` with each image's
span collapsed to one placeholder (SGLang expands it with its own processor, and counts one
image per placeholder), ``image_data`` with one data URL of the agent's bytes per image, in
order, ``sampling_params`` as above (``max_new_tokens``, ``sampling_seed``, top-k ``-1`` off),
``return_logprob`` and ``return_prompt_token_ids``, streamed. SGLang streams cumulative
``output_ids`` (or deltas with ``--incremental-streaming-output``); ``meta_info``'s
``completion_tokens`` says how many of the last ids are new. The first event's
``prompt_token_ids`` (SGLang's ids after its expansion) must be the expanded ids the proxy
sent, or the request fails before any token goes out. Text requests keep
``/v1/completions``.

Routing (a mixture-of-experts model, ``routing_api``: the worker's ``--routed-experts``,
its server started with ``--enable-return-routed-experts``): the card announces the routing
shape of the model's ``config.json`` (``routing.shape_from_config``), and a request that
asks for rows from ``k`` goes to

* ``sglang``: SGLang's native ``/generate`` (as a request with images does, ``input_ids``
  as they are), with ``return_routed_experts: true`` and ``routed_experts_start_len:
  min(k, len(prompt))``. The event that finishes the request carries
  ``meta_info.routed_experts``: base64 of C-order int32 ``[rows, layers, top_k]`` for
  positions ``[start_len, prompt + output - 1)``; an SGLang that ignores the start gives
  them from 0.
* ``vllm``: ``/v1/completions`` with ``routed_experts_prompt_start``, not streamed (vLLM
  sends ``choices[0].routed_experts``, base64 of an ``.npy`` array, only in a whole
  response): the request's tokens come as one chunk when it ends, and an abort drops the
  connection (vLLM cancels on it) and with it the rows.

Either engine gives a row per decoder layer (a dense layer's columns mean nothing) or per
MoE layer; the MoE layers are kept, from ``k``, in the shape's dtype. Requests that ask for
no routing go as before and cost nothing more.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import io
import json
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from relay.protocol import RoutedExperts, RoutingShape
from worker_client.backends.placeholders import check_expansion, collapse_images, data_url
from worker_client.engine import (
    NEVER_SAMPLED_BIAS,
    FinishReason,
    ImageSpan,
    LogprobsMode,
    ModelCard,
    SamplingParams,
    TokenChunk,
    check_prompt,
    id_list,
    placeholder_ids,
    refuse_routing,
)
from worker_client.exceptions import (
    EngineError,
    EngineUnavailableError,
    PromptTooLongError,
    WeightsError,
)
from worker_client.policy import StagedPath
from worker_client.routing import engine_rows, moe_layers, shape_from_config

BACKEND = "openai"
WEIGHTS_APIS = ("sglang", "vllm")
IMAGES_APIS = ("sglang",)
ROUTING_APIS = ("sglang", "vllm")

_FINISH: dict[str, FinishReason] = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "abort": FinishReason.ABORT,
}


def completion_request(
    model: str,
    prompt_ids: Sequence[int],
    sampling: SamplingParams,
    never_sampled: Sequence[int] = (),
) -> dict[str, Any]:
    """The ``/v1/completions`` body for one generation; ``never_sampled`` ids get the
    lowest ``logit_bias`` the API takes."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": id_list(prompt_ids),
        "max_tokens": sampling.max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "logprobs": 0,
        "return_token_ids": True,
        "skip_special_tokens": False,
        "stream": True,
    }
    if sampling.top_k > 0:
        body["top_k"] = sampling.top_k
    if sampling.seed is not None:
        body["seed"] = sampling.seed
    if sampling.stop_token_ids:
        body["stop_token_ids"] = list(sampling.stop_token_ids)
    if never_sampled:
        body["logit_bias"] = never_sampled_bias(never_sampled)
    return body


def never_sampled_bias(ids: Sequence[int]) -> dict[str, float]:
    """``logit_bias`` (its keys the ids as text) that keeps ``ids`` from being sampled."""
    return dict.fromkeys(map(str, ids), NEVER_SAMPLED_BIAS)


def chunk_from_event(event: dict[str, Any]) -> TokenChunk | None:
    """One streamed completion chunk as a ``TokenChunk`` (None for a chunk with no choice,
    e.g. a usage-only one). Raises ``EngineError`` when ids or logprobs are missing."""
    choices = event.get("choices") or []
    if not choices:
        return None
    choice = choices[0]
    token_ids = choice.get("token_ids")
    if token_ids is None:
        raise EngineError(
            "the upstream returned no token_ids: it must support return_token_ids (vLLM >= 0.10)"
        )
    logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
    if token_ids and (logprobs is None or len(logprobs) != len(token_ids)):
        raise EngineError("the upstream returned token ids without one logprob each")
    reason = choice.get("finish_reason")
    finish = None
    if reason is not None:
        finish = _FINISH.get(str(reason))
        if finish is None:
            raise EngineError(f"the upstream ended with finish reason {reason!r}")
    return TokenChunk([int(t) for t in token_ids], [float(lp) for lp in logprobs or []], finish)


def sglang_generate_request(
    prompt_ids: Sequence[int],
    images: Sequence[ImageSpan],
    image_token_id: int | None,
    sampling: SamplingParams,
    routed_experts_start: int | None = None,
    never_sampled: Sequence[int] = (),
) -> dict[str, Any]:
    """SGLang's native ``/generate`` body for a prompt with images (``prompt_ids`` expanded
    as the proxy sends them; the body holds one placeholder per image), or without any.
    ``routed_experts_start``: return the routing rows from that prompt position on;
    ``never_sampled``: ids kept from being sampled (``logit_bias``)."""
    ordered = sorted(images, key=lambda span: span.start)
    params: dict[str, Any] = {
        "max_new_tokens": sampling.max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k if sampling.top_k > 0 else -1,
        "skip_special_tokens": False,
        "no_stop_trim": True,
    }
    if sampling.seed is not None:
        params["sampling_seed"] = sampling.seed
    if sampling.stop_token_ids:
        params["stop_token_ids"] = list(sampling.stop_token_ids)
    if never_sampled:
        params["logit_bias"] = never_sampled_bias(never_sampled)
    body: dict[str, Any] = {"input_ids": id_list(prompt_ids)}
    if ordered:
        if image_token_id is None:
            raise EngineError("a prompt with images needs the model's image token")
        body["input_ids"] = collapse_images(prompt_ids, ordered, image_token_id)
        body["image_data"] = [data_url(span) for span in ordered]
    body |= {
        "sampling_params": params,
        "return_logprob": True,
        "logprob_start_len": -1,
        "top_logprobs_num": 0,
        "return_prompt_token_ids": True,
        "stream": True,
    }
    if routed_experts_start is not None:
        body["return_routed_experts"] = True
        body["routed_experts_start_len"] = routed_experts_start
    return body


@dataclass(slots=True, frozen=True)
class RoutingAsk:
    """What a request asked of an engine's routing rows, and how to read them: the model's
    shape, the decoder layers that are its MoE layers (``layers``) of ``total`` decoder
    layers, the prompt position the server was asked from (``sent``) and the one the
    request wants (``start_from``)."""

    shape: RoutingShape
    layers: list[int] | None
    total: int
    prompt_len: int
    sent: int
    start_from: int

    def sglang(self, encoded: Any, generated: int) -> RoutedExperts:
        """SGLang's ``meta_info.routed_experts``: base64 of C-order int32 rows of
        positions ``[start, prompt + generated - 1)``, ``start`` the one asked (or 0, from
        an SGLang that ignores it), one column per decoder layer or per MoE layer."""
        import numpy as np

        if not isinstance(encoded, str):
            raise EngineError("SGLang returned no routed experts (--enable-return-routed-experts?)")
        try:
            raw = base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise EngineError(f"SGLang's routed experts are not base64: {exc}") from None
        if len(raw) % 4:
            raise EngineError("SGLang's routed experts are not int32")
        flat = np.frombuffer(raw, dtype="<i4")
        end = self.prompt_len + generated - 1
        top_k = self.shape.top_k
        for start in dict.fromkeys((self.sent, 0)):
            n = end - start
            if n <= 0:
                if flat.size == 0:
                    return RoutedExperts(self.start_from, 0, b"")
                continue
            if flat.size % (n * top_k) == 0 and flat.size // (n * top_k) in {
                self.shape.layers,
                self.total,
            }:
                rows = flat.reshape(n, -1, top_k)
                return engine_rows(
                    rows,
                    self.shape,
                    end=end,
                    start_from=self.start_from,
                    layers=self.layers,
                    engine="SGLang",
                )
        raise EngineError(
            f"SGLang returned {flat.size} routed expert ids, not [rows, layers, {top_k}] for "
            f"positions {self.sent} (or 0) to {end}"
        )

    def vllm(self, encoded: Any, generated: int) -> RoutedExperts:
        """vLLM's ``choices[0].routed_experts``: base64 of an ``.npy`` array ``[rows,
        layers, top_k]`` ending at the last position run forward."""
        import numpy as np

        if not isinstance(encoded, str):
            raise EngineError("vLLM returned no routed experts (--enable-return-routed-experts?)")
        try:
            rows = np.load(io.BytesIO(base64.b64decode(encoded)), allow_pickle=False)
        except (binascii.Error, ValueError, OSError) as exc:
            raise EngineError(f"vLLM's routed experts are not a base64 .npy array: {exc}") from None
        return engine_rows(
            rows,
            self.shape,
            end=self.prompt_len + generated - 1,
            start_from=self.start_from,
            layers=self.layers,
            engine="vLLM",
        )


class SGLangStream:
    """Turns the events of one streamed SGLang ``/generate`` into ``TokenChunk``s, checking
    the first event's prompt ids against the proxy's expanded ``prompt_ids``."""

    def __init__(self, prompt_ids: Sequence[int], routing: RoutingAsk | None = None) -> None:
        self._expected: list[int] | None = id_list(prompt_ids)
        self._sent = 0
        self._routing = routing

    def chunk(self, event: dict[str, Any]) -> TokenChunk:
        error = event.get("error")
        if error is not None:
            message = error.get("message") if isinstance(error, dict) else error
            raise EngineError(f"SGLang failed the request: {message}")
        if self._expected is not None:
            check_expansion("SGLang", self._expected, event.get("prompt_token_ids"))
            self._expected = None
        meta = event.get("meta_info") or {}
        total = meta.get("completion_tokens")
        ids = event.get("output_ids")
        entries = meta.get("output_token_logprobs")
        if not isinstance(total, int) or not isinstance(ids, list):
            raise EngineError("SGLang answered without output_ids and completion_tokens")
        new = total - self._sent
        if entries is None or len(entries) != len(ids):
            raise EngineError(
                "SGLang returned output ids without one logprob each (return_logprob?)"
            )
        if not 0 <= new <= len(ids):
            raise EngineError(
                f"SGLang reported {total} completion tokens after {self._sent}, "
                f"with {len(ids)} output ids in the event"
            )
        fresh = ids[len(ids) - new :]
        scored = entries[len(entries) - new :]
        if any(int(entry[1]) != int(token) for entry, token in zip(scored, fresh, strict=True)):
            raise EngineError("SGLang's logprobs are not those of its output ids")
        self._sent = total
        chunk = TokenChunk(
            [int(t) for t in fresh],
            [float(entry[0]) for entry in scored],
            _sglang_finish(meta.get("finish_reason")),
        )
        if chunk.finish_reason is not None and self._routing is not None:
            chunk.routed_experts = self._routing.sglang(meta.get("routed_experts"), total)
        return chunk


def _sglang_finish(reason: Any) -> FinishReason | None:
    if reason is None:
        return None
    kind = reason.get("type") if isinstance(reason, dict) else reason
    finish = _FINISH.get(str(kind))
    if finish is None:
        raise EngineError(f"SGLang ended the request with finish reason {reason!r}")
    return finish


class OpenAIEngine(StagedPath):
    def __init__(
        self,
        base_url: str,
        card: ModelCard,
        *,
        upstream_model: str,
        api_key: str | None = None,
        timeout_seconds: float = 600.0,
        weights_api: str | None = None,
        images_api: str | None = None,
        routing_api: str | None = None,
        routing_layers: list[int] | None = None,
        decoder_layers: int = 0,
        never_sampled: Sequence[int] = (),
    ) -> None:
        """``routing_api``: the server that returns routing rows (its card has the
        routing shape); ``routing_layers`` of its ``decoder_layers`` decoder layers are the
        mixture-of-experts ones (``OpenAIEngine.load`` reads both from ``config.json``).
        ``never_sampled``: a vision-language model's placeholder tokens
        (``engine.placeholder_ids``), which the upstream is asked never to sample."""
        self.never_sampled = tuple(never_sampled)
        if routing_api is not None and routing_api not in ROUTING_APIS:
            raise EngineUnavailableError(
                f"routing_api must be one of {', '.join(ROUTING_APIS)}, not {routing_api!r}"
            )
        if routing_api is not None and card.routing is None:
            raise EngineUnavailableError(
                f"routing_api={routing_api!r} needs a mixture-of-experts model: {card.name}'s "
                "card has no routing shape"
            )
        if weights_api is not None and weights_api not in WEIGHTS_APIS:
            raise EngineUnavailableError(
                f"weights_api must be one of {', '.join(WEIGHTS_APIS)}, not {weights_api!r}"
            )
        if images_api is not None and images_api not in IMAGES_APIS:
            raise EngineUnavailableError(
                f"images_api must be one of {', '.join(IMAGES_APIS)}, not {images_api!r}"
            )
        if images_api is not None and card.image_token_id is None:
            raise EngineUnavailableError(
                f"images_api={images_api!r} needs a vision-language model: {card.name}'s "
                "card names no image token"
            )
        self.weights_api = weights_api
        self.images_api = images_api
        self.routing_api = routing_api
        self._routing_layers = routing_layers
        self._decoder_layers = decoder_layers
        self.base_url = base_url.rstrip("/")
        self._card = card
        self.upstream_model = upstream_model
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = aiohttp.ClientTimeout(total=timeout_seconds)
        self._http: aiohttp.ClientSession | None = None
        self._running: dict[str, asyncio.Event] = {}

    def __repr__(self) -> str:
        return f"<OpenAIEngine {self._card.name} → {self.base_url} running={len(self._running)}>"

    @classmethod
    def load(
        cls,
        model_dir: str | Path,
        *,
        base_url: str,
        name: str | None = None,
        upstream_model: str | None = None,
        api_key: str | None = None,
        max_model_len: int | None = None,
        logprobs_mode: LogprobsMode = LogprobsMode.RAW,
        weights_api: str | None = None,
        images_api: str | None = None,
        routing_api: str | None = None,
    ) -> OpenAIEngine:
        """``model_dir`` holds the model's tokenizer and config (the proxy renders with
        them); ``base_url`` is the upstream's ``.../v1``. ``images_api="sglang"``: a
        vision-language model whose images go to the SGLang server's ``/generate``.
        ``routing_api`` (``sglang`` or ``vllm``): a mixture-of-experts model whose server
        returns each token's experts."""
        if images_api is not None and images_api not in IMAGES_APIS:
            raise EngineUnavailableError(
                f"images_api must be one of {', '.join(IMAGES_APIS)}, not {images_api!r}"
            )
        path = Path(model_dir)
        window = max_model_len
        image_token = None
        routing: RoutingShape | None = None
        layers: list[int] | None = None
        decoder_layers = 0
        config: dict[str, Any] = {}
        try:
            config = json.loads((path / "config.json").read_text())
            unreadable = None
        except (OSError, ValueError) as exc:
            unreadable = exc
        if window is None or images_api is not None or routing_api is not None:
            if unreadable is not None:
                raise EngineUnavailableError(f"{path}: no readable config.json: {unreadable}")
            if window is None:
                window = int(config.get("max_position_embeddings", 0)) or None
            if images_api is not None:
                image_token = config.get("image_token_id")
                if not isinstance(image_token, int) or isinstance(image_token, bool):
                    raise EngineUnavailableError(
                        f"images_api={images_api!r}: {path}/config.json names no image_token_id "
                        "(not a vision-language model?)"
                    )
            if routing_api is not None:
                routing = shape_from_config(config)
                if routing is None:
                    raise EngineUnavailableError(
                        f"routing_api={routing_api!r}: {path}/config.json is not a "
                        "mixture-of-experts model this worker knows"
                    )
                layers = moe_layers(config)
                text = config.get("text_config") if "num_hidden_layers" not in config else None
                decoder_layers = int((text or config).get("num_hidden_layers", 0))
        if window is None:
            raise EngineUnavailableError("give max_model_len: config.json declares no window")
        card = ModelCard(
            name or path.name, window, LogprobsMode(logprobs_mode), BACKEND, image_token, routing
        )
        return cls(
            base_url,
            card,
            upstream_model=upstream_model or card.name,
            api_key=api_key,
            weights_api=weights_api,
            images_api=images_api,
            routing_api=routing_api,
            routing_layers=layers,
            decoder_layers=decoder_layers,
            never_sampled=placeholder_ids(config) if isinstance(config, dict) else (),
        )

    @property
    def card(self) -> ModelCard:
        return self._card

    def _session(self) -> aiohttp.ClientSession:
        if self._http is None or self._http.closed:
            self._http = aiohttp.ClientSession(timeout=self._timeout, headers=self._headers)
        return self._http

    async def generate(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        images: Sequence[ImageSpan] = (),
        routed_experts_from: int | None = None,
    ) -> AsyncGenerator[TokenChunk, None]:
        routing = self._routing_ask(prompt_ids, routed_experts_from)
        if images or (routing is not None and self.routing_api == "sglang"):
            stream = self._generate_native(request_id, prompt_ids, sampling, images, routing)
            try:
                async for native_chunk in stream:
                    yield native_chunk
            finally:
                await stream.aclose()
            return
        check_prompt(self._card, prompt_ids)
        body = completion_request(self.upstream_model, prompt_ids, sampling, self.never_sampled)
        if routing is not None:  # vLLM sends routing only in a whole response
            stream = self._whole(request_id, body, routing)
        else:
            stream = self._stream(
                request_id, f"{self.base_url}/completions", body, chunk_from_event, "upstream"
            )
        try:
            async for chunk in stream:
                yield chunk
        finally:
            await stream.aclose()

    async def _stream(
        self,
        request_id: str,
        url: str,
        body: dict[str, Any],
        to_chunk: Callable[[Any], TokenChunk | None],
        server: str,
    ) -> AsyncGenerator[TokenChunk, None]:
        """POST ``body`` to ``url`` and relay its server-sent events as chunks (an event
        ``to_chunk`` makes nothing of is skipped), until a finish reason or an abort."""
        aborted = self._running.setdefault(request_id, asyncio.Event())
        try:
            async with self._session().post(url, json=body) as response:
                if response.status >= 400:
                    text = (await response.text())[:500]
                    if response.status == 400 and "context" in text.lower():
                        raise PromptTooLongError(text)
                    raise EngineError(f"{server} answered {response.status}: {text}")
                async for data in _sse_data(response.content):
                    if aborted.is_set():
                        yield TokenChunk([], [], FinishReason.ABORT)
                        return
                    if data == b"[DONE]":
                        break
                    chunk = to_chunk(json.loads(data))
                    if chunk is None or (chunk.finish_reason is None and not chunk.token_ids):
                        continue
                    yield chunk
                    if chunk.finish_reason is not None:
                        return
        except aiohttp.ClientError as exc:
            raise EngineError(f"{server} {url}: {type(exc).__name__}: {exc}") from exc
        finally:
            self._running.pop(request_id, None)
        raise EngineError(f"the {server} stream ended without a finish reason")

    def _routing_ask(
        self, prompt_ids: Sequence[int], routed_experts_from: int | None
    ) -> RoutingAsk | None:
        shape = refuse_routing(self._card, routed_experts_from)
        if shape is None or routed_experts_from is None:
            return None
        return RoutingAsk(
            shape,
            self._routing_layers,
            self._decoder_layers,
            len(prompt_ids),
            min(routed_experts_from, len(prompt_ids)),
            routed_experts_from,
        )

    async def _whole(
        self, request_id: str, body: dict[str, Any], routing: RoutingAsk
    ) -> AsyncGenerator[TokenChunk, None]:
        """One ``/v1/completions`` request answered whole (vLLM puts the routing rows only
        there), as one chunk; an abort drops the connection, which cancels it."""
        body = body | {"stream": False, "routed_experts_prompt_start": routing.sent}
        aborted = self._running.setdefault(request_id, asyncio.Event())
        url = f"{self.base_url}/completions"
        try:
            post = asyncio.ensure_future(self._post_whole(url, body))
            abort = asyncio.ensure_future(aborted.wait())
            try:
                await asyncio.wait({post, abort}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                abort.cancel()
                if not post.done():
                    post.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await post
            if post.cancelled():
                yield TokenChunk([], [], FinishReason.ABORT)
                return
            answer = post.result()
        finally:
            self._running.pop(request_id, None)
        chunk = chunk_from_event(answer)
        if chunk is None or chunk.finish_reason is None:
            raise EngineError("the upstream's whole response has no finished choice")
        choice = answer["choices"][0]
        chunk.routed_experts = routing.vllm(choice.get("routed_experts"), len(chunk.token_ids))
        yield chunk

    async def _post_whole(self, url: str, body: dict[str, Any]) -> Any:
        try:
            async with self._session().post(url, json=body) as response:
                if response.status >= 400:
                    text = (await response.text())[:500]
                    if response.status == 400 and "context" in text.lower():
                        raise PromptTooLongError(text)
                    raise EngineError(f"upstream answered {response.status}: {text}")
                return await response.json(content_type=None)
        except aiohttp.ClientError as exc:
            raise EngineError(f"upstream {url}: {type(exc).__name__}: {exc}") from exc

    async def _generate_native(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        images: Sequence[ImageSpan],
        routing: RoutingAsk | None = None,
    ) -> AsyncGenerator[TokenChunk, None]:
        """A request with images, or asking SGLang for routing, through SGLang's native
        ``/generate``."""
        image_token = self._card.image_token_id
        if images and (self.images_api != "sglang" or image_token is None):
            raise EngineError(
                f"model {self._card.name} ({BACKEND} backend) takes no images here: token-id "
                "prompts with images need SGLang's /generate (--images-api sglang); vLLM's "
                "OpenAI-compatible server takes no images with a token-id prompt (run vLLM "
                "in-process with the vllm backend instead)"
            )
        check_prompt(self._card, prompt_ids)
        body = await asyncio.to_thread(
            sglang_generate_request,
            prompt_ids,
            images,
            image_token,
            sampling,
            None if routing is None else routing.sent,
            self.never_sampled,
        )
        events = SGLangStream(prompt_ids, routing)
        stream = self._stream(
            request_id, f"{self.server_url}/generate", body, events.chunk, "SGLang /generate"
        )
        try:
            async for chunk in stream:
                yield chunk
        finally:
            await stream.aclose()

    async def abort(self, request_id: str) -> None:
        event = self._running.get(request_id)
        if event is not None:
            event.set()

    # ------------------------------------------------------------------ weights

    @property
    def server_url(self) -> str:
        """The upstream's root, where its admin routes live (``base_url`` without /v1)."""
        return self.base_url.removesuffix("/v1")

    async def stage_weights(self, path: str) -> None:
        if self.weights_api is None:
            raise WeightsError(
                "this openai-backend worker cannot load weights: start it with "
                f"--weights-api ({' or '.join(WEIGHTS_APIS)}) naming its server's update routes"
            )
        if await asyncio.to_thread(_visible_without_config, path):
            raise WeightsError(f"{path} is not a Hugging Face model directory (no config.json)")
        self._staged = path

    async def commit_weights(self, version: int) -> None:
        path = self._take_staged()
        if self.weights_api == "sglang":
            answer = await self._admin(
                "POST",
                "/update_weights_from_disk",
                {"model_path": path, "weight_version": str(version), "flush_cache": True},
            )
            if not (isinstance(answer, dict) and answer.get("success")):
                message = answer.get("message") if isinstance(answer, dict) else answer
                raise WeightsError(f"the SGLang server did not load {path}: {message}")
            return
        await self._admin("POST", "/pause?mode=wait")
        try:
            await self._admin(
                "POST",
                "/collective_rpc",
                {"method": "reload_weights", "kwargs": {"weights_path": path}},
            )
            await self._admin("POST", "/reset_prefix_cache")
            await self._admin("POST", "/update_weight_version", {"new_version": str(version)})
        finally:
            await self._admin("POST", "/resume")

    async def _admin(self, method: str, route: str, body: Any = None) -> Any:
        """One call to the upstream's admin routes; any failure is a ``WeightsError``."""
        url = f"{self.server_url}{route}"
        try:
            async with self._session().request(method, url, json=body) as response:
                text = await response.text()
                if response.status >= 400:
                    raise WeightsError(f"{method} {route} answered {response.status}: {text[:300]}")
        except aiohttp.ClientError as exc:
            raise WeightsError(f"{method} {route}: {type(exc).__name__}: {exc}") from exc
        try:
            return json.loads(text) if text.strip() else None
        except ValueError:
            return text

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None


async def _sse_data(content: aiohttp.StreamReader) -> AsyncGenerator[bytes, None]:
    """The ``data:`` payloads of a server-sent event stream, however long a line is (an
    SGLang event repeats the prompt's ids and every output id so far: far past aiohttp's
    line limit on a long prompt)."""
    line = bytearray()
    async for piece in content.iter_any():
        start = 0
        while (end := piece.find(b"\n", start)) >= 0:
            line += piece[start:end]
            if line.startswith(b"data:"):
                yield bytes(line[5:]).strip()
            line.clear()
            start = end + 1
        line += piece[start:]
    if line.startswith(b"data:"):
        yield bytes(line[5:]).strip()


def _visible_without_config(path: str) -> bool:
    """A path the worker can see that is no model directory (the server's storage may
    differ from the worker's: a path the worker cannot see is left to the server)."""
    local = Path(path)
    return local.exists() and not (local / "config.json").is_file()
