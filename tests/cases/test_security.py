"""Secure by default (issue 20), as a client on the network meets it.

* Without an admin key, ``/admin/*`` answers loopback clients only: a request from one of
  the test host's own non-loopback addresses (``tests/support/netaddr.py``: the kernel uses
  it as the source when the client binds to it) gets 403 in OpenAI's shape, and the drain
  it asked for did not happen; so does a loopback request relayed by a proxy
  (``X-Forwarded-For``). With a key (read from a file), the same request needs the key and
  then drains (202).
* Every route under ``/admin`` is guarded, including any added later (the route table is
  read, not listed here).
* Keys and backend credentials from files and the environment never show: distinctive
  secret values are grepped for in every admin view, the status page, ``/metrics``, error
  answers and the captured logs.
* The status page shows backend ids to loopback clients and the admin key's holders only.
* ``x-priority`` is bounded by what the key was granted, counted when capped, and never
  forwarded to the backend.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from gateway.config import ConfigError, check_secrets, load_config
from tests.lifecycle.support import MODEL, Sim, chat_body, metric, metric_samples
from tests.support.netaddr import non_loopback_address
from tests.support.scripted import ScriptedBackend, wait_for
from tests.support.servers import GatewayThread, gateway_config

ADMIN = "adm-7f3c1e9b5d2a"  # distinctive: grepped for on every surface
CLIENT_FILE = "cli-file-4b8e2d6a9c1f"
CLIENT_ENV = "cli-env-2c9d7a4e6b3f"
BACKEND = "be-key-9a1d5c3e7b2f"
SECRETS = (ADMIN, CLIENT_FILE, CLIENT_ENV, BACKEND)
ENV_NAME = "GW_TEST_CLIENT_KEY_20"


@pytest.fixture(scope="module")
def remote_addr() -> Iterator[str]:
    with non_loopback_address() as addr:
        if addr is None:
            pytest.skip("this host has no non-loopback address and cannot add one (not root)")
        yield addr


@pytest.fixture(scope="module")
def sim() -> Iterator[Sim]:
    s = Sim("a", api_key=BACKEND)  # the gateway must send the key it read from a file
    yield s
    s.kill()


@pytest.fixture(scope="module")
def secret_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("secrets")
    out = {}
    for name, value in (("admin", ADMIN), ("client", CLIENT_FILE), ("backend", BACKEND)):
        p = d / name
        p.write_text(value + "\n")  # as `echo` and `kubectl create secret --from-file` leave
        out[name] = str(p)
    return out


def _start(cfg: Any) -> GatewayThread:
    gw = GatewayThread(cfg, host="0.0.0.0")
    gw.start()
    return gw


@pytest.fixture(scope="module")
def open_gw(sim: Sim, secret_files: dict[str, str]) -> Iterator[GatewayThread]:
    """No admin key, no client keys; listening on every interface."""
    gw = _start(gateway_config([{"id": "a", "url": sim.url, "models": [MODEL],
                                 "api_key_file": secret_files["backend"]}]))
    yield gw
    gw.stop()


@pytest.fixture(scope="module")
def keyed_gw(sim: Sim, secret_files: dict[str, str]) -> Iterator[GatewayThread]:
    """The admin key from a file, one client key from a file and one from the
    environment, the backend's key from a file."""
    os.environ[ENV_NAME] = CLIENT_ENV
    cfg = gateway_config(
        [{"id": "a", "url": sim.url, "models": [MODEL], "api_key_file": secret_files["backend"]}],
        auth={"admin_key_file": secret_files["admin"],
              "client_keys": [{"name": "filed", "key_file": secret_files["client"]},
                              {"name": "envd", "key_env": ENV_NAME}]})
    gw = _start(cfg)
    yield gw
    gw.stop()
    os.environ.pop(ENV_NAME, None)


def _remote(gw: GatewayThread, addr: str) -> tuple[httpx.Client, str]:
    """A client whose connections come from ``addr``, and the gateway's URL there."""
    port = gw.url.rsplit(":", 1)[1]
    transport = httpx.HTTPTransport(local_address=addr)
    return httpx.Client(transport=transport, timeout=10), f"http://{addr}:{port}"


