"""The control plane's HTTP clients, and the transport that feeds the hung watchdog.

:class:`ControlClients` holds two httpx clients, opened when the controller starts:
``control`` (probes, scrapes, model lists: quick answers, ``health.timeout_s``) and
``work`` (warm-up, application probes, calibration, restart hooks: they generate tokens,
``lifecycle.warmup_timeout_s``). Both go through a :class:`LivenessTransport`, which tells
each backend's :class:`~gateway.fleet.liveness.Liveness` what came back from it; requests
of the control client are also *owed* until answered (:mod:`gateway.fleet.liveness`).
"""

from __future__ import annotations

from collections.abc import Callable

import httpx

from gateway.config import HealthConfig, LifecycleConfig
from gateway.fleet.backend import Backend
from gateway.fleet.fleet import Fleet


class ControlClients:
    """The control plane's two HTTP clients for ``fleet`` (``clock``: monotonic seconds).

    :attr:`control` and :attr:`work` raise ``AssertionError`` before :meth:`open` and
    after :meth:`close`."""

    def __init__(
        self,
        fleet: Fleet,
        health: HealthConfig,
        lifecycle: LifecycleConfig,
        clock: Callable[[], float],
    ) -> None:
        self.fleet = fleet
        self.health = health
        self.lifecycle = lifecycle
        self.clock = clock
        self._control: httpx.AsyncClient | None = None
        self._work: httpx.AsyncClient | None = None

    def open(self) -> None:
        """Open both clients (inside the running event loop). Their pools are sized for
        the fleet then, and for no fewer than 8 backends (discovery may add more; beyond
        that a probe may wait for a connection, which the liveness transport does not count
        against the backend)."""
        h, n = self.health, max(8, len(self.fleet))
        # A hung backend holds up to ~5 of its connections (a probe, a scrape, model lists)
        # until they time out: room for that, so the others' probes never queue behind it.
        self._control = httpx.AsyncClient(
            timeout=httpx.Timeout(h.timeout_s),
            transport=LivenessTransport(
                self.fleet,
                self.clock,
                owes=True,
                limits=httpx.Limits(max_connections=max(16, 8 * n)),
            ),
        )
        # Warm-up, application probes and calibration generate tokens: a longer timeout.
        self._work = httpx.AsyncClient(
            timeout=httpx.Timeout(self.lifecycle.warmup_timeout_s, connect=h.timeout_s),
            transport=LivenessTransport(
                self.fleet,
                self.clock,
                owes=False,
                limits=httpx.Limits(max_connections=max(16, 16 * n)),
            ),
        )

    async def close(self) -> None:
        """Close both clients (idempotent)."""
        for client in (self._control, self._work):
            if client is not None:
                await client.aclose()
        self._control = self._work = None

    @property
    def control(self) -> httpx.AsyncClient:
        """Probes, scrapes, model lists (owed answers)."""
        assert self._control is not None, "controller not started"
        return self._control

    @property
    def work(self) -> httpx.AsyncClient:
        """Warm-up, application probes, calibration, restart hooks."""
        assert self._work is not None, "controller not started"
        return self._work


class LivenessTransport(httpx.AsyncBaseTransport):
    """An httpx transport that reports each request to a backend of ``fleet`` to that
    backend's :class:`~gateway.fleet.liveness.Liveness`: an answer (response headers, any
    status) is *heard*; with ``owes`` (the control-plane client) the request is also owed
    until then, and a timeout leaves it owed (``unanswered``), while a refused or reset
    connection, a wait for a pooled connection or a cancellation owe nothing (``dropped``).
    Requests to other URLs (a restart hook) pass through untouched. ``clock``: monotonic
    seconds. Errors are re-raised unchanged. The base-URL table follows the fleet's
    membership (rebuilt when :attr:`Fleet.version` moves)."""

    def __init__(
        self,
        fleet: Fleet,
        clock: Callable[[], float],
        owes: bool,
        limits: httpx.Limits,
    ) -> None:
        self._inner = httpx.AsyncHTTPTransport(limits=limits)
        self._clock = clock
        self._owes = owes
        self._fleet = fleet
        self._version = -1
        self._bases: list[tuple[str, Backend]] = []

    def _table(self) -> list[tuple[str, Backend]]:
        """(base URL, backend), longest base URL first, so a backend under a path prefix
        wins over its host; rebuilt when the fleet's membership changed."""
        if self._version != self._fleet.version:
            self._bases = sorted(
                ((b.base_url.rstrip("/"), b) for b in self._fleet),
                key=lambda x: len(x[0]),
                reverse=True,
            )
            self._version = self._fleet.version
        return self._bases

    def backend_of(self, url: str) -> Backend | None:
        """The backend whose base URL ``url`` is under, or None."""
        for base, b in self._table():
            if url.startswith(base) and (len(url) == len(base) or url[len(base)] in "/?#"):
                return b
        return None

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        backend = self.backend_of(str(request.url))
        if backend is None:
            return await self._inner.handle_async_request(request)
        lv = backend.liveness
        token = lv.sent(self._clock()) if self._owes else None
        try:
            response = await self._inner.handle_async_request(request)
        except httpx.PoolTimeout:
            if token is not None:
                lv.dropped(token)
            raise
        except httpx.TimeoutException:
            if token is not None:
                lv.unanswered(token)
            raise
        except BaseException:
            if token is not None:
                lv.dropped(token)
            raise
        if token is not None:
            lv.answered(token, self._clock())
        else:
            lv.heard(self._clock())
        return response

    async def aclose(self) -> None:
        await self._inner.aclose()
