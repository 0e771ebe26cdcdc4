"""Maintenance cycles end to end: the medium cycle (drain -> prefix-cache reset -> rest ->
calibration -> slow-start return) started through ``POST /admin/backends/{id}/cooldown``,
calibration drift (-> ``unhealthy``, restart hook), the long cycle (drain -> restart hook ->
cold -> warming -> warm) and staggering (per model never more than ``max_unavailable`` out of
rotation, never the last warm backend), all through real HTTP with simulated backends."""

from __future__ import annotations

import itertools
import logging
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.lifecycle.support import (
    Background,
    Monitor,
    admin,
    chat_body,
    history,
    metric,
    metric_samples,
    out_intervals,
    post_admin,
    sdk,
    sdk_kwargs,
    stream_chat,
    wait_state,
)
from tests.support.scripted import Conn, Received, completion_obj, wait_for


def hook_command(path: Path) -> list[str]:
    """A restart hook command that appends ``<backend_id> <url>`` to ``path``."""
    code = "import sys; open(sys.argv[1], 'a').write(' '.join(sys.argv[2:]) + '\\n')"
    return [sys.executable, "-c", code, str(path), "{backend_id}", "{url}"]


def hook_lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def transitions(samples: dict[Any, float], backend: str) -> dict[tuple[str, str, str], float]:
    """``gateway_backend_transitions_total`` of one backend: {(from, to, reason): count}."""
    out = {}
    for (name, labels), v in samples.items():
        d = dict(labels)
        if name == "gateway_backend_transitions_total" and d["backend"] == backend:
            out[(d["from"], d["to"], d["reason"])] = v
    return out


PROMPT = " ".join(f"word{i}" for i in range(300))  # ~300 tokens: many full prefix blocks


def prefix_hits_after(sim_url: str) -> int:
    """Send PROMPT to the simulator directly; the prefix-cache hits (tokens) it got."""
    def hits() -> int:
        e = httpx.get(sim_url + "/sim/stats", timeout=5).json()["engine"]
        return int(e["prefix_cache_hits_total"])

    before = hits()
    r = httpx.post(sim_url + "/v1/completions", timeout=10,
                   json={"model": "m1", "prompt": PROMPT, "max_tokens": 1})
    assert r.status_code == 200, r.text
    return hits() - before


# ---- medium cycle ----------------------------------------------------------------------------

