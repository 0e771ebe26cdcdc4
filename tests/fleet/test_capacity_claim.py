"""The capacity shares' claim (``gateway.coord.capacity.CLAIM``) against a real Redis: a
replica's share is granted atomically against what the store holds now, so two replicas
that read the same freed slots in one round cannot both take them (issue 14, item 5: the
backends' total in flight stays within one replica's capacity)."""

from __future__ import annotations

import json
from typing import Any

import redis

from gateway.coord.capacity import CLAIM

KEY = "test:cap:demand"


def _report(share: int | None, held: int) -> str:
    return json.dumps({"d": [0.0, float(held), 0.0], "h": held, "s": share})


def test_two_replicas_growing_in_one_round_split_the_freed_slots(redis_server: Any) -> None:
    """12 slots held 4/4/4; r3 shrinks to 2 (its report says so); r1 and r2 both read that
    and each wants 6. Claimed one after the other, the second gets what the first left:
    6 + 4 + 2 = 12, not 6 + 6 + 2 = 14."""
    r = redis.Redis.from_url(redis_server.url)
    r.hset(KEY, mapping={"r1": _report(4, 4), "r2": _report(4, 4), "r3": _report(2, 2)})
    claim = r.register_script(CLAIM)
    live = ["r1", "r2", "r3"]
    assert claim([KEY], ["r1", 6, 12, *live]) == 6
    assert claim([KEY], ["r2", 6, 12, *live]) == 4
    stored = {k.decode(): json.loads(v) for k, v in r.hgetall(KEY).items()}
    assert {k: v["s"] for k, v in stored.items()} == {"r1": 6, "r2": 4, "r3": 2}
    assert stored["r1"]["d"] == [0.0, 4.0, 0.0] and stored["r1"]["h"] == 4  # the rest kept


def test_a_shrunk_share_still_running_above_it_and_dead_replicas(redis_server: Any) -> None:
    """A replica that shrank to 2 but still runs 5 keeps 5 slots from the others; a replica
    the heartbeat no longer lists holds nothing; an unreadable report is skipped; nothing
    is granted below 0."""
    r = redis.Redis.from_url(redis_server.url)
    r.hset(KEY, mapping={"r1": _report(None, 0), "r2": _report(2, 5), "gone": _report(9, 9),
                         "bad": "{not json"})
    claim = r.register_script(CLAIM)
    assert claim([KEY], ["r1", 12, 12, "r1", "r2", "bad"]) == 7
    r.hset(KEY, "r2", _report(2, 14))
    assert claim([KEY], ["r1", 3, 12, "r1", "r2"]) == 0
