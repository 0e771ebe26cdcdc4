"""A scripted fake vLLM backend that can misbehave at the socket level.

It speaks just enough HTTP/1.1 (keep-alive, Content-Length or chunked request bodies) for
a per-test *script*: an async function ``script(req, conn)`` that answers however the test
wants: normal JSON, an SSE stream at chosen times, raw bytes, a silent hang, a close, or a
TCP RST. Every request is recorded with its headers, body and the time (if any) at which
the peer (the gateway) closed the connection, which is how tests prove that a client's
disconnect reached the backend.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from tests.support.servers import LoopThread

CHUNK_ID = "chatcmpl-scripted"


@dataclass
class Received:
    """One request the backend received."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    at: float  # time.monotonic() when fully read
    peer_closed_at: float | None = None  # monotonic time the gateway closed the connection
    finished_at: float | None = None  # monotonic time the script returned

    def json(self) -> Any:
        return json.loads(self.body)


class Conn:
    """The script's handle on one connection."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 req: Received) -> None:
        self.reader = reader
        self.writer = writer
        self.req = req
        self.peer_closed = asyncio.Event()
        self.keep_alive = True
        self._chunked = False

    # -- raw ---------------------------------------------------------------------------
    async def write(self, data: bytes) -> bool:
        """Write raw bytes; False if the peer is gone (the write failed)."""
        if self.peer_closed.is_set() or self.writer.is_closing():
            return False
        try:
            self.writer.write(data)
            await self.writer.drain()
            return True
        except (ConnectionError, OSError):
            self._mark_closed()
            return False

    def _mark_closed(self) -> None:
        if self.req.peer_closed_at is None:
            self.req.peer_closed_at = time.monotonic()
        self.peer_closed.set()

    async def sleep(self, seconds: float) -> bool:
        """Sleep, waking early if the peer closes; True if the peer is still there."""
        try:
            await asyncio.wait_for(self.peer_closed.wait(), seconds)
            return False
        except TimeoutError:
            return True

    def close(self) -> None:
        """Close the TCP connection cleanly (FIN)."""
        self.keep_alive = False
        self.writer.close()

    def reset(self) -> None:
        """Abort the TCP connection with a RST (SO_LINGER 0)."""
        self.keep_alive = False
        sock = self.writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.writer.transport.abort()

    # -- HTTP --------------------------------------------------------------------------
    async def send_response(self, status: int, body: bytes, headers: dict[str, str] | None = None,
                            content_type: str = "application/json") -> bool:
        h = {"content-type": content_type, "content-length": str(len(body)), **(headers or {})}
        head = f"HTTP/1.1 {status} {_REASONS.get(status, 'X')}\r\n" + "".join(
            f"{k}: {v}\r\n" for k, v in h.items()) + "\r\n"
        return await self.write(head.encode() + body)

    async def send_json(self, status: int, obj: Any, headers: dict[str, str] | None = None) -> bool:
        return await self.send_response(status, json.dumps(obj).encode(), headers)

    async def start_stream(self, status: int = 200, headers: dict[str, str] | None = None) -> bool:
        """Status line and headers of a chunked ``text/event-stream`` response."""
        self._chunked = True
        h = {"content-type": "text/event-stream", "transfer-encoding": "chunked",
             "cache-control": "no-cache", **(headers or {})}
        head = f"HTTP/1.1 {status} OK\r\n" + "".join(f"{k}: {v}\r\n" for k, v in h.items())
        return await self.write((head + "\r\n").encode())

    async def chunk(self, data: bytes) -> bool:
        """One HTTP chunk (already-framed SSE bytes)."""
        return await self.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")

    async def event(self, obj: Any, sep: bytes = b"\n\n") -> bool:
        payload = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
        return await self.chunk(b"data: " + payload + sep)

    async def done(self, sep: bytes = b"\n\n") -> bool:
        """``data: [DONE]`` then the chunked terminator."""
        ok = await self.chunk(b"data: [DONE]" + sep)
        return ok and await self.write(b"0\r\n\r\n")


_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found",
            429: "Too Many Requests", 500: "Internal Server Error", 502: "Bad Gateway",
            503: "Service Unavailable"}

Script = Callable[[Received, Conn], Awaitable[None]]


def chunk_obj(content: str | None = None, role: str | None = None, finish: str | None = None,
              model: str = "m1") -> dict[str, Any]:
    """A ``chat.completion.chunk`` like vLLM's."""
    delta: dict[str, Any] = {}
    if role:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    return {"id": CHUNK_ID, "object": "chat.completion.chunk", "created": 1, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}


