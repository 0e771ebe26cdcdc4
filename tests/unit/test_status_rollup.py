"""The status page's pure parts: the per-minute rollup of an hour (injected clock), the
verdict words from their inputs, the bounded incident log."""

from __future__ import annotations

import random

import pytest

from gateway.traffic.incidents import IncidentLog
from gateway.traffic.status_rollup import GROWTH, LogHistogram, MinuteRollup
from gateway.traffic.status_verdict import (
    DEGRADED,
    OPERATIONAL,
    OUTAGE,
    ModelInputs,
    model_verdict,
    overall,
)

# ---- the histogram -------------------------------------------------------------------------


def test_histogram_quantile_is_never_below_the_true_one_and_at_most_5_percent_above() -> None:
    rng = random.Random(7)
    samples = [rng.lognormvariate(-2.0, 1.0) for _ in range(5000)]
    h = LogHistogram()
    for s in samples:
        h.add(s)
    for q in (0.5, 0.9, 0.99):
        true = sorted(samples)[int(q * len(samples) + 0.999999) - 1]
        got = h.quantile(q)
        assert got is not None
        assert true <= got <= true * GROWTH * 1.0000001


def test_histogram_empty_and_merge() -> None:
    a, b = LogHistogram(), LogHistogram()
    assert a.quantile(0.99) is None
    a.add(0.1, 99)
    b.add(2.0, 1)
    a.merge(b)
    assert a.total == 100
    assert a.quantile(0.99) == pytest.approx(0.1, rel=0.05)  # rank 99 of 100
    b.add(2.0, 1)
    a.merge(b)  # b holds 2 now: 3 of 102 slow, the P99 is slow
    assert a.quantile(0.99) == pytest.approx(2.0, rel=0.05)
    a.add(float("nan"))
    a.add(1.0, 0)
    assert a.total == 102


# ---- the rollup (injected clock) -----------------------------------------------------------


def test_rollup_windows_and_an_hour_of_minutes() -> None:
    r = MinuteRollup(span_s=3600, bucket_s=60)
    t0 = 10_000.0
    r.add_ttft("m", t0, [1.0] * 30)  # a slow minute
    r.add_requests("m", t0, 30, 3)
    for minute in range(1, 10):  # nine fast minutes after it
        r.add_ttft("m", t0 + 60 * minute, [0.1] * 30)
        r.add_requests("m", t0 + 60 * minute, 30, 0)
    now = t0 + 9 * 60 + 5
    recent = r.summary("m", now, 300, min_samples=20)
    assert recent.ttft_p99_s == pytest.approx(0.1, rel=0.05)  # the slow minute is out
    assert recent.answered_share == 1.0
    hour = r.summary("m", now, 3600, min_samples=20)
    assert hour.ttft_p99_s == pytest.approx(1.0, rel=0.05)  # 30 of 300 slow: P99 slow
    assert hour.requests == 300 and hour.server_errors == 3
    assert hour.answered_share == pytest.approx(0.99)
    assert hour.ttft_samples == 300
    # an hour later the slow minute has left the hour, then everything has
    later = r.summary("m", t0 + 3600 + 61, 3600, min_samples=20)
    assert later.ttft_p99_s == pytest.approx(0.1, rel=0.05) and later.server_errors == 0
    gone = r.summary("m", t0 + 2 * 3600 + 60 * 10, 3600)
    assert gone.requests == 0 and gone.ttft_p99_s is None and gone.answered_share is None


def test_rollup_needs_min_samples_and_keeps_models_apart() -> None:
    r = MinuteRollup()
    r.add_ttft("a", 0.0, [5.0] * 19)
    r.add_itl("b", 0.0, 0.02, 40)
    assert r.summary("a", 1.0, 60, min_samples=20).ttft_p99_s is None
    assert r.summary("a", 1.0, 60, min_samples=19).ttft_p99_s == pytest.approx(5.0, rel=0.05)
    assert r.summary("b", 1.0, 60).itl_p99_s == pytest.approx(0.02, rel=0.05)
    assert r.summary("b", 1.0, 60).ttft_p99_s is None
    assert r.models() == ["a", "b"]
    r.forget("a")
    assert r.models() == ["b"]
    with pytest.raises(ValueError):
        MinuteRollup(span_s=30, bucket_s=60)


# ---- the verdict words -----------------------------------------------------------------------


def test_no_routable_backend_is_an_outage_whatever_the_latency() -> None:
    v = model_verdict(ModelInputs("m", 0, 0.01, 0.01), 1.0, 0.1)
    assert v.words == OUTAGE


def test_p99_over_the_slo_is_degraded_performance_although_everything_answers() -> None:
    assert model_verdict(ModelInputs("m", 3, 1.5, 0.05), 1.0, 0.1).words == DEGRADED
    assert model_verdict(ModelInputs("m", 3, 0.5, 0.2), 1.0, 0.1).words == DEGRADED
    v = model_verdict(ModelInputs("m", 3, 1.5, 0.2), 1.0, 0.1)
    assert len(v.reasons) == 2 and "TTFT" in v.reasons[0] and "ITL" in v.reasons[1]
    assert model_verdict(ModelInputs("m", 3, 0.5, 0.05, degraded_level=1), 1.0,
                         0.1).words == DEGRADED


def test_recovered_only_when_p99_is_back_under_the_slo() -> None:
    assert model_verdict(ModelInputs("m", 1, 1.0, 0.1), 1.0, 0.1).words == OPERATIONAL  # at
    assert model_verdict(ModelInputs("m", 1, 1.01, 0.1), 1.0, 0.1).words == DEGRADED
    # too few streams to judge: nothing is over (no one is waiting on them)
    v = model_verdict(ModelInputs("m", 1, None, None), 1.0, 0.1)
    assert v.words == OPERATIONAL and v.reasons == ()


def test_overall_is_the_worst_model() -> None:
    assert overall([]) == OPERATIONAL
    assert overall([OPERATIONAL, DEGRADED]) == DEGRADED
    assert overall([DEGRADED, OUTAGE, OPERATIONAL]) == OUTAGE


# ---- the incident log ------------------------------------------------------------------------


def test_incident_log_is_bounded_newest_first() -> None:
    log = IncidentLog(capacity=3)
    for i in range(5):
        log.record(float(i), "drain", f"b{i}", "admin")
    assert [i.subject for i in log.recent()] == ["b4", "b3", "b2"]
    assert [i.at for i in log.recent(1)] == [4.0]
    assert log.recent(1)[0].to_json() == {"at": 4.0, "kind": "drain", "subject": "b4",
                                          "detail": "admin"}
    with pytest.raises(ValueError):
        log.record(0.0, "meteor", "b0", "")
    with pytest.raises(ValueError):
        IncidentLog(0)
