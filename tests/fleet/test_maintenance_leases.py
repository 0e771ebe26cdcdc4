"""Maintenance is fleet-wide (issue 14, item 1; the lease half of item 7): one replica holds a
backend's maintenance lease for a whole cycle, every replica follows it, a dead holder's lease
is taken over and the cycle finished, and the store going away costs no request and leaves
no backend out. Real Redis, real HTTP, simulated vLLM servers that count for themselves
(their ``/is_sleeping`` and ``/sim/stats`` ``control`` records of ``/reset_prefix_cache``,
``/sleep`` and ``/wake_up``)."""

from __future__ import annotations

import itertools
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import redis
import yaml

from gateway.coord.lease_scripts import ACQUIRE, RELEASE, RENEW, TAKE_OVER
from gateway.fleet.cycles import CycleKind
from gateway.fleet.leases import StaggerGroup, may_take_out_fleet
from tests.fleet.drills import drill_s
from tests.lifecycle.support import MODEL, Sim, sdk
from tests.support.scripted import wait_for
from tests.support.servers import GatewayThread
from tests.support.vllm import free_port

OUT = ("draining", "cooldown")
FAST_SYNC = {"sync_interval_s": 0.1, "lease_ttl_s": 3.0}


def sleeping(sim: Sim) -> bool:
    """What the simulator itself says: is vLLM asleep?"""
    return bool(httpx.get(sim.url + "/is_sleeping", timeout=5).json()["is_sleeping"])


def asleep_now(sim: Sim) -> bool:
    """The simulator's own sleep record, read in-process (the sampler's cheap read: what
    ``/is_sleeping`` answers, without an HTTP round trip on a loaded machine)."""
    return sim.server.state.sleep_level > 0


def sleep_intervals(sim: Sim) -> list[tuple[float, float]]:
    """(``/sleep``, next ``/wake_up``) unix times from the simulator's own call records."""
    out: list[tuple[float, float]] = []
    start: float | None = None
    for c in sim.stats()["control_calls"]:
        if c["path"] == "/sleep":
            start = c["at"]
        elif c["path"] == "/wake_up" and start is not None:
            out.append((start, c["at"]))
            start = None
    return out


def control(sim: Sim) -> dict[str, int]:
    """The dev-mode calls the simulator received, by path."""
    return {k: int(v) for k, v in sim.stats()["control"].items()}


def state_of(gw: GatewayThread, backend: str) -> str:
    b = gw.gateway.fleet.get(backend)
    assert b is not None
    return b.state.value


def chat(gw: GatewayThread) -> str:
    """One small chat through ``gw``; the answering backend's fingerprint."""
    out = sdk(gw.url).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert out.choices[0].message.content
    return out.system_fingerprint or ""


def medium_cycles(gw: GatewayThread, backend: str) -> int:
    """Medium cycles ``gw`` started on ``backend`` (its own metric)."""
    c = gw.gateway.metrics.cycles.labels(backend, "medium")
    return int(c._value.get())


# ---- 3 replicas, 3 backends, fast cycles, 2 minutes of load (10 s in the suite) -------------

LOAD_S = drill_s(120.0, 10.0)
# two cycles or more per backend in the load (in the suite's 10 s: cycles back to back, the
# backends' second ones included, about 5 in all)
MEDIUM_EVERY_S = 15.0 if LOAD_S >= 60 else 4.0

