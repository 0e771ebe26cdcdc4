"""The state kept with each config snapshot (issue 18: "the last 3 applied configs, with the
state needed to return to them (calibration baselines, holds, rollout state)"), through real
HTTP: gateways under uvicorn in front of simulated vLLM servers, a restart (a second gateway
on the same ``reload.state_dir``) and a rollback (``POST /admin/config/rollback``).

* A restart takes up the kept state: a backend drained by an operator stays drained (it
  serves nothing), a rollout that was rolled back stays rolled back (not started again at
  its first step), and a backend's calibration baseline is the one taken before the restart
  even though the server now answers otherwise (without it, the baseline would be whatever
  the drifted server answers first, and the drift would never be seen).
* A rollback brings a removed backend back with the hold it had (an admin drain): it does
  not take traffic as a fresh backend would.
"""

from __future__ import annotations

import time
from typing import Any

import httpx

from gateway.config import ReleaseConfig
from tests.lifecycle.support import MODEL, admin, post_admin, sdk
from tests.support.reload_client import config_text, ids, post_config
from tests.support.scripted import wait_for
from tests.support.servers import GatewayThread, gateway_config

CHECKPOINT_S = 0.2


def kept(url: str) -> dict[str, Any]:
    """The running snapshot's kept state (``GET /admin/config/history?config=true``)."""
    hist = httpx.get(url + "/admin/config/history", params={"config": "true"},
                     timeout=5).json()
    running = next(h for h in hist["data"] if h["version"] == hist["running"])
    return running["state"]["kept"]  # type: ignore[no-any-return]


def backend(url: str, bid: str) -> dict[str, Any]:
    return next(b for b in admin(url) if b["id"] == bid)


def assert_held_out(url: str, held: Any) -> None:
    """Six chat requests through the gateway at ``url``: none reaches the simulator
    ``held``, and its backend ``b`` is not warm."""
    served = held.chat_requests()
    client = sdk(url)
    for i in range(6):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"hi {i}"}], max_tokens=4)
    assert held.chat_requests() == served
    assert backend(url, "b")["state"] != "warm"


def test_a_restart_takes_up_the_kept_holds_rollouts_and_calibration_baselines(
    sims: Any, tmp_path: Any,
) -> None:
    a, b = sims("A"), sims("B")
    cfg = gateway_config(
        [{"id": "a", "url": a.url, "model_version": "v1"},
         {"id": "b", "url": b.url, "model_version": "v2"}],
        calibration={"enabled": True, "max_tokens": 4},
        reload={"state_dir": str(tmp_path), "checkpoint_s": CHECKPOINT_S},
        rollouts=[{"model": MODEL, "baseline": "v1", "canary": "v2", "steps": [0.5, 1.0],
                   "min_step_s": 600, "calibration": {"measure": "off"}}])
    with GatewayThread(cfg) as gw:
        gw.wait_ready(timeout=20, routable=2)
        assert wait_for(lambda: set(kept(gw.url)["calibration"]) == {"a", "b"}, 20)
        baseline_a = kept(gw.url)["calibration"]["a"]["answers"]
        r = httpx.post(gw.url + f"/admin/rollouts/{MODEL}/abort", json={"reason": "test"},
                       timeout=5)
        assert r.status_code == 200, r.text
        assert post_admin(gw.url, "b", "drain", {"deadline_s": 1}).status_code == 202
        assert wait_for(lambda: backend(gw.url, "b")["hold"] == "admin_drain", 10)
    # a's server comes back as another build: its answers drift
    a.config = a.config.model_copy(update={"release": ReleaseConfig(drift=1.0)})
    a.kill()
    a.restart()
    with GatewayThread(cfg) as gw:
        gw.wait_ready(timeout=20, routable=1)
        # the operator's drain holds: b is out and serves nothing
        assert backend(gw.url, "b")["hold"] == "admin_drain"
        assert_held_out(gw.url, b)
        # the rollout rolled back before the restart stays rolled back, with its decision
        ro = next(x for x in httpx.get(gw.url + "/admin/rollouts", timeout=5).json()["data"]
                  if x["model"] == MODEL)
        assert ro["status"] == "rolled_back", ro
        assert [h["outcome"] for h in ro["history"]] == ["rolled_back"]
        # a's reference is the baseline from before the restart, not its drifted answers
        assert wait_for(lambda: backend(gw.url, "a")["state"] == "warm", 20)
        time.sleep(3 * CHECKPOINT_S)
        now = kept(gw.url)["calibration"]["a"]["answers"]
        assert now == baseline_a


def test_a_rollback_brings_a_removed_backend_back_with_its_hold(sims: Any,
                                                                tmp_path: Any) -> None:
    a, b = sims("A"), sims("B")
    cfg = gateway_config([{"id": "a", "url": a.url}, {"id": "b", "url": b.url}],
                         reload={"state_dir": str(tmp_path), "checkpoint_s": CHECKPOINT_S})
    with GatewayThread(cfg) as gw:
        gw.wait_ready(timeout=20, routable=2)
        assert post_admin(gw.url, "b", "drain", {"deadline_s": 1}).status_code == 202
        assert wait_for(lambda: backend(gw.url, "b")["hold"] == "admin_drain", 10)
        r = post_config(gw, config_text(gw, {"a": a.url}))  # b removed
        assert r.status_code == 200, r.text
        assert wait_for(lambda: ids(gw) == {"a"}, 20)
        rb = httpx.post(gw.url + "/admin/config/rollback", json={"version": 1}, timeout=10)
        assert rb.status_code == 200, rb.text
        assert ids(gw) == {"a", "b"}
        assert backend(gw.url, "b")["hold"] == "admin_drain"
        time.sleep(1.0)  # a fresh backend would be probed warm by now
        assert_held_out(gw.url, b)
