"""Maintenance that costs no capacity the load needs (issue 11): a due medium cycle does not
take a backend out while the other could not carry the load; it is deferred (counted in
``gateway_maintenance_deferrals_total``, shown in ``/admin/backends``) and runs at the next
quiet moment. Two simulated vLLMs of 4 sequences each, the gateway over HTTP, a closed loop
of clients through the ``openai`` SDK."""

from __future__ import annotations

import threading
import time

import openai

from tests.lifecycle.support import admin, metric, metric_samples, sdk, sdk_kwargs
from tests.support.scripted import wait_for


def test_a_busy_fleet_defers_its_medium_cycles_then_runs_them_when_quiet(sims, lc_gateway):
    a, b = sims("a", itl_s=0.02, max_num_seqs=4), sims("b", itl_s=0.02, max_num_seqs=4)
    gw = lc_gateway(
        {"a": a.url, "b": b.url},
        # every 6 s (due 3 and 6 s after the start): a shorter loaded phase also lets the
        # completion rate (a 15 s window) fall sooner once the load stops
        lifecycle={"medium": {"every_s": 6, "every_requests": 0, "cooldown_s": 0.5}},
    )
    stop = threading.Event()
    errors: list[BaseException] = []

    def client() -> None:  # 12 clients on 8 sequences: both backends saturated
        c = sdk(gw.url)
        while not stop.is_set():
            try:
                c.chat.completions.create(**sdk_kwargs(max_tokens=10))
            except openai.APIError as e:
                errors.append(e)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(12)]
    for t in threads:
        t.start()
    def ran() -> float:
        s = metric_samples(gw.url)
        return sum(metric(s, "gateway_maintenance_cycles_total", backend=n, cycle="medium")
                   or 0 for n in ("a", "b"))

    try:
        # the gateway learns each backend's concurrency (4) from the running plateau
        learned = wait_for(lambda: all(x["capacity"]["concurrency"] == 4
                                       and x["capacity"]["service_rate_rps"]
                                       for x in admin(gw.url)), 15)
        assert learned, admin(gw.url)
        before = ran()
        # medium cycles come due 3 and 6 s after the start; under this load none may run
        deferred = wait_for(lambda: any(x["deferred"] for x in admin(gw.url)), 15)
        assert deferred, admin(gw.url)
        time.sleep(3)
        view = admin(gw.url)
        assert [x["state"] for x in view] == ["warm", "warm"], view
        d = next(x["deferred"] for x in view if x["deferred"])
        assert d["cycle"] == "medium" and "req/s" in d["reason"], d
        assert all(x["capacity"]["service_rate_rps"] for x in view), view
        s = metric_samples(gw.url)
        total = sum(metric(s, "gateway_maintenance_deferrals_total", backend=n,
                           cycle="medium", outcome="deferred") or 0 for n in ("a", "b"))
        assert total >= 1
        assert ran() == before, "a cycle took a backend out under load"
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert not errors, errors[:3]
    # quiet now: the deferred cycles run (one backend at a time) and both return
    both = wait_for(lambda: all(
        metric(metric_samples(gw.url), "gateway_maintenance_cycles_total", backend=n,
               cycle="medium") for n in ("a", "b")), 40, interval=0.2)
    assert both, admin(gw.url)
    s = metric_samples(gw.url)
    assert (metric(s, "gateway_maintenance_deferral_seconds_count") or 0) >= 1