def test_medium_cycle_via_admin_cooldown(sims, lc_gateway, caplog):
    """``POST /admin/backends/a/cooldown`` with ``cooldown_s`` 0.6 while a stream is in flight
    on A. ``GET /admin/backends/a`` shows ``draining`` (in-flight 1), then ``cooldown``, then
    ``warm`` with a slow-start weight below 1; its history ends ``warm -> draining``
    (``cooldown_admin``), ``draining -> cooldown`` (``drained``), ``cooldown -> warm``
    (``cooldown_done``) with a rest of at least ``cooldown_s``. The stream finishes with
    ``[DONE]``; requests during the cycle go to B, and B may not start a cooldown while A is
    out (409: it is the last warm backend of m1). The simulator saw one ``POST
    /reset_prefix_cache`` and its prefix cache really is empty afterwards (a prompt cached
    before the cycle hits nothing, then hits again). Calibration after the rest scores 1.0:
    ``gateway_calibration_score{backend="a"}`` and ``calibration_score`` in the admin API.
    Every transition is logged with its reason; transitions, the cycle and the reset are
    counted in ``/metrics``."""
    caplog.set_level(logging.INFO, logger="gateway.fleet")
    a, b = sims("A", itl_s=0.05), sims("B", itl_s=0.05)
    gw = lc_gateway({"a": a.url, "b": b.url},
                    lifecycle={"medium": {"cooldown_s": 0.6}, "slow_start_s": 3.0},
                    calibration={"enabled": True, "max_tokens": 4})
    url = gw.url
    fp = {a.fingerprint: "A", b.fingerprint: "B"}
    assert prefix_hits_after(a.url) == 0  # first time: nothing cached
    assert prefix_hits_after(a.url) > 0  # the prefix cache works

    streams = []
    first: list[int] = []  # one entry per stream that has sent its first event
    while admin(url, "a")["in_flight"] == 0:  # least-loaded routing: one lands on A soon
        assert len(streams) < 6, "no stream landed on A"
        streams.append(Background(lambda: stream_chat(
            url, chat_body(30, stream=True), on_first_event=lambda: first.append(1))))
        assert wait_for(lambda: len(first) == len(streams), 10), "a stream did not start"
    monitor = Monitor(url)
    r = post_admin(url, "a", "cooldown")
    assert r.status_code == 202, r.text
    wait_state(url, "a", "cooldown", timeout=10)
    refused = post_admin(url, "b", "cooldown")
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "invalid_state"
    during = [fp[sdk(url).chat.completions.create(**sdk_kwargs(2)).system_fingerprint]
              for _ in range(3)]
    wait_state(url, "a", "warm", timeout=10)
    assert monitor.wait_latest(lambda x: x["a"]["state"] == "warm"), "no sample of A back"
    samples = monitor.stop()
    results = [s.result() for s in streams]

    assert during == ["B"] * 3
    for res in results:
        assert res.problem() is None and not res.errors and res.finish_reason == "length"
    seen = [(x["a"]["state"], x["a"]["in_flight"]) for _, x in samples]
    states = [s for s, _ in seen]
    collapsed = [k for k, _ in itertools.groupby(states)]
    assert collapsed[-3:] == ["draining", "cooldown", "warm"], collapsed
    assert any(s == "draining" and n >= 1 for s, n in seen), seen[:10]
    assert [n for s, n in seen if s == "cooldown" and n] == []  # rests only at in-flight 0
    rested = states.index("cooldown")
    back = next(x["a"] for _, x in samples[rested:] if x["a"]["state"] == "warm")
    assert back["slow_start_weight"] < 1.0, back  # slow-start return

    hist = admin(url, "a")["history"]
    tail = [(t["from"], t["to"], t["reason"]) for t in hist[-3:]]
    assert tail == [("warm", "draining", "cooldown_admin"), ("draining", "cooldown", "drained"),
                    ("cooldown", "warm", "cooldown_done")], tail
    assert hist[-1]["at"] - hist[-2]["at"] >= 0.6  # rested at least cooldown_s

    stats = a.stats()
    assert stats["requests_by_path"].get("/reset_prefix_cache") == 1, stats["requests_by_path"]
    assert prefix_hits_after(a.url) == 0  # the cycle emptied the prefix cache
    assert prefix_hits_after(a.url) > 0
    assert b.stats()["requests_by_path"].get("/reset_prefix_cache") is None

    logged = [r.getMessage() for r in caplog.records if r.name == "gateway.fleet"]
    for line in ("backend a: warm -> draining (cooldown_admin)",
                 "backend a: draining -> cooldown (drained)",
                 "backend a: cooldown -> warm (cooldown_done)"):
        assert line in logged, logged  # every transition logged with its reason

    m = metric_samples(url)
    assert metric(m, "gateway_calibration_score", backend="a") == 1.0
    assert admin(url, "a")["calibration_score"] == 1.0
    assert metric(m, "gateway_maintenance_cycles_total", backend="a", cycle="medium") == 1
    assert metric(m, "gateway_prefix_cache_resets_total", backend="a") == 1
    t = transitions(m, "a")
    assert t[("warm", "draining", "cooldown_admin")] == 1
    assert t[("draining", "cooldown", "drained")] == 1
    assert t[("cooldown", "warm", "cooldown_done")] == 1
    assert metric(m, "gateway_backend_state", backend="a", state="warm") == 1
    assert (metric(m, "gateway_drain_seconds_count") or 0) >= 1


# ---- calibration drift -----------------------------------------------------------------------

class Drifting:
    """A scripted vLLM whose completions answer one fixed text per prompt, until
    ``drift()``: then a different text (a corrupted weight load, a wrong model version).
    ``completions`` records the calibration prompts it was asked."""

    def __init__(self, backends) -> None:  # type: ignore[no-untyped-def]
        self.drifted = False
        self.completions: list[tuple[float, str, int | None]] = []
        self.chats = 0
        self.sb = backends(self._script)

    def drift(self) -> None:
        self.drifted = True

    async def _script(self, req: Received, conn: Conn) -> None:
        if req.path == "/v1/completions":
            body = req.json()
            self.completions.append((time.time(), body["prompt"], body.get("seed")))
            words = "one two three four" if not self.drifted else "zebra quantum violet nine"
            await conn.send_json(200, {
                "id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m1",
                "choices": [{"index": 0, "text": words, "logprobs": None,
                             "finish_reason": "length"}],
                "usage": {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}})
        elif req.path == "/reset_prefix_cache":
            await conn.send_json(200, {"success": True})
        else:
            self.chats += 1
            await conn.send_json(200, completion_obj("drifting-backend"))


