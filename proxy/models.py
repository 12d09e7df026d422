"""Models the connected workers serve, and their renderers.

Workers ship their tokenizer files in the hello; the proxy stores them under its cache
directory by content digest and loads a ``ChatRenderer`` from there, so the proxy needs no
model files or hub access of its own. Two workers announcing the same model name with
different tokenizer files are a configuration error: the second is refused.

A teacher (``ModelInfo.teacher``, protocol 6) is reached by an agent only when it names it
exactly: a request that names no model, or one not served, gets the policy as it did before
the teacher joined (the session's model, else the one served model that is not a teacher).
A model is a teacher or not for every worker that serves it. Beside the digest of its
tokenizer files, each model keeps the digest of its vocabulary alone (``vocabulary``): a
teacher scores a policy's ids only when the two give every id the same token, whatever
their configurations and chat templates.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from proxy.chat.renderer import ChatRenderer
from proxy.chat.template_check import (
    ShapeResult,
    ToolsResult,
    check_template,
    check_tools,
    summary_line,
)
from proxy.chat.vision import VisionTokens
from proxy.exceptions import NotFoundError, ProxyError
from relay import protocol
from relay.endpoint import AdmissionRefused

log = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class ServedModel:
    name: str
    digest: str
    max_model_len: int
    renderer: ChatRenderer
    # The template's handling of agents' conversation shapes (proxy.chat.template_check).
    template_check: tuple[ShapeResult, ...] = ()
    # Whether the agents' tools reach the model, and how.
    tools_check: ToolsResult | None = None
    # A vision-language model's image placeholder and processor (None: a text model,
    # which refuses images).
    vision: VisionTokens | None = None
    # A mixture-of-experts model whose workers report the experts each token was routed
    # to (protocol 5), and the shape of those rows; None: a dense model, or workers that
    # cannot report them.
    routing: protocol.RoutingShape | None = None
    # A teacher (protocol 6): it scores sessions and agents reach it only by name.
    teacher: bool = False
    # The digest of its vocabulary: every token with its id, added tokens included
    # (``vocabulary_digest``). The tokenizer files' ``digest`` also covers the model's
    # configuration and template, which a teacher of the same vocabulary may not share.
    vocabulary: str = ""


def vocabulary_digest(tokenizer: Any) -> str:
    """The digest of a tokenizer's vocabulary: each id with its token, in id order."""
    h = hashlib.sha256()
    for token, index in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1]):
        h.update(f"{index}\0{token}\0".encode())
    return h.hexdigest()[:32]


def tokenizer_digest(files: dict[str, bytes]) -> str:
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(name.encode() + b"\0" + hashlib.sha256(files[name]).digest())
    return h.hexdigest()[:32]


class ModelRegistry:
    def __init__(self, cache_dir: Path, *, tool_parser: str | None = None) -> None:
        self.cache_dir = cache_dir
        self.tool_parser = tool_parser
        self.models: dict[str, ServedModel] = {}
        self._lock = asyncio.Lock()
        # Called once a worker's models were added: the proxy's own process freezes what is
        # alive then (a tokenizer, and the modules its loading imported, live as long as
        # the process; unfrozen, every full garbage collection would scan them).
        self.on_added: Callable[[], None] | None = None

    async def admit(self, hello: protocol.Hello) -> None:
        """Admission hook for the worker socket: load every announced model's renderer."""
        async with self._lock:
            before = len(self.models)
            try:
                await self._admit(hello)
            finally:
                if len(self.models) > before and self.on_added is not None:
                    self.on_added()

    async def _admit(self, hello: protocol.Hello) -> None:
        for info in hello.models:
            digest = tokenizer_digest(info.tokenizer_files)
            known = self.models.get(info.name)
            teacher = info.teacher and hello.protocol_version >= protocol.SCORING_VERSION
            if known is not None:
                if known.digest != digest:
                    raise AdmissionRefused(
                        f"model {info.name!r} is already served with other tokenizer files"
                    )
                if known.teacher != teacher:
                    raise AdmissionRefused(
                        f"model {info.name!r} is already served "
                        f"{'as a teacher' if known.teacher else 'as a policy'}, not "
                        f"{'as a teacher' if teacher else 'as a policy'}"
                    )
                routing = (
                    info.routing if hello.protocol_version >= protocol.ROUTING_VERSION else None
                )
                if routing is not None and known.routing not in (None, routing):
                    raise AdmissionRefused(
                        f"model {info.name!r} is already served with routing "
                        f"{known.routing}, not {routing}"
                    )
                if routing is not None and known.routing is None:
                    # The first worker that can report the model's routing.
                    self.models[info.name] = dataclasses.replace(known, routing=routing)
                continue
            try:
                renderer, checked, vision, vocabulary = await asyncio.to_thread(
                    self._load, digest, info.tokenizer_files, info.image_token_id
                )
            except ProxyError as exc:
                raise AdmissionRefused(f"model {info.name!r}: {exc.message}") from None
            except (OSError, ValueError) as exc:
                raise AdmissionRefused(
                    f"model {info.name!r}: cannot load tokenizer: {exc}"
                ) from None
            tools = check_tools(renderer)
            self.models[info.name] = ServedModel(
                info.name,
                digest,
                info.max_model_len,
                renderer,
                tuple(checked),
                tools,
                vision,
                info.routing if hello.protocol_version >= protocol.ROUTING_VERSION else None,
                teacher,
                vocabulary,
            )
            broken = any(r.result != "continued" for r in checked) or tools.result == "refused"
            log.log(
                logging.WARNING if broken else logging.INFO,
                "model %s (tool calls: %s): template check: %s",
                info.name,
                renderer.parser.name,
                summary_line(checked, tools),
            )

    def _load(
        self, digest: str, files: dict[str, bytes], image_token_id: int | None
    ) -> tuple[ChatRenderer, list[ShapeResult], VisionTokens | None, str]:
        target = self.cache_dir / "tokenizers" / digest
        if not target.is_dir():
            target.parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".staging-"))
            for name, data in files.items():
                if "/" in name or name.startswith("."):
                    raise ValueError(f"invalid tokenizer file name {name!r}")
                (staging / name).write_bytes(data)
            try:
                os.replace(staging, target)
            except OSError:  # another loader won the race
                pass
        renderer = ChatRenderer.from_directory(target, tool_parser=self.tool_parser)
        vision = None
        if image_token_id is not None:
            vision = VisionTokens.from_directory(target, renderer.tokenizer, pad_id=image_token_id)
            if vision is None:
                raise ValueError(
                    "the worker announced an image token but sent no preprocessor_config.json"
                )
        vocabulary = vocabulary_digest(renderer.tokenizer)
        return renderer, check_template(renderer), vision, vocabulary

    def resolve(self, requested: str, session_model: str | None, served: set[str]) -> ServedModel:
        """Map the model name an agent sent to a served model.

        Agents send whatever name they were configured with ("gpt-4o", "claude-..."), so a
        name that is not served falls back to the session's model, then to the only served
        model that is not a teacher when there is exactly one (a teacher is reached only by
        its exact name)."""
        for name in (requested, session_model):
            if name and name in served and name in self.models:
                return self.models[name]
        available = [n for n in served if n in self.models and not self.models[n].teacher]
        if len(available) == 1:
            return self.models[available[0]]
        if not available:
            teachers = sorted(n for n in served if n in self.models)
            only = f" but teachers, reached by name only: {teachers}" if teachers else ""
            raise NotFoundError(f"no model is being served{only}", code="model_not_found")
        raise NotFoundError(
            f"model {requested!r} is not served; available: {sorted(available)}",
            code="model_not_found",
        )
