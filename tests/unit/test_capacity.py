"""The service model (pure, injected times): concurrency and service rate learned from a
backend's scrapes, and the queue wait they predict (``gateway.traffic.capacity``)."""

from __future__ import annotations

import pytest

from gateway.traffic.capacity import EngineSample, ServiceModel


def feed(m: ServiceModel, seconds: float, waiting: float, running: float, rate: float,
         start: float = 0.0, finished0: float = 0.0, step: float = 0.5) -> float:
    """Scrapes every ``step`` s for ``seconds``: constant gauges, ``rate`` completions/s.
    Returns the counter's last value."""
    t, fin = start, finished0
    while t <= start + seconds + 1e-9:
        m.observe(EngineSample(t, waiting, running, fin))
        t += step
        fin += rate * step
    return fin - rate * step


def test_nothing_learned_predicts_no_wait():
    m = ServiceModel()
    assert m.concurrency is None and m.service_rate is None
    assert m.predicted_wait(waiting=10, running=4) == 0.0  # no evidence is no overload


def test_concurrency_is_the_running_plateau_while_requests_wait():
    m = ServiceModel()
    feed(m, 10, waiting=0, running=5, rate=2)
    assert m.concurrency == 5  # a lower bound: the most it was seen running
    feed(m, 10, waiting=16, running=16, rate=8, start=11, finished0=20)
    assert m.concurrency == pytest.approx(16)
    # max_num_seqs from the config wins over anything learned
    c = ServiceModel(configured=32)
    feed(c, 5, waiting=3, running=16, rate=8)
    assert c.concurrency == 32


def test_service_rate_is_littles_law_on_the_running_set():
    m = ServiceModel()
    # saturated: 16 running, 8 finished/s -> S = 16/8 = 2 s, mu = 16/2 = 8/s
    feed(m, 20, waiting=16, running=16, rate=8)
    assert m.service_s == pytest.approx(2.0, rel=0.02)
    assert m.service_rate == pytest.approx(8.0, rel=0.02)
    # 16 queued: 17th in line at 8/s
    assert m.predicted_wait(waiting=16, running=16) == pytest.approx(17 / 8, rel=0.02)
    assert m.predicted_wait(waiting=0, running=10) == 0.0  # no queue: it starts at once
    # no queue, whatever the batch: more running than ever seen is no wait (vLLM's own
    # bound may be far above what it ran)
    assert m.predicted_wait(waiting=0, running=40) == 0.0


def test_an_idle_spell_keeps_the_last_service_time():
    m = ServiceModel()
    fin = feed(m, 20, waiting=4, running=16, rate=8)
    # the load stops: the 4 queued and 16 running finish over the next 2.5 s, then idle
    fin = feed(m, 2.0, waiting=0, running=10, rate=8, start=20.5, finished0=fin + 4)
    feed(m, 60, waiting=0, running=0, rate=0, start=23, finished0=fin + 4)
    assert m.service_rate == pytest.approx(8.0, rel=0.05)


def test_a_restarted_server_starts_afresh_and_a_stuck_one_is_left_to_the_watchdog():
    m = ServiceModel()
    fin = feed(m, 10, waiting=0, running=4, rate=4)
    m.observe(EngineSample(11, 0, 0, 0.0))  # counter went down: a new process
    assert len(m._samples) == 1
    stuck = ServiceModel()
    feed(stuck, 20, waiting=5, running=4, rate=0, finished0=fin)
    assert stuck.predicted_wait(5, 4) == 0.0  # nothing learned: the liveness watchdog's


def test_a_passing_plateau_never_caps_what_it_just_ran():
    """One scrape with a queue during a ramp (3 running, 5 waiting) must not make 12
    running read as a queue: there is none."""
    m = ServiceModel()
    m.observe(EngineSample(0.0, 5, 3, 0.0))
    feed(m, 10, waiting=0, running=12, rate=6, start=0.5)
    assert m.concurrency == 12
    assert m.predicted_wait(waiting=0, running=12) == 0.0


def test_service_time_is_fitted_against_the_batch_and_read_at_the_ceiling():
    """A CPU-bound engine: S(n) = 0.1 + 0.02 n seconds. Seen only at batches 4-10, it is
    read at the learned concurrency 16 (0.42 s), not at the batches it ran (about
    0.24 s): its capacity is 16 / 0.42 = 38 req/s, not 16 / 0.24 = 67."""
    m = ServiceModel(window_s=5.0)
    t, fin = 0.0, 0.0
    for n in [4, 6, 8, 10, 5, 7, 9, 4, 10, 6] * 3:
        s_n = 0.1 + 0.02 * n
        for _ in range(20):  # 10 s at batch n: n / S(n) completions a second
            m.observe(EngineSample(t, 0, n, fin))
            t += 0.5
            fin += 0.5 * n / s_n
    m.observe(EngineSample(t, 3, 16, fin))  # one queue seen: concurrency 16
    assert m.concurrency == 16
    assert m.service_at(16) == pytest.approx(0.42, rel=0.1)
    assert m.capacity_rps == pytest.approx(16 / 0.42, rel=0.1)
    # a GPU-like engine (S flat in n) keeps its linear scaling
    g = ServiceModel(window_s=5.0)
    t, fin = 0.0, 0.0
    for n in [4, 6, 8, 10, 5, 7, 9, 4, 10, 6] * 3:
        for _ in range(20):
            g.observe(EngineSample(t, 0, n, fin))
            t += 0.5
            fin += 0.5 * n / 0.2
    g.observe(EngineSample(t, 3, 16, fin))
    assert g.capacity_rps == pytest.approx(16 / 0.2, rel=0.1)


def _engine(lam: float, service, c: int = 16, seconds: float = 300.0, seed: int = 1,
            dt: float = 0.01) -> ServiceModel:
    """A simulated engine scraped every 0.5 s: Poisson arrivals at ``lam`` per second, at
    most ``c`` running, each running request progressing at ``1 / service(n)`` of its work
    per second with ``n`` running (services shorter than a scrape interval, as vLLM's
    are on the recipe's tiny model)."""
    import random

    rnd = random.Random(seed)
    m = ServiceModel()
    running: list[float] = []
    waiting = finished = 0
    t, next_scrape = 0.0, 0.0
    while t < seconds:
        if rnd.random() < lam * dt:
            waiting += 1
        while waiting and len(running) < c:
            running.append(0.0)
            waiting -= 1
        if t >= next_scrape:  # vLLM's gauges are set right after its scheduler ran
            m.observe(EngineSample(t, waiting, len(running), finished))
            next_scrape += 0.5
        if running:
            step = dt / service(len(running))
            left = [p + step for p in running]
            finished += sum(1 for p in left if p >= 1)
            running = [p for p in left if p < 1]
        t += dt
    return m


@pytest.mark.parametrize(("name", "service", "load"), [
    ("cpu-like", lambda n: 0.1 + 0.02 * n, 0.6),
    ("cpu-like", lambda n: 0.1 + 0.02 * n, 0.9),
    ("gpu-like", lambda n: 0.2 + 0.001 * n, 0.6),
])
def test_capacity_estimate_errs_low_never_high(name, service, load):
    """Under Poisson load the capacity read from the scrapes may be low (a cycle deferred
    that could have run) but never high (a cycle run that costs capacity)."""
    true = 16 / service(16)
    m = _engine(load * true, service)
    assert m.concurrency == 16, name  # bursts filled it: the plateau is known
    est = m.capacity_rps
    assert est is not None and 0.6 * true <= est <= 1.05 * true, (name, load, est, true)
