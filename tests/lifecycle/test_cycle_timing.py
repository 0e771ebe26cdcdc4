"""When maintenance cycles may run, as an operator meets it through real HTTP (the gateway
under uvicorn in front of simulated vLLM servers):

* a backend a reload adds (here ``a2b``, at stagger slot 0, the slot that used to come due
  1/1024 of a period after joining) is not cycled within the first period of joining, and
  is cycled once that period is over (the schedule still runs);
* a backend back from a long cycle's restart is not cycled again within a period of its
  return (its next long cycle used to come due one period after the cycle *started*);
* while a canary rollout runs, its only canary backend is not taken out for a due medium
  cycle: the cycle is deferred (counted, and shown with its reason in ``/admin/backends``),
  no request falls back to the baseline, and the cycle runs once the rollout ends.
"""

from __future__ import annotations

import sys
import time
import zlib
from pathlib import Path
from typing import Any

import httpx
import openai
import yaml

from tests.lifecycle.support import admin, history, metric, metric_samples, wait_state
from tests.support.rollout_traffic import FAST_STEPS, MODEL, Servers, config
from tests.support.scripted import wait_for
from tests.support.servers import GatewayThread

CYCLES = "gateway_maintenance_cycles_total"
PERIOD_S = 4.0  # lifecycle.medium.every_s in these tests


def _medium_cycles(url: str, backend: str) -> float:
    return metric(metric_samples(url), CYCLES, backend=backend, cycle="medium") or 0.0


def _taken_out(url: str, backend: str) -> bool:
    return any(to == "draining" for _, to, _ in history(url, backend))


def _reload(gw: GatewayThread, backends: list[dict[str, Any]]) -> None:
    data = gw.gateway.cfg.model_dump(mode="json")
    data["backends"] = backends
    r = httpx.post(gw.url + "/admin/config", content=yaml.safe_dump(data), timeout=10,
                   headers={"content-type": "application/yaml"})
    assert r.status_code == 200, r.text


def test_a_backend_a_reload_adds_is_not_cycled_within_its_first_period(sims, lc_gateway):
    assert zlib.crc32(b"a2b") % 1024 == 0  # the first stagger slot
    a, new = sims("a"), sims("a2b")
    lifecycle = {"medium": {"every_s": PERIOD_S, "every_requests": 0, "cooldown_s": 0.2}}
    gw = lc_gateway({"a": a.url}, lifecycle=lifecycle)
    joined = time.monotonic()
    _reload(gw, [{"id": "a", "url": a.url}, {"id": "a2b", "url": new.url}])
    wait_state(gw.url, "a2b", "warm", timeout=10)
    # within the first period after joining: never taken out, no cycle booked
    while time.monotonic() < joined + PERIOD_S - 0.5:
        assert _medium_cycles(gw.url, "a2b") == 0, history(gw.url, "a2b")
        assert not _taken_out(gw.url, "a2b"), history(gw.url, "a2b")
        time.sleep(0.1)
    # the schedule still runs: due one period after joining (slot 0 adds nothing), started
    # by the next lifecycle round once "a" is back from its own cycle
    assert wait_for(lambda: _medium_cycles(gw.url, "a2b") >= 1, PERIOD_S + 4, 0.1), \
        history(gw.url, "a2b")
    assert ("warm", "draining", "cooldown_scheduled") in history(gw.url, "a2b")


def _hook_command(path: Path) -> list[str]:
    """A restart hook that appends ``<backend_id>`` to ``path`` (and restarts nothing)."""
    code = "import sys; open(sys.argv[1], 'a').write(sys.argv[2] + '\\n')"
    return [sys.executable, "-c", code, str(path), "{backend_id}"]


