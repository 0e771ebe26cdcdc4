"""The status page's pure parts: the per-minute rollup of an hour (injected clock), the
verdict words from their inputs (availability thresholds, the minimum sample, the last
hour), the bounded incident log."""

from __future__ import annotations

import random

import pytest

from gateway.traffic.incidents import IncidentLog
from gateway.traffic.status_rollup import GROWTH, LogHistogram, MinuteRollup
from gateway.traffic.status_verdict import (
    DEGRADED,
    MAJOR,
    OPERATIONAL,
    PARTIAL,
    ModelInputs,
    Window,
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
    assert hour.requests == 300 and hour.failed == 3
    assert hour.answered_share == pytest.approx(0.99)
    assert hour.ttft_samples == 300
    # an hour later the slow minute has left the hour, then everything has
    later = r.summary("m", t0 + 3600 + 61, 3600, min_samples=20)
    assert later.ttft_p99_s == pytest.approx(0.1, rel=0.05) and later.failed == 0
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


WARM = (("warm", 3),)


def inputs(now: Window, states: tuple[tuple[str, int], ...] = WARM, hour: Window | None = None,
           level: int = 0) -> ModelInputs:
    return ModelInputs("m", states, now, hour, level)


def streams(ttft: float | None, itl: float | None, n: int = 50) -> Window:
    """A "now" window of ``n`` streams (and ``n`` gaps), every request answered."""
    return Window(300, n, 0, ttft, n, itl, n)


def test_no_routable_backend_is_a_major_outage_whatever_the_sample() -> None:
    v = model_verdict(inputs(Window(300), (("breaker_open", 2), ("unhealthy", 1))), 1.0, 0.1)
    assert v.words == MAJOR
    assert v.reasons == ("no backend can serve it (2 circuit breaker open, 1 unhealthy)",)
    assert model_verdict(inputs(streams(0.01, 0.01), ()), 1.0, 0.1).reasons == (
        "no backend can serve it (none lists it)",)


@pytest.mark.parametrize(("answered", "words"), [
    (1000, OPERATIONAL), (990, OPERATIONAL),  # 99 % exactly is not under it
    (989, PARTIAL), (900, PARTIAL),  # 90 % exactly is not under it
    (899, MAJOR), (650, MAJOR), (0, MAJOR)])
def test_the_answered_share_makes_a_partial_or_major_outage(answered: int, words: str) -> None:
    now = Window(300, 1000, 1000 - answered)
    v = model_verdict(inputs(now, hour=now), 1.0, 0.1)
    assert v.words == words and v.hour is not None and v.hour.words == words
    if words != OPERATIONAL:
        assert v.reasons[0].startswith(f"{answered / 10:.1f} % of 1000 requests answered "
                                       "in the last 5 min (under ")


def test_availability_is_judged_only_on_min_samples_requests() -> None:
    few = Window(300, 19, 19)  # all failed, but 19 < 20
    v = model_verdict(inputs(few), 1.0, 0.1, min_samples=20)
    assert v.words == OPERATIONAL and v.reasons == ()
    assert v.notes == ("availability in the last 5 min: 19 requests: too few to judge "
                       "(20 needed)",)
    assert model_verdict(inputs(Window(300, 20, 20)), 1.0, 0.1, min_samples=20).words == MAJOR


def test_the_last_hour_has_its_own_words_beside_the_now_window() -> None:
    hour = Window(3600, 1200, 100, 3.0, 1200, 0.05, 1200)  # 91.7 %, and slow
    v = model_verdict(inputs(streams(0.5, 0.05), hour=hour), 1.0, 0.1)
    assert v.words == OPERATIONAL  # now: recovered
    assert v.hour is not None and v.hour.words == PARTIAL
    assert v.hour.reasons == ("91.7 % of 1200 requests answered in the last hour (under 99 %)",
                              "P99 TTFT 3 s over the SLO 1 s in the last hour")


def test_p99_over_the_slo_is_degraded_performance_although_everything_answers() -> None:
    assert model_verdict(inputs(streams(1.5, 0.05)), 1.0, 0.1).words == DEGRADED
    assert model_verdict(inputs(streams(0.5, 0.2)), 1.0, 0.1).words == DEGRADED
    v = model_verdict(inputs(streams(1.5, 0.2)), 1.0, 0.1)
    assert len(v.reasons) == 2 and "TTFT" in v.reasons[0] and "ITL" in v.reasons[1]
    assert model_verdict(inputs(streams(0.5, 0.05), level=1), 1.0, 0.1).words == DEGRADED
    # an outage is worse than slowness
    assert model_verdict(inputs(Window(300, 100, 5, 1.5, 100)), 1.0, 0.1).words == PARTIAL


def test_recovered_only_when_p99_is_back_under_the_slo() -> None:
    assert model_verdict(inputs(streams(1.0, 0.1)), 1.0, 0.1).words == OPERATIONAL  # at
    assert model_verdict(inputs(streams(1.01, 0.1)), 1.0, 0.1).words == DEGRADED


def test_too_few_streams_are_not_judged_but_said_with_the_count() -> None:
    v = model_verdict(inputs(Window(300, 3, 0, 5.0, 3, 0.5, 12)), 1.0, 0.1, min_samples=20)
    assert v.words == OPERATIONAL and v.reasons == ()
    assert v.notes == (
        "availability in the last 5 min: 3 requests: too few to judge (20 needed)",
        "P99 TTFT in the last 5 min: 3 streams: too few to judge (20 needed)",
        "P99 ITL in the last 5 min: 12 inter-token gaps: too few to judge (20 needed)")
    # no stream at all: nothing to judge and nothing to say of P99
    assert model_verdict(inputs(Window(300)), 1.0, 0.1).notes == ()


def test_overall_is_the_worst_model() -> None:
    assert overall([]) == OPERATIONAL
    assert overall([OPERATIONAL, DEGRADED]) == DEGRADED
    assert overall([DEGRADED, MAJOR, PARTIAL, OPERATIONAL]) == MAJOR
    assert overall([DEGRADED, PARTIAL]) == PARTIAL


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
