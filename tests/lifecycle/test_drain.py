"""Draining a backend (case BUG-21), undrain and spot preemption, end to end through the
gateway's HTTP API with simulated vLLM backends.

BUG-21 (kthena #1589): scale-down deleted engines while long generations ran and the router
kept dispatching to them. Here: in-flight streams on a draining backend finish with
``[DONE]``; new requests go elsewhere; the backend counts as drained only at in-flight 0;
with every backend of the model draining, new requests get 503 + ``retry-after``; at a drain
deadline the remaining streams end with an explicit error event then ``[DONE]``, and are never
re-sent elsewhere once bytes reached the client."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import openai
import pytest

from tests.lifecycle.support import (
    MODEL,
    Background,
    Monitor,
    StreamResult,
    admin,
    chat_body,
    history,
    metric,
    metric_samples,
    pin_on_a,
    post_admin,
    sdk,
    sdk_kwargs,
    stream_chat,
    wait_state,
)
from tests.support.scripted import wait_for

HELD_PROBES = 7
"""Passing probes a held-out backend must sit through (what 1.5 s of the test config's
0.2 s interval gives; ``recover_threshold`` is 2): far more than would bring back a backend
that nothing holds."""


def passing_probes(url: str, backend: str) -> float:
    """How many of ``backend``'s probes have passed (``gateway_probe_results_total``)."""
    return metric(metric_samples(url), "gateway_probe_results_total", backend=backend,
                  result="ok") or 0.0


def sit_through_probes(url: str, backend: str, n: int = HELD_PROBES) -> None:
    """Wait until ``n`` more of ``backend``'s probes have passed."""
    target = passing_probes(url, backend) + n
    assert wait_for(lambda: passing_probes(url, backend) >= target, 10), (
        passing_probes(url, backend), target)


# ---- BUG-21 --------------------------------------------------------------------------------

OFF = {"x-gateway-continuation": "off"}  # a cut stream is not continued elsewhere
IN_FLIGHT_TOKENS = 50  # A decodes 10 tokens/s: each in-flight stream lasts ~5 s