def drift_gateway(backends, sims, lc_gateway, tmp_path):  # type: ignore[no-untyped-def]
    a = Drifting(backends)
    b = sims("B")
    hook = tmp_path / "restarts.txt"
    gw = lc_gateway({"a": a.sb.url, "b": b.url},
                    lifecycle={"medium": {"cooldown_s": 0.2},
                               "restart_hook": {"command": hook_command(hook)}},
                    calibration={"enabled": True, "max_tokens": 4})
    return gw, a, b, hook


def test_calibration_drift_marks_unhealthy_and_runs_restart_hook(backends, sims, lc_gateway,
                                                                  tmp_path):
    """A's baseline is its first answers once warm (calibration prompts at temperature 0 and
    the fixed seed). Then its answers change and an admin cooldown runs the medium cycle:
    after the rest the calibration scores below 0.95, so A goes ``unhealthy`` with reason
    ``calibration_drift`` (history and ``gateway_backend_transitions_total``), the score is
    exported (``gateway_calibration_score``), the error is shown in the admin API, and the
    configured restart hook ran once for A (a command writing ``a <url>`` to a file)."""
    gw, a, _b, hook = drift_gateway(backends, sims, lc_gateway, tmp_path)
    url = gw.url
    cfg = gw.cfg.calibration
    baseline = [(p, s) for _, p, s in a.completions]
    assert baseline == [(p, cfg.seed) for p in cfg.prompts], baseline
    assert hook_lines(hook) == []

    a.drift()
    assert post_admin(url, "a", "cooldown").status_code == 202
    assert wait_for(lambda: ("cooldown", "unhealthy", "calibration_drift") in history(url, "a"),
                    10), history(url, "a")
    assert wait_for(lambda: hook_lines(hook) == [f"a {a.sb.url}"], 5), hook_lines(hook)
    after = [(p, sd) for _, p, sd in a.completions[len(cfg.prompts):2 * len(cfg.prompts)]]
    assert after == [(p, cfg.seed) for p in cfg.prompts]  # the calibration after the rest

    # the hook wrote its line; it is counted once its process has exited
    assert wait_for(lambda: (metric(metric_samples(url), "gateway_restart_hooks_total",
                                    backend="a", result="ok") or 0) >= 1, 5)
    m = metric_samples(url)
    score = metric(m, "gateway_calibration_score", backend="a")
    assert score is not None and score < 0.95, score
    assert transitions(m, "a")[("cooldown", "unhealthy", "calibration_drift")] == 1
    info = admin(url, "a")
    assert info["calibration_score"] is not None and info["calibration_score"] < 0.95
    assert "calibration drift" in (info["last_error"] or ""), info


def test_drifted_backend_stays_out_until_calibration_passes(backends, sims, lc_gateway,
                                                            tmp_path):
    """After ``calibration_drift`` the backend still answers ``/health`` (drift is exactly
    the failure probes cannot see), and the restart hook ran but (as a real ``kubectl delete
    pod`` would for a few seconds) has not restarted it yet. It must not come back into
    rotation while its answers still drift: within 3 s (15 probe intervals, far past
    ``recover_threshold``) it is not ``warm`` and no client request reaches it."""
    gw, a, _b, _hook = drift_gateway(backends, sims, lc_gateway, tmp_path)
    url = gw.url
    a.drift()
    assert post_admin(url, "a", "cooldown").status_code == 202
    assert wait_for(lambda: ("cooldown", "unhealthy", "calibration_drift") in history(url, "a"),
                    10), history(url, "a")
    chats_before = a.chats
    client = sdk(url)
    states = set()
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:
        states.add(admin(url, "a")["state"])
        client.chat.completions.create(**sdk_kwargs(2))
        time.sleep(0.05)
    assert "warm" not in states, (states, history(url, "a"))
    assert a.chats == chats_before, "a drifted backend served client requests"


# ---- long cycle ------------------------------------------------------------------------------

