"""Probes that fit Kubernetes (issue 15 item 4), through real HTTP: ``/ready`` is the
gateway's own readiness, not the fleet's. With every backend down the gateway stays ready
and answers each model request itself, 503 with ``retry-after`` in the OpenAI error shape
(as the ``openai`` SDK sees it); the fleet's view is ``/ready/fleet``; the gateway is not
ready while one of its own checks fails (a control loop stuck in a round, a registered
check such as discovery's). Shutting down (503) is ``test_shutdown.py``'s."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from tests.lifecycle.support import MODEL, sdk, sdk_kwargs
from tests.support.scripted import wait_for
from tests.support.servers import GatewayThread, gateway_config

PROMPT = "Say something."

# every model route a client of a down fleet may call: (name, call on an openai client)
CALLS: list[tuple[str, Callable[[openai.OpenAI], Any]]] = [
    ("chat", lambda c: c.chat.completions.create(**sdk_kwargs(4))),
    ("chat stream", lambda c: c.chat.completions.create(**sdk_kwargs(4, stream=True))),
    ("completions", lambda c: c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)),
    ("completions stream", lambda c: c.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, stream=True)),
    ("embeddings", lambda c: c.embeddings.create(model=MODEL, input=PROMPT)),
]


def refused_503(call: Callable[[openai.OpenAI], Any], client: openai.OpenAI) -> dict[str, Any]:
    """Run ``call``; it must fail with the gateway's own 503: ``retry-after`` (whole seconds,
    at least 1) and an OpenAI-shaped error body. Returns the error object."""
    with pytest.raises(openai.APIStatusError) as exc:
        call(client)
    e = exc.value
    assert e.status_code == 503, (e.status_code, e.response.text)
    assert int(e.response.headers["retry-after"]) >= 1
    err = e.response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    return err  # type: ignore[no-any-return]


def closed_port_url() -> str:
    """A URL nothing listens on (connection refused)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}"


@pytest.mark.parametrize("batcher", [False, True], ids=["direct", "batcher"])
def test_all_backends_down_gateway_stays_ready_and_answers_503_itself(sims, lc_gateway,
                                                                      batcher):
    """Two backends serving ``m1`` are killed: once neither is routable, ``/ready/fleet``
    is 503 (both ``unhealthy``, ``m1`` with 0 of 2 routable) while ``/ready`` stays 200,
    and chat, completions (each streamed and not) and embeddings through the ``openai``
    SDK get the gateway's 503 ``no_backend_available`` with ``retry-after``; with the
    predictive batcher too."""
    a, b = sims("A"), sims("B")
    gw = lc_gateway({"a": a.url, "b": b.url}, batcher={"enabled": batcher})
    fleet = httpx.get(gw.url + "/ready/fleet").json()
    assert fleet["routable"] == ["a", "b"] and fleet["states"] == {"warm": 2}
    a.kill()
    b.kill()
    assert wait_for(lambda: httpx.get(gw.url + "/ready/fleet").status_code == 503, 15)
    assert wait_for(lambda: httpx.get(gw.url + "/ready/fleet").json()["states"]
                    == {"unhealthy": 2}, 15), httpx.get(gw.url + "/ready/fleet").text

    client = sdk(gw.url)
    for name, call in CALLS:
        err = refused_503(call, client)
        assert err["code"] == "no_backend_available", (name, err)

    fleet = httpx.get(gw.url + "/ready/fleet").json()
    assert fleet["status"] == "no_routable_backend" and fleet["routable"] == []
    assert fleet["backends"] == 2 and fleet["models"] == {MODEL: {"backends": 2, "routable": 0}}
    r = httpx.get(gw.url + "/ready")
    assert r.status_code == 200, r.text  # the gateway answers: keep it in the Service
    assert r.json()["status"] == "ready"
    assert r.json()["checks"]["control_loops"]["ok"] is True