def test_BUG_21_drain_lets_streams_finish_and_sends_new_work_elsewhere(sims, lc_gateway):
    """BUG-21 repro, scaled from 30 s streams (drain at 2 s, 1 new stream/s until 35 s) to
    ~5 s streams of 10 chunks/s (drain once each has sent bytes; a new stream every 0.25 s
    for 4 s), with the default drain deadline (``lifecycle.drain_deadline_s``, 60 s):

    * the 3 streams in flight on A finish normally: every token, ``finish_reason``, one
      ``[DONE]``, no error event;
    * every request started after the drain (streams, a non-stream through the SDK) is a 200
      from B; A's simulator receives 0 new generation requests;
    * A reports ``drained`` only once its in-flight count reached 0 (and stays ``draining``:
      out of rotation), with the transition counted in ``/metrics``;
    * ``/v1/models`` keeps listing m1 (B serves it);
    * then B is drained too: a new m1 request gets a 503 OpenAI error with ``retry-after``
      (SDK and raw stream request alike), not a hang or a 404."""
    a, b = sims("A", itl_s=0.1), sims("B", itl_s=0.01)
    gw = lc_gateway({"a": a.url, "b": b.url})
    url = gw.url
    fp = {a.fingerprint: "A", b.fingerprint: "B"}

    body = chat_body(IN_FLIGHT_TOKENS, stream=True)
    first = threading.Semaphore(0)
    old = pin_on_a(url, [lambda i=i: stream_chat(url, body, f"old-{i}",
                                                 on_first_event=first.release)
                         for i in range(3)], 3)
    for _ in range(3):  # every stream has sent bytes to its client
        assert first.acquire(timeout=10)
    a_chats_before = a.chat_requests()
    assert a_chats_before == 3

    drained_req = post_admin(url, "a", "drain")
    drain_at = time.monotonic()
    monitor = Monitor(url)
    assert drained_req.status_code == 202, drained_req.text
    a_now = admin(url, "a")
    assert a_now["state"] == "draining" and a_now["drained"] is False
    assert a_now["in_flight"] == 3, a_now  # the precondition: all three still streaming
    assert a_now["drain_deadline_in_s"] >= 30, a_now  # default deadline: >= 30 s

    new: list[Background] = []
    client = sdk(url)
    for i in range(16):
        new.append(Background(
            lambda i=i: stream_chat(url, chat_body(8, stream=True), f"new-{i}")))
        if i == 4:
            r = client.chat.completions.create(**sdk_kwargs(8))
            assert fp[r.system_fingerprint] == "B"
            assert MODEL in [m.id for m in client.models.list().data]
        time.sleep(0.25)
    old_results: list[StreamResult] = [x.result() for x in old]
    new_results: list[StreamResult] = [x.result() for x in new]
    wait_state(url, "a", "draining", drained=True, timeout=5)
    assert monitor.wait_latest(lambda x: x["a"]["drained"]), "no sample of the drained state"
    samples = [(t, x["a"]["state"], x["a"]["in_flight"], x["a"]["drained"])
               for t, x in monitor.stop()]

    for r in old_results:  # in-flight streams complete normally
        assert r.problem() is None, (r.problem(), r.events[-3:])
        assert not r.errors
        assert r.finish_reason == "length"
        assert len([c for c in r.chunks if c["choices"] and c["choices"][0]["delta"].get(
            "content")]) == IN_FLIGHT_TOKENS
        assert fp[r.fingerprint] == "A"
        assert r.first_event_at < drain_at < r.ended  # streaming across the drain
    for r in new_results:  # new work: all 200 from B
        assert r.problem() is None, r.problem()
        assert not r.errors and fp[r.fingerprint] == "B", r.events[-2:]
    assert a.chat_requests() == a_chats_before, "A received new requests while draining"
    assert {f"new-{i}" for i in range(16)} <= b.recent_ids()

    # drained only at in-flight 0; draining (out of rotation) throughout
    assert {s for _, s, _, _ in samples} == {"draining"}, samples
    assert [x for x in samples if x[3] and x[2] != 0] == [], "drained with requests in flight"
    assert any(n == 3 and not d for _, _, n, d in samples), samples[:5]
    first_drained = next(t for t, _, _, d in samples if d)
    # (the gateway frees the place before the client thread reads the stream's end: a
    # thread starved of the GIL may note it late; "drained only at in-flight 0" is above)
    assert first_drained >= max(r.ended for r in old_results) - 0.5
    assert history(url, "a")[-1] == ("warm", "draining", "admin_drain")
    m = metric_samples(url)
    assert metric(m, "gateway_backend_transitions_total", backend="a", **{
        "from": "warm", "to": "draining", "reason": "admin_drain"}) == 1
    assert metric(m, "gateway_backend_state", backend="a", state="draining") == 1
    assert metric(m, "gateway_backend_state", backend="a", state="warm") == 0

    # /v1/models keeps listing m1 while B serves it
    listed = httpx.get(url + "/v1/models", timeout=5)
    assert listed.status_code == 200 and MODEL in [c["id"] for c in listed.json()["data"]]

    # every backend of m1 draining: 503 + retry-after, OpenAI-shaped
    assert post_admin(url, "b", "drain").status_code == 202
    wait_state(url, "b", "draining", drained=True)
    b_chats = b.chat_requests()
    with pytest.raises(openai.InternalServerError) as exc:
        client.chat.completions.create(**sdk_kwargs(8))
    e = exc.value
    assert e.status_code == 503
    assert float(e.response.headers["retry-after"]) > 0
    err = e.response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"], err
    r = stream_chat(url, chat_body(8, stream=True))
    assert r.status == 503 and "retry-after" in r.headers, (r.status, r.headers)
    assert r.headers["content-type"].startswith("application/json")
    assert a.chat_requests() == a_chats_before and b.chat_requests() == b_chats


