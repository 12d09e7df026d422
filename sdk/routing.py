"""Rollout routing replay (R3) for a transformers mixture-of-experts model: a forward pass
whose routers send each token to the experts the rollout engine chose for it.

The trainer's router still computes its own logits, so the gate weights of the chosen
experts, and their gradients, come from the trainer: only *which* experts is forced. A
router returns ``(router_logits, scores, indices)``; replaying means ``indices`` = the
recorded experts and ``scores`` = the router's own weighing gathered at them, as its kind
(``worker_client.routing.ROUTER_KINDS``) computes it: for Qwen3-MoE the softmax of its
logits (renormalised over the chosen experts when the model sets ``norm_topk_prob``), for
DeepSeek-V3 and GLM-4.5 their sigmoid (renormalised, times ``routed_scaling_factor``), for
gpt-oss the softmax of the chosen experts' logits (``replayed_router``).

``replay_routing(model, rows)`` forces the routers for the forward passes run inside it:
``rows`` is ``[positions, layers, top_k]`` (the export's ``routed_experts``, or a sample's),
consumed in order, a forward of ``n`` tokens taking the next ``n`` rows. One sequence at a
time (batch size 1): the rows of a batch's sequences differ.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from sdk.exceptions import RoutingReplayError
from worker_client.exceptions import EngineError
from worker_client.routing import find_routers, router_kind


def _routers(model: Any) -> list[Any]:
    """The model's routers (``find_routers``); one that cannot be replayed is refused."""
    try:
        routers = find_routers(model)
    except EngineError as error:
        raise RoutingReplayError(str(error)) from error
    if not routers:
        raise RoutingReplayError("the model has no mixture-of-experts routers to replay")
    return routers


def _softmax(router: Any, hidden: Any, indices: Any, *, renormalise: bool, cast: bool) -> Any:
    import torch

    logits = torch.nn.functional.linear(hidden, router.weight)
    probs = torch.softmax(logits, dtype=torch.float, dim=-1)
    scores = probs.gather(1, indices)
    if renormalise:
        scores = scores / scores.sum(dim=-1, keepdim=True)
    return logits, scores.to(logits.dtype) if cast else scores


def _deepseek_v2(router: Any, hidden: Any, indices: Any) -> Any:
    import torch

    logits = torch.nn.functional.linear(hidden.float(), router.weight.float())
    scores = logits.softmax(dim=-1, dtype=torch.float32).gather(1, indices)
    return logits, scores * router.routed_scaling_factor


def _sigmoid(router: Any, hidden: Any, indices: Any) -> Any:
    import torch

    logits = torch.nn.functional.linear(hidden.float(), router.weight.float())
    scores = logits.sigmoid().gather(1, indices)
    if router.norm_topk_prob:
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    return logits, scores * router.routed_scaling_factor


def _gpt_oss(router: Any, hidden: Any, indices: Any) -> Any:
    import torch

    logits = torch.nn.functional.linear(hidden, router.weight, router.bias)
    picked = logits.gather(1, indices)
    return logits, torch.softmax(picked, dim=1, dtype=picked.dtype)


def replayed_router(router: Any, hidden_states: Any, indices: Any) -> tuple[Any, Any, Any]:
    """What ``router`` returns for ``hidden_states`` when it picks ``indices`` (``[tokens,
    top_k]``): ``(router_logits, scores, indices)``, the scores (gate weights) of the picked
    experts computed from its own logits as its kind does (``ROUTER_KINDS``)."""
    hidden = hidden_states.reshape(-1, router.weight.shape[1])
    indices = indices.to(hidden.device)
    kind = router_kind(router)
    if kind == "softmax":
        renormalise = bool(getattr(router, "norm_topk_prob", False))
        logits, scores = _softmax(router, hidden, indices, renormalise=renormalise, cast=True)
    elif kind == "softmax-renormalised":
        logits, scores = _softmax(router, hidden, indices, renormalise=True, cast=True)
    elif kind == "mixtral":
        logits, scores = _softmax(router, hidden, indices, renormalise=True, cast=False)
    elif kind == "deepseek-v2":
        logits, scores = _deepseek_v2(router, hidden, indices)
    elif kind == "sigmoid":
        logits, scores = _sigmoid(router, hidden, indices)
    elif kind == "gpt-oss":
        logits, scores = _gpt_oss(router, hidden, indices)
    else:  # pragma: no cover - ROUTER_KINDS names no other kind
        raise RoutingReplayError(f"no replay for routers of kind {kind}")
    return logits, scores, indices


