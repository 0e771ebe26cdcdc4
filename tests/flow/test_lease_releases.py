"""Every exit of a request gives back everything it held (issue 12, the request lease).

In-process: the gateway's real components (admission, batcher, attempts, relay, lease)
called through the ASGI entry with a scripted upstream transport
(:mod:`tests.support.transport`), so each exit is reached deterministically, without
sockets or sleeps. Each test checks :func:`assert_nothing_held` after one exit: removing
any one release from the lease makes at least one of them fail.
"""

from __future__ import annotations

import asyncio

import pytest

from gateway.core.vocab import BackendState, Cut
from gateway.fleet import lifecycle
from gateway.proxy.upstream import Target, UpstreamRequest
from tests.flow.support import (
    CHAT,
    EVENT,
    Streams,
    assert_nothing_held,
    end_stream,
    make_gateway,
    run,
    settle,
    start,
)
from tests.support.transport import ScriptedResponse, json_response

ANSWER = {
    "id": "x",
    "object": "chat.completion",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}
def test_answer_gives_back_everything():
    async def handler(t: Target, req: UpstreamRequest) -> ScriptedResponse:
        return json_response(ANSWER)

    async def main() -> None:
        gw = make_gateway(handler)
        call = start(gw, CHAT)
        await call.task
        assert call.status == 200 and call.json()["choices"][0]["message"]["content"] == "ok"
        assert gw.transport.responses[0].released
        assert_nothing_held(gw)

    run(main())


def test_stream_end_gives_back_everything():
    responses = handler = Streams()

    async def main() -> None:
        gw = make_gateway(handler)
        call = start(gw, {**CHAT, "stream": True})
        await call.started.wait()
        b = gw.fleet.backends[0]
        assert b.in_flight == 1 and gw.gate.scheduler.in_flight == 1  # held while streaming
        end_stream(responses[0])
        await call.task
        assert call.body.endswith(b"data: [DONE]\n\n")
        assert responses[0].released
        assert_nothing_held(gw)

    run(main())


def test_backend_error_gives_back_everything():
    async def handler(t: Target, req: UpstreamRequest) -> ScriptedResponse:
        return json_response({"error": {"message": "boom"}}, status=500)

    async def main() -> None:
        gw = make_gateway(handler, backends=2)
        call = start(gw, CHAT)
        await call.task
        assert call.status == 500  # the backend's own answer, passed on
        assert len(gw.transport.sent) == 2  # retried on the other backend first
        assert_nothing_held(gw)

    run(main())


def test_refusal_before_any_attempt_gives_back_the_ticket():
    async def handler(t: Target, req: UpstreamRequest) -> ScriptedResponse:
        raise AssertionError("nothing may be sent")

    async def main() -> None:
        gw = make_gateway(handler)
        gw.fleet.backends[0].cool_until(gw.controller.clock() + 30)  # a 429 cooling it
        call = start(gw, CHAT)
        await call.task
        assert call.status == 429 and int(call.headers["retry-after"]) >= 29
        assert_nothing_held(gw)

    run(main())


def test_client_hang_up_while_waiting_for_the_backend():
    arrived = asyncio.Event()

    async def handler(t: Target, req: UpstreamRequest) -> ScriptedResponse:
        arrived.set()
        await asyncio.Event().wait()  # never answers
        raise AssertionError

    async def main() -> None:
        gw = make_gateway(handler)
        call = start(gw, CHAT)
        await arrived.wait()
        assert gw.fleet.backends[0].in_flight == 1
        call.hang_up.set()
        await call.task
        assert call.status == 499
        assert_nothing_held(gw)

    run(main())


def test_client_hang_up_mid_stream():
    responses = handler = Streams()

    async def main() -> None:
        gw = make_gateway(handler)
        call = start(gw, {**CHAT, "stream": True})
        await call.started.wait()
        call.hang_up.set()
        await call.task
        assert responses[0].closed  # the backend sees the disconnect and aborts
        assert_nothing_held(gw)

    run(main())


def test_cancellation_gives_back_everything():
    arrived = asyncio.Event()

    async def handler(t: Target, req: UpstreamRequest) -> ScriptedResponse:
        arrived.set()
        await asyncio.Event().wait()
        raise AssertionError

    async def main() -> None:
        gw = make_gateway(handler)
        call = start(gw, CHAT)
        await arrived.wait()
        assert call.task is not None
        call.task.cancel()  # the server's own cancellation: no reason, it propagates
        with pytest.raises(asyncio.CancelledError):
            await call.task
        assert_nothing_held(gw)

    run(main())


def test_shutdown_cut_mid_stream():
    responses = handler = Streams()

    async def main() -> None:
        gw = make_gateway(handler)
        call = start(gw, {**CHAT, "stream": True})
        await call.started.wait()
        for handle in list(gw.fleet.backends[0].active):  # what the shutdown does
            handle.cut(Cut.SHUTDOWN)
        await call.task
        assert b"gateway_shutdown" in call.body and responses[0].closed
        assert_nothing_held(gw)

    run(main())


