"""A cheap, deterministic vLLM stand-in for proxy benchmarks (raw asyncio protocol).

It speaks just enough HTTP/1.1 (keep-alive, ``Content-Length`` request bodies, pipelining)
to answer, with precomputed bytes:

* ``POST /v1/chat/completions``: a fixed ``chat.completion`` JSON (``/v1/completions``: a
  fixed ``text_completion``, which the gateway's warm-up and calibration ask for), or, when
  the body asks for ``"stream": true``, a fixed SSE stream of ``--chunks``
  ``chat.completion.chunk`` events (the last one carries ``usage``, as vLLM's
  ``include_usage`` chunk) then ``data: [DONE]``, in chunked transfer encoding, written in one
  go (``--stream-gap-ms 0``, the default) or one event per gap;
* ``GET /health`` (200), ``GET /v1/models`` (``bench-model``), ``GET /metrics`` (the vLLM load
  gauges the gateway scrapes), ``GET /stats`` (requests served, as JSON).

Nothing is parsed beyond the request line, ``Content-Length`` and a byte search for
``"stream": true``, so the backend costs a few microseconds per request and a proxy in front
of it dominates the measurement. Run: ``python benchmarks/fast_backend.py --port 8101``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import signal

MODEL = "bench-model"
CREATED = 1_700_000_000
_STREAM_RE = re.compile(rb'"stream"\s*:\s*true')
_CONTENT = ["Hello", "!", " This", " is", " a", " fixed", " benchmark", " answer", "."]


def completion_body(model: str = MODEL) -> bytes:
    """The fixed non-streaming answer (compact JSON, like vLLM's)."""
    text = "".join(_CONTENT)
    obj = {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": CREATED,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text, "tool_calls": []},
                "logprobs": None,
                "finish_reason": "stop",
                "stop_reason": None,
            }
        ],
        "usage": {"prompt_tokens": 12, "total_tokens": 22, "completion_tokens": 10},
    }
    return json.dumps(obj, separators=(",", ":")).encode()


def text_completion_body(model: str = MODEL) -> bytes:
    """The fixed ``/v1/completions`` answer (the gateway's warm-up and calibration ask it)."""
    obj = {
        "id": "cmpl-bench",
        "object": "text_completion",
        "created": CREATED,
        "model": model,
        "choices": [
            {
                "index": 0,
                "text": "".join(_CONTENT),
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
            }
        ],
        "usage": {"prompt_tokens": 4, "total_tokens": 14, "completion_tokens": 10},
    }
    return json.dumps(obj, separators=(",", ":")).encode()