def completion_obj(content: str = "hello", model: str = "m1", prompt_tokens: int = 3,
                   completion_tokens: int = 1) -> dict[str, Any]:
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                         "logprobs": None, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


def models_obj(*ids: str, parents: dict[str, str] | None = None) -> dict[str, Any]:
    parents = parents or {}
    return {"object": "list", "data": [
        {"id": i, "object": "model", "created": 1, "owned_by": "vllm",
         "root": parents.get(i, i), "parent": parents.get(i), "max_model_len": 4096,
         "permission": [{"id": f"modelperm-{i}", "object": "model_permission"}]}
        for i in ids]}


async def default_script(req: Received, conn: Conn) -> None:
    """Healthy vLLM-like answers for health, metrics, models and chat (stream or not)."""
    if req.path == "/health":
        await conn.send_response(200, b"")
    elif req.path == "/metrics":
        await conn.send_response(200, b"vllm:num_requests_running{engine=\"0\"} 0.0\n"
                                      b"vllm:num_requests_waiting{engine=\"0\"} 0.0\n"
                                      b"vllm:kv_cache_usage_perc{engine=\"0\"} 0.0\n",
                                 content_type="text/plain")
    elif req.path == "/v1/models":
        await conn.send_json(200, models_obj("m1"))
    elif req.path.startswith("/v1/"):
        body = req.json() if req.body else {}
        if body.get("stream"):
            await conn.start_stream()
            await conn.event(chunk_obj(role="assistant", content=""))
            await conn.event(chunk_obj(content="ok"))
            await conn.event(chunk_obj(finish="stop"))
            await conn.done()
        else:
            await conn.send_json(200, completion_obj("ok"))
    else:
        await conn.send_json(404, {"error": {"message": "not found", "type": "NotFoundError",
                                             "param": None, "code": 404}})


CONTROL_PATHS = ("/health", "/metrics", "/v1/models")


