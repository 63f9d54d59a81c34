"""A password put in ``valkey_url`` shows in no message, for every URL form docs/tiers.md accepts
(endpoint.py, issue 24 "Why" 3).

Passwords are generated with ``/``, ``@``, ``:``, ``?``, ``#`` and percent-escapes between marked
fragments (``Kq0``, ``Kq1``, ...), so a message showing any part of one, even the part after its
last ``/`` or ``@``, holds ``Kq``.
"""

from __future__ import annotations

from urllib.parse import unquote

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.config import OffloadConfig
from kvoffload.store.tiers.endpoint import parse_valkey_url, redact_url

MARK = "Kq"
SEPARATORS = ["/", "@", ":", "?", "#", "%40", "%2F", "%3A", "%25", "%", "!", "~", "+", ",", "="]
# Each form of docs/tiers.md with a user and a password where its user goes ({u}: user, {p}).
FORMS = [
    "redis://{u}:{p}@cache.internal:6379/0",
    "redis://{u}:{p}@cache.internal",
    "rediss://{u}:{p}@cache.internal:6380/2",
    "redis://{u}:{p}@[::1]:6379/0",
    "unix://{u}:{p}@/run/valkey.sock",
    "redis+cluster://{u}:{p}@10.0.0.11:6379,10.0.0.12:6379",
    "rediss+cluster://{u}:{p}@10.0.0.11:6379",
]


@st.composite
def passwords(draw: st.DrawFn) -> str:
    seps = draw(st.lists(st.sampled_from(SEPARATORS), min_size=1, max_size=6))
    lead = draw(st.sampled_from(["", "hun", "@", "/", ":"]))
    return lead + "".join(f"{sep}{MARK}{i}" for i, sep in enumerate(seps))


def assert_hidden(text: str, password: str) -> None:
    assert MARK not in text and MARK not in unquote(text), f"{password!r} shows in {text!r}"


@settings(max_examples=300, deadline=None)
@given(
    form=st.sampled_from(FORMS),
    user=st.sampled_from(["", "tenant-a", "u"]),
    password=passwords(),
)
def test_a_password_in_the_url_shows_in_no_message(form: str, user: str, password: str) -> None:
    url = form.format(u=user, p=password)
    assert_hidden(redact_url(url), password)
    with pytest.raises(ValueError) as refused:
        OffloadConfig(model_id="m", valkey_url=url)
    assert_hidden(str(refused.value), password)
    assert_hidden(repr(refused.value), password)
    with pytest.raises(ValueError) as parsed:
        parse_valkey_url(url)
    assert_hidden(str(parsed.value), password)


@pytest.mark.parametrize(
    "url",
    [
        "redis://u:hun/ter2@127.0.0.1:6379/0",  # before: the whole URL
        "redis://u:hun@ter2@127.0.0.1:6379/0",  # before: "***@ter2@..."
    ],
)
def test_the_issues_urls(url: str) -> None:
    with pytest.raises(ValueError, match="without a password") as refused:
        OffloadConfig(model_id="m", valkey_url=url)
    assert "hun" not in str(refused.value) and "ter2" not in str(refused.value)
    assert "redis://u:***@127.0.0.1:6379/0" in str(refused.value)


def test_redact_url_keeps_what_is_not_secret() -> None:
    assert redact_url("redis://u:a/b@c@h:1/0") == "redis://u:***@h:1/0"
    assert redact_url("redis://h:1/0?password=x#y") == "redis://h:1/0?***"
    assert redact_url("u:secret@h:1") == "u:***@h:1"  # no scheme
    assert redact_url("redis+cluster://tenant@a:1,b:2") == "redis+cluster://tenant@a:1,b:2"
    assert redact_url(None) == "None"


def test_a_query_with_a_password_is_refused_without_showing_it() -> None:
    with pytest.raises(ValueError, match="without a query") as refused:
        OffloadConfig(model_id="m", valkey_url="redis://h:6379/0?password=Kq0")
    assert_hidden(str(refused.value), "Kq0")
