"""An in-process upstream transport for tests of the request flow without sockets.

:class:`ScriptedTransport` implements :class:`gateway.proxy.upstream.Transport` (the
boundary where the aiohttp pool sits in the gateway): each ``send`` calls the test's
``handler(target, request)``, which returns a :class:`ScriptedResponse` whose body the test
feeds chunk by chunk (:meth:`ScriptedResponse.feed`, :meth:`ScriptedResponse.end`), or
raises :class:`gateway.proxy.upstream.UpstreamFailure`, or waits on whatever the test
controls. Every response records whether it was released (done, connection reusable) or
closed (aborted): a request the gateway gave up on must be closed, never leaked.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from multidict import CIMultiDict, CIMultiDictProxy

from gateway.proxy.upstream import Target, UpstreamRequest


class _Body:
    def __init__(self) -> None:
        self.chunks: asyncio.Queue[bytes] = asyncio.Queue()

    async def readany(self) -> bytes:
        return await self.chunks.get()


class ScriptedResponse:
    """One scripted upstream response (the members the flow reads of aiohttp's)."""

    def __init__(
        self,
        status: int = 200,
        content_type: str = "application/json",
        headers: dict[str, str] | None = None,
    ) -> None:
        self.status = status
        self.content_type = content_type
        h = CIMultiDict({"content-type": content_type, **(headers or {})})
        self.headers = CIMultiDictProxy(h)
        self.raw_headers = tuple((k.lower().encode(), v.encode()) for k, v in h.items())
        self.content = _Body()
        self.released = False
        self.closed = False

    def feed(self, data: bytes) -> None:
        """Make ``data`` readable (a chunk of the body)."""
        self.content.chunks.put_nowait(data)

    def end(self) -> None:
        """End the body."""
        self.content.chunks.put_nowait(b"")

    def release(self) -> None:
        self.released = True

    def close(self) -> None:
        self.closed = True

    @property
    def settled(self) -> bool:
        """Released or closed: the gateway let go of it."""
        return self.released or self.closed


def json_response(payload: dict[str, Any], status: int = 200) -> ScriptedResponse:
    """A whole JSON answer."""
    r = ScriptedResponse(status)
    r.feed(json.dumps(payload).encode())
    r.end()
    return r


Handler = Callable[[Target, UpstreamRequest], Awaitable[ScriptedResponse]]


@dataclass
class ScriptedTransport:
    """The test's transport: ``handler`` answers each upstream request."""

    handler: Handler
    sent: list[tuple[str, UpstreamRequest]] = field(default_factory=list)
    responses: list[ScriptedResponse] = field(default_factory=list)
    closed: bool = False
    forgotten: list[str] = field(default_factory=list)  # backends removed from the fleet

    async def send(
        self, target: Target, req: UpstreamRequest, api_key: str | None
    ) -> ScriptedResponse:
        self.sent.append((target.id, req))
        resp = await self.handler(target, req)
        self.responses.append(resp)
        return resp

    async def forget(self, backend_id: str) -> None:
        self.forgotten.append(backend_id)

    async def close(self) -> None:
        self.closed = True

    def open_connections(self, backend_id: str) -> int:
        return sum(1 for r in self.responses if not r.settled)
