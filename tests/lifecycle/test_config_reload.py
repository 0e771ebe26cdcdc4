"""Live config reload (issue 18), through real HTTP: the gateway under uvicorn in front of
simulated vLLM servers, clients on the real ``openai`` SDK, the config changed with ``POST
/admin/config`` while they run.

Must hold: a reload that adds one backend and removes another under load fails no request,
the removed one is drained (then leaves the fleet), the new one is warm before it takes
traffic; an invalid reload (or one with a field that cannot change live) changes nothing;
a rollback to the snapshot before it restores routing within 60 s. The kept configs are
files of mode 0600 in ``reload.state_dir``.
"""

from __future__ import annotations

import os
import stat
import threading
import time
from pathlib import Path

import httpx
import openai
import yaml

from tests.lifecycle.support import MODEL, admin, history, sdk
from tests.support.reload_client import config_text, ids, post_config
from tests.support.scripted import wait_for
from tests.support.servers import GatewayThread, gateway_config

# warm-up on (the test config turns it off): a new backend is warmed up, then ramped
LIFECYCLE = {"warmup_batch_shapes": [1, 2], "warmup_max_tokens": 4, "slow_start_s": 1.0}








class Load:
    """Clients on the ``openai`` SDK, each sending chat completions (every third one
    streamed) in a loop until :meth:`stop`; every failure a client sees is kept."""

    def __init__(self, url: str, clients: int = 4) -> None:
        self.failures: list[str] = []
        self.served = 0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(url, i), daemon=True)
                         for i in range(clients)]
        for t in self._threads:
            t.start()

    def _run(self, url: str, i: int) -> None:
        client = sdk(url)
        n = i
        while not self._stop.is_set():
            n += 1
            try:
                if n % 3 == 0:
                    stream = client.chat.completions.create(
                        model=MODEL, messages=[{"role": "user", "content": f"hi {n}"}],
                        max_tokens=8, stream=True)
                    text = "".join(c.choices[0].delta.content or "" for c in stream
                                   if c.choices)
                    assert text, "an empty stream"
                else:
                    r = client.chat.completions.create(
                        model=MODEL, messages=[{"role": "user", "content": f"hi {n}"}],
                        max_tokens=8)
                    assert r.choices[0].message.content
                self.served += 1
            except Exception as e:  # every failure a client sees counts
                self.failures.append(f"{type(e).__name__}: {e}")

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)


def test_reload_under_load_adds_one_removes_another_and_rollback_restores_it(sims, tmp_path):
    a, b, c = sims("A"), sims("B"), sims("C")
    state = tmp_path / "state"
    gw = GatewayThread(gateway_config(
        [{"id": "a", "url": a.url}, {"id": "b", "url": b.url}], lifecycle=LIFECYCLE,
        reload={"state_dir": str(state)}))
    gw.start(wait_ready=False)
    try:
        gw.wait_ready(timeout=20, routable=2)
        load = Load(gw.url)
        try:
            time.sleep(1.0)
            assert b.chat_requests() > 0  # b takes its share before the reload
            # ---- add c, remove b ----------------------------------------------------------
            r = post_config(gw, config_text(gw, {"a": a.url, "c": c.url}))
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["applied"] is True and body["version"] == 2
            assert (body["backends_added"], body["backends_removed"]) == (["c"], ["b"])
            # c takes no client request (chat) before it is warm: sampled as (count, state)
            # in that order, so a count read before a non-warm state is a breach
            early: list[tuple[int, str]] = []

            def c_warm_and_serving() -> bool:
                served = c.chat_requests()
                st = next((x["state"] for x in admin(gw.url) if x["id"] == "c"), "absent")
                if st != "warm" and served > 0:
                    early.append((served, st))
                return st == "warm" and served > 0

            assert wait_for(c_warm_and_serving, 30, interval=0.02)
            assert early == [], f"c served clients before it was warm: {early}"
            steps = [(f, t) for f, t, _ in history(gw.url, "c")]
            assert steps[:2] == [("cold", "warming"), ("warming", "warm")], steps
            assert wait_for(lambda: "b" not in ids(gw), 30), admin(gw.url)
            drained = b.chat_requests()
            time.sleep(0.5)
            assert b.chat_requests() == drained  # gone: no new request reaches b
            # ---- an invalid config and a field that cannot change live: nothing changes --
            bad = post_config(gw, "backends:\n  - id: x\n")  # no url
            assert bad.status_code == 400, bad.text
            err = bad.json()["error"]
            assert err["code"] == "invalid_config" and err["param"].startswith("backends")
            assert err["type"] == "invalid_request_error" and "url" in err["message"]
            fixed = post_config(gw, config_text(gw, {"a": a.url, "c": c.url},
                                                proxy={"idle_timeout_s": 5.0}))
            assert fixed.status_code == 400, fixed.text
            err = fixed.json()["error"]
            assert err["code"] == "config_refused" and err["param"] == "proxy.idle_timeout_s"
            assert "restart" in err["message"]
            assert ids(gw) == {"a", "c"}
            assert gw.gateway.cfg.proxy.idle_timeout_s != 5.0
            assert httpx.get(gw.url + "/admin/config", timeout=5).json()["version"] == 2
            # ---- roll back to version 1: b back (cold, then warm), c drained and gone ------
            t0 = time.monotonic()
            rb = httpx.post(gw.url + "/admin/config/rollback", json={"version": 1}, timeout=10)
            assert rb.status_code == 200, rb.text
            assert rb.json()["version"] == 3
            assert wait_for(lambda: ids(gw) == {"a", "b"} and all(
                x["state"] == "warm" for x in admin(gw.url)), 60)
            restored_s = time.monotonic() - t0
            assert restored_s < 60
            before = b.chat_requests()
            assert wait_for(lambda: b.chat_requests() > before, 10)  # b takes traffic again
        finally:
            load.stop()
        assert load.failures == [], load.failures[:5]
        assert load.served > 20
        print(f"{load.served} requests, 0 failed; routing restored {restored_s:.2f} s after "
              f"the rollback")
        # ---- the kept configs: newest first, on disk with mode 0600 -----------------------
        hist = httpx.get(gw.url + "/admin/config/history", timeout=5).json()
        assert [(h["version"], h["source"]) for h in hist["data"]] == [
            (3, "rollback"), (2, "admin"), (1, "start")]
        assert hist["running"] == 3
        files = sorted((state / "config-history").glob("*.json"))
        assert len(files) == 3
        assert all(stat.S_IMODE(os.stat(f).st_mode) == 0o600 for f in files)
    finally:
        gw.stop()


