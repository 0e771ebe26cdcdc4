"""Fleet mode end to end at its simplest: two replicas on one real Redis in front of one
simulated backend answer the openai SDK, and each sees the other alive."""

from __future__ import annotations

from tests.lifecycle.support import MODEL, sdk
from tests.support.scripted import wait_for


def test_two_replicas_serve_and_see_each_other(redis_server, sims, replicas):
    a = sims("A")
    r1, r2 = replicas(2, {"a": a.url})
    for gw in (r1, r2):
        out = sdk(gw.url).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert out.choices[0].message.content
    assert wait_for(lambda: r1.gateway.coord.replicas.ids() == ["r1", "r2"], 3)
    assert r2.gateway.coord.link.up
