"""The data path toward backends: pooled aiohttp sessions, forwarding, header hygiene.

aiohttp where bytes flow (measured ~0.4 ms CPU per proxied request against 5-9
ms for httpx's own pool, encode/httpx#3215). One ``ClientSession`` per backend, so one slow
backend's pool can never starve another's. No hidden caps: the pool size comes from config
(default 1024 per backend); there is no total timeout, only connect, time-to-first-byte
and idle-between-chunks (see :class:`gateway.config.ProxyConfig`).

Responses are never decompressed here (``auto_decompress=False``): bytes and their
``content-encoding`` travel together, so a client always gets a body that matches its headers.
Streams ask the backend for ``identity`` so that the relay can frame events.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Iterable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp

from gateway.config import ProxyConfig
from gateway.core.vocab import FailureKind


class Target(Protocol):
    """Where an upstream request goes: a backend's id (its pool's key) and base URL."""

    @property
    def id(self) -> str: ...

    @property
    def base_url(self) -> str: ...


class BodyReader(Protocol):
    """A response body read in chunks as they arrive (``aiohttp.StreamReader``)."""

    async def readany(self) -> bytes: ...


class UpstreamResponse(Protocol):
    """What the flow reads of a backend's response (``aiohttp.ClientResponse`` is one):
    status, content type, headers (``headers`` case-insensitive; ``raw_headers`` as sent),
    the body, and ``release()`` (done, connection reusable) / ``close()`` (abort: the
    backend sees the disconnect)."""

    @property
    def status(self) -> int: ...

    @property
    def content_type(self) -> str: ...

    @property
    def headers(self) -> Mapping[str, str]: ...

    @property
    def raw_headers(self) -> tuple[tuple[bytes, bytes], ...]: ...

    @property
    def content(self) -> BodyReader: ...

    def release(self) -> object: ...

    def close(self) -> None: ...


class Transport(Protocol):
    """The narrow upstream interface the request flow sends through: :class:`UpstreamPool`
    (aiohttp) in the gateway, an in-process script in tests
    (``tests/support/transport.py``)."""

    async def send(
        self, target: Target, req: UpstreamRequest, api_key: str | None
    ) -> UpstreamResponse: ...

    async def forget(self, backend_id: str) -> None:
        """``backend_id`` left the fleet: close what is pooled for it."""

    async def close(self) -> None: ...

# RFC 9110 section 7.6.1 hop-by-hop headers, plus headers the gateway sets itself.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
    }
)
_DROP_REQUEST = HOP_BY_HOP | {"host", "content-length", "authorization", "expect", "x-priority"}
_DROP_RESPONSE = HOP_BY_HOP | {"content-length", "date", "server"}



class UpstreamFailure(Exception):
    """An attempt toward ``backend`` failed.

    ``kind``: ``connect`` (refused, reset before the request was taken, DNS), ``ttfb_timeout``,
    ``idle_timeout``, ``disconnected`` (the backend closed or broke the response),
    ``status`` (a 5xx answer), ``auth`` (the backend refused the gateway's own key),
    ``drained`` (the backend's drain deadline ended the attempt; not its fault),
    ``backend_hung`` (the gateway judged the backend hung and ended the attempt before any
    answer).
    ``body``/``status``/``headers`` keep a backend's error answer so it can be passed on.
    """

    def __init__(
        self,
        backend: Target,
        kind: FailureKind,
        message: str,
        status: int | None = None,
        body: bytes = b"",
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        super().__init__(message)
        self.backend = backend
        self.kind = kind
        self.message = message
        self.status = status
        self.body = body
        self.headers = headers or []


@dataclass(slots=True)
class UpstreamRequest:
    """What to send: method, path (with query), forwarded headers, raw body bytes."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    stream: bool


def header_value(raw: bytes) -> str:
    """A request header's value as the ``str`` aiohttp re-encodes to the same bytes: UTF-8
    (aiohttp writes header values as UTF-8, so a latin-1 decode would double-encode ``é``);
    bytes that are not UTF-8 fall back to latin-1."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("latin-1")


def forward_headers(
    raw: list[tuple[bytes, bytes]],
    request_id_header: str,
    request_id: str,
    stream: bool,
    private: Iterable[bytes] = (),
) -> dict[str, str]:
    """Client headers to send upstream (without the backend key, added per attempt).

    Drops hop-by-hop headers (and any named by ``Connection``), ``host``,
    ``content-length`` (recomputed), the client's ``authorization`` (the client's key
    never leaves the gateway), ``x-priority`` and the ``private`` ones (lower-case raw
    names: the configured priority header; what a client asks of the gateway is not the
    backend's business, issue 20). Keeps everything else unchanged. Streams ask for
    ``accept-encoding: identity``.
    """
    out: dict[str, str] = {}
    extra_drop: set[str] = set()
    dropped = {p.decode("latin-1") for p in private}
    for k, v in raw:
        name = k.decode("latin-1").lower()
        if name == "connection":
            extra_drop.update(t.strip().lower() for t in v.decode("latin-1").split(","))
            continue
        if name in _DROP_REQUEST or name in dropped:
            continue
        value = header_value(v)
        prev = out.get(name)
        out[name] = value if prev is None else f"{prev}, {value}"
    for name in extra_drop:
        out.pop(name, None)
    out[request_id_header] = request_id
    if stream or "accept-encoding" not in out:
        out["accept-encoding"] = "identity"
    return out


def response_headers(
    resp: UpstreamResponse, own: str = "x-request-id"
) -> list[tuple[bytes, bytes]]:
    """Backend response headers to pass to the client, in the order received with repeated
    names kept (two ``set-cookie`` stay two): hop-by-hop ones (RFC 9110 section 7.6.1,
    with every name listed in any ``Connection`` header), length, and ``own`` (the
    request-id header, which the gateway sets itself) dropped. Names lower-case."""
    raw = resp.raw_headers
    extra_drop: set[str] = {own.lower()}
    for k, v in raw:
        if k.lower() == b"connection":  # every Connection line, not only the first
            extra_drop |= {t.strip().lower() for t in v.decode("latin-1").split(",")}
    out = []
    for k, v in raw:
        name = k.decode("latin-1").lower()
        if name in _DROP_RESPONSE or name in extra_drop:
            continue
        out.append((name.encode("latin-1"), v))
    return out


STALE_WINDOW_S = 0.1
"""How soon after its connection was handed out a send that lost that connection before any
answer byte may be the stale keep-alive race, in seconds: the backend closed an idle pooled
connection (its keep-alive timeout) while the gateway was reusing it, so its FIN or RST
arrives within one round trip of the write (RFC 9112 section 9.3.1, "retrying requests": a
client may retry a request on a connection that closed before it got the response, only when
it knows the request was not processed; aiohttp#7297, aiohttp#9138). Go's ``net/http``
``Transport`` (``persistConn.shouldRetryRequest``) re-sends only on a *reused* connection and
only when nothing of the request was written or the server closed it while idle
(``errServerClosedIdle``); aiohttp tells neither, so the gateway bounds the race by time
instead: 0.1 s is about a hundred round trips inside a data centre and one across a
continent. A backend that read the request and worked on it before dropping the connection
(a crash, a "query of death") is past the window: a ``disconnected`` failure, never re-sent
to it."""

STALE_RESENDS = 1
"""How many times one send is re-sent after the stale keep-alive race
(:data:`STALE_WINDOW_S`): once, on another connection of the same backend."""


class _Reuse:
    """What the connector says about one send (set by :class:`_ReuseAwareConnector` through
    :data:`_SEND`): whether its connection already carried a request, and when it was
    handed out (``time.monotonic()`` seconds)."""

    __slots__ = ("at", "reused")

    def __init__(self) -> None:
        self.reused = False
        self.at = 0.0

    def stale_race(self, now: float) -> bool:
        """Whether a disconnect before any answer byte at ``now`` (``time.monotonic()``) is the
        stale keep-alive race: a reused connection, lost within :data:`STALE_WINDOW_S`."""
        return self.reused and now - self.at <= STALE_WINDOW_S


_SEND: ContextVar[_Reuse | None] = ContextVar("gateway_upstream_send", default=None)


class _ReuseAwareConnector(aiohttp.TCPConnector):
    """A ``TCPConnector`` that tells the running send whether the connection it hands out
    already carried a request (aiohttp reuses the same protocol object for a pooled
    connection) and when it handed it out. It costs one weak-set lookup per send, where
    aiohttp's tracing signals would cost about ten awaited callbacks."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._used: weakref.WeakSet[object] = weakref.WeakSet()

    async def connect(self, req: Any, *args: Any, **kwargs: Any) -> Any:
        conn = await super().connect(req, *args, **kwargs)
        note = _SEND.get()
        proto = conn.protocol
        if note is not None and proto is not None:
            note.reused = proto in self._used
            note.at = time.monotonic()
            self._used.add(proto)
        return conn


class UpstreamPool:
    """One pooled aiohttp session per backend, created lazily inside the running loop.

    A send whose pooled keep-alive connection the backend had already closed (the
    ``ServerDisconnectedError`` / connection reset of a stale connection, before any byte
    of an answer, within :data:`STALE_WINDOW_S` of the connection's hand-out) is re-sent
    once on another connection (:data:`STALE_RESENDS`): the backend never saw that
    request, so the client must not see the failure either. Any other disconnect is a
    ``disconnected`` failure, never re-sent here.
    """

    def __init__(self, cfg: ProxyConfig) -> None:
        self.cfg = cfg
        self._sessions: dict[str, aiohttp.ClientSession] = {}
        self._timeout = aiohttp.ClientTimeout(
            total=None,
            connect=cfg.connect_timeout_s,
            sock_connect=cfg.connect_timeout_s,
            sock_read=None,
        )

    def session(self, backend: Target) -> aiohttp.ClientSession:
        s = self._sessions.get(backend.id)
        if s is None or s.closed:
            connector = _ReuseAwareConnector(
                limit=self.cfg.pool_size_per_backend,
                limit_per_host=self.cfg.pool_size_per_backend,
                keepalive_timeout=self.cfg.keepalive_timeout_s,
                ttl_dns_cache=60,
            )
            s = aiohttp.ClientSession(
                base_url=backend.base_url,
                connector=connector,
                timeout=self._timeout,
                auto_decompress=False,
                cookie_jar=aiohttp.DummyCookieJar(),
                skip_auto_headers=("Accept-Encoding",),
                read_bufsize=2**16,
            )
            self._sessions[backend.id] = s
        return s

    def open_connections(self, backend_id: str) -> int:
        """Connections of this backend's pool currently carrying a request."""
        s = self._sessions.get(backend_id)
        if s is None or s.connector is None:
            return 0
        acquired = getattr(s.connector, "_acquired", ())
        return len(acquired)

    async def forget(self, backend_id: str) -> None:
        """``backend_id`` left the fleet (discovery removed it once nothing was in flight
        there): close its session and pooled connections."""
        s = self._sessions.pop(backend_id, None)
        if s is not None:
            await s.close()

    async def close(self) -> None:
        sessions, self._sessions = list(self._sessions.values()), {}
        await asyncio.gather(*(s.close() for s in sessions), return_exceptions=True)

    async def send(
        self, backend: Target, req: UpstreamRequest, api_key: str | None
    ) -> UpstreamResponse:
        """Send ``req`` to ``backend`` and return once the response headers are in.

        Raises :class:`UpstreamFailure` (``connect``, ``disconnected``) when no response
        could be had. The stale keep-alive race is re-sent once on another connection first
        (see the class). The time to first byte is bounded by the caller's timer. The caller owns
        the returned response and must ``release()`` or ``close()`` it.
        """
        headers = req.headers
        if api_key:
            headers = {**headers, "authorization": f"Bearer {api_key}"}
        session = self.session(backend)
        note = _Reuse()
        token = _SEND.set(note)
        try:
            for _ in range(STALE_RESENDS):
                note.reused = False
                try:
                    return await session.request(
                        req.method, req.path, data=req.body, headers=headers
                    )
                except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
                    # a connect error (a ClientOSError too) has no connection: never reused
                    if not note.stale_race(time.monotonic()):
                        raise
            return await session.request(req.method, req.path, data=req.body, headers=headers)
        except aiohttp.ConnectionTimeoutError as e:
            raise UpstreamFailure(backend, FailureKind.CONNECT, f"connect timeout: {e}") from None
        except aiohttp.ClientConnectorError as e:
            raise UpstreamFailure(backend, FailureKind.CONNECT, f"connect error: {e}") from None
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as e:
            raise UpstreamFailure(
                backend, FailureKind.DISCONNECTED, f"connection lost before the response: {e!r}"
            ) from None
        except aiohttp.ClientError as e:
            raise UpstreamFailure(
                backend, FailureKind.DISCONNECTED, f"upstream error: {e!r}"
            ) from None
        finally:
            _SEND.reset(token)