@contextmanager
def replay_routing(model: Any, rows: np.ndarray[Any, Any]) -> Iterator[None]:
    """Within the block, ``model``'s routers route each token to its recorded experts."""
    import torch

    routers = _routers(model)
    if rows.ndim != 3 or rows.shape[1] != len(routers) or rows.shape[2] != routers[0].top_k:
        raise RoutingReplayError(
            f"routing rows of shape {tuple(rows.shape)} do not fit a model of "
            f"{len(routers)} MoE layers with {routers[0].top_k} experts per token"
        )
    if rows.size and int(rows.max()) >= int(routers[0].num_experts):
        raise RoutingReplayError(
            f"routing names expert {int(rows.max())} of {routers[0].num_experts}"
        )
    recorded = torch.from_numpy(rows.astype(np.int64))
    at = [0] * len(routers)

    def forced(layer: int, router: Any) -> Any:
        def forward(hidden_states: Any) -> tuple[Any, Any, Any]:
            hidden = hidden_states.reshape(-1, router.weight.shape[1])
            start, count = at[layer], hidden.shape[0]
            if start + count > recorded.shape[0]:
                raise RoutingReplayError(
                    f"the forward runs {start + count} positions; the routing has "
                    f"{recorded.shape[0]}"
                )
            at[layer] = start + count
            return replayed_router(router, hidden, recorded[start : start + count, layer])

        return forward

    for layer, router in enumerate(routers):
        router.forward = forced(layer, router)  # the instance's, over its class's
    try:
        yield
    finally:
        for router in routers:
            del router.forward


def replayed_logprobs(
    model: Any,
    prompt_ids: Sequence[int],
    response_ids: Sequence[int],
    rows: np.ndarray[Any, Any] | None,
) -> list[float]:
    """Teacher forcing: each response id's logprob given everything before it, in float32,
    with the routers forced to ``rows`` (the sample's ``routed_experts``: one row per id
    but the last; None: the model's own routing)."""
    import torch

    ids = [*prompt_ids, *response_ids]
    inputs = torch.tensor([ids[:-1]], dtype=torch.long, device=model.device)
    with torch.no_grad():
        if rows is None:
            logits = model(input_ids=inputs).logits[0].float()
        else:
            with replay_routing(model, rows[: len(ids) - 1]):
                logits = model(input_ids=inputs).logits[0].float()
    start = len(prompt_ids) - 1
    scores = torch.log_softmax(logits[start:], dim=-1)
    target = torch.tensor(list(response_ids), dtype=torch.long, device=scores.device)[:, None]
    return [float(x) for x in scores.gather(-1, target)[:, 0]]


class ReplayScorer:
    """A fidelity scorer (``sdk.fidelity``) for a transformers mixture-of-experts model:
    ``score(prompt_ids, response_ids, routed_experts=rows)`` teacher-forces the model with
    its routers forced to the recorded rows; without rows, with its own routing."""

    def __init__(self, model: Any) -> None:
        _routers(model)
        self.model = model

    def __call__(
        self,
        prompt_ids: Sequence[int],
        response_ids: Sequence[int],
        images: Sequence[Any] | None = None,
        *,
        routed_experts: np.ndarray[Any, Any] | None = None,
    ) -> list[float]:
        if images:
            raise RoutingReplayError("ReplayScorer scores text: it takes no images")
        was_training = bool(self.model.training)
        self.model.eval()
        try:
            return replayed_logprobs(self.model, prompt_ids, response_ids, routed_experts)
        finally:
            self.model.train(was_training)


