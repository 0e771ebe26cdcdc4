"""Fleet mode gives one autoscaling answer: two gateway replicas (the real app under uvicorn
each) sharing a real Redis and one simulated vLLM, load sent through the openai SDK to one
replica only.

Checked from ``GET /autoscale`` of each replica: both answer the same ``desired_replicas``,
decided by the leader (the lowest live replica id, ``r1``), on the fleet's inputs: ``r1``
received no request, yet its arrival rate is the one ``r2`` saw. With Redis stopped each
replica answers on its own (its own id, local inputs), and never fails a request.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx

from tests.lifecycle.support import MODEL, Sim, wait_for
from tests.support.load import StreamLoad
from tests.support.servers import GatewayThread


def answer(gw: GatewayThread) -> dict[str, Any]:
    r = httpx.get(gw.url + "/autoscale", params={"model": MODEL}, timeout=5)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def test_two_replicas_answer_as_one_and_alone_when_the_store_is_down(
    redis_server: Any, sims: Callable[..., Sim], replicas: Callable[..., list[GatewayThread]]
) -> None:
    sim = sims("a", itl_s=0.02, max_num_seqs=2)
    r1, r2 = replicas(
        2, {"a": sim.url}, backend={"max_num_seqs": 2},
        admission={"in_flight_per_seq": 4}, slo={"ttft_s": 60},
        autoscale={"interval_s": 0.2, "scale_down_cooldown_s": 30},
    )
    load = StreamLoad(r2.url)  # only r2's clients send anything
    try:
        def as_one() -> bool:
            a1, a2 = answer(r1), answer(r2)
            return (a1["decided_by"] == a2["decided_by"] == "r1"
                    and a1["inputs"] == a2["inputs"] == "fleet"
                    and a1["desired_replicas"] == a2["desired_replicas"] > 1
                    and (a1["arrivals"]["rate_rps"] or 0) > 0)
        assert wait_for(as_one, 20), (answer(r1), answer(r2))
        assert load.ok > 0
        # r1 relayed nothing: the rate it decided on is the fleet's (r2's arrivals)
        assert r1.gateway.accounting.model_ttft.get(MODEL) is None
        whole = httpx.get(r2.url + "/autoscale", timeout=5).json()
        assert whole["decided_by"] == "r1" and whole["inputs"] == "fleet"

        redis_server.stop()  # the store goes away: each replica decides on its own

        def alone() -> bool:
            a1, a2 = answer(r1), answer(r2)
            return (a1["decided_by"], a1["inputs"], a2["decided_by"], a2["inputs"]) == (
                "r1", "local", "r2", "local")
        assert wait_for(alone, 15), (answer(r1), answer(r2))
        before = load.ok
        assert wait_for(lambda: load.ok >= before + 5, 15)  # requests still flow
        assert answer(r2)["desired_replicas"] > 1  # r2 decides on what it sees itself
    finally:
        load.stop()
    assert load.failures == [], load.failures[:5]
