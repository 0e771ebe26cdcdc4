"""The lifecycle drill's servers (``benchmarks/lifecycle_drill.py``): the simulated fleet,
the restart hook's control server, the gateway under uvicorn, each in its own thread, and
the backend-kill schedule.

* :class:`Fleet`: three simulated vLLM backends of ``m1`` (``SimServerThread``);
  ``restart`` (the restart hook: a graceful stop, then a fresh server on the same port),
  ``kill`` (``SimServerThread.kill``: listener closed, every open connection reset
  mid-stream, as a SIGKILLed vLLM) and ``revive`` (served again on its port).
* :class:`ControlServer`: ``POST /restart/{backend_id}``, the gateway's restart hook.
* :class:`GatewayServer`: the gateway app under uvicorn on its own loop.
* :class:`Killer`: every ``every_s`` seconds (the same times in every run) one backend is
  killed and revived ``down_s`` seconds later. The victim is the backend with the most
  generation requests open at that moment (ties: round robin from the last victim), so a
  kill lands mid-stream even when the maintenance cycles keep another one drained (a
  backend's medium cycle comes round every ``lifecycle.medium.every_s / backends`` seconds,
  which a plain round robin can fall into step with).
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from aiohttp import web

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.serving import EmbeddedServer, uvicorn_config
from gateway.sim import SimConfig, SimServerThread
from gateway.wiring import Gateway

MODEL = "m1"
NAMES = ("sim-1", "sim-2", "sim-3")


def bound_socket() -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.bind(("127.0.0.1", 0))
    s.listen(1024)
    s.setblocking(False)
    return s


class Fleet:
    """The simulated backends; ``restart(name)`` stops one and serves a fresh one with the
    same config on the same port (what the restart hook asks for). ``kill(name)`` takes one
    away abruptly (connections reset mid-stream) and ``revive(name)`` serves it again on its
    port, unless the restart hook already did."""

    def __init__(self) -> None:
        self.configs = {
            n: SimConfig(model=MODEL, engine_label=n, seed=i, stop_length_max=96)
            for i, n in enumerate(NAMES, 1)
        }
        self.servers: dict[str, SimServerThread] = {}
        self.ports: dict[str, int] = {}
        self.restarts: dict[str, int] = dict.fromkeys(NAMES, 0)
        self.down: set[str] = set()  # killed, not yet served again
        self._lock = threading.Lock()
        for n in NAMES:
            s = SimServerThread(self.configs[n])
            url = s.start()
            self.servers[n] = s
            self.ports[n] = int(url.rsplit(":", 1)[1])

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    def restart(self, name: str) -> None:
        with self._lock:
            self.servers[name].stop()
            s = SimServerThread(self.configs[name], port=self.ports[name])
            s.start()
            self.servers[name] = s
            self.restarts[name] += 1
            self.down.discard(name)

    def open_requests(self, name: str) -> int:
        """Generation requests open on ``name`` (0 while it is down)."""
        with self._lock:
            return 0 if name in self.down else self.servers[name].state.open_requests

    def kill(self, name: str) -> None:
        with self._lock:
            self.servers[name].kill()
            self.down.add(name)

    def revive(self, name: str) -> None:
        with self._lock:
            if name not in self.down:
                return
            s = SimServerThread(self.configs[name], port=self.ports[name])
            s.start()
            self.servers[name] = s
            self.down.discard(name)

    def stop(self) -> None:
        for s in self.servers.values():
            s.stop()


class ControlServer:
    """``POST /restart/{backend_id}``: the gateway's restart hook (runs in its own thread)."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.loop = asyncio.new_event_loop()
        self.port = 0
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, daemon=True, name="control")
        self._thread.start()
        self._ready.wait(10)

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def restart(request: web.Request) -> web.Response:
            name = request.match_info["backend_id"]
            if name not in self.fleet.servers:
                return web.json_response({"error": f"unknown backend {name}"}, status=404)
            await asyncio.get_running_loop().run_in_executor(None, self.fleet.restart, name)
            return web.json_response({"restarted": name})

        async def start() -> None:
            app = web.Application()
            app.router.add_post("/restart/{backend_id}", restart)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            site = web.SockSite(runner, bound_socket())
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            self._ready.set()

        self.loop.run_until_complete(start())
        self.loop.run_forever()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


class GatewayServer:
    """The gateway app under uvicorn on its own event loop, in a thread."""

    def __init__(self, cfg: GatewayConfig) -> None:
        self.app = create_app(cfg)
        self.cfg = cfg
        sock = bound_socket()
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = EmbeddedServer(uvicorn_config(self.app, cfg))
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self._task = asyncio.run_coroutine_threadsafe(self.server.serve(sockets=[sock]), self.loop)
        deadline = time.monotonic() + 30
        while not self.server.started:
            if self._task.done():
                self._task.result()
            if time.monotonic() > deadline:
                raise RuntimeError("gateway did not start")
            time.sleep(0.02)

    @property
    def gateway(self) -> Gateway:
        return self.app.state.gateway  # type: ignore[no-any-return]

    def call(self, fn: Any) -> Any:
        """Run ``fn()`` on the gateway's loop (a consistent read of its state)."""

        async def run() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(10)

    def stop(self) -> None:
        self.server.should_exit = True
        try:
            self._task.result(20)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(5)


class Killer:
    """Kills a backend every ``every_s`` seconds and restarts it ``down_s`` later (module
    docstring). ``kill(name)`` / ``revive(name)`` act on the fleet, ``open_requests(name)``
    counts a backend's open generation requests; ``kills`` lists ``(seconds since start,
    backend, its open requests)``. Runs in a daemon thread from :meth:`start` to
    :meth:`stop` (which revives a backend still down)."""

    def __init__(self, names: Sequence[str], every_s: float, down_s: float,
                 kill: Callable[[str], None], revive: Callable[[str], None],
                 open_requests: Callable[[str], int]) -> None:
        if not 0 < down_s < every_s:
            raise ValueError(f"kill down time {down_s} s must be in (0, {every_s}) s")
        self.names = list(names)
        self.every_s, self.down_s = every_s, down_s
        self._kill, self._revive, self._open = kill, revive, open_requests
        self.kills: list[tuple[float, str, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="killer")
        self._t0 = 0.0

    def start(self) -> None:
        """Start the schedule now (first kill ``every_s`` from now)."""
        self._t0 = time.monotonic()
        self._thread.start()

    def _run(self) -> None:
        k = 0
        last = len(self.names) - 1
        while not self._stop.wait(max(0.0, self._t0 + (k + 1) * self.every_s - time.monotonic())):
            k += 1
            order = [self.names[(last + 1 + i) % len(self.names)] for i in range(len(self.names))]
            opened = {n: self._open(n) for n in order}
            name = max(order, key=lambda n: opened[n])  # first of the most loaded
            last = self.names.index(name)
            self.kills.append((round(time.monotonic() - self._t0, 2), name, opened[name]))
            self._kill(name)
            self._stop.wait(self.down_s)
            self._revive(name)

    def stop(self) -> None:
        """End the schedule (a backend down is revived before this returns)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(30)