def _assert_openai_error(r: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["code"] == code, err
    return dict(err)


def _routable(gw: GatewayThread) -> list[str]:
    return list(httpx.get(gw.url + "/ready/fleet", timeout=5).json()["routable"])


def test_admin_drain_from_a_non_loopback_address_needs_the_key(
        open_gw: GatewayThread, keyed_gw: GatewayThread, remote_addr: str) -> None:
    client, base = _remote(open_gw, remote_addr)
    with client:
        r = client.post(base + "/admin/backends/a/drain")
        err = _assert_openai_error(r, 403, "admin_loopback_only")
        assert err["type"] == "permission_error"
        assert "auth.admin_key_file" in err["message"] and "auth.admin_key_env" in err["message"]
        assert "a" in _routable(open_gw)
        ok = client.post(base + "/v1/chat/completions", json=chat_body())  # still served
        assert ok.status_code == 200, ok.text
    # a loopback peer that relays for someone else is not loopback
    r = httpx.post(open_gw.url + "/admin/backends/a/drain", timeout=10,
                   headers={"x-forwarded-for": "203.0.113.9"})
    _assert_openai_error(r, 403, "admin_loopback_only")
    assert httpx.get(open_gw.url + "/admin/backends/a", timeout=10).status_code == 200

    client, base = _remote(keyed_gw, remote_addr)
    with client:
        _assert_openai_error(client.post(base + "/admin/backends/a/drain"), 401,
                             "invalid_api_key")
        _assert_openai_error(client.post(base + "/admin/backends/a/drain",
                                         headers={"authorization": "Bearer " + ADMIN[:-1]}),
                             401, "invalid_api_key")
        assert "a" in _routable(keyed_gw)
        auth = {"authorization": f"Bearer {ADMIN}"}  # the file's content, newline stripped
        r = client.post(base + "/admin/backends/a/drain", headers=auth)
        assert r.status_code == 202, r.text
        assert wait_for(lambda: "a" not in _routable(keyed_gw), 10)  # out of rotation
        assert client.post(base + "/admin/backends/a/undrain", headers=auth).status_code == 200
    assert wait_for(lambda: "a" in _routable(keyed_gw), 10)


def test_every_admin_route_refuses_a_remote_client_without_a_key(
        open_gw: GatewayThread, remote_addr: str) -> None:
    routes = [(m, re.sub(r"\{[^}]*\}", "x", r.path))
              for r in open_gw.app.routes if getattr(r, "path", "").startswith("/admin")
              for m in sorted(getattr(r, "methods", None) or ())]
    assert len(routes) >= 15, routes  # backends, actions, config, rollouts, zones, fleet
    client, base = _remote(open_gw, remote_addr)
    with client:
        got = {(m, p): client.request(m, base + p).status_code for m, p in routes}
    assert set(got.values()) == {403}, got
    assert "a" in _routable(open_gw)


def _grep(text: str, where: str) -> None:
    for s in SECRETS:
        assert s not in text, f"a secret ({s[:4]}...) shows in {where}"


def test_secrets_from_files_and_env_never_show(
        keyed_gw: GatewayThread, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    admin = {"authorization": f"Bearer {ADMIN}"}
    base = keyed_gw.url
    # the keys work: from the file (newline stripped) and the environment
    for key in (CLIENT_FILE, CLIENT_ENV):
        r = httpx.post(base + "/v1/chat/completions", json=chat_body(), timeout=30,
                       headers={"authorization": f"Bearer {key}"})
        assert r.status_code == 200, r.text  # the backend's key (file) was sent too
    seen: dict[str, str] = {}
    for path in ("/admin/config", "/admin/config/history", "/admin/backends",
                 "/admin/backends/a", "/admin/fleet", "/admin/rollouts", "/admin/zones",
                 "/status", "/status.json", "/metrics", "/ready", "/ready/fleet",
                 "/v1/models"):
        auth = {"authorization": f"Bearer {CLIENT_FILE}"} if path.startswith("/v1") else admin
        r = httpx.get(base + path, headers=auth, timeout=10)
        assert r.status_code == 200, (path, r.text)
        seen[path] = r.text
    shown = json.loads(seen["/admin/config"])["config"]
    assert shown["auth"]["admin_key_file"].endswith("admin")  # the path, not the key
    # error answers: wrong keys, a bad config posted, an unknown model
    errors = [
        httpx.post(base + "/v1/chat/completions", json=chat_body(), timeout=10,
                   headers={"authorization": f"Bearer {CLIENT_FILE}x"}),
        httpx.get(base + "/admin/backends", timeout=10,
                  headers={"authorization": f"Bearer {ADMIN}x"}),
        httpx.post(base + "/admin/config", timeout=10,
                   headers={**admin, "content-type": "application/yaml"},
                   content=f"auth: {{admin_key: 7, client_keys: [{{name: x, key: {BACKEND}}}, "
                           f"{{name: y, key: {BACKEND}}}]}}"),
        httpx.post(base + "/v1/chat/completions", timeout=10,
                   json={**chat_body(), "model": "nope"},
                   headers={"authorization": f"Bearer {CLIENT_ENV}"}),
    ]
    assert [r.status_code for r in errors] == [401, 401, 400, 404], [r.text for r in errors]
    for r in errors:
        seen[f"{r.request.method} {r.request.url.path} -> {r.status_code}"] = r.text
    # a config whose key file cannot be read names the field, and shows no secret
    cfg = load_config(None, backends=[{"id": "b", "url": "http://127.0.0.1:9",
                                       "api_key_file": "/nonexistent/key"}])
    with pytest.raises(ConfigError, match=r"backends\[b\]\.api_key_file: cannot read"):
        check_secrets(cfg)
    for where, text in seen.items():
        _grep(text, where)
    _grep("\n".join(r.getMessage() for r in caplog.records), "the logs")


def test_a_rotated_key_file_is_read_again_on_reload(
        keyed_gw: GatewayThread, secret_files: dict[str, str]) -> None:
    """The admin key's file rewritten (a rotated secret), the config unchanged: a reload
    (here ``POST /admin/config`` of the running view) takes the new key up."""
    url, path = keyed_gw.url, Path(secret_files["admin"])

    def reload(key: str) -> int:
        view = httpx.get(url + "/admin/config", timeout=10,
                         headers={"authorization": f"Bearer {key}"}).json()
        return httpx.post(url + "/admin/config", json=view, timeout=10,
                          headers={"authorization": f"Bearer {key}"}).status_code

    def status(key: str) -> int:
        return httpx.get(url + "/admin/backends", timeout=10,
                         headers={"authorization": f"Bearer {key}"}).status_code

    rotated = ADMIN + "-rotated"
    try:
        path.write_text(rotated + "\n")
        assert status(ADMIN) == 200  # read at start and at reloads only
        assert reload(ADMIN) == 200
        assert (status(ADMIN), status(rotated)) == (401, 200)
    finally:
        path.write_text(ADMIN + "\n")
        reload(rotated)
    assert status(ADMIN) == 200


def test_the_status_page_shows_backend_ids_to_loopback_and_admin_key_holders_only(
        keyed_gw: GatewayThread, remote_addr: str) -> None:
    local = httpx.get(keyed_gw.url + "/status.json", timeout=10).json()
    assert local["details"] is True and [b["id"] for b in local["backends"]] == ["a"]
    client, base = _remote(keyed_gw, remote_addr)
    with client:
        anon = client.get(base + "/status.json").json()
        page = client.get(base + "/status")
        held = client.get(base + "/status.json",
                          headers={"authorization": f"Bearer {ADMIN}"}).json()
    assert anon["details"] is False and anon["backends"] == []
    assert anon["models"][0]["availability"]["routable_backends"] == 1  # still useful
    assert page.status_code == 200 and "status.public_details" in page.text
    assert "<td>a</td>" not in page.text and "<td>a</td>" in httpx.get(
        keyed_gw.url + "/status", timeout=10).text
    assert held["details"] is True and held["backends"][0]["id"] == "a"
    for path in ("/status", "/status.json"):  # answers differ by caller: no shared cache
        r = httpx.get(keyed_gw.url + path, timeout=10)
        assert r.headers["cache-control"] == "private, no-store", path
        assert r.headers["vary"] == "Authorization", path


def test_priority_is_granted_not_claimed_and_never_forwarded(
        backends: Callable[..., ScriptedBackend],
        gateway: Callable[..., GatewayThread]) -> None:
    a = backends()
    gw = gateway({"a": a}, auth={"client_keys": [
        {"name": "web", "key": "sk-web"},  # max_priority: its priority (normal)
        {"name": "ops", "key": "sk-ops", "max_priority": "high"}]})
    for key in ("sk-web", "sk-ops"):
        r = httpx.post(gw.url + "/v1/chat/completions", timeout=10,
                       json={"model": "m1", "messages": [{"role": "user", "content": "hi"}]},
                       headers={"authorization": f"Bearer {key}", "x-priority": "high"})
        assert r.status_code == 200, r.text
    assert a.data_requests and all("x-priority" not in rq.headers for rq in a.data_requests)
    m = metric_samples(gw.url)
    assert metric(m, "gateway_priority_capped_total", key="web", asked="high",
                  granted="normal") == 1
    assert metric(m, "gateway_priority_capped_total", key="ops", asked="high",
                  granted="high") is None
    gate, keys = gw.gateway.gate, {k.name: k for k in gw.gateway.cfg.auth.client_keys}
    assert [gate.priority(p, keys["web"]).label for p in (b"high", b"low", None)] == [
        "normal", "low", "normal"]
    assert gate.priority(b"high", keys["ops"]).label == "high"
    assert gate.priority(b"high", None).label == "normal"  # auth.anonymous_max_priority


def test_key_files_and_priority_bounds_are_checked_at_load(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("\n")
    cfg = load_config(None, auth={"admin_key_file": str(empty)})
    with pytest.raises(ConfigError, match=r"auth\.admin_key_file: .* is empty"):
        check_secrets(cfg)
    with pytest.raises(ConfigError, match="at most one of admin_key, admin_key_env"):
        load_config(None, auth={"admin_key": "x", "admin_key_file": str(empty)})
    with pytest.raises(ConfigError, match="priority 'high' is above max_priority 'normal'"):
        load_config(None, auth={"client_keys": [{"name": "k", "key": "v", "priority": "high",
                                                 "max_priority": "normal"}]})
    same = tmp_path / "same"
    same.write_text("one-secret")
    cfg = load_config(None, auth={"client_keys": [{"name": "a", "key": "one-secret"},
                                                  {"name": "b", "key_file": str(same)}]})
    with pytest.raises(ConfigError, match="'a' and 'b' have the same key"):
        check_secrets(cfg)


def test_a_web_page_cannot_drive_the_keyless_admin_api(open_gw: GatewayThread) -> None:
    """Loopback-only mode against a browser (OWASP CSRF cheat sheet; DNS rebinding): a
    cross-site POST, a foreign ``Origin`` or a ``Host`` that is not a loopback name gets
    403 ``admin_cross_site`` and changes nothing; a body that is not JSON or YAML (what a
    form or a CORS-simple request sends) gets 415, key or not."""
    base, port = open_gw.url, open_gw.url.rsplit(":", 1)[1]
    drain = base + "/admin/backends/a/drain"
    browser = [  # what a page on https://evil.example makes the browser send
        {"sec-fetch-site": "cross-site", "origin": "https://evil.example",
         "content-type": "text/plain"},
        {"sec-fetch-site": "same-site", "content-type": "application/json"},
        {"origin": "https://evil.example", "content-type": "application/json"},
        {"origin": "null", "content-type": "application/json"},
        {"host": f"rebind.evil.example:{port}", "content-type": "application/json"},
    ]
    for headers in browser:
        r = httpx.post(drain, content=b'{"deadline_s": 0}', headers=headers, timeout=10)
        err = _assert_openai_error(r, 403, "admin_cross_site")
        assert "auth.admin_key_file" in err["message"], err
    r = httpx.post(base + "/admin/config", content=b"backends: []", timeout=10,
                   headers={"sec-fetch-site": "cross-site", "content-type": "text/plain"})
    _assert_openai_error(r, 403, "admin_cross_site")
    rebound = {"host": f"rebind.evil.example:{port}"}  # DNS rebinding reads nothing
    _assert_openai_error(httpx.get(base + "/admin/config", headers=rebound, timeout=10),
                         403, "admin_cross_site")
    assert httpx.get(base + "/status.json", headers=rebound, timeout=10).json()[
        "details"] is False
    assert "a" in _routable(open_gw)
    # no browser, or the gateway's own page on a loopback name: served
    for headers in ({"host": f"localhost:{port}", "origin": f"http://localhost:{port}",
                     "sec-fetch-site": "same-origin"},
                    {"host": f"[::1]:{port}"}, {"host": f"gw.localhost:{port}"}, {}):
        assert httpx.get(base + "/admin/backends", headers=headers,
                         timeout=10).status_code == 200, headers
    # a body must say it is JSON or YAML
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                  None):
        r = httpx.post(drain, content=b'{"deadline_s": 0}', timeout=10,
                       headers={"content-type": ctype} if ctype else {})
        _assert_openai_error(r, 415, "unsupported_media_type")
    assert "a" in _routable(open_gw)
    r = httpx.post(drain, content=b'{"deadline_s": 30}', timeout=10,
                   headers={"content-type": "application/json; charset=utf-8"})
    assert r.status_code == 202, r.text
    assert httpx.post(base + "/admin/backends/a/undrain", timeout=10).status_code == 200
    assert wait_for(lambda: "a" in _routable(open_gw), 10)


def test_an_admin_body_must_be_json_or_yaml_with_a_key_too(keyed_gw: GatewayThread) -> None:
    auth = {"authorization": f"Bearer {ADMIN}"}
    r = httpx.post(keyed_gw.url + "/admin/backends/a/drain", content=b"{}", timeout=10,
                   headers={**auth, "content-type": "text/plain"})
    _assert_openai_error(r, 415, "unsupported_media_type")
    # the key defeats cross-site requests by itself: a browser never attaches it
    r = httpx.get(keyed_gw.url + "/admin/backends", timeout=10,
                  headers={**auth, "origin": "https://ops.example", "sec-fetch-site":
                           "cross-site"})
    assert r.status_code == 200, r.text


def test_config_errors_never_echo_a_misspelled_or_secret_fields_value(
        open_gw: GatewayThread) -> None:
    """A typo'd field name (``adminkey``) may hold a key: its value is never echoed, nor a
    secret field's, nor a URL's user info, in ``POST /admin/config``'s 400 or
    :func:`load_config`'s message (what ``check-config``, the start-up log and a SIGHUP
    reload print)."""
    hush = "hush-5e1b7c9d3a"
    bad = [
        f"auth: {{adminkey: {hush}}}\n",
        f"backends: [{{id: a, url: 'http://127.0.0.1:1', models: [m], apikey: {hush}}}]\n",
        f"auth: {{admin_key: [{hush}]}}\n",
        f"auth: {{client_keys: [{{name: k, key: {hush}, key_env: X, priority: low}}]}}\n",
        f"backends: [{{id: a, url: 'http://u:{hush}@127.0.0.1:x', models: [m]}}]\n",
        f"coordination: {{redis_url: 'redis://{hush}@127.0.0.1:6379/x'}}\n",
    ]
    for text in bad:
        r = httpx.post(open_gw.url + "/admin/config", content=text.encode(), timeout=10,
                       headers={"content-type": "application/yaml"})
        err = _assert_openai_error(r, 400, "invalid_config")
        assert hush not in r.text, (text, err["message"])
        with pytest.raises(ConfigError) as info:
            load_config(None, **yaml.safe_load(text))
        assert hush not in str(info.value), (text, str(info.value))
    with pytest.raises(ConfigError, match=r"auth\.adminkey: unknown field \(check the "
                       r"spelling\)$"):
        load_config(None, auth={"adminkey": hush})


def test_a_dead_backends_address_reaches_the_logs_not_the_client(
        backends: Callable[..., ScriptedBackend], gateway: Callable[..., GatewayThread],
        caplog: pytest.LogCaptureFixture) -> None:
    """A backend that refuses connections: the anonymous client (the openai SDK) is told
    which backend by id, never its host and port (``Cannot connect to host 127.0.0.1:N``);
    the logs and ``/admin/backends``' ``last_error`` keep the detail."""
    caplog.set_level(logging.INFO)
    a = backends()
    gw = gateway({"a": a}, health={"interval_s": 60.0, "timeout_s": 1.0})  # one probe: up
    port = a.url.rsplit(":", 1)[1]
    a.stop()  # connection refused from now on; the gateway still thinks it warm
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model="m1", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.APIStatusError) as by_id:
        client.responses.retrieve("resp_0123456789abcdef")
    for e in (info.value, by_id.value):
        said = str(e) + e.response.text
        assert "backend 'a'" in said, said
        assert port not in said and "127.0.0.1" not in said and "Connect call" not in said, said
    assert info.value.status_code == 502
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert f"127.0.0.1:{port}" in logged  # the operator's detail
    shown = httpx.get(gw.url + "/admin/backends/a", timeout=5).json()
    assert port in json.dumps(shown.get("last_error"))


def test_n_and_best_of_are_bounded_by_proxy_max_n(
        open_gw: GatewayThread, backends: Callable[..., ScriptedBackend],
        gateway: Callable[..., GatewayThread]) -> None:
    """One anonymous request with ``n: 65536, max_tokens: 1`` would make 65536 sequences
    on one backend: above ``proxy.max_n`` (default 128, OpenAI's own bound) it is a 400
    ``invalid_value`` on ``n`` (or ``best_of``) that no backend sees."""
    client = openai.OpenAI(base_url=open_gw.url + "/v1", api_key="x", max_retries=0)
    msgs: Any = [{"role": "user", "content": "hi"}]
    for n in (65536, 129):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=msgs, n=n, max_tokens=1)
        err = info.value.body
        assert isinstance(err, dict) and (err["code"], err["param"]) == ("invalid_value", "n")
        assert "128" in err["message"] and "proxy.max_n" in err["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="a", best_of=129, max_tokens=1)
    assert isinstance(info.value.body, dict) and info.value.body["param"] == "best_of"
    ok = client.chat.completions.create(model=MODEL, messages=msgs, n=2, max_tokens=1)
    assert len(ok.choices) == 2
    a = backends()
    gw = gateway({"a": a}, proxy={"max_n": 4})
    r = httpx.post(gw.url + "/v1/chat/completions", timeout=10,
                   json={"model": "m1", "messages": msgs, "n": "5"})  # read as vLLM reads it
    assert _assert_openai_error(r, 400, "invalid_value")["param"] == "n"
    assert not a.data_requests


def test_a_backend_urls_password_shows_in_no_view(
        backends: Callable[..., ScriptedBackend], caplog: pytest.LogCaptureFixture) -> None:
    """``backends[].url`` with user info: every admin view (and the logs) shows the user
    and ``***``, one helper for all (``gateway.core.urls.redacted_url``)."""
    caplog.set_level(logging.INFO)
    pw = "pw-3f8a1c6e9d"
    a = backends()
    url = a.url.replace("http://", f"http://ops:{pw}@")
    with GatewayThread(gateway_config([{"id": "a", "url": url}])) as gw:
        views = {p: httpx.get(gw.url + p, timeout=10) for p in (
            "/admin/backends", "/admin/backends/a", "/admin/config", "/status.json")}
    for path, r in views.items():
        assert r.status_code == 200 and pw not in r.text, (path, r.text)
    assert views["/admin/backends/a"].json()["url"] == url.replace(pw, "***")
    # the gateway's own lines (httpx's per-request INFO lines are off: gateway.logs)
    assert pw not in "\n".join(r.getMessage() for r in caplog.records
                               if r.name.startswith("gateway"))


def test_every_breaker_open_is_a_503_with_retry_after_not_a_rate_limit(
        backends: Callable[..., ScriptedBackend],
        gateway: Callable[..., GatewayThread]) -> None:
    """The only backend fails until its breaker opens: the gateway's fast-fail is 503
    ``no_backend_available`` with ``Retry-After`` (RFC 9110 §15.6.4), which the openai SDK
    raises as a server error, never ``RateLimitError`` (that tells users their own key is
    limited); counted ``no_backend``."""

    async def failing(req: Any, conn: Any) -> None:
        await conn.send_json(500, {"error": {"message": "boom", "type": "server_error"}})

    a = backends(failing)
    gw = gateway({"a": a}, breaker={"consecutive_failures": 1, "open_base_s": 60,
                                    "open_max_s": 120}, proxy={"max_attempts": 1})
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    msgs: Any = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.InternalServerError):  # the backend's own 500, relayed
        client.chat.completions.create(model="m1", messages=msgs)
    asked = len(a.data_requests)
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model="m1", messages=msgs)
    e = info.value
    assert not isinstance(e, openai.RateLimitError) and e.status_code == 503, e
    assert isinstance(e.body, dict) and e.body["code"] == "no_backend_available", e.body
    assert 1 <= int(e.response.headers["retry-after"]) <= 60
    assert len(a.data_requests) == asked  # no backend was asked
    m = metric_samples(gw.url)
    assert metric(m, "gateway_request_errors_total", model="m1", error_type="no_backend") == 1
