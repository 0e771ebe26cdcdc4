"""Health and routing around backends that go away or refuse the gateway's key: a dead
backend stops getting traffic and in-window failures fail over (case BUG-19); sticky
sessions re-pin when their backend goes (case BUG-20); probes against authenticated
backends do not mark them down, and a wrong backend key is a loud configuration error
(case BUG-25)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.scripted import (
    Conn,
    Received,
    ScriptedBackend,
    completion_obj,
    default_script,
    wait_for,
)
from tests.support.servers import GatewayThread, gateway_config

BODY = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64}


def named(name: str, delay_s: float = 0.0):
    """Data-plane script answering with the backend's name as the content."""

    async def script(req: Received, conn: Conn) -> None:
        if delay_s and not await conn.sleep(delay_s):
            return
        await conn.send_json(200, completion_obj(name))

    return script


def metric_samples(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``GET /metrics`` as {(sample name, sorted labels): value}."""
    text = httpx.get(url + "/metrics", timeout=5).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def state_of(samples, backend: str) -> str | None:
    for (name, labels), v in samples.items():
        d = dict(labels)
        if name == "gateway_backend_state" and d.get("backend") == backend and v == 1:
            return d["state"]
    return None


def attempts_on(samples, backend: str) -> float:
    return sum(v for (name, labels), v in samples.items()
               if name == "gateway_upstream_attempts_total" and dict(labels)["backend"] == backend)


# ---- BUG-19 --------------------------------------------------------------------------------

def test_BUG_19_dead_backend_stops_getting_traffic(backends, gateway):
    """BUG-19, scaled from 60 s at 5 req/s (kill at 10 s, restart at 40 s) to ~10 s at
    ~10 req/s from two client threads (kill A at 2 s, restart at 6 s), with the test
    config's 0.2 s probe interval. Every client request is a 200 (requests that meet the dead
    A fail over to B, nothing had been sent to the client); A is marked unhealthy within the
    documented detection time (``fail_threshold`` probes, HealthConfig; plus scheduling
    slack) and no request picks it from then until it is back; after the restart it is warm
    again within the documented recovery (``recover_threshold`` probes + model discovery;
    plus slack) and serves traffic; ``/metrics`` showed A warm, then unhealthy, then warm
    again. No gateway restart."""
    a, b = backends(named("A", 0.02)), backends(named("B", 0.02))
    gw = gateway({"a": a, "b": b})
    h = gw.cfg.health
    # documented + one tick, plus slack for a loaded machine (probe rounds and the event loop
    # run late there); both stay well under the 4 s that A is down, then back
    detect_s = h.fail_threshold * h.interval_s + h.interval_s + 1.5
    recover_s = h.recover_threshold * h.interval_s + h.interval_s + 2.0
    clients = 2  # load threads, one request in flight each
    results: list[tuple[float, int, str]] = []
    samples: list[tuple[float, str | None, float]] = []
    stop = threading.Event()

    def load() -> None:
        with httpx.Client(timeout=10) as c:
            while not stop.is_set():
                t = time.monotonic()
                r = c.post(gw.url + "/v1/chat/completions", json=BODY)
                who = r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else ""
                results.append((t, r.status_code, who))
                time.sleep(max(0.0, 0.2 - (time.monotonic() - t)))

    def monitor() -> None:
        while not stop.is_set():
            s = metric_samples(gw.url)
            samples.append((time.monotonic(), state_of(s, "a"), attempts_on(s, "a")))
            time.sleep(0.05)

    threads = [threading.Thread(target=f) for f in (*[load] * clients, monitor)]
    for t in threads:
        t.start()
    try:
        time.sleep(2.0)
        killed_at, killed_wall = time.monotonic(), time.time()
        a.stop()
        time.sleep(4.0)
        a_seen_before_restart = len(a.requests)
        restarted_at, restarted_wall = time.monotonic(), time.time()
        a.restart()
        time.sleep(4.0)
    finally:
        stop.set()
        for t in threads:
            t.join(15)

    bad = [(round(t - killed_at, 2), s) for t, s, _ in results if s != 200]
    assert not bad, f"client errors while B was healthy: {bad}"
    assert len(results) >= 50  # ~100 on an idle machine (2 clients x 5 req/s x 10 s)
    history = [(t.at, t.from_state.value, t.to_state.value)
               for t in gw.gateway.fleet.get("a").history]
    down = [at for at, _, to in history if to == "unhealthy" and at >= killed_wall]
    assert down, history
    assert down[0] - killed_wall <= detect_s, (down[0] - killed_wall, history)
    back = [at for at, _, to in history if to == "warm" and at >= restarted_wall]
    assert back, history
    assert back[0] - restarted_wall <= recover_s, (back[0] - restarted_wall, history)

    # Metrics endpoint: A warm, then unhealthy, then warm; no attempt on A while it was down.
    states = [s for _, s, _ in samples]
    first_down = next(i for i, s in enumerate(states) if s == "unhealthy")
    back_up = next(i for i in range(first_down, len(states)) if states[i] == "warm")
    assert "warm" in states[:first_down]
    down_window = samples[first_down:back_up]
    # A request that picked A just before the probe marked it unhealthy is counted when its
    # attempt fails, possibly after the first "unhealthy" sample: at most one such request
    # per client (each has one in flight and tries a backend once). A router that kept
    # sending to the dead A would add ~5 attempts per second of the window.
    down_attempts = [att for _, _, att in down_window]
    assert max(down_attempts) - down_attempts[0] <= clients, (
        "attempts on A while it was unhealthy", down_attempts)
    # Requests sent between detection and the restart were all served by B.
    detected_at = samples[first_down][0]
    during = {who for t, _, who in results if detected_at < t < restarted_at}
    assert during == {"B"}, during
    # A serves again after the restart, once it is warm.
    assert len(a.data_requests) > 0 and len(a.requests) > a_seen_before_restart
    warm_again_at = restarted_at + (back[0] - restarted_wall)
    assert "A" in {who for t, _, who in results if t > warm_again_at}


# ---- BUG-20 --------------------------------------------------------------------------------

def session_call(url: str, header: str, session: str) -> str:
    r = httpx.post(url + "/v1/chat/completions", json=BODY, headers={header: session},
                   timeout=10)
    assert r.status_code == 200, (session, r.status_code, r.text)
    return r.json()["choices"][0]["message"]["content"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("when", ["at_once", "after_detection"])
def test_BUG_20_sticky_session_repins_when_backend_goes(backends, gateway, when):
    """BUG-20 repro with the configured session header (``X-Session-ID``): 3 requests of S1
    land on one backend X; X is killed; the next 3 S1 requests all get 200 from the other
    backend Y (``at_once``: sent while the gateway still believes X is up, so the first one
    fails over; ``after_detection``: X already marked unhealthy); X comes back and S1 stays on
    Y (no flapping). Stickiness is not dropped for everyone: a new session S2 also sticks to
    one backend."""
    bks = {"A": backends(named("A")), "B": backends(named("B"))}
    gw = gateway({"a": bks["A"], "b": bks["B"]})
    header = gw.cfg.routing.session_header
    assert header.lower() == "x-session-id"
    call = lambda s: session_call(gw.url, "X-Session-ID", s)  # noqa: E731

    httpx.post(gw.url + "/v1/chat/completions", json=BODY, timeout=10)  # move round-robin
    first = [call("S1") for _ in range(3)]
    assert len(set(first)) == 1, first
    x = first[0]
    y = "B" if x == "A" else "A"
    bks[x].stop()
    if when == "after_detection":
        assert wait_for(lambda: gw.gateway.fleet.get(x.lower()).state.value == "unhealthy", 5)
    assert [call("S1") for _ in range(3)] == [y, y, y]

    bks[x].restart()
    gw.wait_ready(timeout=10, routable=2)
    assert [call("S1") for _ in range(3)] == [y, y, y]  # no flapping back
    s2 = [call("S2") for _ in range(3)]
    assert len(set(s2)) == 1, s2


# ---- BUG-25 --------------------------------------------------------------------------------

BACKEND_KEY = "BACKEND_KEY-0123"
CLIENT_KEY = "CLIENT_KEY-4567"


class KeyedBackend:
    """A scripted vLLM started with ``--api-key``: every path needs the Bearer key except
    ``GET /health``; a refused request gets vLLM's 401 ``{"error": "Unauthorized"}``."""

    def __init__(self, name: str, key: str = BACKEND_KEY) -> None:
        self.name = name
        self.key = key
        self.refused: list[Received] = []
        self.sb = ScriptedBackend(self._data, control=self._control)

    async def _allowed(self, req: Received, conn: Conn) -> bool:
        if req.method == "GET" and req.path == "/health":
            return True
        if req.headers.get("authorization") == f"Bearer {self.key}":
            return True
        self.refused.append(req)
        await conn.send_json(401, {"error": "Unauthorized"})
        return False

    async def _control(self, req: Received, conn: Conn) -> None:
        if await self._allowed(req, conn):
            await default_script(req, conn)

    async def _data(self, req: Received, conn: Conn) -> None:
        if await self._allowed(req, conn):
            await conn.send_json(200, completion_obj(self.name))


