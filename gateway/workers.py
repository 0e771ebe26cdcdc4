"""``llm-gateway serve --workers N``: N gateway processes on one port, each a fleet-mode
replica of the same coordination (``coordination.redis_url``).

How (and why this way):

* **One listening socket, bound once by the parent** (:func:`gateway.serving.listen_socket`)
  and inherited by every worker. A port in use fails once, with its one-line message,
  before any worker starts; connections that arrive while a worker starts or restarts wait
  in the one shared accept queue, and the kernel hands each to whichever worker accepts it.
  (With ``SO_REUSEPORT`` each worker would own a socket and its own queue: the connections
  queued on a worker that dies are reset.)
* **Workers are spawned, not forked** (``multiprocessing`` "spawn": a fresh interpreter
  that is handed the socket as an inherited file descriptor, as uvicorn's own ``--workers``
  does). Nothing of the parent's state crosses (no event loop, thread, lock or open
  connection), so a worker is exactly the one-process gateway; the cost is each worker
  importing the gateway itself (about a second).
* **Each worker is a replica**: its own process, event loop, state and replica id
  (``<coordination.replica_id>-w<i>`` when an id is configured, else the default
  ``<hostname>-<pid>-<hex>``), sharing the fleet's state through the store like replicas on
  different hosts. Without ``coordination.redis_url`` the command is refused
  (:func:`require_fleet_mode`): N processes with private rate limits, drains and
  maintenance would fight over the backends (issue 14).
* **Signals**: SIGTERM or SIGINT to the parent is forwarded to every worker as SIGTERM, and
  each shuts down gracefully (``server.graceful_shutdown_s``, :mod:`gateway.serving`); a
  second signal is forwarded too and ends them at once. Workers ignore SIGINT themselves (a
  terminal's Ctrl-C reaches the whole process group: the parent's forward is the one
  signal each worker gets) and receive SIGTERM when the parent dies (Linux
  ``PR_SET_PDEATHSIG``), so none is left serving alone.
* **A worker that dies unexpectedly is restarted** (after :data:`RESTART_DELAY_S`), with a
  new replica id (``...-w<i>.<n>``: the store's leases of the dead one expire on their TTL
  and are not mistaken for the new process's). More than :data:`MAX_RESTARTS` unexpected
  exits within :data:`RESTART_WINDOW_S` is a crash loop: every worker is stopped and the
  command exits 1 (:data:`CRASH_LOOP_EXIT`), for the service manager to see.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from multiprocessing.context import SpawnProcess
from typing import Any

from gateway.config import ConfigError, GatewayConfig

log = logging.getLogger("gateway.workers")

RESTART_DELAY_S = 1.0
"""Seconds between a worker's unexpected exit and its replacement."""
MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0
"""More than :data:`MAX_RESTARTS` unexpected worker exits within this many seconds is a
crash loop (a worker that cannot start will not start the sixth time either)."""
CRASH_LOOP_EXIT = 1
STOP_MARGIN_S = 10.0
"""Seconds a worker gets beyond ``server.graceful_shutdown_s`` (plus uvicorn's own 5 s and
the 3 s the last streams get to end) before the parent kills it."""
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def require_fleet_mode(cfg: GatewayConfig, workers: int) -> None:
    """Refuse ``--workers`` above 1 without fleet mode (a :class:`ConfigError`: exit 2)."""
    if workers > 1 and not cfg.coordination.enabled:
        raise ConfigError(
            f"--workers {workers} needs fleet mode: set coordination.redis_url (or "
            "LLM_GATEWAY_COORDINATION__REDIS_URL); without a shared store each worker "
            "would keep its own rate limits, drains and maintenance cycles"
        )


def worker_config(cfg: GatewayConfig, index: int, generation: int) -> GatewayConfig:
    """``cfg`` for worker ``index`` (1-based), started for the ``generation``-th time (0:
    first): a configured ``coordination.replica_id`` R becomes ``R-w<index>`` (``.<n>``
    after a restart); without one each worker takes the default (hostname, pid: unique)."""
    base = cfg.coordination.replica_id
    if not base:
        return cfg
    rid = f"{base}-w{index}" + (f".{generation}" if generation else "")
    coord = cfg.coordination.model_copy(update={"replica_id": rid})
    return cfg.model_copy(update={"coordination": coord})


def _die_with_parent(parent: int) -> None:
    """Ask Linux for SIGTERM when the parent exits (nothing elsewhere); if it is already
    gone, stop now."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)


def worker_main(
    cfg: GatewayConfig,
    sock: socket.socket,
    index: int,
    parent: int,
    observe: Callable[[GatewayConfig], None],
) -> None:
    """A worker's body (in the spawned process): the one-process gateway on the inherited
    ``sock``, shut down gracefully on SIGTERM."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent(parent)
    observe(cfg)  # logs and spans (gateway.cli.observe)
    from gateway.app import create_app
    from gateway.serving import run, serve

    log.info("worker %d (pid %d) starting as replica %s", index, os.getpid(),
             cfg.coordination.replica_id or "(default id)")
    app = create_app(cfg)
    run(lambda: serve(app, cfg, sock=sock, signals=(signal.SIGTERM,)), cfg)


@dataclass
class _Slot:
    """One worker position: its current process, how often it was started, since when."""

    index: int
    proc: SpawnProcess | None = None
    generation: int = 0
    started_at: float = 0.0
    restart_at: float | None = None  # monotonic; a replacement is due then
    signalled: int = 0  # SIGTERMs forwarded to the current process