def test_BUG_21_drain_deadline_ends_streams_with_an_error_event(sims, lc_gateway):
    """BUG-21 variant with a drain deadline (scaled from 10 s to 1 s): three ~6 s streams and
    one non-stream request are in flight on A when A is drained with ``deadline_s: 1``.

    * At the deadline each stream (raw reader and the openai SDK) ends with one explicit,
      OpenAI-shaped error event (code ``drain_deadline``) then ``[DONE]``, after the tokens
      it already had: never a silent cut, never ended as if complete.
    * A cut stream is never re-sent to B (bytes had reached the client): B never sees its
      request id. The non-stream request had sent nothing to its client, so it is re-sent to
      B and answered 200 (``FleetController.drain``'s documented behaviour).
    * The streams turn continuation off (``x-gateway-continuation: off``): this is what a
      stream that cannot go on elsewhere gets (with it on they continue on B:
      tests/lifecycle/test_continuation_drain.py).
    * The gateway closed its upstream requests, so A's engine aborted all four generations.
    * A is ``drained`` (in-flight 0) right after the deadline; the stream errors are counted
      as ``gateway_stream_errors_total{code="drain_deadline"}``."""
    a, b = sims("A", itl_s=0.1), sims("B", itl_s=0.01)
    gw = lc_gateway({"a": a.url, "b": b.url})
    url = gw.url
    fp = {a.fingerprint: "A", b.fingerprint: "B"}
    body = chat_body(60, stream=True)

    got: list[Any] = []  # what the SDK stream has received so far
    raw_first: list[int] = []  # the raw streams that have sent their first event

    def sdk_stream() -> tuple[list[Any], BaseException | None]:
        try:
            for chunk in sdk(url).chat.completions.create(
                    **sdk_kwargs(60, stream=True),
                    extra_headers={"x-request-id": "cut-sdk", **OFF}):
                got.append(chunk)
        except openai.APIError as e:
            return got, e
        return got, None

    def non_stream() -> Any:
        return sdk(url).chat.completions.create(**sdk_kwargs(60),
                                                extra_headers={"x-request-id": "cut-ns"})

    calls = [lambda i=i: stream_chat(url, body, f"cut-{i}", headers=OFF,
                                     on_first_event=lambda i=i: raw_first.append(i))
             for i in range(2)]
    running = pin_on_a(url, [*calls, sdk_stream, non_stream], 4)
    # the streams have sent tokens to their clients (the SDK's more than 2 chunks)
    assert wait_for(lambda: len(raw_first) == 2 and len(got) > 2, 10), (raw_first, len(got))
    asked_at = time.monotonic()  # the deadline runs from when the gateway took the drain,
    assert post_admin(url, "a", "drain", {"deadline_s": 1.0}).status_code == 202
    drain_at = time.monotonic()  # somewhere between these two
    assert admin(url, "a")["in_flight"] == 4  # all four still running on A
    raw: list[StreamResult] = [running[0].result(), running[1].result()]
    sdk_chunks, sdk_error = running[2].result()
    ns = running[3].result()
    b_ids = b.recent_ids()

    for r in raw:
        assert r.problem() is None, r.problem()  # well-formed: error event then [DONE]
        assert len(r.errors) == 1 and r.errors[0]["code"] == "drain_deadline", r.events[-3:]
        assert r.events[-2:] == [r.events[-2], "[DONE]"] and "error" in r.chunks[-1]
        assert 0 < len(r.content) and r.finish_reason is None  # partial, not "complete"
        assert 0.9 <= r.ended - asked_at and r.ended - drain_at <= 3.0, (
            r.ended - asked_at, r.ended - drain_at)
    assert isinstance(sdk_error, openai.APIError), sdk_error
    assert "drained" in str(sdk_error).lower()
    assert len(sdk_chunks) > 2  # it had received tokens before the error
    assert not {"cut-0", "cut-1", "cut-sdk"} & b_ids, "a cut stream was re-sent to B"
    assert ns.choices[0].finish_reason == "length" and fp[ns.system_fingerprint] == "B"
    assert "cut-ns" in b_ids

    a_state = wait_state(url, "a", "draining", drained=True, timeout=2)
    assert a_state["in_flight"] == 0
    assert wait_for(lambda: a.stats()["aborted"] == 4, 3), a.stats()["aborted"]
    m = metric_samples(url)
    assert metric(m, "gateway_stream_errors_total", backend="a", code="drain_deadline") == 3


