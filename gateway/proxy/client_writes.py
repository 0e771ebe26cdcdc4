"""A write timeout toward clients: a client that stops reading is not a client.

uvicorn has no write timeout. An ASGI ``send`` of a body chunk waits (uvicorn's
``FlowControl.drain``) while the connection's write buffer is above its high-water mark,
that is while the client is not reading; a client that stops reading with its socket open
would hold a stream's backend generation, its admission slot and backend slot for ever (and
a non-stream answer's bytes in memory, since closing a transport waits for its buffer to
drain).

:func:`write_timeout_protocol` gives uvicorn an HTTP protocol class whose writes must make
progress: when the transport stays paused (asyncio's ``pause_writing`` / ``resume_writing``,
the same signals uvicorn's ``send`` waits on) for ``timeout_s`` seconds, the connection is
aborted. uvicorn then reports ``http.disconnect`` to the request, which the request path
already handles as a client gone: :class:`gateway.proxy.relay.ClientWatch` cuts the request,
the upstream response is closed (vLLM aborts), the lease gives everything back, and a client
disconnect (499, attempt outcome ``client_gone``, breaker neutral) is counted. A slow but
steady reader keeps resuming the transport and is never cut. It costs nothing per write:
one timer per pause of the transport, which only a client slower than the answer causes.
"""

from __future__ import annotations

import asyncio
import logging

from uvicorn.protocols.http.auto import AutoHTTPProtocol

log = logging.getLogger("gateway.proxy")


class _WriteTimeout(asyncio.Protocol):
    """Mixin over a uvicorn HTTP protocol: abort the connection when its writes stay paused
    for :attr:`write_timeout_s` seconds."""

    write_timeout_s: float = 30.0
    _wt_transport: asyncio.BaseTransport | None = None
    _wt_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._wt_transport = transport
        super().connection_made(transport)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._wt_timer is None:
            loop = asyncio.get_running_loop()
            self._wt_timer = loop.call_later(self.write_timeout_s, self._write_stalled)

    def resume_writing(self) -> None:
        self._wt_cancel()
        super().resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._wt_cancel()
        super().connection_lost(exc)

    def _wt_cancel(self) -> None:
        if self._wt_timer is not None:
            self._wt_timer.cancel()
            self._wt_timer = None

    def _write_stalled(self) -> None:
        self._wt_timer = None
        transport = self._wt_transport
        if transport is None or transport.is_closing():
            return
        log.info(
            "client %s read nothing for %g s (server.client_write_timeout_s): connection "
            "closed, its request ends as a client disconnect",
            transport.get_extra_info("peername"),
            self.write_timeout_s,
        )
        # abort, not close: close would wait for the unread buffer to drain
        abort = getattr(transport, "abort", None)
        if abort is not None:
            abort()
        else:  # pragma: no cover - every stream transport has abort()
            transport.close()


def write_timeout_protocol(
    timeout_s: float, base: type[asyncio.Protocol] = AutoHTTPProtocol
) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class ``base`` (default: the one ``http="auto"`` picks,
    httptools when installed) whose connections are aborted when a write makes no progress
    for ``timeout_s`` seconds (``server.client_write_timeout_s``). Pass the result as
    ``uvicorn.Config(http=...)``."""
    return type(
        f"WriteTimeout{base.__name__}", (_WriteTimeout, base), {"write_timeout_s": timeout_s}
    )
