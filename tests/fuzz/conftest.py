"""The fuzz tests' gateway over two simulated vLLM servers, started once for the package
(hypothesis runs hundreds of examples against it; none starts a server)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from tests.lifecycle.support import Sim, chat_body
from tests.support.servers import GatewayThread, gateway_config

KEY = "sk-fuzz-client"
AUTH = {"authorization": f"Bearer {KEY}"}


@dataclass
class SimRig:
    """Two simulators serving ``m1`` and a gateway in front of them; ``url``: the gateway."""

    sims: list[Sim]
    gw: GatewayThread
    http: httpx.Client

    @property
    def url(self) -> str:
        return self.gw.url

    @staticmethod
    def relayed(status: int, body: bytes) -> bool:
        """The simulators' own answer to a route they do not serve (``/v1/responses``):
        Starlette's 404, which the gateway relays as it came."""
        return status == 404 and body == b'{"detail":"Not Found"}'

    def plain(self) -> httpx.Response:
        """A normal chat request (what must still be served after any fuzzed input)."""
        return self.http.post(self.url + "/v1/chat/completions", json=chat_body(4),
                              headers=AUTH)


@pytest.fixture(scope="package")
def sim_rig() -> Iterator[SimRig]:
    """The request-path fuzz target: one admission slot (a leaked one shows at once as the
    next request's wait), a client key (so ``Authorization`` is read), fast simulators whose
    answers end within 8 tokens."""
    sims = [Sim(f"s{i}", itl_s=0.001, stop_length_max=8) for i in range(2)]
    cfg = gateway_config(
        [{"id": s.name, "url": s.url} for s in sims],
        admission={"max_in_flight": 1, "max_queue_wait_s": 10.0},
        auth={"client_keys": [{"name": "fuzz", "key": KEY}]},
        server={"body_idle_timeout_s": 2.0},  # a body that never comes: 408 soon
    )
    gw = GatewayThread(cfg)
    try:
        gw.start()
        gw.wait_ready(routable=2)
        with httpx.Client(timeout=20) as http:
            yield SimRig(sims, gw, http)
    finally:
        gw.stop()
        for s in sims:
            s.stop()
