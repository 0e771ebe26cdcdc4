"""Canary rollouts in the running gateway (issue 18, Deliver 3 and 4), through real HTTP:
the gateway under uvicorn in front of simulated vLLM servers of two versions, clients on the
real ``openai`` SDK, rollouts started by the config, by a live reload and by the admin API.

Must hold: a good canary is promoted through every step with 0 failed requests; a slower
canary (TTFT x1.5) is rolled back at its first step (and a rollout from a config change
returns the config); a drifted canary (calibration) is rolled back even when it is fast;
the share the bad canary served is within the first step's share plus the step's minimum
sample; sticky sessions stay on one version; a model without a rollout routes as before.

Steps are small (tiny ``min_step_s``, 0.1 s calibration rounds, 40 requests and 20 latency
samples a side before a comparison), so each test sends a few hundred short requests.
Backends per version are sized to the step's shares, so that a version's backends carry
no more load per backend than the other's (a canary at 25 % is one
backend of four; a good canary runs on three backends against the baseline's one, so that
at the 100 % step each of its backends carries less than the baseline's did at 50 %): a
backend with more concurrent requests queues longer (a prefill step stalls the batch), a
difference of load, not of version, which a closed loop of clients on one machine would
otherwise turn into a false regression. The gateway holds a step above the canary's
capacity share (x1.25) itself: one canary backend of four holds at 25 % until a reload adds
canary capacity (the last test).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from datetime import datetime, timedelta
from typing import Any

import httpx
import openai
import pytest
import yaml

from tests.lifecycle.support import metric, metric_samples, metric_sum
from tests.support.rollout_traffic import (
    FAST_STEPS,
    LOOSE_GATES,
    MODEL,
    Servers,
    Traffic,
    config,
)
from tests.support.scripted import wait_for
from tests.support.servers import GatewayThread, gateway_config

REQUESTS = "gateway_requests_total"
CHAT = "/v1/chat/completions"


def rollouts(url: str) -> list[dict[str, Any]]:
    r = httpx.get(url + "/admin/rollouts", timeout=10)
    r.raise_for_status()
    return r.json()["data"]  # type: ignore[no-any-return]


def rollout(url: str, model: str = MODEL) -> dict[str, Any]:
    return next(r for r in rollouts(url) if r["model"] == model)


def shown(url: str, model: str = MODEL) -> str:
    """The rollout's whole view as JSON, for a failure message (a dict's repr is cut)."""
    return json.dumps(rollout(url, model), indent=1, default=str)


def ended(url: str) -> bool:
    return rollout(url)["status"] != "running"


def run_until_decided(gw: GatewayThread, timeout: float = 60) -> tuple[dict[str, Any], Traffic]:
    """Traffic until the rollout of ``MODEL`` ends; returns its snapshot and the traffic."""
    traffic = Traffic(gw.url)
    try:
        assert wait_for(lambda: ended(gw.url), timeout, 0.1), shown(gw.url)
    finally:
        traffic.stop()
    return rollout(gw.url), traffic


def decisions(url: str) -> dict[tuple[str, str], float]:
    s = metric_samples(url)
    out: dict[tuple[str, str], float] = {}
    for d in ("pass", "promoted", "rolled_back", "hold"):
        for reason in ("ok", "ttft", "itl", "errors", "calibration", "insufficient",
                       "operator", "capacity"):
            v = metric(s, "gateway_rollout_decisions_total", model=MODEL, decision=d,
                       reason=reason)
            if v:
                out[(d, reason)] = v
    return out


def test_good_canary_is_promoted_through_every_step(servers: Servers) -> None:
    servers.add("a", "v1")
    for name in ("b1", "b2", "b3"):
        servers.add(name, "v2")
    servers.add("c", None, model="m0")  # a model whose backend has no model_version
    plan = {"model": MODEL, "baseline": "v1", "canary": "v2", "steps": [0.5, 1.0],
            **FAST_STEPS}
    with GatewayThread(config(servers.backends, rollouts=[plan])) as gw:
        snap, traffic = run_until_decided(gw)
        assert snap["status"] == "promoted", snap["history"]
        assert [h["outcome"] for h in snap["history"]] == ["pass", "promoted"]
        assert traffic.failures == []
        print(f"\ngood canary promoted through {len(snap['steps'])} steps: "
              f"{len(traffic.versions)} requests, 0 failed")
        # each decision with its numbers and times
        cmp = snap["history"][0]["comparison"]
        assert {m["metric"] for m in cmp["metrics"]} == {"calibration", "ttft", "itl",
                                                         "error_rate"}
        assert all(m["decision"] == "pass" for m in cmp["metrics"])
        assert snap["calibration"]["probes"] >= 10 and snap["calibration"]["failures"] == 0
        assert all(h["at_unix"] > 0 for h in snap["history"])
        # sticky sessions: a session stays on its version; as the canary's share grows a
        # session of the baseline moves to the canary at most once, and never back
        moves = {s: _runs([servers.version_of[fp] for fp in fps])
                 for s, fps in traffic.sessions.items()}
        assert moves and all(m in (["v1"], ["v2"], ["v1", "v2"]) for m in moves.values()), moves
        assert any(m[0] == "v1" for m in moves.values()), moves  # some began on each
        assert any(m[0] == "v2" for m in moves.values()), moves
        assert decisions(gw.url) == {("pass", "ok"): 1, ("promoted", "ok"): 1}
        s = metric_samples(gw.url)
        assert metric(s, "gateway_rollout_step", model=MODEL) == 2
        # the share of traffic per version, from gateway_requests_total: each answer
        # counted under the version of the backend that gave it, as the clients saw it
        seen = Counter(servers.version_of[fp] for fp in traffic.versions)
        served = {v: metric_sum(s, REQUESTS, model=MODEL, version=v) for v in ("v1", "v2")}
        assert served["v1"] and served["v2"], served
        assert served == {"v1": seen["v1"], "v2": seen["v2"]}, (served, seen)
        assert metric_sum(s, REQUESTS, model=MODEL) == len(traffic.versions)  # none as ""
        # promoted: every request goes to the canary now
        before = len(traffic.versions)
        after = Traffic(gw.url, clients=2)
        time.sleep(0.5)
        after.stop()
        assert after.failures == []
        assert {servers.version_of[fp] for fp in after.versions} == {"v2"}, before
        # a model without versions (nor rollout): its requests counted under version ""
        plain = Traffic(gw.url, clients=1, model="m0")
        assert wait_for(lambda: len(plain.versions) >= 4, 10)
        plain.stop()
        assert plain.failures == []
        s = metric_samples(gw.url)
        m0 = {lbl: v for (n, lbl), v in s.items() if n == REQUESTS and ("model", "m0") in lbl}
        assert {dict(lbl)["version"] for lbl in m0} == {""}, m0
        assert sum(m0.values()) == len(plain.versions), m0


def _runs(versions: list[str]) -> list[str]:
    """``versions`` with repeats in a row collapsed: the versions a session went through."""
    return [v for i, v in enumerate(versions) if i == 0 or versions[i - 1] != v]


def _config_text(gw: GatewayThread, **changes: Any) -> str:
    data = gw.gateway.cfg.model_dump(mode="json")
    data.update(changes)
    return yaml.safe_dump(data)


def test_slow_canary_from_a_config_change_rolls_back_and_returns_the_config(
    servers: Servers,
) -> None:
    for name in ("a1", "a2", "a3"):  # the canary one backend of four, as in a fleet:
        servers.add(name, "v1")  # at 25 % each backend carries the same load
    servers.add("b", "v2", ttft_factor=1.5)
    first = 0.25
    plan = {"model": MODEL, "baseline": "v1", "canary": "v2", "steps": [first, 1.0],
            **FAST_STEPS, "calibration": {"measure": "off"}}
    with GatewayThread(config(servers.backends)) as gw:
        r = httpx.post(gw.url + "/admin/config", content=_config_text(gw, rollouts=[plan]),
                       headers={"content-type": "application/yaml"}, timeout=10)
        assert r.status_code == 200, r.text
        started_in = r.json()["version"]
        assert rollout(gw.url)["origin"] == "config"
        snap, traffic = run_until_decided(gw)
        assert snap["status"] == "rolled_back", snap["history"]
        last = snap["history"][-1]
        assert last["step"] == 0 and "ttft" in last["reason"], last
        assert traffic.failures == []
        # the bound: the first step's share plus the step's minimum sample
        served = snap["served"]
        total = served["baseline"] + served["canary"]
        assert served["canary"] <= first * total + plan["min_step_requests"], served
        print(f"\nslow canary (TTFT x1.5) rolled back at step 0 ({first:.0%}): it served "
              f"{served['canary']} of {total} requests ({served['canary'] / total:.1%}); "
              f"bound {first:.0%} x {total} + {plan['min_step_requests']}")
        assert snap["share_before_rollback"] is not None
        assert decisions(gw.url) == {("rolled_back", "ttft"): 1}
        assert metric(metric_samples(gw.url), "gateway_rollout_step", model=MODEL) == -1
        # the config went back to the one before the change (a new version, no rollouts)
        def returned() -> bool:
            h = httpx.get(gw.url + "/admin/config/history", timeout=10).json()
            return h["running"] > started_in and h["data"][0]["source"] == "rollback"
        assert wait_for(returned, 10)
        assert gw.gateway.cfg.rollouts == []
        # every request to the baseline now
        after = Traffic(gw.url, clients=2)
        time.sleep(0.5)
        after.stop()
        assert after.failures == [] and after.versions
        assert {servers.version_of[fp] for fp in after.versions} == {"v1"}


def test_drifted_canary_rolls_back_on_calibration_though_fast(servers: Servers) -> None:
    servers.add("a", "v1")
    servers.add("b", "v2", drift=0.5)
    with GatewayThread(config(servers.backends)) as gw:
        # 3 probes (one round) suffice: calibration decides at the step's first comparison
        body = {"model": MODEL, "baseline": "v1", "canary": "v2", "steps": [0.5, 1.0],
                **FAST_STEPS, "calibration": {"interval_s": 0.1, "min_probes": 3}}
        r = httpx.post(gw.url + "/admin/rollouts", json=body, timeout=10)
        assert r.status_code == 201, r.text
        again = httpx.post(gw.url + "/admin/rollouts", json=body, timeout=10)
        assert again.status_code == 409 and again.json()["error"]["param"] == "model"
        snap, traffic = run_until_decided(gw)
        assert snap["status"] == "rolled_back", snap["history"]
        last = snap["history"][-1]
        assert last["step"] == 0 and last["reason"].startswith("calibration failed"), last
        # the canary is as fast as the baseline by construction (no ttft / itl factor):
        # calibration's failure decides, whatever the latencies say
        assert snap["calibration"]["failures"] > 0.02 * snap["calibration"]["probes"]
        served = snap["served"]
        print(f"\ndrifted canary rolled back at step 0 on calibration "
              f"({snap['calibration']['failures']}/{snap['calibration']['probes']} probes "
              f"failed): it served {served['canary']} of "
              f"{served['baseline'] + served['canary']} requests")
        assert traffic.failures == []
        assert decisions(gw.url) == {("rolled_back", "calibration"): 1}
        # an admin rollout returns no config
        h = httpx.get(gw.url + "/admin/config/history", timeout=10).json()
        assert h["data"][0]["source"] == "start"


def test_admin_api_errors_and_abort(servers: Servers) -> None:
    servers.add("a", "v1")
    servers.add("b", "v2")
    with GatewayThread(config(servers.backends)) as gw:
        url = gw.url + "/admin/rollouts"
        r = httpx.post(url, json={"model": MODEL, "baseline": "v1", "canary": "v9"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "canary", r.text
        assert "v9" in r.json()["error"]["message"]
        r = httpx.post(url, json={"model": MODEL, "baseline": "v1", "canary": "v2",
                                  "steps": [0.5, 0.2]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "steps", r.text
        r = httpx.post(url, json={"model": MODEL, "baseline": "v1", "canary": "v2",
                                  "stepz": [1.0]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stepz", r.text
        r = httpx.post(url, json={"model": MODEL, "baseline": "v1", "canary": "v2",
                                  "targeting": {"client_keys": ["typo"], "steps": 1}})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "targeting.client_keys", r.text
        assert httpx.post(url + "/m1/abort").status_code == 404
        r = httpx.post(url, json={"model": MODEL, "baseline": "v1", "canary": "v2"})
        assert r.status_code == 201 and r.json()["status"] == "running"
        r = httpx.post(url + "/m1/abort", json={"reason": 5})  # a reason is text
        assert r.status_code == 400 and r.json()["error"]["param"] == "reason", r.text
        assert httpx.post(url + "/m1/abort", json=["pager"]).status_code == 400
        assert rollouts(gw.url)[0]["status"] == "running"  # nothing changed
        r = httpx.post(url + "/m1/abort", json={"reason": "pager"})
        assert r.status_code == 200 and r.json()["status"] == "rolled_back"
        assert r.json()["history"][-1]["reason"] == "operator: aborted: pager"
        assert decisions(gw.url) == {("rolled_back", "operator"): 1}
        # rolled back: the baseline serves everything
        c = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0)
        fps = {c.chat.completions.create(model=MODEL, messages=[{"role": "user",
                                                                 "content": "x"}],
                                         max_tokens=2).system_fingerprint
               for _ in range(10)}
        assert {servers.version_of[fp or ""] for fp in fps} == {"v1"}
        # ended: a second abort says so; DELETE clears it and both versions serve again
        again = httpx.post(url + "/m1/abort")
        assert again.status_code == 409, again.text
        assert again.json()["error"]["code"] == "rollout_ended"
        assert "DELETE" in again.json()["error"]["message"]
        cleared = httpx.delete(url + "/m1")
        assert cleared.status_code == 200 and cleared.json()["status"] == "rolled_back"
        assert httpx.delete(url + "/m1").status_code == 404
        assert rollouts(gw.url) == []
        fps = {c.chat.completions.create(model=MODEL, messages=[{"role": "user",
                                                                 "content": f"y{i}"}],
                                         max_tokens=2).system_fingerprint
               for i in range(20)}
        assert {servers.version_of[fp or ""] for fp in fps} == {"v1", "v2"}
        assert {b["id"]: b["model_version"] for b in httpx.get(
            gw.url + "/admin/backends").json()["backends"]} == {"a": "v1", "b": "v2"}
        # a running rollout keeps both versions: a reload taking one away is refused
        r = httpx.post(url, json={"model": MODEL, "baseline": "v1", "canary": "v2"})
        assert r.status_code == 201, r.text
        text = _config_text(gw, backends=[dict(servers.backends[0])])
        refused = httpx.post(gw.url + "/admin/config", content=text, timeout=10,
                             headers={"content-type": "application/yaml"})
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == "backends"
        assert "abort it first" in refused.json()["error"]["message"]
        assert httpx.delete(url + "/m1").status_code == 409  # running: abort first


def test_every_admin_refusal_names_its_field_and_rollout_times_are_wall_clock(
    servers: Servers,
) -> None:
    """Each 400 of ``POST /admin/rollouts``, ``/admin/config`` and ``/admin/config/rollback``
    whose cause is a field names it in ``param`` (a ``model_version`` that is not a label
    value included); ``GET /admin/rollouts`` gives times as ISO 8601 UTC and Unix seconds."""
    servers.add("a", "v1")
    servers.add("b", "v2")
    with GatewayThread(config(servers.backends)) as gw, httpx.Client(
            base_url=gw.url, timeout=10) as http:  # one client: a new one per call is slow
        def refused(path: str, body: Any) -> tuple[str | None, str]:
            r = (http.post(path, json=body) if path.endswith("rollouts")
                 else http.post(path, content=yaml.safe_dump(body),
                                headers={"content-type": "application/yaml"}))
            assert r.status_code == 400, (body, r.text)
            err = r.json()["error"]
            return err["param"], err["message"]

        base = {"model": MODEL, "baseline": "v1", "canary": "v2"}
        for body, param in (
            ({**base, "canary": "***"}, "canary"),
            ({**base, "canary": "v" * 500}, "canary"),
            ({**base, "baseline": " v1"}, "baseline"),
            ({**base, "canary": "v1"}, "canary"),
            ({**base, "min_step_s": 10, "max_step_s": 5}, "max_step_s"),
            ({**base, "targeting": {"steps": 1}}, "targeting.steps"),
            ({**base, "targeting": {"steps": 9, "low_priority": True}}, "targeting.steps"),
            ({**base, "model": "nope"}, "model"),
            ({**base, "gates": {"p99_tolerance": -1}}, "gates.p99_tolerance"),
            ({**base, "gates": {"alpha": 2}}, "gates.alpha"),
        ):
            assert refused("/admin/rollouts", body)[0] == param, body
        assert "not a model version" in refused("/admin/rollouts", {**base, "canary": "***"})[1]
        shown = http.get("/admin/config").json()["config"]
        a, b = shown["backends"]
        for cfg, param in (
            ({"backends": [{**a, "model_version": "v 1"}, b]}, "backends.0.model_version"),
            ({"rollouts": [{**base, "canary": "v9"}]}, "rollouts.0.canary"),
            ({"rollouts": [base, base]}, "rollouts.1.model"),
            ({"backends": [a, {**b, "id": "a"}]}, "backends.1.id"),
            ({"backends": [a, b, {"id": "c", "url": "http://127.0.0.1:9",
                                  "api_key_env": "R18B_UNSET_KEY"}]}, "backends[c].api_key_env"),
            ({"auth": {**shown["auth"], "admin_key_env": "R18B_UNSET_KEY"}},
             "auth.admin_key_env"),
        ):
            assert refused("/admin/config", {**shown, **cfg})[0] == param, cfg
        r = http.post("/admin/config/rollback")  # none kept before
        assert r.status_code == 400 and r.json()["error"]["param"] == "version", r.text
        # times: wall clock, ISO 8601 UTC and Unix seconds
        before = time.time()
        assert http.post("/admin/rollouts", json=base).status_code == 201
        assert http.post(f"/admin/rollouts/{MODEL}/abort").status_code == 200
        (snap,) = http.get("/admin/rollouts").json()["data"]
        started = datetime.fromisoformat(snap["started_at"])
        assert started.utcoffset() == timedelta(0), snap["started_at"]
        assert before - 1 <= started.timestamp() <= time.time() + 1, snap["started_at"]
        assert abs(snap["started_unix"] - started.timestamp()) < 1e-3
        (h,) = snap["history"]
        assert abs(datetime.fromisoformat(h["at"]).timestamp() - h["at_unix"]) < 1e-3, h
        assert before - 1 <= h["at_unix"] <= time.time() + 1, h


def test_a_canarys_errors_count_though_retries_hide_them_from_clients(
    servers: Servers,
) -> None:
    """The canary answers 30 % of its requests with a 500; the gateway retries them on the
    baseline, so no client sees an error, yet each failed attempt is a canary error and the
    rollout is rolled back for it at its first step."""
    servers.add("a", "v1")
    servers.add("b", "v2", faults={"error_rate": 0.3})
    # 80 requests a side (expected p ~ 5e-8 against the per-step level alpha / 2 steps):
    # at 40 a side (p ~ 9e-5 expected) a canary whose breaker had shed part of its share
    # passed step 0 in one CI run
    plan = {"model": MODEL, "baseline": "v1", "canary": "v2", "steps": [0.5, 1.0],
            **FAST_STEPS, "min_step_requests": 80, "min_requests": 80,
            "calibration": {"measure": "off"}}
    with GatewayThread(config(servers.backends, rollouts=[plan])) as gw:
        snap, traffic = run_until_decided(gw)
        assert traffic.failures == []
        assert snap["status"] == "rolled_back", snap["history"]
        assert snap["history"][-1]["step"] == 0, snap["history"]
        assert decisions(gw.url) == {("rolled_back", "errors"): 1}


def test_a_calibration_measure_that_cannot_fit_the_answers_rolls_back_at_once(
    servers: Servers,
) -> None:
    servers.add("a", "v1")
    servers.add("b", "v2")
    with GatewayThread(config(servers.backends)) as gw:
        body = {"model": MODEL, "baseline": "v1", "canary": "v2", "steps": [0.5, 1.0],
                "calibration": {"measure": "cosine", "interval_s": 0.1}}
        r = httpx.post(gw.url + "/admin/rollouts", json=body, timeout=10)
        assert r.status_code == 201, r.text
        assert wait_for(lambda: rollout(gw.url)["status"] == "rolled_back", 20)
        reason = rollout(gw.url)["history"][-1]["reason"]
        assert "calibration cannot be measured" in reason and "cosine" in reason, reason
        assert decisions(gw.url) == {("rolled_back", "calibration"): 1}


def test_invalid_rollout_config_names_the_field(servers: Servers) -> None:
    servers.add("a", "v1")
    with pytest.raises(Exception, match=r"rollouts\.0\.canary: no backend of model 'm1'"):
        gateway_config(servers.backends, rollouts=[{"model": MODEL, "baseline": "v1",
                                                    "canary": "v2"}])


def test_a_model_without_rollout_routes_as_before(servers: Servers) -> None:
    servers.add("a", "v1")
    servers.add("b", "v2")
    servers.add("x", "old", model="m2")
    servers.add("y", "new", model="m2")
    plan = {"model": MODEL, "baseline": "v1", "canary": "v2", "steps": [0.5, 1.0]}
    with GatewayThread(config(servers.backends, rollouts=[plan])) as gw:
        traffic = Traffic(gw.url, clients=2, model="m2")
        assert wait_for(lambda: len({servers.version_of[fp] for fp in traffic.versions})
                        == 2, 10)  # both versions of m2 serve it: versions ignored
        traffic.stop()
        assert traffic.failures == []
        # no rollout, yet each answer counted under its backend's version
        s = metric_samples(gw.url)
        seen = Counter(servers.version_of[fp] for fp in traffic.versions)
        assert {v: metric_sum(s, REQUESTS, model="m2", version=v) for v in ("old", "new", "")} \
            == {"old": seen["old"], "new": seen["new"], "": 0}, seen
        assert rollout(gw.url)["served"] == {"baseline": 0, "canary": 0}


def test_a_version_without_a_routable_backend_falls_back_to_the_other(
    servers: Servers,
) -> None:
    servers.add("a", "v1")
    servers.add("b", "v2")
    servers.add("c", "v3")  # a third version of the model: never the canary's stand-in
    plan = {"model": MODEL, "baseline": "v1", "canary": "v2", "steps": [0.5, 1.0],
            "min_step_s": 600, "calibration": {"measure": "off"}}
    with GatewayThread(config(servers.backends, rollouts=[plan])) as gw:
        servers.threads[1].stop()  # the canary's only backend is gone
        traffic = Traffic(gw.url, clients=2)
        assert wait_for(lambda: len(traffic.versions) >= 40, 20)
        traffic.stop()
        assert traffic.failures == []  # retried on, then routed to, the baseline
        assert {servers.version_of[fp] for fp in traffic.versions} == {"v1"}
        snap = rollout(gw.url)
        assert snap["status"] == "running" and snap["fallbacks"].get("v2", 0) > 0, snap
        s = metric_samples(gw.url)
        assert metric(s, "gateway_rollout_fallbacks_total", model=MODEL, version="v2")
        # counted under the version that served them (v1), not the one assigned (v2)
        assert metric_sum(s, REQUESTS, model=MODEL, version="v2") == 0
        assert metric_sum(s, REQUESTS, model=MODEL, version="v1") == len(traffic.versions)
        # refused before any backend answered: an invalid body (no messages) is refused
        # before the rollout assigns a version: version ""; with no backend of the model
        # left, refused after the assignment: the version assigned (v1 or v2)
        r = httpx.post(gw.url + CHAT, json={"model": MODEL}, timeout=10)
        assert r.status_code == 400, r.text
        servers.threads[0].stop()  # the baseline's only backend too
        servers.threads[2].stop()  # and the third version's (the last resort)
        body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 2}
        codes = [httpx.post(gw.url + CHAT, json=body, timeout=30).status_code
                 for _ in range(6)]
        assert set(codes) <= {429, 502, 503}, codes  # the gateway's own refusals
        s = metric_samples(gw.url)
        assert metric(s, REQUESTS, endpoint=CHAT, model=MODEL, status="400", version="") == 1
        refused = {lbl: v for (n, lbl), v in s.items() if n == REQUESTS
                   and ("model", MODEL) in lbl and dict(lbl)["status"] in ("429", "502", "503")}
        assert sum(refused.values()) == len(codes), refused
        assert {dict(lbl)["version"] for lbl in refused} <= {"v1", "v2"}, refused


def test_the_batcher_places_by_version_and_admin_routes_need_the_admin_key(
    servers: Servers,
) -> None:
    servers.add("a", "v1")
    servers.add("b", "v2")
    plan = {"model": MODEL, "baseline": "v1", "canary": "v2", "steps": [0.5, 1.0],
            "min_step_s": 600, "calibration": {"measure": "off"}}
    cfg = config(servers.backends, rollouts=[plan], batcher={"enabled": True},
                 auth={"admin_key": "sekret"})
    with GatewayThread(cfg) as gw:
        url = gw.url + "/admin/rollouts"
        assert httpx.get(url).status_code == 401
        assert httpx.post(url + "/m1/abort").status_code == 401
        admin = {"authorization": "Bearer sekret"}
        assert httpx.get(url, headers=admin).json()["data"][0]["status"] == "running"
        traffic = Traffic(gw.url, clients=2)
        assert wait_for(lambda: len({servers.version_of[fp] for fp in traffic.versions}) == 2,
                        10)  # the batcher places on both versions while it runs
        r = httpx.post(url + "/m1/abort", headers=admin)
        assert r.status_code == 200 and r.json()["status"] == "rolled_back"
        seen = len(traffic.versions)
        assert wait_for(lambda: len(traffic.versions) >= seen + 20, 10)
        traffic.stop()
        assert traffic.failures == []
        after = {servers.version_of[fp] for fp in traffic.versions[seen + 2:]}
        assert after == {"v1"}, after  # rolled back: the batcher places on the baseline only


def test_a_canary_held_at_the_step_above_its_capacity_moves_on_after_a_reload(
    servers: Servers,
) -> None:
    """One canary backend of four carries 25 % (x1.25 slack: 31 %): the rollout passes
    20 % and holds there instead of sending it 50 %; a reload that adds a canary backend
    and moves a baseline backend to the canary's version (3 of 5: 60 %) lets it move on to
    50 % and on to 100 % (3 canary backends x 1.25 >= the baseline's 2). Each step's canary
    servers carry no more per server than the baseline's (20 % on one against 80 % on
    three; 50 % on three against 50 % on two): with one canary server against a pool of
    three at equal load per server, the canary's TTFT is the worse by pooling (the
    baseline's requests go to the least loaded of three), a capacity effect this test is
    not about."""
    for name in ("a1", "a2", "a3"):
        servers.add(name, "v1")
    servers.add("b1", "v2")
    extra = servers.add("b2", "v2")
    plan = {"model": MODEL, "baseline": "v1", "canary": "v2", "steps": [0.2, 0.5, 1.0],
            **FAST_STEPS, "min_step_requests": 24, "min_requests": 24,
            "calibration": {"measure": "off"},  # smaller samples: three steps in seconds
            **LOOSE_GATES}  # the subject is capacity, not latency
    backends = [b for b in servers.backends if b["id"] != "b2"]
    with GatewayThread(config(backends)) as gw:
        assert httpx.post(gw.url + "/admin/rollouts", json=plan, timeout=10).status_code == 201
        traffic = Traffic(gw.url)
        try:
            assert wait_for(lambda: rollout(gw.url)["held"] is not None, 30, 0.1), \
                shown(gw.url)
            snap = rollout(gw.url)
            assert (snap["status"], snap["step"], snap["share"]) == ("running", 0, 0.2)
            assert snap["held"] == ("canary capacity 25 % (x1.25 = 31 %) < step 50 %: add "
                                    "backends with model_version v2"), snap["held"]
            assert snap["capacity"]["backends"] == {"baseline": 3, "canary": 1}
            assert decisions(gw.url) == {("hold", "capacity"): 1}  # none rolled back
            cfg = gw.gateway.cfg.model_dump(mode="json")
            added = [*cfg["backends"], {"id": "b2", "url": extra, "models": [MODEL],
                                        "model_version": "v2"}]
            moved = [{**b, "model_version": "v2"} if b["id"] == "a3" else b for b in added]
            r = httpx.post(gw.url + "/admin/config", timeout=10,
                           headers={"content-type": "application/yaml"},
                           content=_config_text(gw, backends=moved))
            assert r.status_code == 200, r.text
            assert wait_for(lambda: ended(gw.url), 40, 0.1), shown(gw.url)
        finally:
            traffic.stop()
        snap = rollout(gw.url)
        assert snap["status"] == "promoted", snap["history"]
        assert [(h["step"], h["outcome"]) for h in snap["history"]] == [
            (0, "hold"), (0, "pass"), (1, "pass"), (2, "promoted")]
        assert traffic.failures == []
        assert decisions(gw.url) == {("hold", "capacity"): 1, ("pass", "ok"): 2,
                                     ("promoted", "ok"): 1}