def test_a_backend_back_from_a_restart_is_not_cycled_again_within_a_period(
    sims, lc_gateway, tmp_path: Path
):
    """Long cycle every 3 s: "a" first due 1.5 s after the start (slot 0 of 2). Its restart
    (drain, hook, cold, probes, warming, warm) takes about a second; it used to come due
    again 3 s after the cycle *started*, so about 2 s after it was back."""
    every = 3.0
    a, b = sims("a"), sims("b")
    hooks = tmp_path / "restarts.txt"
    gw = lc_gateway({"a": a.url, "b": b.url},
                    lifecycle={"long": {"every_s": every}, "check_interval_s": 0.1,
                               "restart_hold_s": 0.5,
                               "restart_hook": {"command": _hook_command(hooks)}})

    def back() -> bool:
        h = history(gw.url, "a")
        return ("draining", "cold", "restarted") in h and h[-1][1] == "warm"

    assert wait_for(back, 10, 0.05), history(gw.url, "a")
    returned = time.monotonic()
    restarts = len(history(gw.url, "a"))
    while time.monotonic() < returned + every - 0.5:
        h = history(gw.url, "a")
        assert len(h) == restarts and h[-1][1] == "warm", h  # nothing since its return
        time.sleep(0.05)
    # and the schedule goes on: its next long cycle within two periods of the return
    assert wait_for(lambda: hooks.read_text().split().count("a") >= 2, every + 3, 0.1), \
        history(gw.url, "a")


def _ask(url: str, n: int) -> None:
    c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=10)
    for i in range(n):
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"q{i}"}],
                                  max_tokens=2)
    c.close()


def test_a_rollouts_only_canary_backend_is_not_cycled_while_the_rollout_runs(
    servers: Servers,
) -> None:
    servers.add("a1", "v1")
    servers.add("a2", "v1")
    servers.add("c", "v2")  # the canary's only backend
    # steps that stay at the first one for the whole test: the rollout keeps running
    plan = {"model": MODEL, "baseline": "v1", "canary": "v2", "steps": [0.5, 1.0],
            **FAST_STEPS, "min_step_s": 600, "max_step_s": 900}
    lifecycle = {"medium": {"every_s": PERIOD_S, "every_requests": 0, "cooldown_s": 0.2}}
    cfg = config(servers.backends, rollouts=[plan], lifecycle=lifecycle)
    with GatewayThread(cfg) as gw:
        # the three come due 1/3, 2/3 and 3/3 of a period after the start: c last
        def held() -> bool:
            d = next(b for b in admin(gw.url) if b["id"] == "c")["deferred"]
            return d is not None and d["cycle"] == "medium"

        assert wait_for(held, PERIOD_S + 4, 0.1), admin(gw.url, "c")
        d = next(b for b in admin(gw.url) if b["id"] == "c")["deferred"]
        assert d["reason"] == "last routable canary backend (v2) of m1 while its rollout runs"
        s = metric_samples(gw.url)
        assert metric(s, "gateway_maintenance_deferrals_total", backend="c", cycle="medium",
                      outcome="deferred") == 1
        # another period with requests: c stays in, the baselines still get their cycles
        until = time.monotonic() + PERIOD_S
        while time.monotonic() < until:
            _ask(gw.url, 4)
            assert not _taken_out(gw.url, "c"), history(gw.url, "c")
            time.sleep(0.1)
        assert _medium_cycles(gw.url, "c") == 0
        assert _medium_cycles(gw.url, "a1") >= 1 and _medium_cycles(gw.url, "a2") >= 1
        snap = next(r for r in httpx.get(gw.url + "/admin/rollouts").json()["data"]
                    if r["model"] == MODEL)
        assert snap["status"] == "running", snap
        assert sum(snap.get("fallbacks", {}).values()) == 0, snap
        # the rollout ends: the deferred cycle runs
        r = httpx.post(gw.url + f"/admin/rollouts/{MODEL}/abort", json={"reason": "test"})
        assert r.status_code == 200, r.text
        assert wait_for(lambda: _medium_cycles(gw.url, "c") >= 1, PERIOD_S + 4, 0.1), \
            admin(gw.url, "c")
