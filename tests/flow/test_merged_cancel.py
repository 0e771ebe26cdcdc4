"""A merged request whose every client hung up is cancelled upstream (issue 12: moved here
from the socket test in tests/batching/test_merge_window.py, which waited on timeouts and
polled the simulator; that a cancelled upstream send really closes the backend's connection
is tests/cases/test_disconnect.py's BUG-02).

In-process: the real batcher, merge window and pipeline through the ASGI entry, with a
scripted upstream that is still generating (no answer yet) when the clients leave."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from gateway.proxy.upstream import Target, UpstreamRequest
from tests.flow.support import MODEL, assert_nothing_held, make_gateway, settle, start
from tests.support.transport import ScriptedResponse

MERGING: dict[str, Any] = {
    "batcher": {"enabled": True, "predictive": False,
                "normal": {"max_batch_size": 4, "max_wait_ms": 800}},
}


def test_a_merged_request_is_cancelled_when_every_client_hangs_up() -> None:
    """4 non-streaming completions fill the batch and ride one merged request; the backend
    is still generating when all 4 clients hang up: the upstream request is cancelled (the
    generation does not go on without clients), the 4 are counted as cancelled members
    (``gateway_merged_requests_total{outcome="cancelled"}``), and nothing stays held."""
    cancelled: list[str] = []
    sent: list[UpstreamRequest] = []

    async def handler(t: Target, req: UpstreamRequest) -> ScriptedResponse:
        sent.append(req)
        try:
            await asyncio.Event().wait()  # about 10 s of tokens: never answered here
        except asyncio.CancelledError:
            cancelled.append(t.id)
            raise
        raise AssertionError("unreachable")

    async def main() -> None:
        gw = make_gateway(handler, **MERGING)
        body = {"model": MODEL, "prompt": "go on", "max_tokens": 1000, "ignore_eos": True}
        calls = [start(gw, body, path="/v1/completions") for _ in range(4)]
        for _ in range(50):
            if sent:
                break
            await settle()
        assert len(sent) == 1, "the 4 did not go upstream as one merged request"
        assert len(json.loads(sent[0].body)["prompt"]) == 4
        backend = gw.fleet.backends[0]
        assert backend.in_flight == 4 and not cancelled  # a place per prompt, generating
        for c in calls:
            c.hang_up.set()
        await asyncio.gather(*(c.task for c in calls if c.task is not None))
        assert cancelled == [backend.id], "the merged generation went on without clients"
        assert [c.status for c in calls] == [499] * 4
        count = gw.metrics.registry.get_sample_value(
            "gateway_merged_requests_total",
            {"endpoint": "/v1/completions", "outcome": "cancelled"},
        )
        assert count == 4
        assert_nothing_held(gw)

    asyncio.run(main())
