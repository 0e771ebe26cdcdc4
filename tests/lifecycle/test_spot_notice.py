"""Spot interruption notices end to end (issue 15, item 2's must-hold): the real gateway under
uvicorn in front of simulated vLLM backends placed in zones, the ``openai`` SDK as client.

Zone a: spot ``a1`` on node n1, spot ``a2`` on node n2, on-demand ``a3``; zone b: spot ``b1``,
on-demand ``b2``. ``POST /admin/zones/a/notice {"node": "n1"}`` under steady load from four
client threads: a1 drains within the 30 s preemption deadline with no failed request and no
request sent after the notice reaches it; zone a's score halves, so a2 takes each request with
probability ``score / n`` = 0.5 / 4 (``gateway/routing/spot.py``), counted from a2's own
``/sim/stats`` over a fixed number of requests before and after."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.lifecycle.support import Sim, admin, metric, metric_samples, sdk, sdk_kwargs
from tests.support.scripted import wait_for
from tests.support.servers import GatewayThread, gateway_config

ITYPE = "g6.xlarge"
PLACES = {  # backend -> (zone, capacity type, node)
    "a1": ("a", "spot", "n1"),
    "a2": ("a", "spot", "n2"),
    "a3": ("a", "on-demand", "n3"),
    "b1": ("b", "spot", "n4"),
    "b2": ("b", "on-demand", "n5"),
}
N = 300  # requests counted per phase


def placed(urls: dict[str, str]) -> list[dict[str, Any]]:
    return [{"id": k, "url": u, "zone": PLACES[k][0], "capacity_type": PLACES[k][1],
             "node": PLACES[k][2], "instance_type": ITYPE} for k, u in urls.items()]


class SdkLoad:
    """Steady load through the gateway from ``threads`` openai SDK clients (every other one
    streaming), back to back; each request's ``x-request-id`` is ``<phase>-<thread>-<n>``
    (the phase when it was sent); ``done[phase]``: answered requests; ``failures``: what
    the client saw go wrong."""

    def __init__(self, url: str, threads: int = 4) -> None:
        self.phase = "warmup"
        self.done: dict[str, int] = {}
        self.failures: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(url, i), daemon=True)
                         for i in range(threads)]
        for t in self._threads:
            t.start()

    def _run(self, url: str, i: int) -> None:
        client = sdk(url)
        stream = i % 2 == 1
        n = 0
        while not self._stop.is_set():
            n += 1
            phase = self.phase
            rid = f"{phase}-{i}-{n}"
            try:
                kw = sdk_kwargs(max_tokens=4, stream=stream)
                res = client.chat.completions.create(**kw, extra_headers={"x-request-id": rid})
                if stream:
                    finished = [c.choices[0].finish_reason for c in res if c.choices]
                    assert finished and finished[-1] == "length", finished
                else:
                    assert res.choices[0].finish_reason == "length"
            except (openai.OpenAIError, AssertionError) as e:
                self.failures.append(f"{rid}: {type(e).__name__}: {e}")
                continue
            with self._lock:
                self.done[phase] = self.done.get(phase, 0) + 1

    def count(self, phase: str) -> int:
        with self._lock:
            return self.done.get(phase, 0)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=30)


def ids(sim: Sim, phase: str) -> set[str]:
    """The request ids of ``phase`` that reached ``sim`` (its own record)."""
    return {r["headers"].get("x-request-id", "") for r in sim.stats()["recent_requests"]
            if r["headers"].get("x-request-id", "").startswith(phase + "-")}


@pytest.fixture
def zoned(sims: Callable[..., Sim]) -> Iterator[tuple[GatewayThread, dict[str, Sim]]]:
    backends = {k: sims(k, itl_s=0.005) for k in PLACES}
    # a long half-life keeps zone a's score flat while the test counts
    cfg = gateway_config(placed({k: s.url for k, s in backends.items()}),
                         spot={"half_life_s": 1e6})
    gw = GatewayThread(cfg)
    gw.start(wait_ready=False)
    try:
        gw.wait_ready(timeout=30, routable=len(backends))
        yield gw, backends
    finally:
        gw.stop()


def test_a_notice_drains_the_node_without_failures_and_halves_the_zones_spot_share(
    zoned: tuple[GatewayThread, dict[str, Sim]],
) -> None:
    gw, sim = zoned
    load = SdkLoad(gw.url)
    try:
        load.phase = "before"
        assert wait_for(lambda: load.count("before") >= N, timeout=60), load.done
        r = httpx.post(gw.url + "/admin/zones/a/notice", json={"node": "n1"}, timeout=10)
        noticed = time.time()
        load.phase = "after"
        assert r.status_code == 202, r.text
        body = r.json()
        assert body["preempted"] == ["a1"] and body["on_node"] == ["a1"]
        assert (body["zone"], body["instance_type"], body["repeat"]) == ("a", ITYPE, False)
        assert body["score_before"] == 1.0 and body["score"] == pytest.approx(0.5, abs=1e-3)
        assert wait_for(lambda: load.count("after") >= N, timeout=60), load.done
        # a1 drained and left within the preemption deadline (30 s)
        a1 = admin(gw.url, "a1")
        assert a1["state"] == "cold" and a1["hold"] == "preempted", a1
        out = [t for t in a1["history"] if (t["from"], t["to"]) == ("draining", "cold")]
        assert out and out[-1]["at"] - noticed <= 30.0, a1["history"]
        # a repeat for the same node does nothing
        again = httpx.post(gw.url + "/admin/zones/a/notice", json={"node": "n1"}, timeout=10)
        assert again.status_code == 200 and again.json()["repeat"] is True, again.text
    finally:
        load.stop()
    assert load.failures == [], load.failures[:5]
    assert ids(sim["a1"], "after") == set()  # nothing sent after the notice reached a1
    before = len(ids(sim["a2"], "before")) / load.count("before")
    after = len(ids(sim["a2"], "after"))
    n = load.count("after")
    # each request after the notice: a2 with probability 0.5 / 4 (binomial: 4 sigma)
    p = 0.5 / 4
    assert abs(after - n * p) <= 4 * math.sqrt(n * p * (1 - p)), (after, n, before)
    assert before > 0.1, before  # at full score it had its part of 5 (about 1/5)
    zones = {z["zone"]: z for z in httpx.get(gw.url + "/admin/zones").json()["zones"]}
    assert zones["a"]["score"] == pytest.approx(0.5, abs=1e-3) and zones["b"]["score"] == 1.0
    assert [(b["id"], b["state"]) for b in zones["a"]["backends"]] == [
        ("a1", "cold"), ("a2", "warm"), ("a3", "warm")]
    m = metric_samples(gw.url)
    assert metric(m, "gateway_spot_interruptions_total", zone="a", instance_type=ITYPE) == 1.0
    assert metric(m, "gateway_spot_zone_score", zone="a") == pytest.approx(0.5, abs=1e-3)


def test_bad_notices_get_openai_shaped_errors_naming_the_field() -> None:
    # backends that never answer: the admin surface alone is under test
    cfg = gateway_config(placed({k: "http://127.0.0.1:9" for k in PLACES}),
                         auth={"admin_key": "adm"})
    gw = GatewayThread(cfg)
    gw.start(wait_ready=False)  # never ready: no backend answers
    try:
        def post(zone: str, body: Any = None, key: str | None = "adm", **kw: Any) -> Any:
            headers = {"authorization": f"Bearer {key}"} if key else {}
            return httpx.post(f"{gw.url}/admin/zones/{zone}/notice", json=body,
                              headers=headers, timeout=10, **kw)

        def error(r: httpx.Response, status: int) -> dict[str, Any]:
            assert r.status_code == status, r.text
            err: dict[str, Any] = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}, err
            return err

        assert error(post("a", key=None), 401)["code"] == "invalid_api_key"
        err = error(post("zz"), 404)
        assert (err["code"], err["param"]) == ("zone_not_found", "zone")
        assert "a, b" in err["message"]
        r = httpx.post(f"{gw.url}/admin/zones/a/notice", content=b"[1]",
                       headers={"authorization": "Bearer adm",
                                "content-type": "application/json"})
        assert error(r, 400)["code"] == "invalid_json"
        err = error(post("a", {"nod": "n1"}), 400)
        assert (err["code"], err["param"]) == ("unknown_field", "nod")
        for bad in ({"node": 5}, {"node": ""}, {"instance_type": ["x"]}, {"reason": "r" * 300}):
            err = error(post("a", bad), 400)
            assert (err["code"], err["param"]) == ("invalid_value", next(iter(bad))), bad
        err = error(post("a", {"node": "n4"}), 400)  # b1's node, in zone b
        assert err["param"] == "node" and "zone 'b'" in err["message"]
        assert error(httpx.get(gw.url + "/admin/zones"), 401)["code"] == "invalid_api_key"
        # a notice without a node: only the score drops, nothing is preempted
        r = post("b", {"reason": "rebalance recommendation"})
        assert r.status_code == 202, r.text
        body = r.json()
        assert body["preempted"] == [] and body["score"] == pytest.approx(0.5, abs=1e-3)
        assert body["instance_type"] is None and body["reason"] == "rebalance recommendation"
        assert all(b["hold"] is None for b in body["backends"])
        m = metric_samples(gw.url)
        assert metric(m, "gateway_spot_interruptions_total", zone="b",
                      instance_type="unknown") == 1.0
    finally:
        gw.stop()