@pytest.fixture
def keyed_fleet() -> Iterator[Callable[..., tuple[GatewayThread, KeyedBackend, KeyedBackend]]]:
    """Factory: A and B requiring BACKEND_KEY, and a gateway configured with ``api_key``
    for them (and CLIENT_KEY for its clients). Not waited on: the test decides."""
    made: list[Any] = []

    def make(gateway_key: str, **backend_extra: Any):
        a, b = KeyedBackend("A"), KeyedBackend("B")
        a.sb.start()
        b.sb.start()
        made.extend([a.sb, b.sb])
        cfg = gateway_config(
            [{"id": "a", "url": a.sb.url, "api_key": gateway_key, **backend_extra},
             {"id": "b", "url": b.sb.url, "api_key": gateway_key, **backend_extra}],
            auth={"client_keys": [{"name": "client", "key": CLIENT_KEY}]},
        )
        gw = GatewayThread(cfg)
        made.append(gw)
        gw.start(wait_ready=False)
        return gw, a, b

    yield make
    for thing in reversed(made):
        thing.stop()


def test_BUG_25_probes_keep_authenticated_backends_healthy(keyed_fleet):
    """BUG-25 repro, right key: A and B require the key on every path but ``GET /health``.
    Health checking runs for 3 s at the test's 0.2 s interval (15 probe and scrape rounds;
    scaled from 30 s): both stay warm throughout, every probe result is ok, no configuration
    error; every request they received except ``/health`` carried BACKEND_KEY, none ever
    carried the client's key, none was refused; a chat request (raw and SDK) is a 200."""
    gw, a, b = keyed_fleet(BACKEND_KEY)
    gw.wait_ready(timeout=10, routable=2)
    deadline = time.monotonic() + 3.0
    seen_states: set[str] = set()
    while time.monotonic() < deadline:
        seen_states |= {bk.state.value for bk in gw.gateway.fleet.backends}
        time.sleep(0.05)
    assert seen_states == {"warm"}
    r = httpx.post(gw.url + "/v1/chat/completions", json=BODY, timeout=10,
                   headers={"authorization": f"Bearer {CLIENT_KEY}"})
    assert r.status_code == 200, r.text
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=CLIENT_KEY, max_retries=0)
    assert client.chat.completions.create(**BODY).choices[0].message.content in ("A", "B")

    samples = metric_samples(gw.url)
    probes = {(dict(lb)["backend"], dict(lb)["result"]): v for (n, lb), v in samples.items()
              if n == "gateway_probe_results_total"}
    assert probes.get(("a", "ok"), 0) >= 10 and probes.get(("b", "ok"), 0) >= 10, probes
    assert {k for k in probes if k[1] != "ok"} == set(), probes
    assert not [k for k in samples if k[0] == "gateway_backend_config_errors_total"]
    admin = httpx.get(gw.url + "/admin/backends", timeout=5).json()["backends"]
    assert [bk["config_error"] for bk in admin] == [None, None]
    for bk in (a, b):
        assert not bk.refused, [(r.method, r.path) for r in bk.refused]
        guarded = [r for r in bk.sb.requests if r.path != "/health"]
        assert {r.path for r in guarded} >= {"/metrics", "/v1/models"}
        assert all(r.headers.get("authorization") == f"Bearer {BACKEND_KEY}" for r in guarded)
        assert not [r for r in bk.sb.requests if CLIENT_KEY in str(r.headers)]


