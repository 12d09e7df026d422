"""The trajectory viewer: a web page at ``/ui/`` for reading sessions as a trainer would.

It lists sessions and shows one as its tree of turns beside its tree of agents (branch reason, finish reason,
delivery and retries, worker, policy version, timings) and any trajectory as tokens: context and sampled tokens
told apart, each sampled token's logprob on hover and in its colour, each image as a
thumbnail in place of its placeholder tokens. The page polls, so a
running session is seen live. Its assets ship in the package (``proxy/api/ui_assets``):
no CDN.

Access is the admin door's. A browser cannot send a bearer token, so the page has a
login form: the admin token posted there sets an HttpOnly, SameSite=Strict cookie holding
an expiry and an HMAC of it under the admin token (the token itself never is a cookie;
changing the token signs everyone out). The data routes under ``/ui/api/`` take that
cookie or the admin token as a bearer header. Without an admin token configured (``--no-auth``)
the viewer is open like the rest of the proxy.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from importlib import resources
from typing import Any

from aiohttp import web

from proxy.api.errors import json_response
from proxy.appkeys import CONFIG, MODELS, SESSIONS
from proxy.auth import AuthPolicy, Verdict, presented_credentials, secret_equal
from proxy.cluster import CLUSTER, FORWARDED_BY
from proxy.exceptions import AuthenticationError, BadRequestError, NotFoundError
from proxy.sessions.model import Session, TurnNode, node_versions

COOKIE = "rr_ui"
_PARTIAL = "\ufffd"  # what decoding part of a character's bytes gives
_MAX_SPLIT = 8  # tokens one character may be spread over (UTF-8: 4 bytes at most)
COOKIE_SECONDS = 12 * 3600
SESSIONS_LISTED = 200  # the newest ones
_ASSETS = {
    "viewer.js": "text/javascript",
    "viewer.css": "text/css",
}


def _asset(name: str) -> str:
    return resources.files("proxy.api").joinpath("ui_assets", name).read_text(encoding="utf-8")


def _signature(admin_token: str, expires: int) -> str:
    message = f"rollout-relay viewer {expires}".encode()
    return hmac.new(admin_token.encode(), message, hashlib.sha256).hexdigest()


def make_cookie(admin_token: str, *, now: float | None = None) -> str:
    expires = int((now if now is not None else time.time()) + COOKIE_SECONDS)
    return f"{expires}.{_signature(admin_token, expires)}"


def cookie_valid(admin_token: str, value: str, *, now: float | None = None) -> bool:
    expires_text, dot, signature = value.partition(".")
    if not dot or not expires_text.isdigit():
        return False
    expires = int(expires_text)
    if expires < (now if now is not None else time.time()):
        return False
    return secret_equal(_signature(admin_token, expires), signature)


def _signed_in(request: web.Request) -> bool:
    """The admin door's own check (an open proxy, or the admin token presented), or the
    sign-in cookie."""
    token = request.app[CONFIG].admin_token
    credentials = presented_credentials(request.headers)
    if AuthPolicy(token).check_admin(credentials, _no_trial_keys) is Verdict.ALLOW:
        return True
    return token is not None and cookie_valid(token, request.cookies.get(COOKIE, ""))


def _no_trial_keys(trial_id: str) -> None:
    return None  # a trial key never opens the viewer, whichever trial it names


def _require(request: web.Request) -> None:
    if not _signed_in(request):
        raise AuthenticationError("sign in at /ui/ first", code="not_signed_in")


# ---------------------------------------------------------------------- pages


async def page(request: web.Request) -> web.Response:
    name = "viewer.html" if _signed_in(request) else "login.html"
    status = 200 if name == "viewer.html" else 401
    return web.Response(text=_asset(name), content_type="text/html", status=status)


async def asset(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    kind = _ASSETS.get(name)
    if kind is None:
        raise NotFoundError(f"no asset {name!r}", code="not_found")
    return web.Response(text=_asset(name), content_type=kind)


async def login(request: web.Request) -> web.Response:
    token = request.app[CONFIG].admin_token
    form = await request.post()
    given = form.get("token")
    if token is not None and not (isinstance(given, str) and secret_equal(token, given.strip())):
        text = _asset("login.html").replace("<!--error-->", "That is not the admin token.")
        return web.Response(text=text, content_type="text/html", status=401)
    response = web.HTTPSeeOther("/ui/")
    if token is not None:
        response.set_cookie(
            COOKIE,
            make_cookie(token),
            max_age=COOKIE_SECONDS,
            path="/ui",
            httponly=True,
            samesite="Strict",
            secure=request.secure,
        )
    raise response


async def logout(request: web.Request) -> web.Response:
    response = web.HTTPSeeOther("/ui/")
    response.del_cookie(COOKIE, path="/ui")
    raise response


# ---------------------------------------------------------------------- data


def _turn(node: TurnNode) -> dict[str, Any]:
    meta = node.meta
    return {
        "turn": node.index,
        "parent": node.parent,
        "branch_reason": meta.branch_reason,
        "finish_reason": meta.finish_reason,
        "capped": meta.capped,
        "truncated": meta.truncated,
        "delivered": meta.delivered,
        "retry_of": meta.retry_of,
        "replays": meta.replays,
        "api": meta.api,
        "model": meta.model,
        "worker_id": meta.worker_id,
        "policy_version": meta.extra.get("policy_version"),
        # Every version that sampled the reply, in order (two after an abort-mode update).
        "policy_versions": [v for v, _, _ in node_versions(node)],
        "queue_seconds": round(meta.queue_seconds, 4),
        "engine_seconds": round(meta.engine_seconds, 4),
        "prompt_tokens": node.prompt_len,
        "completion_tokens": len(node.completion_ids),
        "tool_calls": meta.tool_calls,
        "created_at": meta.created_at,
        "agent": node.agent.id,
        "agent_kind": node.agent.kind,
    }


async def list_sessions(request: web.Request) -> web.Response:
    """The newest sessions of every replica (a replica asked by another lists its own)."""
    _require(request)
    rows: list[dict[str, Any]] = [
        {
            "trial_id": s.trial_id,
            "status": s.state.value,
            "model": s.model,
            "turns": len(s.nodes),
            "branches": sum(1 for _ in s.leaves()),
            "reward": s.reward,
            "created_at": s.created_at,
            "updated_at": s.updated_at,
        }
        for s in request.app[SESSIONS].newest(SESSIONS_LISTED)
    ]
    cluster = request.app.get(CLUSTER)
    if cluster is not None and FORWARDED_BY not in request.headers:
        for part in await cluster.gather(request, {}):
            rows += part["sessions"]
        rows.sort(key=lambda row: row["created_at"], reverse=True)
        del rows[SESSIONS_LISTED:]
    return json_response({"sessions": rows})


async def session_tree(request: web.Request) -> web.Response:
    _require(request)
    session = request.app[SESSIONS].get(request.match_info["trial_id"])
    leaves = [
        {"leaf": leaf.index, "turns": [n.index for n in session.path(leaf.index)]}
        for leaf in session.leaves()
    ]
    return json_response(
        {
            "trial_id": session.trial_id,
            "status": session.state.value,
            "model": session.model,
            "reward": session.reward,
            "options": session.options.as_dict(),
            "turns": [_turn(n) for n in session.nodes],
            "trajectories": leaves,
            "agents": session.agent_list(),
        }
    )


def _texts(request: web.Request, session: Session, model: str, ids: list[int]) -> list[str]:
    """Each token's own text (special tokens included); ids when no worker has brought
    the model's tokenizer."""
    served = request.app[MODELS].models.get(model) or request.app[MODELS].models.get(
        session.model or ""
    )
    if served is None:
        return [f"<{i}>" for i in ids]
    return token_texts(served.renderer.tokenizer, ids)