def test_backends_never_reached_gateway_is_ready_and_answers_503():
    """A gateway whose only backend never answered (nothing listens there) is ready
    (``/ready`` 200, after its start-up probe round) and answers 503 with ``retry-after``;
    ``/ready/fleet`` says the backend is ``cold`` and none is routable."""
    cfg = gateway_config([{"id": "gone", "url": closed_port_url()}])
    gw = GatewayThread(cfg)
    gw.start(wait_ready=False)  # (its wait_ready also waits for a routable backend)
    try:
        assert wait_for(lambda: httpx.get(gw.url + "/ready").status_code == 200, 15), \
            httpx.get(gw.url + "/ready").text
        fleet = httpx.get(gw.url + "/ready/fleet")
        assert fleet.status_code == 503
        assert fleet.json()["routable"] == [] and fleet.json()["states"] == {"cold": 1}
        client = sdk(gw.url)
        for name, call in CALLS:
            err = refused_503(call, client)
            assert err["code"] == "no_backend_available", (name, err)
    finally:
        gw.stop()


def test_not_ready_while_a_control_loop_is_stuck_in_a_round(sims, lc_gateway):
    """A control loop whose round does not end within its stall bound makes the gateway
    not ready (503 ``not_ready``, ``failing: ["control_loops"]``, the loop named in the
    detail) while its backends stay routable; when the round ends it is ready again."""
    a = sims("A")
    gw = lc_gateway({"a": a.url})
    assert httpx.get(gw.url + "/ready").status_code == 200
    release: dict[str, asyncio.Event] = {}

    async def add_stuck_loop() -> None:
        release["event"] = event = asyncio.Event()

        async def stuck_round() -> None:
            await event.wait()

        gw.gateway.controller.add_loop("stuck_round", 0.05, stuck_round, stall_after_s=0.5)

    gw.run(add_stuck_loop())
    assert wait_for(lambda: httpx.get(gw.url + "/ready").status_code == 503, 10)
    body = httpx.get(gw.url + "/ready").json()
    assert body["status"] == "not_ready" and body["failing"] == ["control_loops"], body
    assert "stuck_round" in body["checks"]["control_loops"]["detail"]
    assert httpx.get(gw.url + "/ready/fleet").json()["routable"] == ["a"]

    async def unstick() -> None:
        release["event"].set()

    gw.run(unstick())
    assert wait_for(lambda: httpx.get(gw.url + "/ready").status_code == 200, 10), \
        httpx.get(gw.url + "/ready").text


def test_not_ready_until_a_registered_check_passes(sims, lc_gateway):
    """A check registered on the gateway's readiness (as discovery registers its own)
    keeps ``/ready`` at 503 naming it and its detail until it passes; a check that raises
    is a failing check, its exception in the detail, not a broken probe."""
    a = sims("A")
    gw = lc_gateway({"a": a.url})
    synced = {"value": False, "raise": False}

    def discovery_check() -> tuple[bool, str]:
        if synced["raise"]:
            raise RuntimeError("source gone")
        return synced["value"], "first snapshot in" if synced["value"] else "no snapshot yet"

    async def register() -> None:
        gw.gateway.readiness.add("test_check", discovery_check)

    gw.run(register())
    r = httpx.get(gw.url + "/ready")
    assert r.status_code == 503 and r.json()["failing"] == ["test_check"], r.text
    assert r.json()["checks"]["test_check"] == {"ok": False, "detail": "no snapshot yet"}
    assert r.json()["checks"]["control_loops"]["ok"] is True
    synced["value"] = True
    r = httpx.get(gw.url + "/ready")
    assert r.status_code == 200 and r.json()["checks"]["test_check"]["ok"] is True, r.text
    synced["raise"] = True
    r = httpx.get(gw.url + "/ready")
    assert r.status_code == 503 and "RuntimeError: source gone" in \
        r.json()["checks"]["test_check"]["detail"], r.text


def test_the_discovery_check_of_a_static_fleet_counts_its_backends(sims, lc_gateway):
    """``/ready``'s ``discovery`` detail says what the fleet came from, with the count
    ``gateway_discovery_endpoints{source="static"}`` gives, not "0 endpoints"."""
    a, b = sims("A"), sims("B")
    gw = lc_gateway({"a": a.url, "b": b.url})
    r = httpx.get(gw.url + "/ready")
    assert r.status_code == 200, r.text
    assert r.json()["checks"]["discovery"] == {"ok": True,
                                               "detail": "static: 2 backends from the config"}
    gauge = [line for line in httpx.get(gw.url + "/metrics").text.splitlines()
             if line.startswith('gateway_discovery_endpoints{source="static"}')]
    assert gauge == ['gateway_discovery_endpoints{source="static"} 2.0']
