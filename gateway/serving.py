"""Running the gateway under uvicorn with a graceful shutdown.

On SIGTERM (or Ctrl-C) the gateway drains itself: ``/ready`` answers 503 at once and new
model requests get 503 ``gateway_shutting_down`` with ``retry-after`` (a load balancer
moves them elsewhere); requests in flight, streams included, get up to
``server.graceful_shutdown_s`` to finish; at the end of that grace period the streams still
open end with an OpenAI-shaped error event then ``data: [DONE]``; then the server closes.
A second signal exits at once.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import signal
import socket
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import uvicorn
from uvicorn.config import LOGGING_CONFIG

from gateway.config import GatewayConfig
from gateway.core.listening import CannotListen, host_port
from gateway.core.vocab import Cut
from gateway.core.wording import plural
from gateway.embedded import EmbeddedServer
from gateway.logs import uvicorn_log_config
from gateway.proxy.bad_http import openai_400_protocol
from gateway.proxy.client_writes import write_timeout_protocol
from gateway.wiring import Gateway

log = logging.getLogger("gateway.serving")


def uvicorn_config(app: Any, cfg: GatewayConfig) -> uvicorn.Config:
    """uvicorn settings for the gateway: no server header, no access log unless asked, a
    write timeout toward clients (``server.client_write_timeout_s``), an OpenAI-shaped 400
    for a request it cannot parse (:mod:`gateway.proxy.bad_http`), uvicorn's log lines
    in ``server.log_format`` (:func:`gateway.logs.uvicorn_log_config`)."""
    s = cfg.server
    routed = uvicorn_log_config(s.log_format)
    return uvicorn.Config(
        app,
        host=s.host,
        port=s.port,
        log_level=s.log_level,
        access_log=s.access_log,
        server_header=False,
        lifespan="on",
        timeout_graceful_shutdown=5,
        timeout_keep_alive=math.ceil(s.keep_alive_s),
        http=write_timeout_protocol(s.client_write_timeout_s, openai_400_protocol()),
        log_config=LOGGING_CONFIG if routed is None else routed,
    )


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (``host``, ``port``) for uvicorn to listen on, made the way
    ``uvicorn.Config.bind_socket`` makes it (IPv6 when ``host`` has a colon,
    ``SO_REUSEADDR``, inheritable). A failed bind raises :class:`CannotListen` naming the
    address (uvicorn's own logs a bare ``[Errno 98] Address already in use`` and exits)."""
    sock = socket.socket(family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise CannotListen(host, port, e) from None
    sock.set_inheritable(True)
    return sock


def in_flight(gw: Gateway) -> int:
    """Requests the gateway still owes an answer beyond its queues: sent to a backend."""
    return sum(b.in_flight for b in gw.fleet.backends)


def queued(gw: Gateway) -> int:
    """Requests the gateway owes an answer that hold no backend now: waiting in the
    admission queue or the batcher's buckets, between two attempts, or still receiving
    their body."""
    n = gw.gate.scheduler.queued + gw.pipeline.retrying + len(gw.uploading)
    if gw.batching is not None:
        n += gw.batching.core.queued
    return n


async def graceful_shutdown(gw: Gateway, grace_s: float, poll_s: float = 0.05) -> None:
    """Stop taking requests, let in-flight and queued ones finish within ``grace_s``
    seconds, then end the rest: no new attempt starts (no retry), queued requests get 503
    ``gateway_shutting_down`` (never sent, so another instance can take them), as do
    requests still uploading their body, and streams get an error event and ``[DONE]``.
    Every request is answered before uvicorn's own shutdown timeout, so none gets its bare
    500."""
    gw.shutting_down = True
    log.warning(
        "shutting down: /ready is 503; %s in flight and %d queued get %g s",
        plural(in_flight(gw), "request"),
        queued(gw),
        grace_s,
    )
    deadline = time.monotonic() + grace_s
    while (in_flight(gw) > 0 or queued(gw) > 0) and time.monotonic() < deadline:
        await asyncio.sleep(poll_s)
    gw.pipeline.shutting_down = True
    shed = gw.gate.shed_queued() + (gw.batching.shed_queued() if gw.batching else 0)
    gw.uploads_cut = True
    for task in list(gw.uploading):
        task.cancel()  # answered 503 without the rest of its body
        shed += 1
    if shed or in_flight(gw) > 0:
        log.warning(
            "grace period over: %s refused, ending %d in flight",
            plural(shed, "queued request"),
            in_flight(gw),
        )
        for b in gw.fleet.backends:
            for handle in list(b.active):
                handle.cut(Cut.SHUTDOWN)
        end = time.monotonic() + 3.0
        while in_flight(gw) > 0 and time.monotonic() < end:
            await asyncio.sleep(poll_s)


def run(main: Callable[[], Coroutine[Any, Any, None]], cfg: GatewayConfig) -> None:
    """Run ``main()`` on the event loop uvicorn would pick (uvloop when installed)."""
    factory = uvicorn_config(None, cfg).get_loop_factory()
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(main())


async def _reload_file(gw: Gateway) -> None:
    """``SIGHUP``'s reload of the config file, logged (applied or why not)."""
    from gateway.reload_errors import ReloadRefused

    assert gw.reloader is not None
    try:
        await gw.reloader.reload_file("sighup")
    except ReloadRefused as e:
        log.error("SIGHUP: config not applied (the running config is unchanged): %s",
                  e.problem)


async def serve(
    app: Any,
    cfg: GatewayConfig,
    on_started: Callable[[], Awaitable[None] | None] | None = None,
    sock: socket.socket | None = None,
    signals: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM),
) -> None:
    """Serve ``app`` until one of ``signals`` (SIGTERM/SIGINT), then shut down gracefully.

    ``sock``: the socket to listen on, bound beforehand by :func:`listen_socket` (the demo
    binds it before it starts anything else; ``--workers`` binds it once in the parent,
    :mod:`gateway.workers`); None: bind ``server.host``:``server.port`` now, raising
    :class:`CannotListen` when that fails. ``signals``: those that start the shutdown (a
    worker of ``--workers`` takes only SIGTERM: its parent forwards the rest).

    Once started, everything allocated so far (modules, config, the app) is moved out of
    the garbage collector's reach (``gc.freeze()``, as the CPython docs suggest for servers):
    later collections then scan only per-request objects.
    """
    config = uvicorn_config(app, cfg)
    # Bind first: a port in use (or a bad host) fails here, before the lifespan probes and
    # warms any backend.
    if sock is None:
        sock = listen_socket(cfg.server.host, cfg.server.port)
    server = EmbeddedServer(config)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def on_signal() -> None:
        if stop.is_set():
            log.warning("second signal: exiting now")
            server.force_exit = True
            server.should_exit = True
        stop.set()

    for sig in signals:
        loop.add_signal_handler(sig, on_signal)
    reloads: set[asyncio.Task[None]] = set()

    def on_hangup() -> None:  # SIGHUP: the config file again (gateway.reloading)
        gw: Gateway | None = getattr(app.state, "gateway", None)
        if gw is None or gw.reloader is None:
            log.warning("SIGHUP: the gateway is not started yet; not reloaded")
            return
        task = loop.create_task(_reload_file(gw))
        reloads.add(task)
        task.add_done_callback(reloads.discard)

    if hasattr(signal, "SIGHUP") and signal.SIGHUP not in signals:
        loop.add_signal_handler(signal.SIGHUP, on_hangup)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.02)
    if task.done():
        try:
            task.result()
        except SystemExit as e:  # uvicorn's startup failure (logged above by uvicorn)
            raise OSError(f"the gateway failed to start (exit status {e.code})") from None
        return
    # the line uvicorn logs when it binds the socket itself
    logging.getLogger("uvicorn.error").info(
        "Uvicorn running on http://%s (Press CTRL+C to quit)",
        host_port(cfg.server.host, sock.getsockname()[1]),
    )
    gc.collect()
    gc.freeze()
    if on_started is not None:
        result = on_started()
        if result is not None:
            await result
    waiter = asyncio.create_task(stop.wait())
    await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    if not task.done():
        gw: Gateway = app.state.gateway
        await graceful_shutdown(gw, cfg.server.graceful_shutdown_s)
        server.should_exit = True
    waiter.cancel()
    await task