def test_three_replicas_under_load_take_one_backend_out_at_a_time_and_reset_it_once_per_cycle(
        redis_server, sims, replicas):
    names = ("a", "b", "c")
    backends = {n: sims(n.upper()) for n in names}
    lifecycle = {
        "max_unavailable": 1,
        "check_interval_s": 0.25,
        "drain_deadline_s": 5,
        "carry_utilization": 1.0,
        "medium": {"every_s": MEDIUM_EVERY_S, "every_requests": 0, "cooldown_s": 1.5,
                   "sleep": True},
    }
    # the default lease TTL (10 s): three gateways, three simulators and six clients share
    # one process here, and a shorter TTL can run out while a holder's loop waits its turn
    reps = replicas(3, {n: s.url for n, s in backends.items()}, lifecycle=lifecycle,
                    coordination={"sync_interval_s": 0.1})
    stop = threading.Event()
    failures: list[str] = []
    served = [0]
    samples: list[tuple[float, int]] = []  # (time, sleeping backends)

    def client(i: int) -> None:
        k = i
        while not stop.is_set():
            gw = reps[k % len(reps)]
            k += 1
            try:
                chat(gw)
                served[0] += 1
            except Exception as e:  # every failure a client sees counts
                failures.append(f"{gw.cfg.coordination.replica_id}: {type(e).__name__}: {e}")

    def sampler() -> None:
        while not stop.is_set():
            t = time.monotonic()
            samples.append((t, sum(asleep_now(s) for s in backends.values())))
            stop.wait(max(0.0, 0.1 - (time.monotonic() - t)))

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(6)]
    threads.append(threading.Thread(target=sampler, daemon=True))
    for t in threads:
        t.start()
    time.sleep(LOAD_S)
    stop.set()
    for t in threads:
        t.join(30)
    # no new cycle from here on (a test's hand on each replica's schedule), and the cycle
    # under way finishes, so every sleep has its wake-up
    for gw in reps:
        gw.run(_no_more_cycles(gw))

    def settled() -> bool:
        calls = [control(sim) for sim in backends.values()]
        return (
            not any(sleeping(sim) for sim in backends.values())
            and all(c.get("/sleep", 0) <= c.get("/wake_up", 0) for c in calls)
            and all(state_of(gw, n) == "warm" for gw in reps for n in names)
        )

    assert wait_for(settled, 30, interval=0.2)

    assert failures == [], failures[:5]
    assert served[0] > 200 * LOAD_S / 120
    assert len(samples) > 5 * LOAD_S  # sampled every 100 ms over the load (a loaded machine
    # stretches the sampler's turns)
    assert max(n for _, n in samples) <= 1, "more than max_unavailable asleep at once"
    assert min(len(names) - n for _, n in samples) >= 1
    # and exactly, between samples: no two backends' sleeps overlap in their own records
    spans = sorted(iv for sim in backends.values() for iv in sleep_intervals(sim))
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert start >= end, spans
    handovers = sum(gw.gateway.metrics.lease_handovers.labels(n)._value.get()
                    for gw in reps for n in names)
    print(f"{served[0]} requests, 0 failed, {handovers:g} handovers; {len(samples)} samples, "
          f"at most "
          f"{max(n for _, n in samples)} asleep; medium cycles per backend: "
          f"{ {n: sum(medium_cycles(gw, n) for gw in reps) for n in names} }; "
          f"resets: { {n: control(s).get('/reset_prefix_cache', 0) for n, s in backends.items()} }")
    for n, sim in backends.items():
        calls = control(sim)
        cycles = sum(medium_cycles(gw, n) for gw in reps)
        # each cycle: exactly one reset, at most one sleep and its wake-up, on one backend,
        # from one replica. (A cycle skips its sleep when the store did not take the record
        # of it in time: on this loaded machine a call can outlast op_timeout_s. A holder
        # whose loop was held up past its lease's TTL hands the cycle over, and the new
        # holder may wake it once more.)
        handed = sum(gw.gateway.metrics.lease_handovers.labels(n)._value.get() for gw in reps)
        sleeps = calls.get("/sleep", 0)
        assert calls.get("/reset_prefix_cache", 0) == cycles, (n, calls, cycles)
        assert cycles - 2 <= sleeps <= cycles, (n, calls, cycles)
        assert sleeps <= calls.get("/wake_up", 0) <= sleeps + handed, (n, calls, cycles)
        assert all(c["ok"] for c in sim.stats()["control_calls"]), sim.stats()["control_calls"]
        # once per period fleet-wide (MEDIUM_EVERY_S over the load and the settling): not
        # once per replica per period (3 x as many)
        assert 1 <= cycles <= math.ceil((LOAD_S + 5) / MEDIUM_EVERY_S) + 2, (n, cycles)


async def _no_more_cycles(gw: GatewayThread) -> None:
    for b in gw.gateway.fleet:
        b.cycles.next_medium = b.cycles.next_short = b.cycles.next_long = math.inf