def token_texts(tokenizer: Any, ids: list[int]) -> list[str]:
    """Each token's text, decoded in one batch. A character whose bytes are split over
    several tokens is shown on the token that completes it (the others show nothing),
    instead of as replacement characters."""
    backend = getattr(tokenizer, "backend_tokenizer", None)

    def decode(part: list[int]) -> str:
        if backend is not None:
            text: str = backend.decode(part, skip_special_tokens=False)
            return text
        return str(tokenizer.decode(part, skip_special_tokens=False))

    if backend is not None:
        texts: list[str] = backend.decode_batch([[i] for i in ids], skip_special_tokens=False)
    else:
        texts = [decode([i]) for i in ids]
    at = 0
    while at < len(texts):
        if _PARTIAL not in texts[at]:
            at += 1
            continue
        end = at
        while end < len(texts) and _PARTIAL in texts[end] and end - at < _MAX_SPLIT:
            end += 1
        for stop in (end, end + 1):  # the run alone, or with the token after it
            joined = decode(ids[at:stop])
            if stop <= len(ids) and _PARTIAL not in joined:
                texts[at:stop] = [""] * (stop - at - 1) + [joined]
                break
        at = max(end, at + 1)
    return texts


async def trajectory_tokens(request: web.Request) -> web.Response:
    _require(request)
    session = request.app[SESSIONS].get(request.match_info["trial_id"])
    try:
        leaf = int(request.match_info["leaf"])
    except ValueError:
        raise BadRequestError(
            "a trajectory is named by its last turn", code="invalid_request"
        ) from None
    if not 0 <= leaf < len(session.nodes):
        raise NotFoundError(f"no turn {leaf} in {session.trial_id}", code="turn_not_found")
    trajectory = session.trajectory(session.nodes[leaf])
    model = session.nodes[leaf].meta.model
    prompt = trajectory["prompt_ids"]
    response = trajectory["response_ids"]
    texts = _texts(request, session, model, prompt + response)
    return json_response(
        {
            "leaf": leaf,
            "prompt": [[t, i] for t, i in zip(texts, prompt, strict=False)],
            "response": [
                [t, i, m, round(lp, 4)]
                for t, i, m, lp in zip(
                    texts[len(prompt) :],
                    response,
                    trajectory["response_mask"],
                    trajectory["response_logprobs"],
                    strict=True,
                )
            ],
            "turns": [
                {"turn": t["turn"], "start": t["response_start"], "end": t["response_end"]}
                for t in trajectory["turns"]
            ],
            # Shown in place of their placeholder tokens, as thumbnails.
            "images": [
                {
                    "start": image["span"][0],
                    "end": image["span"][1],
                    "width": image["width"],
                    "height": image["height"],
                    "url": f"/ui/api/sessions/{session.trial_id}/images/{image['sha256']}",
                }
                for image in trajectory.get("multi_modal_data", {}).get("images", [])
            ],
        }
    )


