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
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp

from worker_client.backends.placeholders import check_expansion, collapse_images, data_url
from worker_client.engine import (
    FinishReason,
    ImageSpan,
    LogprobsMode,
    ModelCard,
    SamplingParams,
    TokenChunk,
    check_prompt,
    id_list,
)
from worker_client.exceptions import (
    EngineError,
    EngineUnavailableError,
    PromptTooLongError,
    WeightsError,
)
from worker_client.policy import StagedPath

BACKEND = "openai"
WEIGHTS_APIS = ("sglang", "vllm")
IMAGES_APIS = ("sglang",)

_FINISH: dict[str, FinishReason] = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "abort": FinishReason.ABORT,
}


def completion_request(
    model: str, prompt_ids: Sequence[int], sampling: SamplingParams
) -> dict[str, Any]:
    """The ``/v1/completions`` body for one generation."""
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
    return body


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
    image_token_id: int,
    sampling: SamplingParams,
) -> dict[str, Any]:
    """SGLang's native ``/generate`` body for a prompt with images (``prompt_ids`` expanded
    as the proxy sends them; the body holds one placeholder per image)."""
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
    return {
        "input_ids": collapse_images(prompt_ids, ordered, image_token_id),
        "image_data": [data_url(span) for span in ordered],
        "sampling_params": params,
        "return_logprob": True,
        "logprob_start_len": -1,
        "top_logprobs_num": 0,
        "return_prompt_token_ids": True,
        "stream": True,
    }


class SGLangStream:
    """Turns the events of one streamed SGLang ``/generate`` into ``TokenChunk``s, checking
    the first event's prompt ids against the proxy's expanded ``prompt_ids``."""

    def __init__(self, prompt_ids: Sequence[int]) -> None:
        self._expected: list[int] | None = id_list(prompt_ids)
        self._sent = 0

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
        return TokenChunk(
            [int(t) for t in fresh],
            [float(entry[0]) for entry in scored],
            _sglang_finish(meta.get("finish_reason")),
        )


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
    ) -> None:
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
    ) -> OpenAIEngine:
        """``model_dir`` holds the model's tokenizer and config (the proxy renders with
        them); ``base_url`` is the upstream's ``.../v1``. ``images_api="sglang"``: a
        vision-language model whose images go to the SGLang server's ``/generate``."""
        if images_api is not None and images_api not in IMAGES_APIS:
            raise EngineUnavailableError(
                f"images_api must be one of {', '.join(IMAGES_APIS)}, not {images_api!r}"
            )
        path = Path(model_dir)
        window = max_model_len
        image_token = None
        if window is None or images_api is not None:
            try:
                config = json.loads((path / "config.json").read_text())
            except (OSError, ValueError) as exc:
                raise EngineUnavailableError(f"{path}: no readable config.json: {exc}") from exc
            if window is None:
                window = int(config.get("max_position_embeddings", 0)) or None
            if images_api is not None:
                image_token = config.get("image_token_id")
                if not isinstance(image_token, int) or isinstance(image_token, bool):
                    raise EngineUnavailableError(
                        f"images_api={images_api!r}: {path}/config.json names no image_token_id "
                        "(not a vision-language model?)"
                    )
        if window is None:
            raise EngineUnavailableError("give max_model_len: config.json declares no window")
        card = ModelCard(
            name or path.name, window, LogprobsMode(logprobs_mode), BACKEND, image_token
        )
        return cls(
            base_url,
            card,
            upstream_model=upstream_model or card.name,
            api_key=api_key,
            weights_api=weights_api,
            images_api=images_api,
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
    ) -> AsyncGenerator[TokenChunk, None]:
        if images:
            stream = self._generate_with_images(request_id, prompt_ids, sampling, images)
            try:
                async for image_chunk in stream:
                    yield image_chunk
            finally:
                await stream.aclose()
            return
        check_prompt(self._card, prompt_ids)
        body = completion_request(self.upstream_model, prompt_ids, sampling)
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

    async def _generate_with_images(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        images: Sequence[ImageSpan],
    ) -> AsyncGenerator[TokenChunk, None]:
        """A request with images, through SGLang's native ``/generate``."""
        image_token = self._card.image_token_id
        if self.images_api != "sglang" or image_token is None:
            raise EngineError(
                f"model {self._card.name} ({BACKEND} backend) takes no images here: token-id "
                "prompts with images need SGLang's /generate (--images-api sglang); vLLM's "
                "OpenAI-compatible server takes no images with a token-id prompt (run vLLM "
                "in-process with the vllm backend instead)"
            )
        check_prompt(self._card, prompt_ids)
        body = await asyncio.to_thread(
            sglang_generate_request, prompt_ids, images, image_token, sampling
        )
        events = SGLangStream(prompt_ids)
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
