"""The viewer's sign-in cookie: an expiry and its HMAC under the admin token."""

from __future__ import annotations

from transformers import AutoTokenizer

from proxy.api.ui import COOKIE_SECONDS, cookie_valid, make_cookie, token_texts
from tests.families import family_model


def test_a_cookie_is_valid_until_it_expires() -> None:
    cookie = make_cookie("admin", now=1000.0)
    assert cookie_valid("admin", cookie, now=1000.0)
    assert cookie_valid("admin", cookie, now=1000.0 + COOKIE_SECONDS)
    assert not cookie_valid("admin", cookie, now=1001.0 + COOKIE_SECONDS)


def test_a_cookie_is_bound_to_the_admin_token_and_cannot_be_edited() -> None:
    cookie = make_cookie("admin", now=1000.0)
    expires, _, signature = cookie.partition(".")
    assert "admin" not in cookie
    assert not cookie_valid("rotated", cookie, now=1000.0)
    assert not cookie_valid("admin", f"{int(expires) + 3600}.{signature}", now=1000.0)
    for junk in ["", ".", "x.y", f"{expires}.", f"-5.{signature}"]:
        assert not cookie_valid("admin", junk, now=1000.0)


def test_characters_split_over_tokens_show_on_the_token_that_completes_them() -> None:
    """Byte-level BPE splits emoji and CJK over tokens: each token's text, joined, is the
    text, with no replacement characters."""
    tokenizer = AutoTokenizer.from_pretrained(str(family_model("qwen3")))
    text = "Ünïcödé — 日本語のテキスト 🚀🔥 and 🧑‍💻 done"
    ids = tokenizer.encode(text, add_special_tokens=False)
    singles = [tokenizer.decode([i]) for i in ids]
    assert any("\ufffd" in t for t in singles)  # the case this is about
    texts = token_texts(tokenizer, ids)
    assert len(texts) == len(ids)
    assert "".join(texts) == text
    assert not any("\ufffd" in t for t in texts)