def test_client_keys_rotate_live_and_history_keeps_the_last_three(sims, tmp_path):
    """A rotated client key: the old one is refused (401) and the new one served from the
    next request; the history keeps 3 (``reload.keep``) and never shows a key."""
    a = sims("A")
    gw = GatewayThread(gateway_config(
        [{"id": "a", "url": a.url}], auth={"client_keys": [{"name": "team", "key": "old-k"}]},
        reload={"state_dir": str(tmp_path)}))
    gw.start()
    try:
        def chat(key: str) -> int:
            try:
                openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0).chat \
                    .completions.create(model=MODEL, max_tokens=2,
                                        messages=[{"role": "user", "content": "hi"}])
                return 200
            except openai.APIStatusError as e:
                return e.status_code

        assert chat("old-k") == 200
        for i, key in enumerate(["new-k", "newer-k", "newest-k"]):
            data = gw.gateway.cfg.model_dump(mode="json")
            data["auth"]["client_keys"] = [{"name": "team", "key": key, "rpm": 100 + i}]
            r = post_config(gw, yaml.safe_dump(data))
            assert r.status_code == 200, r.text
        assert chat("old-k") == 401
        assert chat("newest-k") == 200
        hist = httpx.get(gw.url + "/admin/config/history?config=true", timeout=5).json()
        assert [h["version"] for h in hist["data"]] == [4, 3, 2]
        assert "newest-k" not in str(hist) and "old-k" not in str(hist)
        assert hist["data"][0]["config"]["auth"]["client_keys"][0]["key"] == "***"
        assert len(list(Path(tmp_path, "config-history").glob("*.json"))) == 3
        same = post_config(gw, yaml.safe_dump(gw.gateway.cfg.model_dump(mode="json")))
        assert same.json() == {**same.json(), "applied": False, "version": None}
    finally:
        gw.stop()