def test_long_cycle_runs_restart_hook_then_cold_warming_warm(sims, lc_gateway, tmp_path):
    """Long cycle every 3 s (first due times spread: A at ~1.5 s, B at ~3 s), warm-up on,
    restart hook = a command writing ``<id> <url>`` to a file (it restarts nothing, so the
    backend is held out only for ``restart_hold_s``, here 0.5 s, instead of until a probe sees
    it go away). Each backend in turn: drain
    (``restart_scheduled``) -> hook -> ``cold`` (``restarted``) -> probe -> ``warming`` ->
    warm-up at batch shapes 1, 2, 4, 8 (15 more warm-up completions seen by its simulator) ->
    ``warm``. Never both out of rotation; client requests meanwhile all 200; hooks, cycles
    and cold starts counted."""
    a, b = sims("A"), sims("B")
    hook = tmp_path / "restarts.txt"
    gw = lc_gateway({"a": a.url, "b": b.url},
                    lifecycle={"long": {"every_s": 3.0}, "check_interval_s": 0.1,
                               "warmup_batch_shapes": [1, 2, 4, 8], "restart_hold_s": 0.5,
                               "restart_hook": {"command": hook_command(hook)}})
    url = gw.url
    start_wall = time.time()
    warmups = {s: s.stats()["requests_by_path"].get("/v1/completions", 0) for s in (a, b)}
    assert warmups[a] == warmups[b] == 15

    statuses: list[int] = []
    stop = threading.Event()

    def load() -> None:
        with httpx.Client(timeout=10) as c:
            while not stop.is_set():
                statuses.append(c.post(url + "/v1/chat/completions",
                                       json=chat_body(4)).status_code)
                time.sleep(0.05)

    t = threading.Thread(target=load, daemon=True)
    t.start()
    try:
        ok = wait_for(lambda: {ln.split()[0] for ln in hook_lines(hook)} >= {"a", "b"}, 8)
        assert ok, hook_lines(hook)
        wait_state(url, "a", "warm", timeout=5)
        wait_state(url, "b", "warm", timeout=5)
    finally:
        stop.set()
        t.join(10)

    assert f"a {a.url}" in hook_lines(hook) and f"b {b.url}" in hook_lines(hook)
    for name, sim in (("a", a), ("b", b)):
        h = history(url, name)
        i = h.index(("warm", "draining", "restart_scheduled"))
        assert h[i:i + 4] == [("warm", "draining", "restart_scheduled"),
                              ("draining", "cold", "restarted"),
                              ("cold", "warming", "probe_ok"),
                              ("warming", "warm", "ready")], h
        assert sim.stats()["requests_by_path"]["/v1/completions"] >= warmups[sim] + 15
    ia = [iv for iv in out_intervals(admin(url, "a")["history"], time.time())
          if iv[1] > start_wall]
    ib = [iv for iv in out_intervals(admin(url, "b")["history"], time.time())
          if iv[1] > start_wall]
    overlaps = [(x, y) for x in ia for y in ib if x[0] < y[1] and y[0] < x[1]]
    assert not overlaps, (ia, ib)
    assert statuses and set(statuses) == {200}, statuses
    m = metric_samples(url)
    for name in ("a", "b"):
        assert (metric(m, "gateway_restart_hooks_total", backend=name, result="ok") or 0) >= 1
        assert (metric(m, "gateway_maintenance_cycles_total", backend=name, cycle="long")
                or 0) >= 1
    starts = sum(v for (n, labels), v in m.items()
                 if n == "gateway_cold_start_seconds_count" and ("stage", "total") in labels)
    assert starts >= 4  # 2 at start + 2 restarts


