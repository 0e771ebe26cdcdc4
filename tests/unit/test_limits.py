"""The entry layer of admission (pure, times as arguments): token buckets and per-key
requests/tokens-per-minute limits (``gateway.traffic.limits``)."""

from __future__ import annotations

import math

import pytest

from gateway.traffic.limits import KeyLimiter, TokenBucket, ratelimit_duration


def test_token_bucket_refills_at_its_rate():
    b = TokenBucket(60, 60.0, now=0.0)  # 1 per second, burst 60
    b.take(60, 0.0)
    assert b.wait_for(1, 0.0) == pytest.approx(1.0)
    assert b.wait_for(1, 0.5) == pytest.approx(0.5)
    assert b.wait_for(1, 1.0) == 0.0
    assert b.wait_for(61, 1.0) == math.inf
    assert b.reset_in(1.0) == pytest.approx(59.0)


def test_key_limiter_rpm_verdicts_feed_ratelimit_headers():
    lim = KeyLimiter(rpm=3, tpm=None, now=0.0)
    verdicts = [lim.check(10, 0.0) for _ in range(4)]
    assert [v.admitted for v in verdicts] == [True, True, True, False]
    assert [v.remaining_requests for v in verdicts] == [2, 1, 0, 0]
    last = verdicts[-1]
    assert last.limit_requests == 3 and last.retry_after_s == pytest.approx(20.0)
    assert last.reason == "requests per minute"
    assert last.limit_tokens is None
    assert lim.check(10, 20.0).admitted


def test_key_limiter_tpm_and_oversized_request():
    lim = KeyLimiter(rpm=None, tpm=1000, now=0.0)
    assert lim.check(800, 0.0).admitted
    v = lim.check(400, 0.0)
    assert not v.admitted and v.reason == "tokens per minute"
    assert v.retry_after_s == pytest.approx(200 / (1000 / 60))
    huge = lim.check(5000, 0.0)
    assert not huge.admitted and "exceed" in huge.reason


def test_rejected_check_charges_nothing():
    lim = KeyLimiter(rpm=2, tpm=100, now=0.0)
    assert lim.check(90, 0.0).admitted
    assert not lim.check(90, 0.0).admitted  # tokens short
    assert lim.check(5, 0.0).admitted, "the refused request did not use a request slot"


def test_full_limiter_is_like_a_new_one():
    lim = KeyLimiter(60, 600, 0.0)
    assert lim.full(0.0)
    assert lim.check(100, 0.0).admitted and not lim.full(0.0)
    assert not lim.full(5.0)  # 100 of 600 tokens back after 10 s
    assert lim.full(10.0)


def test_refund_gives_back_what_a_later_refusal_charged():
    lim = KeyLimiter(rpm=2, tpm=1000, now=0.0)
    assert lim.check(400, 0.0).admitted
    lim.refund(400, 0.0)  # e.g. the queue was full: the key keeps its quota
    v = lim.check(400, 0.0)
    assert v.admitted and v.remaining_requests == 1 and v.remaining_tokens == 600
    lim.refund(10_000, 0.0)
    assert lim.check(1, 0.0).remaining_tokens == 999, "never above capacity"


def test_settle_charges_the_reported_usage_instead_of_the_estimate():
    """An estimate of 800 that used 4 gives 796 back; one of 100 that used 300 takes 200
    more, down below zero if need be (the key then waits out what it used); usage equal to
    the estimate changes nothing. ``state`` reads the buckets without charging."""
    lim = KeyLimiter(rpm=10, tpm=1000, now=0.0)
    assert lim.check(800, 0.0).remaining_tokens == 200
    lim.settle(800, 4, 0.0)
    v = lim.state(0.0)
    assert v.admitted and v.remaining_tokens == 996 and v.remaining_requests == 9
    assert lim.check(100, 0.0).admitted
    lim.settle(100, 300, 0.0)
    assert lim.state(0.0).remaining_tokens == 696
    lim.settle(300, 300, 0.0)
    assert lim.state(0.0).remaining_tokens == 696
    lim.settle(0, 1500, 0.0)  # far more than estimated: a debt
    assert lim.state(0.0).remaining_tokens == 0
    assert lim.check(10, 0.0).retry_after_s == pytest.approx((10 + 804) / (1000 / 60))
    lim.settle(10_000, 0, 0.0)
    assert lim.state(0.0).remaining_tokens == 1000, "never above capacity"
    lim.settle(0, 10**12, 0.0)  # a degenerate report: at most one minute's limit owed
    assert lim.check(1, 0.0).retry_after_s == pytest.approx(1001 / (1000 / 60))
    only_rpm = KeyLimiter(rpm=2, tpm=None, now=0.0)
    only_rpm.settle(100, 5, 0.0)  # no tokens bucket: nothing to settle
    assert only_rpm.state(0.0).remaining_requests == 2


def test_ratelimit_duration_format():
    assert ratelimit_duration(0.02) == "20ms"
    assert ratelimit_duration(1.5) == "1.5s"
    assert ratelimit_duration(360) == "6m0s"
