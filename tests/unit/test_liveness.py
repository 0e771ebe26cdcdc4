"""The hung watchdog's rule (gateway.fleet.liveness) on an injected clock: silence while
owing a control-plane answer makes a backend suspect, then hung; any answer resets it; a
slow answer, a refused connection or the gateway's own stall never makes it hung."""

from __future__ import annotations

import math

import pytest

from gateway.fleet.liveness import Liveness, LivenessRule, Verdict

RULE = LivenessRule()  # the defaults: suspect 1 s, hung 2 s (4 s with no peer heard)
TICK = 0.125  # exact in binary: sums of ticks carry no rounding error


def run(lv: Liveness, start: float, end: float, peers_heard_at: float = math.inf,
        rule: LivenessRule = RULE) -> list[tuple[float, Verdict]]:
    """Check every TICK seconds over [start, end]; the verdicts that changed, with times.
    ``peers_heard_at`` inf: another backend answers all the time."""
    out: list[tuple[float, Verdict]] = []
    t = start
    last = None
    while t <= end:
        peers = t if peers_heard_at == math.inf else peers_heard_at
        v = lv.check(t, peers, rule)
        if v is not last:
            out.append((t, v))
            last = v
        t += TICK
    return out


def test_owing_nothing_is_alive_however_long_nothing_comes_back() -> None:
    lv = Liveness()
    lv.heard(0.0)
    assert run(lv, 0.0, 60.0) == [(0.0, Verdict.ALIVE)]
    assert lv.silence_s == 0.0 and lv.silent_since() is None


def test_an_unanswered_probe_makes_it_suspect_after_1_s_and_hung_after_2_s() -> None:
    lv = Liveness()
    lv.heard(0.0)
    lv.sent(0.5)  # a scrape that never comes back
    assert run(lv, 0.0, 5.0) == [(0.0, Verdict.ALIVE), (1.5, Verdict.SUSPECT),
                                 (2.5, Verdict.HUNG)]
    assert lv.peer_heard


def test_without_a_peer_heard_from_it_takes_twice_as_long() -> None:
    """One backend alone (or the gateway's own network broken): hung only after 4 s."""
    lv = Liveness()
    lv.heard(0.0)
    lv.sent(0.5)
    changes = run(lv, 0.0, 6.0, peers_heard_at=0.2)  # the peer was last heard before
    assert changes == [(0.0, Verdict.ALIVE), (1.5, Verdict.SUSPECT), (4.5, Verdict.HUNG)]
    assert not lv.peer_heard


def test_a_slow_answer_resets_the_silence() -> None:
    """A busy backend answering its probes in 0.875 s, every second, is never suspect."""
    lv = Liveness()
    lv.heard(0.0)
    verdicts = set()
    t = 0.0
    pending: list[tuple[float, int]] = []
    while t < 30.0:
        if t % 1.0 == 0:
            pending.append((t + 0.875, lv.sent(t)))  # probe on a fixed tick
        for due, tok in [p for p in pending if p[0] <= t]:
            lv.answered(tok, t)
            pending.remove((due, tok))
        verdicts.add(lv.check(t, t, RULE))
        t += TICK
    assert verdicts == {Verdict.ALIVE}
    assert lv.silence_s < RULE.suspect_after_s


def test_silence_starts_at_the_later_of_the_oldest_owed_request_and_the_last_answer() -> None:
    lv = Liveness()
    lv.sent(0.0)  # outstanding since 0 ...
    lv.heard(0.75)  # ... but something else was answered at 0.75
    assert lv.silent_since() == 0.75
    assert run(lv, 0.75, 3.0) == [(0.75, Verdict.ALIVE), (1.75, Verdict.SUSPECT),
                                  (2.75, Verdict.HUNG)]


