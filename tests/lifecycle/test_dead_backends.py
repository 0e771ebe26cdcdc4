"""Dead servers cost no request while a live one remains: an attempt that found no
connection (nothing was sent) does not count toward ``proxy.max_attempts``, so a request
goes on to a backend it has not tried (each retry within the retry budget). A new user's
trial killed 2 of 4 simulators and saw requests answered 502 whose 2 attempts both met a
dead one, though 2 served. Real HTTP through uvicorn, the ``openai`` SDK, simulated vLLM
servers killed as SIGKILL does (connection refused)."""

from __future__ import annotations

import openai

from tests.lifecycle.support import MODEL, metric_samples, metric_sum


def test_two_of_four_servers_killed_cost_no_request(sims, lc_gateway) -> None:
    servers = [sims(n) for n in ("a", "b", "c", "d")]
    # probes every 30 s: the gateway learns of the deaths only from its requests' attempts
    # (the trial's first seconds), its circuit breakers as they come (the defaults)
    gw = lc_gateway({s.name: s.url for s in servers}, proxy={"max_attempts": 2},
                    health={"interval_s": 30.0, "timeout_s": 1.0})
    servers[0].kill()
    servers[1].kill()
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0)
    served = []
    for i in range(30):
        r = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": f"q{i}"}], max_tokens=2)
        served.append(r.http_response.status_code)
    assert served == [200] * 30
    m = metric_samples(gw.url)
    # the dead servers were tried (the test meets what the trial met), and some request
    # met both before a live one
    assert metric_sum(m, "gateway_upstream_attempts_total", outcome="connect") >= 2