def test_the_view_of_get_admin_config_posted_back_edited_is_applied(sims):
    """``GET /admin/config``'s body (``{"version": N, "config": {...}}``, keys shown as
    ``***``) posted back whole with one live field edited, as JSON or YAML, is applied; a
    view of a version that no longer runs is refused (409 ``config_conflict``)."""
    a = sims("A")
    gw = GatewayThread(gateway_config(
        [{"id": "a", "url": a.url}], auth={"client_keys": [{"name": "team", "key": "k1"}]}))
    gw.start()
    try:
        view = httpx.get(gw.url + "/admin/config", timeout=5).json()
        assert view["config"]["auth"]["client_keys"][0]["key"] == "***"
        view["config"]["auth"]["client_keys"][0]["rpm"] = 100
        r = httpx.post(gw.url + "/admin/config", json=view, timeout=10)
        assert r.status_code == 200, r.text
        assert r.json()["applied"] and r.json()["version"] == view["version"] + 1, r.text
        assert gw.gateway.cfg.auth.client_keys[0].rpm == 100
        assert gw.gateway.cfg.auth.client_keys[0].key == "k1"  # '***' kept the key
        stale = view
        view = httpx.get(gw.url + "/admin/config", timeout=5).json()
        view["config"]["auth"]["client_keys"][0]["rpm"] = 200
        r = post_config(gw, yaml.safe_dump(view))  # the same view as YAML
        assert r.status_code == 200 and r.json()["applied"], r.text
        assert gw.gateway.cfg.auth.client_keys[0].rpm == 200
        stale["config"]["auth"]["client_keys"][0]["rpm"] = 300
        r = httpx.post(gw.url + "/admin/config", json=stale, timeout=10)
        assert r.status_code == 409, r.text
        assert r.json()["error"]["code"] == "config_conflict"
        assert r.json()["error"]["param"] == "version"
        assert gw.gateway.cfg.auth.client_keys[0].rpm == 200
        r = httpx.post(gw.url + "/admin/config", json={**view, "version": "x"}, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == "version", r.text
    finally:
        gw.stop()


def test_admission_limits_and_routing_weights_apply_to_the_next_request(sims):
    """``admission.max_in_flight`` 1 with no queue: a second request while one streams is
    refused (429); after a reload to 4, the same second request is served while the first
    still streams. ``routing.weights`` reach the ``load_thermal`` policy."""
    a = sims("A", itl_s=0.05)
    gw = GatewayThread(gateway_config([{"id": "a", "url": a.url}],
                                      admission={"max_in_flight": 1, "max_queued": 0}))
    gw.start()
    try:
        client = sdk(gw.url)

        def second_while_one_streams() -> int:
            stream = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "long"}], max_tokens=60,
                stream=True)
            it = iter(stream)
            next(it)  # the first stream holds the one slot now
            try:
                client.with_options(max_retries=0).chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
                status = 200
            except openai.APIStatusError as e:
                status = e.status_code
            for _ in it:
                pass
            return status

        assert second_while_one_streams() == 429
        r = post_config(gw, config_text(gw, {"a": a.url}, admission={"max_in_flight": 4},
                                        routing={"weights": {"waiting": 3.0}}))
        assert r.status_code == 200, r.text
        assert set(r.json()["changed"]) == {"admission.max_in_flight",
                                            "routing.weights.waiting"}
        assert second_while_one_streams() == 200
        policy = getattr(gw.gateway.router, "inner", gw.gateway.router)
        assert policy.weights.waiting == 3.0
    finally:
        gw.stop()


def test_replacing_every_backend_drops_no_request(sims):
    """Make before break: a reload that replaces every backend ({a, b} -> {c, d}) keeps a and
    b serving until c and d are warm, then drains them; clients without retries see no
    failure (before: about 1 s of 503 ``no_backend_available``, nothing warm yet)."""
    a, b, c, d = sims("A"), sims("B"), sims("C"), sims("D")
    gw = GatewayThread(gateway_config([{"id": "a", "url": a.url}, {"id": "b", "url": b.url}],
                                      lifecycle=LIFECYCLE))
    gw.start(wait_ready=False)
    try:
        gw.wait_ready(timeout=20, routable=2)
        load = Load(gw.url)
        try:
            time.sleep(0.5)
            r = post_config(gw, config_text(gw, {"c": c.url, "d": d.url}))
            assert r.status_code == 200, r.text
            assert wait_for(lambda: ids(gw) == {"c", "d"}, 30), admin(gw.url)
            time.sleep(0.5)
        finally:
            load.stop()
        assert load.failures == [], load.failures[:5]
        assert c.chat_requests() > 0 and d.chat_requests() > 0
    finally:
        gw.stop()


