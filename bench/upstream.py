"""The baseline: an OpenAI chat-completions endpoint served straight from the ``instant``
engine, with no sessions, no chat template, no relay.

The same client calling this shows what one HTTP round trip with the same engine costs on
loopback; the difference to the proxy's figures is what the proxy adds. The LiteLLM proxy
forwards to this same endpoint, so its figures compare like with like.

Run as ``python -m bench.upstream --port P --model-dir DIR``.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from aiohttp import web

from worker_client.backends.instant import InstantEngine
from worker_client.engine import FinishReason, SamplingParams

ENGINE: web.AppKey[InstantEngine] = web.AppKey("engine", InstantEngine)
VOCAB_TEXT: web.AppKey[dict[int, str]] = web.AppKey("vocab_text", dict)


def _words(engine: InstantEngine) -> dict[int, str]:
    # Plain text per id, so replies are as long as the proxy's (no tokenizer needed).
    return {i: f"w{i} " for i in engine.vocab}


async def chat_completions(request: web.Request) -> web.StreamResponse:
    body: dict[str, Any] = await request.json()
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return web.json_response({"error": {"message": "messages required"}}, status=400)
    engine = request.app[ENGINE]
    words = request.app[VOCAB_TEXT]
    # The engine needs prompt ids; one id per message keeps the baseline free of
    # tokenization cost (the point is the HTTP round trip).
    prompt = list(range(1, len(messages) + 1))
    max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
    sampling = SamplingParams(max_tokens=max_tokens, seed=body.get("seed"))
    rid = f"up-{time.perf_counter_ns()}"
    created = int(time.time())
    model = str(body.get("model", "bench"))
    if not body.get("stream"):
        ids: list[int] = []
        finish = FinishReason.STOP
        async for chunk in engine.generate(rid, prompt, sampling):
            ids.extend(chunk.token_ids)
            finish = chunk.finish_reason or finish
        text = "".join(words.get(i, "") for i in ids)
        return web.json_response(
            {
                "id": f"chatcmpl-{rid}",
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "finish_reason": "length" if finish is FinishReason.LENGTH else "stop",
                        "logprobs": None,
                    }
                ],
                "usage": {
                    "prompt_tokens": len(prompt),
                    "completion_tokens": len(ids),
                    "total_tokens": len(prompt) + len(ids),
                },
            }
        )
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)

    def chunk_body(delta: dict[str, Any], finish: str | None) -> bytes:
        data = {
            "id": f"chatcmpl-{rid}",
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }
        return b"data: " + json.dumps(data).encode() + b"\n\n"

    await response.write(chunk_body({"role": "assistant", "content": ""}, None))
    async for chunk in engine.generate(rid, prompt, sampling):
        text = "".join(words.get(i, "") for i in chunk.token_ids)
        if text:
            await response.write(chunk_body({"content": text}, None))
        if chunk.finish_reason is not None:
            reason = "length" if chunk.finish_reason is FinishReason.LENGTH else "stop"
            await response.write(chunk_body({}, reason))
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def models(request: web.Request) -> web.Response:
    name = request.app[ENGINE].card.name
    return web.json_response({"object": "list", "data": [{"id": name, "object": "model"}]})


def build_app(engine: InstantEngine) -> web.Application:
    app = web.Application(client_max_size=256 * 1024 * 1024)
    app[ENGINE] = engine
    app[VOCAB_TEXT] = _words(engine)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/healthz", healthz)
    return app


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.upstream")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--name", default="bench")
    parser.add_argument("--reply-tokens", type=int, default=16)
    args = parser.parse_args()
    engine = InstantEngine.load(args.model_dir, name=args.name, reply_tokens=args.reply_tokens)
    web.run_app(build_app(engine), host=args.host, port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
