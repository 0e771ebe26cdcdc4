"""The response-id table and the ids read off Responses API answers (pure, fake clock)."""

from __future__ import annotations

import json

from gateway.routing.response_owners import ResponseOwners, id_in_body, id_in_events


class Clock:
    """A settable monotonic clock (seconds)."""

    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_owner_expires_after_its_ttl():
    clock = Clock()
    table = ResponseOwners(ttl_s=60.0, max_entries=10, clock=clock)
    table.remember("resp_1", "a", "m1")
    clock.t += 60.0
    owner = table.owner("resp_1")
    assert owner is not None and (owner.backend_id, owner.model) == ("a", "m1")
    clock.t += 0.001
    assert table.owner("resp_1") is None
    assert len(table) == 0


def test_table_keeps_the_newest_within_its_bound():
    table = ResponseOwners(ttl_s=60.0, max_entries=2, clock=Clock())
    for i in range(3):
        table.remember(f"resp_{i}", "a", "m1")
    assert table.owner("resp_0") is None
    assert [table.owner(f"resp_{i}") is not None for i in (1, 2)] == [True, True]
    table.forget("resp_1")
    assert table.owner("resp_1") is None and len(table) == 1


def test_id_in_body_reads_the_top_level_id_only():
    body = json.dumps({"object": "response", "output": [{"id": "msg_1"}], "id": "resp_9"})
    assert id_in_body(body.encode()) == "resp_9"
    assert id_in_body(b'{"output": [{"id": "msg_1"}]}') is None
    assert id_in_body(b"not json \"id\"") is None
    assert id_in_body(b'[{"id": "x"}]') is None


def test_id_in_events_finds_response_created():
    created = {"type": "response.created", "sequence_number": 0,
               "response": {"id": "resp_7", "status": "in_progress"}}
    block = (b": ping\n\nevent: response.created\ndata: " + json.dumps(created).encode()
             + b"\n\nevent: response.in_progress\ndata: {\"type\": \"response.in_progress\"}\n\n")
    assert id_in_events(block) == "resp_7"
    delta = b'event: response.output_text.delta\ndata: {"type": "response.output_text.delta"}\n\n'
    assert id_in_events(delta) is None
    # the name in a delta's text is not the event
    text = b'data: {"type": "response.output_text.delta", "delta": "response.created"}\n\n'
    assert id_in_events(text) is None
