"""Fixtures of the fleet-mode tests: a real Redis, simulated backends, and several gateway
replicas (each the real app under uvicorn, in its own thread and loop, or for the drills
that would saturate one interpreter, `llm-gateway serve` in a process of its own) sharing
that Redis."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.lifecycle.support import Sim
from tests.support.gateway_process import ServeProcess
from tests.support.servers import GatewayThread, gateway_config
from tests.support.sim_process import SimProcess
from tests.support.vllm import free_port


def _started(kind: Callable[..., Any]) -> Iterator[Callable[..., Any]]:
    """A factory ``make(name, itl_s=0.01, **SimConfig fields)`` of ``kind`` (a simulator
    class), each stopped when the test ends."""
    made: list[Any] = []

    def make(name: str, itl_s: float = 0.01, **config: Any) -> Any:
        s = kind(name, itl_s, **config)
        made.append(s)
        return s

    yield make
    for s in made:
        s.stop()


@pytest.fixture
def sims() -> Iterator[Callable[..., Sim]]:
    """Factory ``sims(name, itl_s=0.01, **SimConfig fields)`` of started simulators."""
    yield from _started(Sim)


@pytest.fixture
def sim_processes() -> Iterator[Callable[..., SimProcess]]:
    """Factory ``sim_processes(name, itl_s=0.01, **SimConfig fields)`` of simulators each in
    a process of its own (:mod:`tests.support.sim_process`: the drills that would saturate
    one interpreter)."""
    yield from _started(SimProcess)


OP_TIMEOUT_S = 1.0
"""The replicas' ``coordination.op_timeout_s`` unless a test sets its own (the default is
0.25 s: a call is given 0.5 s). Every replica, simulator and client thread of a test shares
one process and one GIL, and on CI's loaded 2-core machine a replica's loop was measured
stalled past 0.5 s: one late answer takes a link down (by design: the request path never
waits on the store), and an admin write then got a 503 in a test about something else.
The tests of a slow or frozen store set their own ``op_timeout_s``."""


@pytest.fixture
def replicas(redis_server: Any) -> Iterator[Callable[..., list[GatewayThread]]]:
    """Factory ``replicas(n, {"a": url, ...}, wait_routable=None, backend=None, **sections)``
    -> ``n`` started gateway replicas (ids ``r1``..``rn``) sharing the test's Redis, each with
    every backend (or ``wait_routable`` of them) routable. ``coordination`` settings in
    ``sections`` are merged over the fleet defaults (``redis_url``, fast sync,
    :data:`OP_TIMEOUT_S`)."""
    made: list[GatewayThread] = []

    def make(n: int, urls: dict[str, str], wait_routable: int | None = None,
             backend: dict[str, Any] | None = None, **sections: Any) -> list[GatewayThread]:
        out = []
        coord = dict(sections.pop("coordination", {}))
        for i in range(1, n + 1):
            c = {"redis_url": redis_server.url, "replica_id": f"r{i}", "sync_interval_s": 0.1,
                 "op_timeout_s": OP_TIMEOUT_S, **coord}
            cfg = gateway_config([{"id": k, "url": u, **(backend or {})} for k, u in urls.items()],
                                 coordination=c, **sections)
            gw = GatewayThread(cfg)
            made.append(gw)
            gw.start(wait_ready=False)
            out.append(gw)
        for gw in out:
            want = len(urls) if wait_routable is None else wait_routable
            gw.wait_ready(timeout=30, routable=want)
        return out

    yield make
    for gw in made:
        gw.stop()


@pytest.fixture
def replica_processes(redis_server: Any, tmp_path: Path
                      ) -> Iterator[Callable[..., list[ServeProcess]]]:
    """Factory ``replica_processes(n, {"a": url, ...}, backend=None, **sections)`` -> ``n``
    gateway replicas, each ``llm-gateway serve`` in a process of its own (ids ``r1``..``rn``,
    the config :func:`replicas` would give them, written to ``tmp_path``), started together
    and each with every backend routable: the drills whose replicas, simulators and clients
    would otherwise share one interpreter (:mod:`tests.support.sim_process`)."""
    made: list[ServeProcess] = []

    def make(n: int, urls: dict[str, str], backend: dict[str, Any] | None = None,
             **sections: Any) -> list[ServeProcess]:
        coord = dict(sections.pop("coordination", {}))
        out = []
        for i in range(1, n + 1):
            c = {"redis_url": redis_server.url, "replica_id": f"r{i}", "sync_interval_s": 0.1,
                 "op_timeout_s": OP_TIMEOUT_S, **coord}
            port = free_port()
            server = {**sections.get("server", {}), "port": port}
            cfg = gateway_config([{"id": k, "url": u, **(backend or {})} for k, u in urls.items()],
                                 coordination=c, **{**sections, "server": server})
            path = tmp_path / f"r{i}.yaml"
            path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
            gw = ServeProcess(path, port, tmp_path / f"r{i}.log", tmp_path)
            made.append(gw)
            out.append(gw)
        for gw in out:
            gw.wait_ready(timeout=60)
            wait_routable(gw.url, len(urls))
        return out

    yield make
    for gw in made:
        gw.stop()


def wait_routable(url: str, want: int, timeout: float = 30.0) -> None:
    """Until the gateway at ``url`` routes to ``want`` backends (``/ready/fleet``)."""
    from tests.support.scripted import wait_for

    def routable() -> bool:
        return len(httpx.get(url + "/ready/fleet", timeout=5).json()["routable"]) >= want

    assert wait_for(routable, timeout), httpx.get(url + "/ready/fleet", timeout=5).text