def test_queued_request_shed_at_shutdown():
    first = handler = Streams()

    async def main() -> None:
        gw = make_gateway(handler, admission={"max_in_flight": 1})
        running = start(gw, {**CHAT, "stream": True})
        await running.started.wait()
        queued = start(gw, CHAT)
        await settle()
        assert gw.gate.scheduler.queued == 1
        assert gw.gate.shed_queued() == 1
        await queued.task
        assert queued.status == 503 and queued.json()["error"]["code"] == "gateway_shutting_down"
        end_stream(first[0])
        await running.task
        assert_nothing_held(gw)

    run(main())


def test_client_hang_up_in_the_batcher_queue():
    first = handler = Streams()

    async def main() -> None:
        gw = make_gateway(
            handler,
            backend={"max_num_seqs": 1},
            batcher={"enabled": True, "merge": False, "in_flight_per_seq": 1.0},
        )
        assert gw.batching is not None
        running = start(gw, {**CHAT, "stream": True})
        await running.started.wait()
        queued = start(gw, {**CHAT, "stream": True})
        await settle()
        assert gw.batching.core.queued == 1  # no room: it waits in its bucket
        queued.hang_up.set()
        await queued.task
        assert queued.status == 499 and gw.batching.core.queued == 0
        end_stream(first[0])
        await running.task
        assert len(first) == 1  # the one that left was never sent
        assert_nothing_held(gw)

    run(main())


def test_dispatched_request_released_when_its_slot_frees():
    """A queued request is dispatched into the slot a finished one gives back (the lease
    wakes the queue), and its reservation turns into its attempt."""
    first = handler = Streams()

    async def main() -> None:
        gw = make_gateway(
            handler,
            backend={"max_num_seqs": 1},
            batcher={"enabled": True, "merge": False, "in_flight_per_seq": 1.0},
        )
        assert gw.batching is not None
        a = start(gw, {**CHAT, "stream": True})
        await a.started.wait()
        b = start(gw, {**CHAT, "stream": True})
        await settle()
        assert gw.batching.core.queued == 1
        end_stream(first[0])
        await a.task
        await settle()  # a few loop turns, far less than the batcher's 50 ms re-check
        assert len(first) == 2, "the freed slot did not wake the queue"
        await b.started.wait()  # dispatched into the freed slot
        assert gw.batching.pending == {}
        end_stream(first[1])
        await b.task
        assert_nothing_held(gw)

    run(main())


def test_request_gone_between_dispatch_and_attempt_gives_back_its_reservation():
    """Dispatched (places reserved on a backend) and cancelled before its attempt starts:
    the reservation goes back with its lease."""

    handler = Streams()

    async def main() -> None:
        gw = make_gateway(
            handler,
            backends=2,
            backend={"max_num_seqs": 1},
            batcher={"enabled": True, "merge": False, "in_flight_per_seq": 1.0},
        )
        assert gw.batching is not None
        spare = gw.fleet.backends[1]
        lifecycle.apply_transition(spare, BackendState.DRAINING, "test", 0.0)
        running = start(gw, {**CHAT, "stream": True})
        await running.started.wait()
        queued = start(gw, {**CHAT, "stream": True})
        await settle()
        assert gw.batching.core.queued == 1
        lifecycle.apply_transition(spare, BackendState.WARM, "test", 0.0)
        gw.batching.pump()  # dispatched to the spare backend: its places reserved there
        assert gw.batching.pending == {spare.id: 1}
        assert queued.task is not None
        queued.task.cancel()  # gone before it could start its attempt
        with pytest.raises(asyncio.CancelledError):
            await queued.task
        assert gw.batching.pending == {}
        running.task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running.task
        assert_nothing_held(gw)

    run(main())


class _Unrenderable(ScriptedResponse):
    """A response whose headers cannot be read (an unexpected error after it opened)."""

    @property  # type: ignore[override]  # a property that raises, on purpose
    def raw_headers(self) -> tuple[tuple[bytes, bytes], ...]:
        raise RuntimeError("unreadable headers")

    @raw_headers.setter
    def raw_headers(self, value: object) -> None:
        pass


@pytest.mark.parametrize("stream", [False, True])
def test_unexpected_error_after_the_answer_opened(stream: bool):
    """An error between the backend's accepted answer and the client's response: 500, the
    open attempt ended and the upstream response closed by the lease."""

    async def handler(t: Target, req: UpstreamRequest) -> ScriptedResponse:
        r = _Unrenderable(200, "text/event-stream" if stream else "application/json")
        r.feed(EVENT if stream else b"{}")
        if not stream:
            r.end()
        return r

    async def main() -> None:
        gw = make_gateway(handler)
        call = start(gw, {**CHAT, "stream": stream})
        await call.task
        assert call.status == 500 and call.json()["error"]["code"] == "internal_error"
        assert gw.transport.responses[0].closed
        assert_nothing_held(gw)

    run(main())
