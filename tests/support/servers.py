"""Run real servers in background threads for sync tests: the gateway under uvicorn.

Each server gets its own event loop and a socket bound to port 0 (no port races).
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any

import httpx
import uvicorn

from gateway.app import create_app
from gateway.config import GatewayConfig, load_config
from gateway.fleet.discovery import DiscoverySource
from gateway.serving import EmbeddedServer, uvicorn_config
from gateway.wiring import Gateway


def bound_socket(host: str = "127.0.0.1") -> socket.socket:
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY on accepted sockets only then
    # (without it, keep-alive responses wait ~40 ms for the client's delayed ACK).
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.bind((host, 0))
    s.listen(1024)
    s.setblocking(False)
    return s


class LoopThread:
    """An asyncio loop in a daemon thread; ``call(coro)`` runs a coroutine there."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def call(self, coro: Coroutine[Any, Any, Any], timeout: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call_soon(self, fn: Callable[[], Any]) -> None:
        self.loop.call_soon_threadsafe(fn)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


class GatewayThread:
    """The real gateway app under uvicorn, in a thread. ``url`` is its base URL."""

    def __init__(self, cfg: GatewayConfig, source: DiscoverySource | None = None,
                 host: str = "127.0.0.1") -> None:
        """``host``: the address it listens on (``0.0.0.0``: every interface, for a test
        that connects from a non-loopback address); ``url`` is on 127.0.0.1 either way."""
        self.cfg = cfg
        self.host = host
        self.app = create_app(cfg, source=source)
        self._lt: LoopThread | None = None
        self._server: uvicorn.Server | None = None
        self.url = ""

    @property
    def gateway(self) -> Gateway:
        return self.app.state.gateway  # type: ignore[no-any-return]

    def start(self, wait_ready: bool = True, timeout: float = 20) -> str:
        sock = bound_socket(self.host)
        port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        ucfg = uvicorn_config(self.app, self.cfg)
        self._server = EmbeddedServer(ucfg)
        self._lt = LoopThread("gateway")
        server = self._server
        self._task = asyncio.run_coroutine_threadsafe(server.serve(sockets=[sock]), self._lt.loop)
        deadline = time.monotonic() + timeout
        while not server.started:
            if self._task.done():
                self._task.result()
            if time.monotonic() > deadline:
                raise TimeoutError("gateway did not start")
            time.sleep(0.005)
        if wait_ready:
            self.wait_ready(timeout)
        return self.url

    def wait_ready(self, timeout: float = 20, routable: int | None = None) -> None:
        """Wait until the gateway is ready (``/ready`` 200: its own checks) and at least
        ``routable`` backends (default 1) are routable (``/ready/fleet``)."""
        want = 1 if routable is None else routable
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if httpx.get(self.url + "/ready", timeout=5).status_code == 200:
                fleet = httpx.get(self.url + "/ready/fleet", timeout=5).json()
                if len(fleet["routable"]) >= want:
                    return
            time.sleep(0.02)
        raise TimeoutError(
            f"gateway not ready: {httpx.get(self.url + '/ready', timeout=5).text}; "
            f"backends: {httpx.get(self.url + '/admin/backends', timeout=5).text}"
        )

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 30) -> Any:
        """Run a coroutine on the gateway's loop (to read or poke its state safely)."""
        assert self._lt is not None
        return self._lt.call(coro, timeout)

    def stop(self) -> None:
        if self._server is not None and self._lt is not None:
            self._server.should_exit = True
            try:
                self._task.result(15)
            except Exception:
                pass
            self._lt.close()
        self._server = None

    def __enter__(self) -> GatewayThread:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def gateway_config(backends: list[dict[str, Any]], **sections: Any) -> GatewayConfig:
    """A test config: fast probes/scrapes unless overridden, the given backends."""
    base: dict[str, Any] = {
        "health": {"interval_s": 0.2, "timeout_s": 1.0},
        "telemetry": {"scrape_interval_s": 0.2, "models_refresh_s": 2.0},
        "server": {"graceful_shutdown_s": 2},
        # Scripted backends answer data-plane paths with the test's script, so by default
        # no warm-up, calibration or maintenance cycle sends them extra requests; the
        # lifecycle tests turn these on.
        "lifecycle": {
            "warmup_batch_shapes": [],
            "slow_start_s": 0,
            "short": {"every_s": 0},
            "medium": {"every_s": 0, "every_requests": 0},
            "long": {"every_s": 0},
        },
        "calibration": {"enabled": False},
    }
    for k, v in sections.items():
        base[k] = _merge(base.get(k, {}), v) if isinstance(v, dict) else v
    return load_config(None, backends=backends, **base)


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out