# ---- the long cycle: the restart hook once for the fleet ---------------------------------------

LONG_EVERY_S = 4.0  # backend a's first cycle due after 2 s, b's after 4 s (spread over it)

def test_a_long_cycle_runs_its_restart_hook_once_for_the_fleet_and_every_replica_follows(
        redis_server, sims, replicas, tmp_path):
    a, b = sims("A"), sims("B")
    hook = tmp_path / "hook.txt"
    lifecycle = {
        "max_unavailable": 1, "drain_deadline_s": 3, "restart_hold_s": 1.5,
        "check_interval_s": 0.25, "long": {"every_s": LONG_EVERY_S},
        "medium": {"every_s": 0, "every_requests": 0},
        "restart_hook": {"command": ["sh", "-c", f"echo {{backend_id}} $(date +%s.%N) >> {hook}"]},
    }
    reps = replicas(2, {"a": a.url, "b": b.url}, lifecycle=lifecycle, coordination=FAST_SYNC)

    def runs() -> list[tuple[str, float]]:  # (backend, unix time) of each hook run
        text = hook.read_text() if hook.exists() else ""
        return [(ln.split()[0], float(ln.split()[1])) for ln in text.splitlines() if ln.strip()]

    def lines() -> list[str]:
        return [n for n, _ in runs()]

    assert wait_for(lambda: {"a", "b"} <= set(lines()), 40), lines()
    for gw in reps:
        gw.run(_no_more_cycles(gw))
    assert wait_for(lambda: all(state_of(gw, n) == "warm" for gw in reps for n in "ab"), 30)
    for n in "ab":
        started = sum(gw.gateway.metrics.cycles.labels(n, "long")._value.get() for gw in reps)
        assert lines().count(n) == started, (n, lines(), started)  # once per cycle, not per replica
        times = [t for m, t in runs() if m == n]
        assert all(t2 - t1 >= 0.9 * LONG_EVERY_S for t1, t2 in itertools.pairwise(times)), times
        followed = sum(
            gw.gateway.metrics.transitions.labels(n, frm, "cold", "fleet_restarted")._value.get()
            for gw in reps for frm in ("draining", "cooldown"))
        assert followed == started  # the other replica took it out and held it too


# ---- a holder SIGKILLed mid-cycle ---------------------------------------------------------------

def _serve_subprocess(tmp_path: Path, cfg: dict[str, Any]) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cfg = {**cfg, "server": {**cfg.get("server", {}), "host": "127.0.0.1", "port": port}}
    path = tmp_path / "replica.yaml"
    path.write_text(yaml.safe_dump(cfg))
    log = open(tmp_path / "replica.log", "wb")  # kept open for the child
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "-c", str(path)],
        stdout=log, stderr=subprocess.STDOUT, cwd=Path(__file__).resolve().parents[2],
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        try:
            r = httpx.get(url + "/ready/fleet", timeout=1)
            return r.status_code == 200 and len(r.json()["routable"]) >= len(cfg["backends"])
        except httpx.HTTPError:
            return False

    if not wait_for(ready, 30):
        proc.kill()
        raise AssertionError((tmp_path / "replica.log").read_text()[-3000:])
    return proc, url


