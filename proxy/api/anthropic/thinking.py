"""Signatures of the thinking blocks the proxy returns.

Anthropic clients send a reply's ``thinking`` blocks back unchanged, ``signature``
included, and the API refuses blocks it did not sign. The proxy does the same: a block's
signature is an HMAC-SHA256 of its text under the trial's own key, so a block that comes
back is recognised as one this trial was given, and an altered or foreign one is refused
before anything is recorded.
"""

from __future__ import annotations

import base64
import hashlib
import hmac

_DOMAIN = b"rollout-relay/thinking/1\x00"


def sign_thinking(trial_key: str, trial_id: str, thinking: str) -> str:
    mac = hmac.new(trial_key.encode(), digestmod=hashlib.sha256)
    mac.update(_DOMAIN + trial_id.encode() + b"\x00" + thinking.encode())
    return base64.urlsafe_b64encode(mac.digest()).decode().rstrip("=")


def thinking_signed(trial_key: str, trial_id: str, thinking: str, signature: str) -> bool:
    return hmac.compare_digest(sign_thinking(trial_key, trial_id, thinking), signature)