def test_undrain_returns_backend_to_rotation(sims, lc_gateway):
    """``POST .../drain`` on an idle backend: drained at once, no traffic; ``POST
    .../undrain``: warm again (history ``draining -> warm``, reason ``admin_undrain``) and
    served again; undraining a warm backend is a 409 OpenAI error; unknown backend 404; a bad
    ``deadline_s`` 400."""
    a, b = sims("A"), sims("B")
    gw = lc_gateway({"a": a.url, "b": b.url})
    url = gw.url
    fp = {a.fingerprint: "A", b.fingerprint: "B"}
    client = sdk(url)

    assert post_admin(url, "a", "drain", {"deadline_s": 5}).status_code == 202
    wait_state(url, "a", "draining", drained=True)
    served = [fp[client.chat.completions.create(**sdk_kwargs(2)).system_fingerprint]
              for _ in range(6)]
    assert served == ["B"] * 6

    r = post_admin(url, "a", "undrain")
    assert r.status_code == 200 and r.json()["state"] == "warm", r.text
    assert history(url, "a")[-2:] == [("warm", "draining", "admin_drain"),
                                      ("draining", "warm", "admin_undrain")]
    served = []
    while "A" not in served and len(served) < 20:
        served.append(fp[client.chat.completions.create(**sdk_kwargs(2)).system_fingerprint])
    assert "A" in served, served

    again = post_admin(url, "a", "undrain")
    assert again.status_code == 409 and again.json()["error"]["code"] == "invalid_state"
    assert post_admin(url, "nope", "drain").status_code == 404
    bad = post_admin(url, "a", "drain", {"deadline_s": "soon"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "deadline_s"
    assert admin(url, "a")["state"] == "warm"


def test_preempt_drains_with_30s_deadline_then_cold_then_back(sims, lc_gateway):
    """``POST .../preempt`` (spot preemption notice): a drain with the 30 s default deadline;
    the stream in flight on A still finishes with ``[DONE]``; then A goes ``cold`` (reason
    ``spot_preemption``) and stays out while the old instance still answers (probes passing
    must not bring back an instance that is about to vanish); once it goes away and a new
    one answers on the same address, probes bring it back through ``warming`` to ``warm``."""
    a, b = sims("A", itl_s=0.05), sims("B")
    gw = lc_gateway({"a": a.url, "b": b.url})
    url = gw.url
    [s] = pin_on_a(url, [lambda: stream_chat(url, chat_body(30, stream=True))], 1)

    assert post_admin(url, "a", "preempt").status_code == 202
    now = wait_state(url, "a", "draining", maintenance="preempt")
    assert 25 <= now["drain_deadline_in_s"] <= 30.5, now
    r = s.result()
    assert r.problem() is None and not r.errors and r.finish_reason == "length"
    wait_state(url, "a", "cold", timeout=10)
    sit_through_probes(url, "a")  # several passing probes: still held out
    detail = admin(url, "a")
    assert detail["state"] == "cold" and detail["hold"] == "preempted", detail
    a.kill()  # the spot instance goes away...
    wait_for(lambda: admin(url, "a")["hold"] is None, 5)
    a.restart()  # ...and a new one comes up on the same address
    wait_state(url, "a", "warm", timeout=10)
    h = history(url, "a")
    i = h.index(("warm", "draining", "spot_preemption"))
    assert h[i:i + 4] == [("warm", "draining", "spot_preemption"),
                          ("draining", "cold", "spot_preemption"),
                          ("cold", "warming", "probe_ok"),
                          ("warming", "warm", "ready")], h


def test_admin_drain_is_sticky(sims, lc_gateway):
    """An operator's drain holds until undrain: a health blip (the backend restarting, the
    usual reason to drain it) must not bring it back by itself, and a second drain request
    neither restarts the procedure nor pushes the deadline out (the earlier one wins)."""
    a, b = sims("A", itl_s=0.05), sims("B")
    gw = lc_gateway({"a": a.url, "b": b.url})
    url = gw.url
    [s] = pin_on_a(url, [lambda: stream_chat(url, chat_body(60, stream=True))], 1)
    assert post_admin(url, "a", "drain", {"deadline_s": 20}).status_code == 202
    first = admin(url, "a")["drain_deadline_in_s"]
    r = post_admin(url, "a", "drain", {"deadline_s": 100})
    assert r.status_code == 202 and r.json()["drain_deadline_in_s"] <= first  # not extended
    assert s.result().problem() is None
    wait_state(url, "a", "draining", drained=True)

    a.kill()  # the operator restarts it...
    wait_state(url, "a", "unhealthy", timeout=5)
    a.restart()  # ...it answers again, but stays out: it is still drained
    sit_through_probes(url, "a")
    detail = admin(url, "a")
    assert detail["state"] == "unhealthy" and detail["hold"] == "admin_drain", detail
    assert post_admin(url, "a", "undrain").status_code == 200
    wait_state(url, "a", "warm", timeout=10)