def test_keys_survive_a_round_trip_and_bad_reloads_are_refused_and_counted(sims):
    """``GET /admin/config`` shows keys as ``***``: posting it back (edited) keeps them; a
    ``***`` where no key runs is refused; an empty body, no backends, a YAML error (its
    message never quotes the line, which may hold a key) and a leaving backend's id given
    to another server are refused; each refusal is counted."""
    a, b, c = sims("A"), sims("B"), sims("C")
    gw = GatewayThread(gateway_config(
        [{"id": "a", "url": a.url}, {"id": "b", "url": b.url}],
        auth={"admin_key": "adm-secret", "client_keys": [{"name": "t", "key": "cli-secret"}]}))
    gw.start()
    adm = {"authorization": "Bearer adm-secret"}
    try:
        def post(body: str) -> httpx.Response:
            return httpx.post(gw.url + "/admin/config", content=body.encode(),
                              headers={**adm, "content-type": "application/yaml"},
                              timeout=10)

        shown = httpx.get(gw.url + "/admin/config", headers=adm, timeout=5).json()["config"]
        assert shown["auth"]["admin_key"] == "***"
        shown["routing"]["weights"]["waiting"] = 2.0
        r = post(yaml.safe_dump(shown))
        assert r.status_code == 200 and r.json()["changed"] == ["routing.weights.waiting"], r.text
        assert httpx.get(gw.url + "/admin/config", headers=adm, timeout=5).status_code == 200
        assert httpx.get(gw.url + "/admin/config", timeout=5,
                         headers={"authorization": "Bearer ***"}).status_code == 401
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="cli-secret", max_retries=0)
        assert client.chat.completions.create(model=MODEL, max_tokens=2, messages=[
            {"role": "user", "content": "hi"}]).choices
        shown["auth"]["client_keys"].append({"name": "u", "key": "***"})
        r = post(yaml.safe_dump(shown))
        assert r.status_code == 400 and r.json()["error"]["param"] == "auth.client_keys.1.key"
        shown["auth"]["client_keys"].pop()
        for body, why in (("", "empty"), ("  \n", "empty"),
                          (yaml.safe_dump({**shown, "backends": []}), "no backends")):
            r = post(body)
            assert r.status_code == 400, (why, r.text)
            assert r.json()["error"]["code"] == "invalid_config", r.text
        r = post("auth:\n  admin_key: TOPSECRET: x\n")
        assert r.status_code == 400 and "TOPSECRET" not in r.text
        r = post(yaml.safe_dump({**shown, "auth": {**shown["auth"], "admin_key": 7}}))
        assert r.status_code == 400 and "adm-secret" not in r.text
        # b leaves (a long stream keeps it draining); its id given to c meanwhile: refused
        stream = sdk(gw.url).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "long"}], max_tokens=3500,
            stream=True, extra_headers={"authorization": "Bearer cli-secret"},
            extra_body={"ignore_eos": True})
        it = iter(stream)
        next(it)
        listed = httpx.get(gw.url + "/admin/backends", headers=adm, timeout=5).json()
        pinned = next(x["id"] for x in listed["backends"] if x["in_flight"] > 0)
        other = "a" if pinned == "b" else "b"
        urls = {"a": a.url, "b": b.url}
        shown["backends"] = [{"id": other, "url": urls[other]}]
        assert post(yaml.safe_dump(shown)).status_code == 200
        shown["backends"].append({"id": pinned, "url": c.url})
        r = post(yaml.safe_dump(shown))
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == f"backends[{pinned}].url"
        assert "still leaving" in r.json()["error"]["message"]
        stream.close()  # 3500 tokens at 10 ms: open through every step above on a slow machine
        text = httpx.get(gw.url + "/metrics", timeout=5).text
        invalid = [ln for ln in text.splitlines()
                   if ln.startswith("gateway_config_reloads_total{") and 'outcome="invalid"' in ln]
        assert invalid and float(invalid[0].rsplit(" ", 1)[1]) >= 6, invalid
    finally:
        gw.stop()


def test_a_damaged_snapshot_is_moved_aside_shown_and_not_counted_among_the_kept(
        sims, tmp_path):
    """The state directory holds a truncated snapshot and one of the wrong shape: the start
    moves them aside (``*.damaged``, kept for the operator) and ``GET /admin/config/history``
    lists them; the rotation then keeps the last 3 valid snapshots (``reload.keep``)."""
    a = sims("A")
    d = tmp_path / "config-history"
    d.mkdir()
    (d / "00000001.json").write_text('{"version": 1, "config": {"backe')  # truncated
    (d / "00000002.json").write_text('{"version": 2, "source": "admin"}')  # wrong shape
    gw = GatewayThread(gateway_config([{"id": "a", "url": a.url}],
                                      reload={"state_dir": str(tmp_path)}))
    gw.start()
    try:
        for i in range(3):
            data = gw.gateway.cfg.model_dump(mode="json")
            data["routing"]["weights"]["waiting"] = 2.0 + i
            assert post_config(gw, yaml.safe_dump(data)).status_code == 200
        hist = httpx.get(gw.url + "/admin/config/history", timeout=5).json()
        assert [h["version"] for h in hist["data"]] == [6, 5, 4], hist  # 1, 2 not reused
        assert sorted(p.name for p in d.glob("*.json")) == [
            "00000004.json", "00000005.json", "00000006.json"]
        damaged = hist["damaged"]
        assert [x["file"] for x in damaged] == ["00000001.json.damaged",
                                                "00000002.json.damaged"], damaged
        assert "not JSON" in damaged[0]["problem"], damaged
        assert "not a snapshot" in damaged[1]["problem"], damaged
        assert all(x["moved"] for x in damaged)
        assert (d / "00000001.json.damaged").read_text().startswith('{"version": 1')
    finally:
        gw.stop()
