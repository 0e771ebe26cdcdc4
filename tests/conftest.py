"""Shared fixtures: scripted backends and a gateway in front of them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

from tests.realvllm.servers import launch_early, stop_early
from tests.support.scripted import ScriptedBackend
from tests.support.servers import GatewayThread, gateway_config
from tests.support.tls import share_default_context


def pytest_configure(config: pytest.Config) -> None:
    """One default TLS context for the process's httpx clients (:mod:`tests.support.tls`)."""
    share_default_context()

# Property-based tests (hypothesis; the fuzz tests of tests/fuzz/, issue 20): a fixed seed
# (derandomize: the examples are a function of the test alone, the same on every run) and a
# bounded count. Each test asks for its share of ``max_examples`` (tests/fuzz/budget.py), so
# the profile scales them all: ``ci`` (default: a few hundred cases in all, about 20 s on two
# cores) and ``long`` (10 times as many, for benchmarks: ``--hypothesis-profile=long``).
_FUZZ = {"derandomize": True, "database": None, "deadline": None, "print_blob": True,
         "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large,
                                   HealthCheck.filter_too_much]}
settings.register_profile("ci", max_examples=100, **_FUZZ)
settings.register_profile("long", max_examples=1000, **_FUZZ)
settings.load_profile("ci")  # hypothesis' plugin loads --hypothesis-profile after this


def pytest_collection_finish(session: pytest.Session) -> None:
    """Boot the real vLLM servers in the background (niceness 19) when the session will
    use them, so their two minutes of boot overlap the rest of the suite."""
    launch_early(session)


def pytest_sessionfinish(session: pytest.Session) -> None:
    stop_early(session)


@pytest.fixture
def backends() -> Iterator[Callable[..., ScriptedBackend]]:
    """Factory of started scripted backends, stopped after the test."""
    made: list[ScriptedBackend] = []

    def make(*args: Any, **kwargs: Any) -> ScriptedBackend:
        b = ScriptedBackend(*args, **kwargs)
        b.start()
        made.append(b)
        return b

    yield make
    for b in made:
        b.stop()


@pytest.fixture
def gateway() -> Iterator[Callable[..., GatewayThread]]:
    """Factory: ``gateway({"a": backend_a, ...}, **config_sections)`` -> started gateway."""
    made: list[GatewayThread] = []

    def make(bk: dict[str, ScriptedBackend], wait_routable: int | None = None,
             **sections: Any) -> GatewayThread:
        cfg = gateway_config([{"id": k, "url": b.url} for k, b in bk.items()], **sections)
        gw = GatewayThread(cfg)
        gw.start()
        gw.wait_ready(routable=len(bk) if wait_routable is None else wait_routable)
        made.append(gw)
        return gw

    yield make
    for gw in made:
        gw.stop()


@pytest.fixture
def redis_server() -> Iterator[Any]:
    """A started real Redis (:class:`tests.support.redis_server.RedisServer`) on a free
    port, closed after the test. Skips without ``redis-server`` (fails under CI)."""
    from tests.support.redis_server import RedisServer

    srv = RedisServer().start()
    try:
        yield srv
    finally:
        srv.close()


@pytest.fixture
def servers() -> Iterator[Any]:
    """Simulated vLLM servers of model versions for the rollout tests
    (:class:`tests.support.rollout_traffic.Servers`), stopped after the test."""
    from tests.support.rollout_traffic import Servers

    s = Servers()
    try:
        yield s
    finally:
        s.stop()
