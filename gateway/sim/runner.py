"""Run simulated vLLM servers in-process: on the current asyncio loop, or in a thread.

``run_sim_server`` serves ``create_sim_app(config)`` with a ``uvicorn.Server`` task on
the running loop (port 0 picks a free port; the yielded URL has the real one).
``SimServerThread`` does the same on its own loop in a daemon thread, for sync tests;
its ``kill()`` stops it as a SIGKILLed vLLM goes (every open connection reset, nothing
ended in-band). Neither installs signal handlers, so they never steal the host's Ctrl-C.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import AsyncIterator

import uvicorn
from fastapi import FastAPI
from uvicorn.config import LOGGING_CONFIG

from gateway.core.listening import CannotListen, host_port
from gateway.embedded import EmbeddedServer
from gateway.logs import current_format, uvicorn_log_config
from gateway.sim.config import SimConfig
from gateway.sim.server import create_sim_app
from gateway.sim.state import SimState


def _bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port).

    ``proto`` must be ``IPPROTO_TCP``: asyncio sets ``TCP_NODELAY`` on accepted sockets
    only when ``sock.proto == IPPROTO_TCP``; with the default ``proto=0`` Nagle stays on
    and every keep-alive response (headers and body are two writes) waits ~40 ms for
    the client's delayed ACK. ``TCP_NODELAY`` on the listener is inherited as well.
    A failed bind raises :class:`CannotListen` naming the address.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise CannotListen(host, port, e) from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def _url(host: str, sock: socket.socket) -> str:
    return f"http://{host_port(host, sock.getsockname()[1])}"


def _uvicorn_config(app: FastAPI, log_level: str) -> uvicorn.Config:
    # in a process logging JSON (the demo with server.log_format: json), uvicorn's lines
    # stay JSON: its default config would give its loggers text handlers again
    routed = uvicorn_log_config(current_format())
    return uvicorn.Config(
        app,
        log_level=log_level,
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=2,
        timeout_keep_alive=30,
        log_config=LOGGING_CONFIG if routed is None else routed,
    )


async def _shutdown(server: uvicorn.Server, app: FastAPI, task: asyncio.Task[None]) -> None:
    state: SimState = app.state.sim
    # End hanging requests and streams first (streams end with finish_reason "abort"),
    # then let uvicorn close the connections and run the lifespan shutdown.
    state.closing.set()
    server.should_exit = True
    await state.runner.stop()
    try:
        await asyncio.wait_for(asyncio.shield(task), timeout=5)
    except TimeoutError:
        server.force_exit = True
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@contextlib.asynccontextmanager
async def run_sim_server(
    config: SimConfig | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    log_level: str = "warning",
    app: FastAPI | None = None,
) -> AsyncIterator[str]:
    """Serve a simulator on the current event loop; yields its base URL (``http://h:p``).

    ``port=0`` picks a free port; a port that cannot be bound raises
    :class:`gateway.core.listening.CannotListen`. ``app`` (from ``create_sim_app``) may be
    passed to keep a handle on ``app.state.sim``; the uvicorn server serving it is
    ``app.state.http_server`` (its listeners and open connections, for
    :meth:`SimServerThread.kill`). On exit, open streams end and the server stops.
    """
    app = app or create_sim_app(config or SimConfig())
    sock = _bind(host, port)
    server = EmbeddedServer(_uvicorn_config(app, log_level))
    app.state.http_server = server
    task = asyncio.create_task(server.serve(sockets=[sock]), name="sim-uvicorn")
    try:
        while not server.started:
            if task.done():
                task.result()  # re-raise the start-up error
                raise RuntimeError("simulator server exited during start-up")
            await asyncio.sleep(0.005)
        yield _url(host, sock)
    finally:
        await _shutdown(server, app, task)
        sock.close()


class SimServerThread:
    """A simulator on its own event loop in a daemon thread, for synchronous code.

    ``url = SimServerThread(config).start()`` ... ``.stop()``; also a context manager.
    ``app`` is the FastAPI app (``app.state.sim`` holds the live state).
    """

    def __init__(
        self,
        config: SimConfig | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        log_level: str = "warning",
    ) -> None:
        self.config = config or SimConfig()
        self.host = host
        self.port = port
        self.log_level = log_level
        self.app: FastAPI = create_sim_app(self.config)
        self.url: str | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    @property
    def state(self) -> SimState:
        """The server's live ``SimState`` (engine, faults, counters)."""
        state: SimState = self.app.state.sim
        return state

    def start(self, timeout: float = 10.0) -> str:
        """Start serving; return the base URL once it accepts connections."""
        if self._thread is not None:
            raise RuntimeError("already started")
        self._thread = threading.Thread(target=self._main, name="sim-server", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("simulator did not start in time")
        if self._error is not None:
            raise RuntimeError("simulator failed to start") from self._error
        assert self.url is not None
        return self.url

    def stop(self, timeout: float = 10.0) -> None:
        """Stop serving and join the thread (idempotent)."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(stop.set)
        thread.join(timeout)

    def kill(self, timeout: float = 10.0) -> None:
        """Stop at once, as a SIGKILLed vLLM does (idempotent): the listening socket is
        closed and every open connection reset (``transport.abort()``: unsent bytes are
        dropped, the peer reads the end of the connection). An open stream ends where it is,
        without ``finish_reason``, ``[DONE]`` or the chunked terminator; a request waiting
        for its answer gets none; a new connection is refused. Then the server stops
        (:meth:`stop`: nothing is left for its graceful shutdown to end)."""
        loop = self._loop
        if self._thread is None or loop is None or loop.is_closed():
            return
        server: uvicorn.Server | None = getattr(self.app.state, "http_server", None)
        reset = threading.Event()

        def abort_all() -> None:
            try:
                if server is not None:
                    for listener in getattr(server, "servers", []):
                        listener.close()
                    for conn in list(server.server_state.connections):
                        transport = getattr(conn, "transport", None)
                        if transport is not None:
                            transport.abort()
            finally:
                reset.set()

        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nothing open
            loop.call_soon_threadsafe(abort_all)
            reset.wait(timeout)
        self.stop(timeout)

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # surfaced by start()
            self._error = exc
        finally:
            self._ready.set()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        async with run_sim_server(
            host=self.host, port=self.port, log_level=self.log_level, app=self.app
        ) as url:
            self.url = url
            self._ready.set()
            await self._stop.wait()