@pytest.mark.parametrize("models_in_config", [False, True], ids=["discovered", "configured"])
def test_BUG_25_wrong_backend_key_is_a_loud_config_error(keyed_fleet, caplog, models_in_config):
    """BUG-25 variant, wrong backend key (with models discovered from ``/v1/models``, and
    with models listed in the config). The backends stay alive and are never marked
    unhealthy; the gateway shows a distinct signal: ``gateway_backend_config_errors_total``,
    ``config_error`` in ``GET /admin/backends``, an ERROR log naming the backend. A client's
    chat request is not blamed on the client (no 401/403) and is not a plain "no backend
    available" 503: its OpenAI-shaped error says the gateway's backend credentials are
    wrong."""
    caplog.set_level(logging.INFO)
    extra = {"models": ["m1"]} if models_in_config else {}
    gw, a, b = keyed_fleet("WRONG-KEY", **extra)
    fleet = gw.gateway.fleet
    assert wait_for(lambda: all(bk.config_error for bk in fleet.backends), 5)
    states: set[str] = set()
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        states |= {bk.state.value for bk in fleet.backends}
        time.sleep(0.05)
    assert "unhealthy" not in states, states

    samples = metric_samples(gw.url)
    for bid in ("a", "b"):
        assert samples.get(("gateway_backend_config_errors_total",
                            (("backend", bid), ("status", "401")))), samples
    admin = {bk["id"]: bk for bk in httpx.get(gw.url + "/admin/backends").json()["backends"]}
    assert admin["a"]["config_error"] and admin["b"]["config_error"]
    assert admin["a"]["state"] != "unhealthy" and admin["b"]["state"] != "unhealthy"
    loud = [rec for rec in caplog.records
            if rec.levelno >= logging.ERROR and " a " in f" {rec.getMessage()} "]
    assert loud, "no ERROR log names backend a"

    r = httpx.post(gw.url + "/v1/chat/completions", json=BODY, timeout=10,
                   headers={"authorization": f"Bearer {CLIENT_KEY}"})
    assert r.status_code not in (200, 401, 403), r.text  # the client's own key was right
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] != "no_backend_available", err
    assert any(w in err["message"].lower() for w in ("credential", "key", "configur")), err
    assert not [x for bk in (a, b) for x in bk.sb.requests if CLIENT_KEY in str(x.headers)]
