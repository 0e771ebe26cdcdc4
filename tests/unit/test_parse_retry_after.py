"""Reading a backend's wait hint (``gateway.traffic.retry_after``): ``Retry-After``
(RFC 9110 section 10.2.3) and OpenAI's ``retry-after-ms``; a value that is not a finite
positive wait is unreadable (None), never 0 s."""

from __future__ import annotations

import email.utils

import pytest

from gateway.traffic.retry_after import (
    backend_retry_after,
    parse_retry_after,
    parse_retry_after_ms,
    says_when,
)

NOW = 1_700_000_000.0


def test_parse_retry_after_reads_seconds_and_dates():
    assert parse_retry_after("7", NOW) == 7.0
    assert parse_retry_after(" 1.5 ", NOW) == 1.5
    assert parse_retry_after(email.utils.formatdate(NOW + 30, usegmt=True), NOW) == 30.0


@pytest.mark.parametrize("value", [None, "", "soon", "-5", "nan", "inf", "-inf", "1e999",
                                   "0", "9" * 5000, "Wed, 21 Oct 2015 07:28:00 GMT"])
def test_parse_retry_after_unreadable_is_none(value):
    assert parse_retry_after(value, NOW) is None


def test_parse_retry_after_ms_reads_milliseconds():
    assert parse_retry_after_ms("250") == 0.25
    for value in (None, "", "soon", "-250", "nan", "inf", "0"):
        assert parse_retry_after_ms(value) is None, value


def test_backend_retry_after_prefers_milliseconds_then_seconds():
    assert backend_retry_after([(b"retry-after", b"7"), (b"retry-after-ms", b"3000")], NOW) == 3
    assert backend_retry_after([(b"retry-after", b"7"), (b"retry-after-ms", b"nan")], NOW) == 7
    assert backend_retry_after([(b"retry-after-ms", b"250")], NOW) == 0.25
    assert backend_retry_after([(b"retry-after", b"-5")], NOW) is None
    assert backend_retry_after([(b"x-foo", b"1")], NOW) is None


def test_says_when_sees_either_header_readable_or_not():
    assert says_when([(b"retry-after-ms", b"250")])
    assert says_when([(b"retry-after", b"soon")])
    assert not says_when([(b"x-retry-after", b"1")])
