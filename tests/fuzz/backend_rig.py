"""The backend side of the fuzz tests (issue 20): two scripted backends
(:class:`tests.support.scripted.ScriptedBackend`) answering whatever the running example
set in :class:`Answers` (a stream's raw SSE bytes and how it ends, a non-stream answer's
status, headers and body, the ``/metrics`` exposition, the ``/v1/models`` answer), and a
gateway in front of them, started once per module."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Literal

import httpx

from tests.fuzz.oracle import WAIT_S
from tests.support.broken_streams import chunk
from tests.support.scripted import (
    Conn,
    Received,
    ScriptedBackend,
    chunk_obj,
    completion_obj,
    models_obj,
)
from tests.support.servers import GatewayThread, gateway_config

GOOD_METRICS = (b'vllm:num_requests_running{engine="0"} 0.0\n'
                b'vllm:num_requests_waiting{engine="0"} 0.0\n'
                b'vllm:kv_cache_usage_perc{engine="0"} 0.0\n')
GOOD_MODELS = json.dumps(models_obj("m1")).encode()
GOOD_STREAM = [b"data: " + json.dumps(chunk_obj(role="assistant", content="")).encode() + b"\n\n",
               b"data: " + json.dumps(chunk_obj(content="ok")).encode() + b"\n\n",
               b"data: " + json.dumps(chunk_obj(finish="stop")).encode() + b"\n\n",
               b"data: [DONE]\n\n"]

End = Literal["end", "fin", "rst"]


@dataclass
class Answers:
    """What both backends answer now (each example sets it; :meth:`reset`: healthy)."""

    stream: list[bytes] = field(default_factory=lambda: list(GOOD_STREAM))
    end: End = "end"
    status: int = 200
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = json.dumps(completion_obj("ok")).encode()
    ctype: str = "application/json"
    metrics: bytes = GOOD_METRICS
    metrics_status: int = 200
    models: bytes = GOOD_MODELS
    models_status: int = 200

    def reset(self) -> None:
        self.__init__()  # type: ignore[misc]


class BackendRig:
    """Two scripted backends playing :attr:`answers` and a gateway in front of them."""

    def __init__(self) -> None:
        self.answers = Answers()
        self.backends = [ScriptedBackend(self._data, self._control) for _ in range(2)]
        for b in self.backends:
            b.start()
        cfg = gateway_config(
            [{"id": f"b{i}", "url": b.url} for i, b in enumerate(self.backends)],
            telemetry={"scrape_interval_s": 0.05, "models_refresh_s": 0.05},
            # bad answers are the backends' failures; the breaker and the retry budget would
            # take them out of rotation for a while, which the settled check waits out: keep
            # them open to every example instead, and coolings short
            breaker={"consecutive_failures": 10_000, "min_requests": 10_000},
            retry={"budget_ratio": 1.0, "budget_min_per_s": 1_000.0, "max_cooling_s": 0.2,
                   "default_retry_after_s": 0.1},
            admission={"max_in_flight": 1, "max_queue_wait_s": 10.0},
            proxy={"idle_timeout_s": 2.0, "ttfb_timeout_s": 2.0},
        )
        self.gw = GatewayThread(cfg)
        self.gw.start()
        self.gw.wait_ready(routable=2)
        self.http = httpx.Client(timeout=WAIT_S)

    @property
    def url(self) -> str:
        return self.gw.url

    def stop(self) -> None:
        self.http.close()
        self.gw.stop()
        for b in self.backends:
            b.stop()

    def plain(self) -> httpx.Response:
        """A normal chat request."""
        return self.http.post(self.url + "/v1/chat/completions", json={
            "model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})

    def relayed(self, status: int, body: bytes) -> bool:
        """Whether ``(status, body)`` is the backends' own answer, relayed as sent."""
        return status == self.answers.status and body == self.answers.body

    async def _control(self, req: Received, conn: Conn) -> None:
        a = self.answers
        if req.path == "/metrics":
            await conn.send_response(a.metrics_status, a.metrics, content_type="text/plain")
        elif req.path == "/v1/models":
            await conn.send_response(a.models_status, a.models)
        else:
            await conn.send_response(200, b"")

    async def _data(self, req: Received, conn: Conn) -> None:
        a = self.answers
        try:
            stream = json.loads(req.body).get("stream") is True
        except (ValueError, AttributeError):
            stream = False
        if not stream or a.status != 200:
            await conn.send_response(a.status, a.body, dict(a.headers), a.ctype)
            return
        head = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                b"transfer-encoding: chunked\r\n\r\n")
        data = head + b"".join(chunk(e) for e in a.stream if e)
        if a.end == "end":
            await conn.write(data + b"0\r\n\r\n")
            return
        await conn.write(data + b"40\r\npartial")  # a chunk cut in its middle
        if a.end == "fin":
            conn.close()
        else:
            conn.reset()