def test_a_holder_killed_mid_cycle_leaves_the_backend_back_in_rotation_within_ttl_plus_rest(
        redis_server, sims, replicas, tmp_path):
    a, b, c = sims("A"), sims("B"), sims("C")
    urls = {"a": a.url, "b": b.url, "c": c.url}
    ttl, rest = 3.0, 3.0
    lifecycle = {"max_unavailable": 1, "drain_deadline_s": 5,
                 "medium": {"every_s": 0, "every_requests": 0, "cooldown_s": rest, "sleep": True}}
    r1, r2 = replicas(2, urls, lifecycle=lifecycle, coordination=FAST_SYNC)
    base = r1.cfg.model_dump(mode="json", exclude_none=True)
    base["coordination"] = {**base["coordination"], "replica_id": "doomed"}
    proc, url = _serve_subprocess(tmp_path, base)
    try:
        assert wait_for(lambda: "doomed" in r1.gateway.coord.replicas.ids(), 10)
        r = httpx.post(url + "/admin/backends/a/cooldown", json={}, timeout=5)
        assert r.status_code == 202, r.text
        assert wait_for(lambda: sleeping(a), 10), "the holder never put A to sleep"
        # the others follow the holder's lease: A is out of rotation on them too
        assert state_of(r1, "a") in OUT and state_of(r2, "a") in OUT
        os.kill(proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    fp_a = a.fingerprint

    def served_by_a() -> bool:
        if sleeping(a):
            return False
        return any(chat(gw) == fp_a for gw in (r1, r2) for _ in range(4))

    assert wait_for(served_by_a, ttl + rest + 10, interval=0.1)
    back_after = time.monotonic() - killed
    print(f"holder killed: A back in rotation after {back_after:.2f} s (bound {ttl + rest:g} s)")
    assert back_after <= ttl + rest + 1.5, back_after  # the bound, with one round of margin
    handovers = sum(
        gw.gateway.metrics.lease_handovers.labels("a")._value.get() for gw in (r1, r2))
    assert handovers == 1
    calls = control(a)
    assert calls == {"/reset_prefix_cache": 1, "/sleep": 1, "/wake_up": 1}, calls
    assert state_of(r1, "a") == "warm" and state_of(r2, "a") == "warm"


# ---- the store restarted mid-cycle, then down --------------------------------------------------

REST_S = 4.0  # the cooldown's rest: long enough to restart the store within it

def test_store_restarted_mid_cycle_gets_the_lease_back_and_a_stopped_store_leaves_nothing_out(
        redis_server, sims, replicas):
    a, b = sims("A"), sims("B")
    lifecycle = {"max_unavailable": 1, "drain_deadline_s": 5,
                 "medium": {"every_s": 0, "every_requests": 0, "cooldown_s": REST_S}}
    r1, r2 = replicas(2, {"a": a.url, "b": b.url}, lifecycle=lifecycle, coordination=FAST_SYNC)
    store = redis.Redis.from_url(redis_server.url, decode_responses=True)
    cycle_key = "llm-gateway:maint:cycle:a"

    # a cooldown on r1: r2 follows within a second
    assert httpx.post(r1.url + "/admin/backends/a/cooldown", json={}).status_code == 202
    assert wait_for(lambda: state_of(r2, "a") in OUT, 1.0, interval=0.02)
    assert wait_for(lambda: state_of(r2, "a") == "cooldown", 5)
    assert r1.gateway.coord.leases.snapshot()[0]["holder"] == "r1"

    # the store restarts empty: the holder writes its lease back, the follower keeps A out
    redis_server.stop()
    redis_server.start()
    assert wait_for(lambda: store.hget(cycle_key, "holder") == "r1", 5), "lease not written back"
    assert store.hget(cycle_key, "phase") == "cooldown"
    assert state_of(r2, "a") == "cooldown"
    # the cycle ends on r1 and r2 follows it back
    assert wait_for(lambda: state_of(r1, "a") == "warm" and state_of(r2, "a") == "warm", 10)

    # now a cycle with the store stopped mid-way: the follower returns A once the lease it
    # saw ran out (its rest's end here), the holder finishes; no new lease meanwhile
    assert httpx.post(r2.url + "/admin/backends/b/cooldown", json={}).status_code == 202
    assert wait_for(lambda: state_of(r1, "b") == "cooldown", 5)
    redis_server.stop()
    stopped = time.monotonic()
    backend_a = r1.gateway.fleet.get("a")
    leases = r1.gateway.coord.leases
    assert r1.run(leases.acquire(backend_a, CycleKind.MEDIUM, "test", None)) is None
    for gw in (r1, r2):
        assert chat(gw)  # requests keep flowing
    assert wait_for(lambda: state_of(r1, "b") == "warm" and state_of(r2, "b") == "warm", 12)
    assert time.monotonic() - stopped <= REST_S + 3 + 2
    assert r1.gateway.coord.leases.held == {}
    # the store back: coordination resumes by itself (a new lease is taken and followed)
    redis_server.start()
    assert wait_for(lambda: r1.gateway.coord.link.up and r2.gateway.coord.link.up, 5)
    assert httpx.post(r1.url + "/admin/backends/a/cooldown", json={}).status_code == 202
    assert wait_for(lambda: state_of(r2, "a") == "cooldown", 5)
    assert wait_for(lambda: state_of(r2, "a") == "warm", 12)


# ---- the scripts themselves ---------------------------------------------------------------------

def test_the_lease_scripts_refuse_a_second_holder_a_stagger_breach_and_a_repeated_start(
        redis_server):
    r = redis.Redis.from_url(redis_server.url, decode_responses=True)
    acquire, release = r.register_script(ACQUIRE), r.register_script(RELEASE)
    renew, take_over = r.register_script(RENEW), r.register_script(TAKE_OVER)
    peers = ["a", "b", "c"]

    def ask(backend: str, holder: str, cycle: str = "medium", known: int = 0) -> list[Any]:
        others = [p for p in peers if p != backend]
        args = {"backend": backend, "holder": holder, "cycle": cycle, "reason": "t",
                "phase": "draining" if cycle != "short" else "probing", "ttl_ms": 3000,
                "takes_out": 0 if cycle == "short" else 1, "force": 0, "known_start_ms": known,
                "drain_ms": 5000, "peer_ids": others,
                "groups": [{"model": "m", "peers": peers, "limit": 1, "out": []}]}
        keys = [f"t:maint:lease:{backend}", f"t:maint:cycle:{backend}",
                *(f"t:maint:cycle:{p}" for p in others)]
        return acquire(keys, [json.dumps(args)])  # type: ignore[no-any-return]

    def leased() -> set[str]:
        return {p for p in peers if r.hget(f"t:maint:cycle:{p}", "open") == "1"}

    token, started = ask("a", "r1")
    assert int(token) == 1
    assert ask("a", "r2")[0] == 0  # r1 holds it
    groups = [StaggerGroup("m", tuple(peers), 1, ())]
    assert ask("b", "r2")[0] == 0 and not may_take_out_fleet("b", groups, leased())
    assert int(ask("c", "r2", cycle="short")[0]) == 1  # an engine probe takes nothing out
    assert release(["t:maint:lease:c", "t:maint:cycle:c"], ["r2", "1"]) == 1
    assert release(["t:maint:lease:a", "t:maint:cycle:a"], ["r1", "1"]) == 1
    assert r.exists("t:maint:lease:a") == 0
    # a started at `started`: a replica that has not booked that start is refused
    assert ask("a", "r2")[0] == 0 and "started by r1" in ask("a", "r2")[1]
    assert int(ask("b", "r2")[0]) == 1 and may_take_out_fleet("b", groups, leased() - {"b"})
    release(["t:maint:lease:b", "t:maint:cycle:b"], ["r2", "1"])
    # booked: allowed again (the next period)
    assert int(ask("a", "r3", known=int(started))[0]) == 2
    # r3 dies: its lease expires, the record stays open; r1 takes it over at the token it read
    r.delete("t:maint:lease:a")
    assert take_over(["t:maint:lease:a", "t:maint:cycle:a"], ["r1", "3000", "1"]) is None
    got = take_over(["t:maint:lease:a", "t:maint:cycle:a"], ["r1", "3000", "2"])
    assert int(got[0]) == 3 and r.get("t:maint:lease:a") == "r1"
    fields = json.dumps({"cycle": "medium", "reason": "t", "phase": "cooldown", "takes_out": 1,
                         "drain_in_ms": -1, "rest_in_ms": 1000, "slept": "1", "reset_done": "1"})
    # the old holder's renewal is refused (it stops its side effects); the new one's passes
    assert renew(["t:maint:lease:a", "t:maint:cycle:a"], ["r3", "2", "3000", fields]) == 0
    assert renew(["t:maint:lease:a", "t:maint:cycle:a"], ["r1", "3", "3000", fields]) == 1
    # the store emptied (a restart): the holder's renewal writes the record back
    r.flushall()
    assert renew(["t:maint:lease:a", "t:maint:cycle:a"], ["r1", "3", "3000", fields]) == 1
    assert r.hget("t:maint:cycle:a", "phase") == "cooldown" and r.get("t:maint:lease:a") == "r1"