class ScriptedBackend:
    """The fake backend. ``script`` answers data-plane requests; control-plane paths
    (``/health``, ``/metrics``, ``/v1/models``) use ``control`` (healthy by default)."""

    def __init__(self, script: Script | None = None, control: Script | None = None,
                 models: tuple[str, ...] = ("m1",)) -> None:
        self.script = script or default_script
        self.models = models
        self.control = control or self._default_control
        self.requests: list[Received] = []
        self.open_now = 0  # data-plane requests being answered now
        self.max_open = 0
        self._lt: LoopThread | None = None
        self._server: asyncio.base_events.Server | None = None
        self.url = ""
        self.port = 0
        self._conns: set[asyncio.StreamWriter] = set()

    async def _default_control(self, req: Received, conn: Conn) -> None:
        if req.path == "/v1/models":
            await conn.send_json(200, models_obj(*self.models))
        else:
            await default_script(req, conn)

    @property
    def data_requests(self) -> list[Received]:
        """Requests other than health/metrics/models probes."""
        return [r for r in self.requests if r.path not in CONTROL_PATHS]

    def start(self, port: int = 0) -> str:
        self._lt = LoopThread("scripted-backend")
        self._lt.call(self._start(port))
        self.url = f"http://127.0.0.1:{self.port}"
        return self.url

    async def _start(self, port: int) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", port,
                                                  reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]

    def stop(self) -> None:
        """Stop listening and drop every connection (a dead backend: connection refused)."""
        if self._lt is None:
            return
        self._lt.call(self._stop())
        self._lt.close()
        self._lt = None

    async def _stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for w in list(self._conns):
            w.transport.abort()
        await self._server.wait_closed()

    def restart(self) -> None:
        """Listen again on the same port."""
        port = self.port
        self.start(port)

    async def _read_request(self, reader: asyncio.StreamReader) -> Received | None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            return None
        lines = head.decode("latin-1").split("\r\n")
        method, path, _ = lines[0].split(" ", 2)
        headers: dict[str, str] = {}
        for line in lines[1:]:
            if ":" in line:
                k, v = line.split(":", 1)
                headers[k.strip().lower()] = v.strip()
        body = b""
        if "content-length" in headers:
            body = await reader.readexactly(int(headers["content-length"]))
        elif headers.get("transfer-encoding", "").lower() == "chunked":
            parts = []
            while True:
                size = int((await reader.readuntil(b"\r\n")).strip(), 16)
                if size == 0:
                    await reader.readuntil(b"\r\n")
                    break
                parts.append(await reader.readexactly(size))
                await reader.readexactly(2)
            body = b"".join(parts)
        return Received(method, path, headers, body, time.monotonic())

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._conns.add(writer)
        try:
            while True:
                req = await self._read_request(reader)
                if req is None:
                    return
                self.requests.append(req)
                conn = Conn(reader, writer, req)
                watcher = asyncio.create_task(self._watch_close(reader, conn))
                control = req.path in CONTROL_PATHS
                script = self.control if control else self.script
                if not control:
                    self.open_now += 1
                    self.max_open = max(self.max_open, self.open_now)
                try:
                    await script(req, conn)
                except (ConnectionError, OSError):
                    conn._mark_closed()
                finally:
                    if not control:
                        self.open_now -= 1
                    req.finished_at = time.monotonic()
                if not conn.keep_alive or conn.peer_closed.is_set():
                    # keep watching so a late close is still recorded, then stop
                    await asyncio.sleep(0)
                    watcher.cancel()
                    if not writer.is_closing():
                        writer.close()
                    return
                # Wait until the close watcher has really stopped reading: a read of the next
                # request while its read(1) is still pending raises RuntimeError ("readuntil()
                # called while another coroutine is already waiting"), which killed the
                # connection under the gateway's pooled keep-alive (a spurious 502).
                watcher.cancel()
                await asyncio.gather(watcher, return_exceptions=True)
        finally:
            self._conns.discard(writer)

    async def _watch_close(self, reader: asyncio.StreamReader, conn: Conn) -> None:
        try:
            data = await reader.read(1)
        except (ConnectionError, OSError):
            data = b""
        if not data:
            conn._mark_closed()
        else:  # a pipelined byte: give it back (aiohttp does not pipeline; keep it simple)
            reader._buffer[0:0] = data  # type: ignore[attr-defined]

    def __enter__(self) -> ScriptedBackend:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def error_obj(message: str, code: int, type_: str = "BadRequestError") -> dict[str, Any]:
    """vLLM's error body."""
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}


def read_json_answer(sock: Any, bufsize: int = 65536) -> bytes:
    """Raw bytes of one HTTP answer with a JSON body read from ``sock`` (a socket the test
    wrote a request to): until the head is in and the body ends with ``}``, or EOF."""
    data = b""
    while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
        chunk = sock.recv(bufsize)
        if not chunk:
            break
        data += chunk
    return data


def wait_for(pred: Callable[[], bool], timeout: float = 5.0, interval: float = 0.02) -> bool:
    """Poll ``pred`` until true or ``timeout`` seconds; returns the last value.

    While polling, a ``pred`` that raises (state not there yet: a server not listening, an
    entry not listed) counts as false; the last call after the deadline is not guarded, so a
    predicate that still raises then fails the test with its own error."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if pred():
                return True
        except Exception:  # "not yet"; the final call below re-raises
            pass
        time.sleep(interval)
    return pred()


__all__ = [
    "Conn", "Received", "ScriptedBackend", "chunk_obj", "completion_obj", "default_script",
    "error_obj", "models_obj", "read_json_answer", "wait_for",
]
