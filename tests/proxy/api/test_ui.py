"""The viewer's sign-in cookie: an expiry and its HMAC under the admin token."""

from __future__ import annotations

from proxy.api.ui import COOKIE_SECONDS, cookie_valid, make_cookie


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