class BatchReplay:
    """Rollout routing replay for a trainer's batched forward passes (TRL's GRPOTrainer, or
    any loop that runs ``model(input_ids=..., attention_mask=...)`` on padded sequences).

    ``add(ids, rows)`` registers a sequence's ids (``prompt_ids + response_ids``) with its
    routing (a sample's ``routed_experts``); while installed (``install()`` / ``remove()``,
    or ``with``), every forward of ``model`` forces its routers, for each sequence of the
    batch, to the rows of the registered sequence with the same real ids (those the
    attention mask keeps; the batch may pad either side and hold the sequences in any
    order, in chunks), a registered sequence's prefix taking that prefix's rows. Padding
    and a sequence's last id (never run forward at rollout) get expert rows of zeros: no
    real position attends to them, and the last position's logits predict nothing. A
    sequence that was not registered is an error (``RoutingReplayError``), never a silent
    forward with the trainer's own routing; ``paused()`` runs the model's own routing.

    The routers read the rows of the latest forward until the next one, so that gradient
    checkpointing, which runs the routers again during the backward pass, replays the same.
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        self.routers = _routers(model)
        self.layers = len(self.routers)
        self.top_k = int(self.routers[0].top_k)
        self.experts = int(self.routers[0].num_experts)
        self._rows: dict[tuple[int, ...], np.ndarray[Any, Any]] = {}
        self._current: Any = None  # [tokens, layers, top_k] of the latest forward
        self._hook: Any = None
        self._paused = False

    def __repr__(self) -> str:
        return f"<BatchReplay sequences={len(self._rows)} installed={self._hook is not None}>"

    # ------------------------------------------------------------------ sequences

    def add(self, ids: Sequence[int], rows: np.ndarray[Any, Any]) -> None:
        if rows.ndim != 3 or rows.shape[1:] != (self.layers, self.top_k):
            raise RoutingReplayError(
                f"routing rows of shape {tuple(rows.shape)} do not fit a model of "
                f"{self.layers} MoE layers with {self.top_k} experts per token"
            )
        if not len(ids) - 1 <= rows.shape[0] <= len(ids):
            raise RoutingReplayError(f"{rows.shape[0]} routing rows for {len(ids)} ids")
        if rows.size and int(rows.max()) >= self.experts:
            raise RoutingReplayError(f"routing names expert {int(rows.max())} of {self.experts}")
        self._rows[tuple(int(i) for i in ids)] = rows

    def clear(self) -> None:
        self._rows.clear()

    def __len__(self) -> int:
        return len(self._rows)

    def rows_for(self, ids: Sequence[int]) -> np.ndarray[Any, Any]:
        """``[len(ids), layers, top_k]`` for a registered sequence or a prefix of one."""
        key = tuple(int(i) for i in ids)
        rows = self._rows.get(key)
        if rows is None:
            rows = next(
                (r for k, r in self._rows.items() if len(k) > len(key) and k[: len(key)] == key),
                None,
            )
        if rows is None:
            raise RoutingReplayError(
                f"a forward runs a sequence of {len(key)} ids whose routing was not "
                f"registered ({len(self._rows)} sequences are)"
            )
        out = np.zeros((len(key), self.layers, self.top_k), np.int64)
        kept = min(len(key), rows.shape[0])
        out[:kept] = rows[:kept]
        return out

    def batch_rows(self, input_ids: Any, attention_mask: Any | None) -> Any:
        """The rows of a padded batch ``[batch, length]`` as ``[batch * length, layers,
        top_k]`` (the order in which the routers see its tokens)."""
        import torch

        batch, length = input_ids.shape
        out = torch.zeros((batch, length, self.layers, self.top_k), dtype=torch.long)
        ids = input_ids.detach().cpu()
        mask = (
            torch.ones_like(ids, dtype=torch.bool)
            if attention_mask is None
            else attention_mask.detach().cpu().bool()
        )
        for b in range(batch):
            where = mask[b].nonzero()[:, 0]
            rows = self.rows_for(ids[b, where].tolist())
            out[b, where] = torch.from_numpy(rows)
        return out.reshape(batch * length, self.layers, self.top_k)

    # ------------------------------------------------------------------ hooks

    def install(self) -> BatchReplay:
        if self._hook is not None:
            return self
        for layer, router in enumerate(self.routers):
            router.forward = self._forced(layer, router)
        self._hook = self.model.register_forward_pre_hook(self._before, with_kwargs=True)
        return self

    def remove(self) -> None:
        if self._hook is None:
            return
        self._hook.remove()
        self._hook = None
        self._current = None
        for router in self.routers:
            del router.forward

    def __enter__(self) -> BatchReplay:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.remove()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """The model's own routing inside the block."""
        was, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = was

    def _before(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._paused:
            return
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if input_ids is None:
            raise RoutingReplayError("routing replay needs the forward's input_ids")
        self._current = self.batch_rows(input_ids, kwargs.get("attention_mask"))

    def _forced(self, layer: int, router: Any) -> Any:

        own = type(router).forward

        def forward(hidden_states: Any) -> tuple[Any, Any, Any]:
            if self._paused:
                return own(router, hidden_states)  # type: ignore[no-any-return]
            hidden = hidden_states.reshape(-1, router.weight.shape[1])
            current = self._current
            if current is None or current.shape[0] != hidden.shape[0]:
                raise RoutingReplayError(
                    f"the routers run {hidden.shape[0]} tokens; the forward's routing has "
                    f"{0 if current is None else current.shape[0]}"
                )
            return replayed_router(router, hidden, current[:, layer])

        return forward
