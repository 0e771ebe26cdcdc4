"""Retry-After hints: the [1, 60] s bounds and the Little's-law estimate
(``gateway.traffic.retry_after``)."""

from __future__ import annotations

import pytest

from gateway.traffic.retry_after import clamp_retry_after, retry_after_s


def test_retry_after_bounds_and_littles_law():
    assert retry_after_s(10, 5.0) == pytest.approx(2.0)
    assert retry_after_s(1, 100.0) == 1.0  # floor 1 s
    assert retry_after_s(10_000, 1.0) == 60.0  # cap 60 s
    assert retry_after_s(5, 0.0) == 60.0  # nothing finishing: come back late
    assert clamp_retry_after(float("nan")) == 60.0