async def image(request: web.Request) -> web.Response:
    """An image of the session, for the page's thumbnails (the cookie is what an ``<img>``
    can present)."""
    _require(request)
    session = request.app[SESSIONS].get(request.match_info["trial_id"])
    found = session.images.get(request.match_info["sha256"])
    if found is None:
        raise NotFoundError(f"no such image in {session.trial_id}", code="image_not_found")
    return web.Response(
        body=found.data,
        content_type=found.media_type.value,
        headers={"Cache-Control": "private, max-age=86400", "X-Content-Type-Options": "nosniff"},
    )


async def _to_page(request: web.Request) -> web.Response:
    raise web.HTTPFound("/ui/")


def add_routes(app: web.Application) -> None:
    app.router.add_get("/ui", _to_page)
    app.router.add_get("/ui/", page)
    app.router.add_get("/ui/assets/{name}", asset)
    app.router.add_post("/ui/login", login)
    app.router.add_post("/ui/logout", logout)
    app.router.add_get("/ui/api/sessions", list_sessions)
    app.router.add_get("/ui/api/sessions/{trial_id}", session_tree)
    app.router.add_get("/ui/api/sessions/{trial_id}/trajectories/{leaf}", trajectory_tokens)
    app.router.add_get("/ui/api/sessions/{trial_id}/images/{sha256}", image)