@dataclass
class Supervisor:
    """Starts ``workers`` processes on ``sock`` and keeps them running (see the module doc).
    :meth:`run` returns the command's exit status."""

    cfg: GatewayConfig
    sock: socket.socket
    workers: int
    observe: Callable[[GatewayConfig], None]
    clock: Callable[[], float] = time.monotonic
    slots: list[_Slot] = field(default_factory=list)
    signals_seen: int = 0
    exits: list[float] = field(default_factory=list)  # monotonic times of unexpected exits

    def __post_init__(self) -> None:
        self._ctx = multiprocessing.get_context("spawn")
        self.slots = [_Slot(i) for i in range(1, self.workers + 1)]

    def _start(self, slot: _Slot) -> None:
        cfg = worker_config(self.cfg, slot.index, slot.generation)
        proc = self._ctx.Process(
            target=worker_main,
            args=(cfg, self.sock, slot.index, os.getpid(), self.observe),
            name=f"llm-gateway-worker-{slot.index}",
            daemon=False,
        )
        proc.start()
        slot.proc, slot.started_at, slot.restart_at, slot.signalled = proc, self.clock(), None, 0
        slot.generation += 1

    def _on_signal(self, signum: int, frame: Any) -> None:
        """SIGTERM / SIGINT to the parent: counted here, forwarded by :meth:`_forward`
        (the main loop's next turn, within 0.2 s: a handler that ran while a worker was
        being started would miss that one)."""
        self.signals_seen += 1

    def _forward(self) -> None:
        """Send each live worker one SIGTERM per signal the parent got (the first starts
        its graceful shutdown, a second ends it at once)."""
        for slot in self.slots:
            p = slot.proc
            while p is not None and p.pid and slot.signalled < self.signals_seen:
                slot.signalled += 1
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGTERM)

    def _reap(self) -> int | None:
        """Note each worker that exited; schedule its restart, or return the exit status
        when that makes a crash loop."""
        now = self.clock()
        for slot in self.slots:
            p = slot.proc
            if p is None or p.is_alive():
                continue
            p.join()
            slot.proc = None
            if self.signals_seen:
                continue
            self.exits = [t for t in self.exits if now - t <= RESTART_WINDOW_S] + [now]
            log.error(
                "worker %d (pid %s) exited unexpectedly with %s after %.1f s",
                slot.index, p.pid, p.exitcode, now - slot.started_at,
            )
            if len(self.exits) > MAX_RESTARTS:
                print(
                    f"llm-gateway: {len(self.exits)} worker exits within "
                    f"{RESTART_WINDOW_S:g} s (the last with status {p.exitcode}); stopping "
                    "every worker",
                    file=sys.stderr, flush=True,
                )
                return CRASH_LOOP_EXIT
            slot.restart_at = now + RESTART_DELAY_S
        return None

    def _stop_all(self) -> None:
        """SIGTERM every live worker, then wait for each (killing one that outlives the
        grace period)."""
        self.signals_seen = max(self.signals_seen, 1)
        self._forward()
        deadline = self.clock() + self.cfg.server.graceful_shutdown_s + STOP_MARGIN_S
        for slot in self.slots:
            if slot.proc is not None:
                slot.proc.join(max(0.1, deadline - self.clock()))
                if slot.proc.is_alive():
                    slot.proc.kill()
                    slot.proc.join(5)

    def run(self) -> int:
        """Start every worker and supervise them until a signal ends them all (0) or a
        crash loop (:data:`CRASH_LOOP_EXIT`)."""
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            for slot in self.slots:
                self._start(slot)
            log.warning(
                "%d workers on %s, replicas of fleet %r",
                self.workers, self.sock.getsockname(), self.cfg.coordination.namespace,
            )
            while True:
                self._forward()
                status = self._reap()
                if status is not None:
                    self.signals_seen += 1  # no restarts from here on
                    self._stop_all()
                    return status
                if not self.signals_seen:
                    for slot in self.slots:
                        if slot.restart_at is not None and self.clock() >= slot.restart_at:
                            self._start(slot)
                live = [s.proc.sentinel for s in self.slots if s.proc is not None]
                if self.signals_seen and not live:
                    return 0
                wait(live, timeout=0.2)  # a worker's exit, a signal, or a due restart
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            self._stop_all_quietly()

    def _stop_all_quietly(self) -> None:
        if any(s.proc is not None and s.proc.is_alive() for s in self.slots):
            self._stop_all()


def serve_workers(
    cfg: GatewayConfig, workers: int, observe: Callable[[GatewayConfig], None]
) -> int:
    """``llm-gateway serve --workers N`` (N > 1): bind, then run the :class:`Supervisor`.
    Raises :class:`ConfigError` without fleet mode and
    :class:`gateway.core.listening.CannotListen` for an address it cannot bind."""
    from gateway.config import check_secrets
    from gateway.serving import listen_socket

    require_fleet_mode(cfg, workers)
    check_secrets(cfg)  # once, here: a worker failing on it would only crash-loop
    sock = listen_socket(cfg.server.host, cfg.server.port)
    sock.listen(2048)  # connections wait in this queue while the workers start
    try:
        return Supervisor(cfg, sock, workers, observe).run()
    finally:
        sock.close()
