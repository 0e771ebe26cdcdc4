"""Issue 14's must-hold for faults of the shared store, through public behaviour only (the
openai SDK, ``/ready``, ``/admin/fleet``, ``/metrics`` and the simulators' own records): 3
replicas on one real Redis in front of 3 simulated backends, steady load through every
replica. Redis stopped for 20 s (3 s in the suite: tests/fleet/drills.py) under that load,
then started (empty, as a Redis without persistence restarts): no client request fails,
every backend keeps serving, each replica runs on its local share meanwhile and resumes
coordination by itself (store up, 3 replicas listed, a resync counted). Then the store
frozen (SIGSTOP: connections open, nothing answered) for a few seconds: no request fails
either."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.fleet.drills import drill_s
from tests.lifecycle.support import MODEL, sdk
from tests.support.scripted import wait_for

OUTAGE_S = drill_s(20.0, 3.0)
FREEZE_S = 3.0  # past a store call's whole allowance (2 x op_timeout_s, 1 s here): calls time out


@dataclass
class Load:
    """``per_replica`` client threads on each replica URL, each sending one request after
    the other (stream and non-stream in turn) with the SDK (no retries). Counts what was
    answered, per phase and replica, and keeps every failure."""

    urls: list[str]
    per_replica: int = 2
    phase: str = "before"
    ok: Counter[tuple[str, str]] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def _client(self, url: str, n: int) -> None:
        client = sdk(url)
        i = n
        while not self._stop.is_set():
            i += 1
            phase = self.phase
            try:
                if i % 2:
                    stream = client.chat.completions.create(
                        model=MODEL, messages=[{"role": "user", "content": f"s{i}"}],
                        max_tokens=6, stream=True, extra_body={"ignore_eos": True})
                    text = "".join(c.choices[0].delta.content or "" for c in stream
                                   if c.choices)
                else:
                    out = client.chat.completions.create(
                        model=MODEL, messages=[{"role": "user", "content": f"n{i}"}],
                        max_tokens=6, extra_body={"ignore_eos": True})
                    text = out.choices[0].message.content or ""
                if not text:
                    raise AssertionError("empty answer")
                self.ok[(phase, url)] += 1
            except Exception as e:  # every failure is the test's business
                self.failures.append(f"{phase} {url}: {type(e).__name__}: {e}")

    def start(self) -> None:
        for url in self.urls:
            for n in range(self.per_replica):
                t = threading.Thread(target=self._client, args=(url, n), daemon=True)
                t.start()
                self._threads.append(t)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)

    def in_phase(self, phase: str) -> dict[str, int]:
        return {u: self.ok[(phase, u)] for u in self.urls}


def fleet_view(url: str) -> dict:
    return httpx.get(url + "/admin/fleet", timeout=5).json()  # type: ignore[no-any-return]


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and not s.labels:
                return float(s.value)
    return 0.0


def all_replicas(urls: list[str], pred: Callable[[str], bool], timeout: float) -> bool:
    return wait_for(lambda: all(pred(u) for u in urls), timeout)


def test_store_outage_and_freeze_under_load_fail_no_request(redis_server, sims, replicas):
    backends = [sims(n) for n in ("A", "B", "C")]
    gws = replicas(3, {"a": backends[0].url, "b": backends[1].url, "c": backends[2].url},
                   coordination={"retry_interval_s": 0.3})  # a store back is tried soon
    urls = [g.url for g in gws]
    assert all_replicas(urls, lambda u: len(fleet_view(u)["replicas"]) == 3, 15)
    load = Load(urls)
    load.start()
    try:
        time.sleep(1)  # every client under way
        # ---- Redis stopped for OUTAGE_S under load-----------------------------------
        load.phase = "outage"
        served_before = [b.chat_requests() for b in backends]
        redis_server.stop()
        assert all_replicas(urls, lambda u: fleet_view(u)["store"]["fallback"], 10)
        for u in urls:  # still ready: a load balancer must keep sending requests here
            r = httpx.get(u + "/ready", timeout=5)
            assert r.status_code == 200 and r.json()["coordination"]["fallback"], r.text
        time.sleep(OUTAGE_S)
        served_outage = [b.chat_requests() - s for b, s in zip(backends, served_before,
                                                                strict=True)]
        # ---- started again (empty): coordination resumes by itself -------------------
        load.phase = "resync"
        redis_server.start()

        def resumed(u: str) -> bool:
            v = fleet_view(u)
            return v["store"]["up"] and len(v["replicas"]) == 3

        assert all_replicas(urls, resumed, 20), [fleet_view(u) for u in urls]
        assert all(metric(u, "gateway_coordination_resyncs_total") >= 1 for u in urls)
        time.sleep(1.0)  # load through the resync
        # ---- frozen store (SIGSTOP) for a few seconds --------------------------------
        load.phase = "frozen"
        redis_server.pause()
        try:
            time.sleep(FREEZE_S)
        finally:
            redis_server.resume()
        load.phase = "after"
        assert all_replicas(urls, resumed, 20), [fleet_view(u) for u in urls]
        time.sleep(1)
    finally:
        load.stop()
    assert load.failures == [], load.failures[:10]
    for phase in ("outage", "resync", "frozen", "after"):
        counts = load.in_phase(phase)
        assert all(n > 0 for n in counts.values()), (phase, counts)  # load through each
    assert all(n > 0 for n in served_outage), served_outage  # no backend out meanwhile
    for u in urls:  # no backend stuck out of rotation on any replica
        assert wait_for(lambda u=u: sorted(httpx.get(u + "/ready/fleet").json()["routable"])
                        == ["a", "b", "c"], 10), httpx.get(u + "/admin/backends").text