def test_a_timed_out_request_is_still_owed_until_the_backend_answers() -> None:
    lv = Liveness()
    lv.heard(0.0)
    tok = lv.sent(0.125)
    lv.check(0.125, 0.125, RULE)
    lv.unanswered(tok)  # its 1 s timeout passed
    assert lv.owed == 0 and lv.silent_since() == 0.125
    assert run(lv, 0.25, 2.25)[-1] == (2.125, Verdict.HUNG)
    lv.heard(2.3)  # it answers something again
    assert lv.check(2.375, 2.375, RULE) is Verdict.ALIVE and lv.silence_s == 0.0


def test_a_refused_connection_owes_nothing() -> None:
    """A dead backend (connection refused) is the probes' fail_threshold to judge."""
    lv = Liveness()
    lv.heard(0.0)
    for i in range(30):
        lv.dropped(lv.sent(0.125 * i))
    assert run(lv, 0.0, 5.0) == [(0.0, Verdict.ALIVE)]


def test_a_stalled_gateway_loop_counts_at_most_max_step_per_check() -> None:
    """The gateway's own event loop stalled 3 s: answers that came meanwhile are unread,
    so that time counts only ``max_step_s`` (0.5 s): no verdict from the gateway's stall."""
    lv = Liveness()
    lv.heard(0.0)
    lv.check(0.0, 0.0, RULE)
    tok = lv.sent(0.2)
    assert lv.check(0.3, 0.3, RULE) is Verdict.ALIVE  # 0.1 s of silence
    assert lv.check(3.3, 3.3, RULE) is Verdict.ALIVE  # 3 s late: +0.5 s
    assert lv.silence_s == pytest.approx(0.6)
    lv.answered(tok, 3.31)  # the answer is read as soon as the loop runs
    assert lv.check(3.4, 3.4, RULE) is Verdict.ALIVE and lv.silence_s == 0.0


def test_zero_thresholds_disable_the_verdicts() -> None:
    lv = Liveness()
    lv.sent(0.0)
    off = LivenessRule(suspect_after_s=0.0, hung_after_s=0.0)
    assert run(lv, 0.0, 30.0, rule=off) == [(0.0, Verdict.ALIVE)]
    only_suspect = LivenessRule(suspect_after_s=1.0, hung_after_s=0.0)
    lv2 = Liveness()
    lv2.sent(0.0)
    assert run(lv2, 0.0, 30.0, rule=only_suspect) == [(0.0, Verdict.ALIVE),
                                                      (1.0, Verdict.SUSPECT)]


def test_time_to_hung_after_a_freeze_with_the_default_loops() -> None:
    """The default loops (scrape every 0.5 s + its duration, probe on a 1 s tick) against
    a backend that answers everything in 20 ms until it freezes at t=10.23: hung 2-2.6 s
    later, whatever the phase."""
    for phase in (0.0, 0.13, 0.29, 0.41, 0.5, 0.77):
        lv = Liveness()
        freeze = 10.23 + phase
        outstanding: list[tuple[float, int]] = []
        next_scrape, next_probe = 0.0, 0.05
        t = 0.0
        hung_at = None
        while t < freeze + 10 and hung_at is None:
            for due, tok in [o for o in outstanding if o[0] <= t + 1e-9]:
                outstanding.remove((due, tok))
                lv.answered(tok, t)
            if t >= next_scrape:
                due = t + 0.02 if t < freeze else math.inf
                outstanding.append((due, lv.sent(t)))
                next_scrape = t + (0.52 if t < freeze else 1.5)  # 1 s timeout + 0.5 s
            if t >= next_probe:
                if not any(d == math.inf for d, _ in outstanding[-2:]) or t < freeze:
                    due = t + 0.02 if t < freeze else math.inf
                    outstanding.append((due, lv.sent(t)))
                next_probe += 1.0
            if lv.check(t, t, RULE) is Verdict.HUNG:
                hung_at = t
            t = round(t + 0.01, 2)
        assert hung_at is not None
        assert 2.0 <= hung_at - freeze <= 2.6, (phase, hung_at - freeze)
