"""A failed canary stays failed (issue 18: "automatic rollback to the baseline version and
the previous snapshot"), through real HTTP: the gateway under uvicorn in front of simulated
vLLM servers (a drifted build fails its calibration at its first step), a restart (a second
gateway on the same ``reload.state_dir``, started as ``serve`` starts: the kept config
resumed), the admin API and ``POST /admin/config``.

Must hold (:mod:`gateway.flow.rollout_ledger`, identity ``(model, baseline, canary)``):

* a restart goes on with the rollout that ran (an admin one included) and never starts a
  config entry whose canary rolled back;
* a config rollback (automatic or not) never starts a canary that failed, even an entry
  with other step settings, and the model's requests go to the failed rollout's baseline
  (not to a rollout of the snapshot returned to); ``GET /admin/rollouts`` keeps every
  ended rollout with its reason;
* ``POST /admin/config`` says which entries were started and why not; the advice it gives
  (``DELETE /admin/rollouts/{model}``, then apply the config again) starts the entry;
* a malformed JSON body sent as JSON gets JSON's error, with line and column.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import yaml

from gateway.reload_input import resume_config
from tests.lifecycle.support import metric, metric_samples
from tests.support.rollout_traffic import (
    FAST_STEPS,
    LOOSE_GATES,
    MODEL,
    Servers,
    Traffic,
    config,
)
from tests.support.scripted import wait_for
from tests.support.servers import GatewayThread

DRIFT = {"calibration": {"interval_s": 0.1, "min_probes": 3}}


def listing(url: str) -> dict[str, Any]:
    r = httpx.get(url + "/admin/rollouts", timeout=10)
    r.raise_for_status()
    return r.json()  # type: ignore[no-any-return]


def current(url: str) -> dict[str, Any]:
    return next(r for r in listing(url)["data"] if r["model"] == MODEL)


def post(gw: GatewayThread, **changes: Any) -> httpx.Response:
    data = gw.gateway.cfg.model_dump(mode="json")
    data.update(changes)
    return httpx.post(gw.url + "/admin/config", content=yaml.safe_dump(data),
                      headers={"content-type": "application/yaml"}, timeout=10)


def running_version(url: str) -> int:
    return httpx.get(url + "/admin/config/history", timeout=10).json()["running"]  # type: ignore[no-any-return]


def until_ended(gw: GatewayThread, rid: str, timeout: float = 60) -> dict[str, Any]:
    """Traffic until rollout ``rid`` has ended; its entry of ``ended``."""
    traffic = Traffic(gw.url)
    try:
        assert wait_for(lambda: any(e["id"] == rid for e in listing(gw.url)["ended"]),
                        timeout, 0.1), listing(gw.url)
    finally:
        traffic.stop()
    assert traffic.failures == []
    return next(e for e in listing(gw.url)["ended"] if e["id"] == rid)


def versions_served(gw: GatewayThread, servers: Servers, seconds: float = 0.6) -> set[str]:
    t = Traffic(gw.url, clients=2)
    time.sleep(seconds)
    t.stop()
    assert t.failures == [] and t.versions
    return {servers.version_of[fp] for fp in t.versions}


def test_a_restart_keeps_the_admin_rollout_and_never_starts_a_failed_config_entry(
    servers: Servers, tmp_path: Any,
) -> None:
    servers.add("a1", "v1")
    servers.add("a6", "v4-drift", drift=0.5)
    servers.add("a8", "v6")
    cfg = config(servers.backends, reload={"state_dir": str(tmp_path), "checkpoint_s": 0.2})
    entry = {"model": MODEL, "baseline": "v1", "canary": "v4-drift", "steps": [0.5, 1.0],
             **FAST_STEPS, **DRIFT}
    with GatewayThread(cfg) as gw:
        r = post(gw, rollouts=[entry])
        assert r.status_code == 200, r.text
        started = r.json()["rollouts"]
        assert [(x["model"], x["started"], x["code"]) for x in started] == [
            (MODEL, True, "started")], started
        failed = until_ended(gw, current(gw.url)["id"])
        assert failed["status"] == "rolled_back" and failed["label"] == "calibration"
        assert failed["blocking"]
        assert wait_for(lambda: gw.gateway.cfg.rollouts == [], 10)  # the config returned
        # the same body again: applied, the entry not started, and the response says why
        r = post(gw, rollouts=[entry])
        assert r.status_code == 200 and r.json()["applied"], r.text
        (item,) = r.json()["rollouts"]
        assert not item["started"] and item["code"] == "rolled_back", item
        assert f"DELETE /admin/rollouts/{MODEL}" in item["reason"]
        # an admin rollout of a good build runs
        body = {"model": MODEL, "baseline": "v1", "canary": "v6", "steps": [0.3, 0.6, 1.0],
                "min_step_s": 300, "max_step_s": 600, "calibration": {"measure": "off"}}
        r = httpx.post(gw.url + "/admin/rollouts", json=body, timeout=10)
        assert r.status_code == 201, r.text
        admin_id = r.json()["id"]
    # the restart, as serve makes it: the kept config (with the failed entry) resumed
    start = resume_config(cfg, None, {})
    assert start.resumed is not None, start.says
    assert start.config.rollouts and start.config.rollouts[0].canary == "v4-drift"
    with GatewayThread(start.config) as gw:
        gw.wait_ready(timeout=20, routable=3)
        now = current(gw.url)
        assert (now["id"], now["status"], now["origin"]) == (admin_id, "running", "admin"), now
        ended = listing(gw.url)["ended"]
        assert [(e["id"], e["status"], e["blocking"]) for e in ended] == [
            (failed["id"], "rolled_back", True)], ended
        assert "v4-drift" not in versions_served(gw, servers)
        decided = {k: v for k, v in metric_samples(gw.url).items()
                   if k[0] == "gateway_rollout_decisions_total"}
        assert not decided, decided  # nothing started and rolled back again


def test_a_config_rollback_never_starts_a_failed_canary_and_the_advice_works(
    servers: Servers,
) -> None:
    servers.add("a", "v1")
    servers.add("b", "v2", drift=0.5)
    e1 = {"model": MODEL, "baseline": "v1", "canary": "v2", "steps": [0.5, 1.0],
          **FAST_STEPS, **DRIFT}
    e2 = {**e1, "min_step_s": 0.4}  # the same canary at another pace
    with GatewayThread(config(servers.backends)) as gw:
        assert post(gw, rollouts=[e1]).json()["rollouts"][0]["started"]
        until_ended(gw, current(gw.url)["id"])
        assert wait_for(lambda: gw.gateway.cfg.rollouts == [], 10)
        r = post(gw, rollouts=[e1])  # E1 in the running config again, not started
        assert not r.json()["rollouts"][0]["started"], r.text
        with_e1 = r.json()["version"]
        # the operator's explicit ask: clear, then a changed entry
        d = httpx.delete(gw.url + f"/admin/rollouts/{MODEL}", timeout=10)
        assert d.status_code == 200 and d.json()["unblocked"], d.text
        r = post(gw, rollouts=[e2])
        assert r.json()["rollouts"][0]["started"], r.text
        e2_id = current(gw.url)["id"]
        until_ended(gw, e2_id)
        # the config returns to the version with E1: E1 is not started
        assert wait_for(lambda: running_version(gw.url) > with_e1 + 1, 10)
        assert [c.min_step_s for c in gw.gateway.cfg.rollouts] == [e1["min_step_s"]]
        now = current(gw.url)
        assert (now["id"], now["status"]) == (e2_id, "rolled_back"), now
        assert versions_served(gw, servers) == {"v1"}
        assert metric(metric_samples(gw.url), "gateway_rollout_step", model=MODEL) == -1
        # the advice of the response: DELETE, then apply the config again: it starts
        assert httpx.delete(gw.url + f"/admin/rollouts/{MODEL}", timeout=10).status_code == 200
        r = post(gw)
        assert r.status_code == 200 and r.json()["unchanged"], r.text
        (item,) = r.json()["rollouts"]
        assert item["started"] and item["code"] == "started", item
        assert current(gw.url)["status"] == "running"


def test_after_a_failed_config_rollout_the_model_goes_to_its_baseline_not_an_older_rollout(
    servers: Servers,
) -> None:
    servers.add("a", "v1")
    for name in ("c1", "c2", "c3"):
        servers.add(name, "v6")
    servers.add("b", "v5", drift=0.5)
    good = {"model": MODEL, "baseline": "v1", "canary": "v6", "steps": [0.5, 1.0],
            **FAST_STEPS, **LOOSE_GATES}  # its promotion is the set-up, not the subject
    with GatewayThread(config(servers.backends)) as gw:
        r = httpx.post(gw.url + "/admin/rollouts", json=good, timeout=10)
        assert r.status_code == 201, r.text
        promoted = until_ended(gw, r.json()["id"])
        assert promoted["status"] == "promoted", promoted
        bad = {"model": MODEL, "baseline": "v1", "canary": "v5", "steps": [0.5, 1.0],
               **FAST_STEPS, **DRIFT}
        r = post(gw, rollouts=[bad])
        assert r.json()["rollouts"][0]["started"], r.text
        failed = until_ended(gw, current(gw.url)["id"])
        assert failed["status"] == "rolled_back", failed
        assert wait_for(lambda: gw.gateway.cfg.rollouts == [], 10)  # returned
        now = current(gw.url)
        assert (now["id"], now["status"]) == (failed["id"], "rolled_back"), now
        assert versions_served(gw, servers) == {"v1"}
        assert metric(metric_samples(gw.url), "gateway_rollout_step", model=MODEL) == -1
        ended = listing(gw.url)["ended"]  # every decision kept, newest first
        assert [(e["canary"], e["status"]) for e in ended] == [
            ("v5", "rolled_back"), ("v6", "promoted")], ended
        assert ended[0]["reason"] and ended[0]["ended_at"].endswith("+00:00")


def test_a_malformed_json_config_gets_a_json_error(servers: Servers) -> None:
    servers.add("a", "v1")
    with GatewayThread(config(servers.backends)) as gw:
        r = httpx.post(gw.url + "/admin/config", content=b'{"backends": [}',
                       headers={"content-type": "application/json"}, timeout=10)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "invalid_config" and err["type"], err
        assert "not valid JSON" in err["message"] and "line 1, column 15" in err["message"]
        assert "YAML" not in err["message"], err
        # the other admin bodies that are JSON say where, too
        for path in ("/admin/rollouts", "/admin/config/rollback"):
            r = httpx.post(gw.url + path, content=b'{"model": }',
                           headers={"content-type": "application/json"}, timeout=10)
            assert r.status_code == 400, r.text
            assert "line 1, column 11" in r.json()["error"]["message"], (path, r.text)