def stream_events(chunks: int = 10, model: str = MODEL) -> list[bytes]:
    """The fixed SSE events: ``chunks`` ``chat.completion.chunk`` events, then ``[DONE]``.

    The first carries the role, the middle ones content, the second to last the finish
    reason and the last one the usage (``choices: []``), as vLLM with ``include_usage``.
    """
    if chunks < 3:
        raise ValueError("need at least 3 chunks (role, finish, usage)")
    head = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": CREATED}
    head["model"] = model
    deltas: list[dict[str, object]] = [{"role": "assistant", "content": ""}]
    n_content = chunks - 3
    deltas += [{"content": _CONTENT[i % len(_CONTENT)]} for i in range(n_content)]
    events = []
    for d in deltas:
        choice = {"index": 0, "delta": d, "logprobs": None, "finish_reason": None}
        events.append({**head, "choices": [choice]})
    events.append(
        {**head, "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}]}
    )
    usage = {"prompt_tokens": 12, "total_tokens": 12 + n_content, "completion_tokens": n_content}
    events.append({**head, "choices": [], "usage": usage})
    out = [b"data: " + json.dumps(e, separators=(",", ":")).encode() + b"\n\n" for e in events]
    out.append(b"data: [DONE]\n\n")
    return out


def stream_body(chunks: int = 10, model: str = MODEL) -> bytes:
    """What a client reads from the stream (the SSE bytes, de-chunked)."""
    return b"".join(stream_events(chunks, model))


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _response(status: str, ctype: bytes, body: bytes) -> bytes:
    return (
        b"HTTP/1.1 "
        + status.encode()
        + b"\r\ncontent-type: "
        + ctype
        + b"\r\ncontent-length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )


METRICS_TEXT = (
    "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
    "# TYPE vllm:num_requests_running gauge\n"
    f'vllm:num_requests_running{{engine="0",model_name="{MODEL}"}} 0.0\n'
    "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
    "# TYPE vllm:num_requests_waiting gauge\n"
    f'vllm:num_requests_waiting{{engine="0",model_name="{MODEL}"}} 0.0\n'
    "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n"
    "# TYPE vllm:kv_cache_usage_perc gauge\n"
    f'vllm:kv_cache_usage_perc{{engine="0",model_name="{MODEL}"}} 0.0\n'
)


class Answers:
    """Precomputed response bytes, shared by every connection."""

    def __init__(self, chunks: int, gap_s: float) -> None:
        self.gap_s = gap_s
        self.completion = _response("200 OK", b"application/json", completion_body())
        self.text_completion = _response("200 OK", b"application/json", text_completion_body())
        events = stream_events(chunks)
        self.stream_head = (
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        self.stream_chunks = [_chunk(e) for e in events] + [b"0\r\n\r\n"]
        self.stream_all = self.stream_head + b"".join(self.stream_chunks)
        models = {
            "object": "list",
            "data": [
                {
                    "id": MODEL,
                    "object": "model",
                    "created": CREATED,
                    "owned_by": "vllm",
                    "root": MODEL,
                    "parent": None,
                    "max_model_len": 4096,
                }
            ],
        }
        self.models = _response("200 OK", b"application/json", json.dumps(models).encode())
        self.health = _response("200 OK", b"text/plain", b"")
        self.metrics = _response(
            "200 OK", b"text/plain; version=0.0.4; charset=utf-8", METRICS_TEXT.encode()
        )
        self.not_found = _response("404 Not Found", b"application/json", b'{"detail":"Not Found"}')
        self.bad = _response("400 Bad Request", b"text/plain", b"bad request")
        self.served = {"nonstream": 0, "stream": 0, "other": 0}


class BackendProtocol(asyncio.Protocol):
    """One keep-alive connection: parse requests from the buffer, answer from `Answers`."""

    __slots__ = ("answers", "buf", "busy", "transport")

    def __init__(self, answers: Answers) -> None:
        self.answers = answers
        self.buf = b""
        self.transport: asyncio.Transport | None = None
        self.busy = False  # a spaced stream is being written

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None

    def data_received(self, data: bytes) -> None:
        self.buf = self.buf + data if self.buf else data
        if not self.busy:
            self._process()

    def _process(self) -> None:
        t = self.transport
        while t is not None and not self.busy:
            buf = self.buf
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = buf[:end]
            first, _, rest = head.partition(b"\r\n")
            length = 0
            close = False
            lower = rest.lower()
            i = lower.find(b"content-length:")
            if i >= 0:
                j = lower.find(b"\r\n", i)
                length = int(lower[i + 15 : j if j >= 0 else None])
            elif b"transfer-encoding:" in lower:
                t.write(self.answers.bad)
                t.close()
                return
            if b"connection: close" in lower:
                close = True
            total = end + 4 + length
            if len(buf) < total:
                return
            body = buf[end + 4 : total]
            self.buf = buf[total:]
            self._answer(t, first, body)
            if close:
                t.close()
                return

    def _answer(self, t: asyncio.Transport, first: bytes, body: bytes) -> None:
        a = self.answers
        method, _, rest = first.partition(b" ")
        path = rest.partition(b" ")[0].partition(b"?")[0]
        if method == b"POST" and path in (b"/v1/chat/completions", b"/v1/completions"):
            if _STREAM_RE.search(body) is not None:
                a.served["stream"] += 1
                if a.gap_s > 0:
                    self._spaced_stream(t)
                else:
                    t.write(a.stream_all)
            else:
                a.served["nonstream"] += 1
                t.write(a.completion if path == b"/v1/chat/completions" else a.text_completion)
            return
        a.served["other"] += 1
        if method == b"GET" and path == b"/health":
            t.write(a.health)
        elif method == b"GET" and path == b"/v1/models":
            t.write(a.models)
        elif method == b"GET" and path == b"/metrics":
            t.write(a.metrics)
        elif method == b"GET" and path == b"/stats":
            t.write(_response("200 OK", b"application/json", json.dumps(a.served).encode()))
        else:
            t.write(a.not_found)

    def _spaced_stream(self, t: asyncio.Transport) -> None:
        a = self.answers
        self.busy = True
        t.write(a.stream_head + a.stream_chunks[0])
        loop = asyncio.get_running_loop()
        rest = iter(a.stream_chunks[1:])

        def step() -> None:
            if self.transport is None:
                return
            part = next(rest, None)
            if part is None:
                self.busy = False
                self._process()
                return
            self.transport.write(part)
            loop.call_later(a.gap_s, step)

        loop.call_later(a.gap_s, step)


async def serve(host: str, port: int, chunks: int, gap_ms: float) -> None:
    answers = Answers(chunks, gap_ms / 1000.0)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: BackendProtocol(answers), host, port, backlog=4096, reuse_address=True
    )
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"fast backend listening on http://{host}:{port}", flush=True)
    async with server:
        await stop.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8101)
    p.add_argument("--chunks", type=int, default=10, help="chat.completion.chunk events")
    p.add_argument(
        "--stream-gap-ms",
        type=float,
        default=0.0,
        help="pause between stream events (0: the whole stream in one write)",
    )
    args = p.parse_args(argv)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency of uvicorn[standard]
        uvloop = None  # type: ignore[assignment]
    with contextlib.suppress(KeyboardInterrupt):
        if uvloop is not None:
            uvloop.run(serve(args.host, args.port, args.chunks, args.stream_gap_ms))
        else:
            asyncio.run(serve(args.host, args.port, args.chunks, args.stream_gap_ms))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
