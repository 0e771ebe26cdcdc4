"""DNS discovery end to end: a real DNS server (dnsmasq) whose records the test changes, the
real gateway under uvicorn resolving it, simulated vLLM servers on distinct loopback
addresses sharing one port (the pods of a headless Service), the openai SDK as the client.

What is checked is the gateway's routing, seen from the backends' own records of what they
served (``/sim/stats``) and the client's answers: a new address gets requests after its
warm-up, one that left the answer gets none once its drain began and is removed from the
fleet (with its metric series) when nothing is in flight there, no request fails while the
records change under load, and a resolver outage keeps the fleet serving.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.lifecycle.support import Sim, metric, metric_samples, sdk, sdk_kwargs, wait_for
from tests.support.dnsmasq import DnsServer
from tests.support.servers import GatewayThread, gateway_config

NAME = "vllm.test"


class Load:
    """``workers`` threads sending streaming chats through the SDK until :meth:`stop`; every
    answer is checked whole (``[DONE]`` reached through the SDK, ``max_tokens`` chunks,
    a finish reason)."""

    def __init__(self, base_url: str, workers: int = 4, max_tokens: int = 12) -> None:
        self.ok = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._run, args=(base_url, max_tokens), daemon=True)
            for _ in range(workers)
        ]
        for t in self._threads:
            t.start()

    def _run(self, base_url: str, max_tokens: int) -> None:
        client = sdk(base_url)
        while not self._stop.is_set():
            try:
                chunks = list(client.chat.completions.create(**sdk_kwargs(max_tokens, True)))
                tokens = sum(1 for c in chunks if c.choices and c.choices[0].delta.content)
                finish = [c.choices[0].finish_reason for c in chunks if c.choices]
                if tokens != max_tokens or finish[-1] != "length":
                    raise AssertionError(f"{tokens} tokens, finish {finish[-1:]}")
                with self._lock:
                    self.ok += 1
            except Exception as e:
                with self._lock:
                    self.failures.append(f"{type(e).__name__}: {e}")

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)


def backends(gw: GatewayThread) -> dict[str, dict[str, Any]]:
    """``/admin/backends`` by id."""
    body = httpx.get(gw.url + "/admin/backends", timeout=5).json()
    return {b["id"]: b for b in body["backends"]}


def chats(pod: Sim) -> int:
    return pod.chat_requests()


def bound_for(gw: GatewayThread, pods: int) -> int:
    """The admission bound of ``pods`` pods of 16 sequences each (admission.in_flight_per_seq)."""
    return math.ceil(16 * pods * gw.cfg.admission.in_flight_per_seq)


@pytest.fixture
def dns_gateway(
    dns_server: DnsServer, pods: Callable[..., Sim]
) -> Any:
    """Two pods in DNS, a gateway discovering them (resolving every 0.2 s)."""
    a, b = pods("127.0.0.2"), pods("127.0.0.3")
    dns_server.set_records([(a.host, NAME), (b.host, NAME)])
    cfg = gateway_config(
        [],
        discovery={
            "source": "dns",
            "dns": {"name": NAME, "port": a.port, "interval_s": 0.2, "timeout_s": 0.5,
                    "nameservers": [dns_server.nameserver]},
            "template": {"max_num_seqs": 16},
        },
    )
    gw = GatewayThread(cfg)
    gw.start(wait_ready=False)
    ids = {f"{p.host}-{p.port}" for p in (a, b)}
    assert wait_for(
        lambda: {i for i, x in backends(gw).items() if x["state"] == "warm"} == ids, 20
    ), backends(gw)
    yield gw, a, b
    gw.stop()


def test_records_changing_under_load_move_traffic_without_failing_a_request(
    dns_gateway: Any, dns_server: DnsServer, pods: Callable[..., Sim]
) -> None:
    gw, a, b = dns_gateway
    load = Load(gw.url)
    try:
        assert wait_for(lambda: load.ok >= 10, 20)

        # a new address: it enters cold, warms up, then takes requests
        c = pods("127.0.0.4")
        c_id = f"{c.host}-{c.port}"
        dns_server.set_records([(a.host, NAME), (b.host, NAME), (c.host, NAME)])
        assert wait_for(lambda: c_id in backends(gw), 10)
        assert wait_for(lambda: backends(gw)[c_id]["state"] == "warm", 15), backends(gw)[c_id]
        assert wait_for(lambda: chats(c) >= 3, 15)
        history = httpx.get(f"{gw.url}/admin/backends/{c_id}", timeout=5).json()["history"]
        moves = [(h["from"], h["to"]) for h in history]
        assert moves[:2] == [("cold", "warming"), ("warming", "warm")], moves
        # admission's bound follows the fleet's capacity (max_num_seqs from the template)
        assert gw.gateway.gate.scheduler.max_in_flight == bound_for(gw, 3)

        # an address leaves the answer: drained (nothing new reaches it), then removed
        a_id = f"{a.host}-{a.port}"
        gone = gw.gateway.fleet.get(a_id)
        dns_server.set_records([(b.host, NAME), (c.host, NAME)])
        # removed once the requests it had when its drain began ended (every attempt
        # sent there is counted in flight until it ends, so all have reached it by then)
        assert wait_for(lambda: a_id not in backends(gw), 10), backends(gw).get(a_id)
        assert gone is not None and gone.in_flight == 0
        served_by_a = chats(a)
        assert gw.gateway.gate.scheduler.max_in_flight == bound_for(gw, 2)
        before = load.ok
        assert wait_for(lambda: load.ok >= before + 20, 20)
        assert chats(a) == served_by_a, "a request reached an address after its drain began"

        # the resolver goes away: an outage, the fleet stays as it was and keeps serving
        dns_server.stop()
        assert wait_for(
            lambda: metric(metric_samples(gw.url), "gateway_discovery_up", source="dns") == 0, 10
        )
        before = load.ok
        time.sleep(1.0)  # five resolution intervals without an answer
        assert wait_for(lambda: load.ok >= before + 20, 20)
        assert {i for i, x in backends(gw).items() if x["state"] == "warm"} == {
            f"{b.host}-{b.port}", c_id
        }
    finally:
        load.stop()
    assert load.failures == [], load.failures[:5]
    assert load.ok > 0
    # nothing leaked: every backend (the removed one too) and the scheduler end at zero
    assert wait_for(lambda: all(x["in_flight"] == 0 for x in backends(gw).values()), 5)
    assert gw.gateway.gate.scheduler.in_flight == 0
    text = httpx.get(gw.url + "/metrics", timeout=5).text
    assert f'backend="{a_id}"' not in text, "a removed backend's series is still exported"
    assert f'backend="{c_id}"' in text
    samples = metric_samples(gw.url)
    assert metric(samples, "gateway_discovery_changes_total", change="added") == 3
    assert metric(samples, "gateway_discovery_changes_total", change="removed") == 1
    assert metric(samples, "gateway_discovery_outages_total", source="dns") == 1