# ---- staggering ------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [2, 3], ids=["2-backends", "3-backends"])
def test_staggered_cycles_never_two_out_never_zero_warm(sims, lc_gateway, n):
    """``n`` backends of m1 with medium and long cycles sped up the way ``demo --fast-cycles``
    has them (long period = 2 x medium period; first due times spread over each period), so
    that a long cycle of one backend and a medium cycle of another fall due at the same
    instant (A's long and B's medium both at ~2 s) - the fleet is not overloaded: each cycle
    (0.3 s rest, calibration, or restart and warm-up) is far shorter than the spacing of the
    due times. Short cycles every 0.5 s; a light steady load for 6 s. ``max_unavailable`` is
    max(1, 25% of n) = 1: ``GET /admin/backends`` (sampled every ~30 ms) never shows two
    backends out of rotation nor zero warm, and the transition histories show no two
    out-of-rotation windows overlapping. At least ``n`` medium cycles complete (each backend
    at least one), short cycles run, and every client request is a well-formed 200 (no error,
    no cut stream).

    The load runs at least 6 s and until the monitor has watched enough (more than 80
    samples, every backend seen out of rotation, more than 30 client requests, the medium
    cycles done): on a loaded machine that takes longer, rather than failing on a count
    reached in fixed wall time."""
    names = "abc"[:n]
    sim = {x: sims(x.upper()) for x in names}
    medium_every = float(n)  # first medium due at 1, 2(, 3) s; first long at 2, 4(, 6) s
    # max_num_seqs known: the gateway may plan with the backends' real capacity (a light
    # load never saturates them, so it could not learn it, and would defer the cycles)
    gw = lc_gateway({x: s.url for x, s in sim.items()}, backend={"max_num_seqs": 16},
                    lifecycle={"check_interval_s": 0.1, "slow_start_s": 0.5,
                               "short": {"every_s": 0.5},
                               "medium": {"every_s": medium_every, "cooldown_s": 0.3},
                               "long": {"every_s": 2 * medium_every}},
                    calibration={"enabled": True, "max_tokens": 2})
    url = gw.url
    start_wall = time.time()
    problems: list[str] = []
    count = [0]
    stop = threading.Event()

    def load(stream: bool) -> None:
        with httpx.Client(timeout=10) as c:
            while not stop.is_set():
                count[0] += 1
                if stream:
                    r = stream_chat(url, chat_body(8, stream=True))
                    if r.problem() or r.errors:
                        problems.append(f"stream: {r.problem()} {r.events[-2:]}")
                else:
                    resp = c.post(url + "/v1/chat/completions", json=chat_body(8))
                    if resp.status_code != 200 or not resp.json()["choices"]:
                        problems.append(f"{resp.status_code} {resp.text[:200]}")
                time.sleep(0.05)

    threads = [threading.Thread(target=load, args=(s,), daemon=True) for s in (True, False)]
    for th in threads:
        th.start()
    monitor = Monitor(url)
    t0 = time.monotonic()
    watched: dict[str, Any] = {}

    def watched_enough() -> bool:
        if time.monotonic() - t0 < 6.0 or len(monitor.samples) <= 80 or count[0] <= 30:
            return False
        seen_out = {k for _, x in list(monitor.samples) for k, v in x.items()
                    if v["state"] != "warm"}
        done = {x: history(url, x).count(("cooldown", "warm", "cooldown_done")) for x in names}
        watched.update(seen_out=sorted(seen_out), done=done)
        return seen_out == set(names) and sum(done.values()) >= n and min(done.values()) >= 1

    covered = wait_for(watched_enough, 60, interval=0.25)
    samples = monitor.stop()
    stop.set()
    for th in threads:
        th.join(10)
    assert covered, {"samples": len(samples), "requests": count[0], **watched}

    outs = [(t, sorted(k for k, v in x.items() if v["state"] != "warm")) for t, x in samples]
    end = time.time()
    iv = {x: [w for w in out_intervals(admin(url, x)["history"], end) if w[1] > start_wall]
          for x in names}
    overlaps = [(p, q, round(y[0] - start_wall, 3)) for p, q in itertools.combinations(names, 2)
                for x in iv[p] for y in iv[q] if x[0] < y[1] and y[0] < x[1]]
    violations = {
        "samples with two out": len([o for _, o in outs if len(o) > 1]),
        "samples with zero warm": len([o for _, o in outs if len(o) == n]),
        "overlapping out windows (pair, start s)": overlaps[:5],
        "client errors": problems[:3],
    }
    assert not any(violations.values()), violations
    done = {x: history(url, x).count(("cooldown", "warm", "cooldown_done")) for x in names}
    assert sum(done.values()) >= n and min(done.values()) >= 1, done
    m = metric_samples(url)
    shorts = sum(metric(m, "gateway_maintenance_cycles_total", backend=x, cycle="short") or 0
                 for x in names)
    assert shorts > 0


def test_fast_restart_is_seen_from_the_new_process_not_after_the_hold(sims, lc_gateway):
    """A restart hook (HTTP) that restarts the simulator before it returns: no probe ever
    fails, but the next scrape shows a new ``process_start_time_seconds``, so the backend
    leaves its restart hold at once and is warm again within seconds, not after
    ``restart_hold_s`` (120 s by default)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    a, b = sims("A"), sims("B")

    class Hook(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            a.kill()
            time.sleep(0.3)  # a restart that takes a moment
            a.restart()
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        gw = lc_gateway({"a": a.url, "b": b.url},
                        lifecycle={"check_interval_s": 0.1, "restart_hook": {
                            "url": f"http://127.0.0.1:{srv.server_address[1]}/restart"}})
        t0 = time.monotonic()
        assert gw.gateway.cfg.lifecycle.restart_hold_s == 120
        ctl = gw.gateway.controller
        a_rec = gw.gateway.fleet.get("a")
        # the start time the restart is told by: from a scrape before the hook runs
        assert wait_for(lambda: a_rec.load is not None
                        and a_rec.load.process_start_s is not None, timeout=10)
        gw.run(ctl.maintenance.long_cycle(a_rec, "test"))
        wait_state(gw.url, "a", "warm", timeout=15)
        assert time.monotonic() - t0 < 30
        assert ("draining", "cold", "restarted") in history(gw.url, "a")
    finally:
        srv.shutdown()
