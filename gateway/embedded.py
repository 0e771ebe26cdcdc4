"""A uvicorn server embedded in a host program's event loop: the gateway's ``serve``, the
simulator and the tests' servers. Two differences from ``uvicorn.Server``:

* **signals** are left to the host program (:meth:`EmbeddedServer.capture_signals` does
  nothing): the gateway drains on SIGTERM itself (:mod:`gateway.serving`);
* **a prompt exit**: setting ``should_exit`` wakes the main loop at once (uvicorn polls the
  flag every 0.1 s, ``uvicorn/server.py`` ``main_loop``), and the shutdown polls every
  :data:`POLL_S` (5 ms) for the connections and request tasks to end, where uvicorn first
  waits a fixed 0.1 s after asking the connections to close and then polls every 0.1 s
  (the same steps and ``timeout_graceful_shutdown`` otherwise). Measured with the tests'
  gateway (``tests/support/servers.py``, one scripted backend, 2 cores): a stop with
  nothing open took 0.11-0.20 s before, about 0.01 s after; one with a client's idle
  keep-alive connection open took 0.11 s, now about 0.01 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator

import uvicorn

POLL_S = 0.005
"""How often a shutdown looks whether the connections and request tasks have ended, in
seconds (uvicorn polls every 0.1 s and first waits a fixed 0.1 s)."""


class EmbeddedServer(uvicorn.Server):
    """A ``uvicorn.Server`` for a host program's loop (module docstring). ``should_exit``
    may be set from any thread."""

    def __init__(self, config: uvicorn.Config) -> None:
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._exit = False
        super().__init__(config)

    @property
    def should_exit(self) -> bool:
        """uvicorn's flag; setting it true wakes the main loop."""
        return self._exit

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        self._exit = value
        loop, wake = self._loop, self._wake
        if value and loop is not None and wake is not None:
            with contextlib.suppress(RuntimeError):  # the loop already closed
                loop.call_soon_threadsafe(wake.set)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def main_loop(self) -> None:
        """uvicorn's loop (a tick every 0.1 s: the ``date`` header, ``limit_max_requests``),
        woken at once by ``should_exit``."""
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        counter = 0
        should_exit = await self.on_tick(counter)
        while not should_exit:
            counter = (counter + 1) % 864000
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), 0.1)
            should_exit = await self.on_tick(counter)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's shutdown (``uvicorn/server.py`` ``Server.shutdown``, same steps, same
        ``timeout_graceful_shutdown``), polling every :data:`POLL_S` instead of its fixed
        0.1 s wait after asking the connections to close and its 0.1 s polls for them and
        for the request tasks: a stop ends as soon as the last connection has."""
        logging.getLogger("uvicorn.error").info("Shutting down")
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        state = self.server_state
        for connection in list(state.connections):
            connection.shutdown()
        await asyncio.sleep(0)
        try:
            await asyncio.wait_for(self._drained(), timeout=self.config.timeout_graceful_shutdown)
        except TimeoutError:
            logging.getLogger("uvicorn.error").error(
                "Cancel %s running task(s), timeout graceful shutdown exceeded",
                len(state.tasks))
            for t in state.tasks:
                t.cancel(msg="Task cancelled, timeout graceful shutdown exceeded")
        if not self.force_exit:
            await self.lifespan.shutdown()

    async def _drained(self) -> None:
        """Wait until no connection and no request task is open (uvicorn's
        ``_wait_tasks_to_complete``, polled every :data:`POLL_S`), then for the listeners."""
        state = self.server_state
        while (state.connections or state.tasks) and not self.force_exit:
            await asyncio.sleep(POLL_S)
        for server in self.servers:
            await server.wait_closed()
