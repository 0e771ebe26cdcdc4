"""Which backend holds each stored Responses API response (pure; time is an argument).

The Responses API is stateful: ``POST /v1/responses`` stores the response it creates on the
server that created it (vLLM keeps them in its process memory), and a follow-up naming it
(``previous_response_id``) or a by-id call (``GET``/``DELETE /v1/responses/{id}``,
``POST .../cancel``, ``GET .../input_items``) only works there. :class:`ResponseOwners`
remembers, for each response id the gateway saw created, the backend that created it and
the model, bounded in size and for a time to live; :func:`id_in_body` and
:func:`id_in_events` read the id off a non-stream answer and off a stream's first events.

Wire shapes (OpenAI Responses API reference, "The response object" and "Streaming events";
vLLM ``vllm/entrypoints/openai/responses``): a non-stream answer is the response object,
whose top-level ``id`` is the response id (vLLM: ``resp_`` + 32 hex digits); a stream's first
event is ``event: response.created`` with ``data: {"type": "response.created", "response":
{"id": ..., ...}, "sequence_number": 0}``.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

CREATED_EVENT = "response.created"
_CREATED = CREATED_EVENT.encode()


@dataclass(frozen=True, slots=True)
class Owner:
    """Where a response lives: ``backend_id`` created it for ``model`` at ``learned_at``
    (the table's clock, monotonic seconds)."""

    backend_id: str
    model: str
    learned_at: float


class ResponseOwners:
    """Response id -> :class:`Owner`, bounded (the oldest learned goes first past
    ``max_entries``) and expiring ``ttl_s`` seconds after it was learned (config
    ``routing.responses_ttl_s`` / ``routing.responses_max_entries``). ``clock``: monotonic
    seconds. An id evicted or expired reads as unknown (:meth:`owner` returns None)."""

    def __init__(self, ttl_s: float, max_entries: int, clock: Callable[[], float]) -> None:
        self._ttl = ttl_s
        self._max = max_entries
        self._clock = clock
        self._owners: OrderedDict[str, Owner] = OrderedDict()

    def remember(
        self, response_id: str, backend_id: str, model: str, learned_at: float | None = None
    ) -> None:
        """``backend_id`` holds ``response_id`` (for ``model``) from ``learned_at`` (the
        table's clock; default now: another replica may have learned it earlier)."""
        at = self._clock() if learned_at is None else learned_at
        self._owners[response_id] = Owner(backend_id, model, at)
        self._owners.move_to_end(response_id)
        while len(self._owners) > self._max:
            self._owners.popitem(last=False)

    def owner(self, response_id: str) -> Owner | None:
        """The owner of ``response_id``, or None (never learned, evicted or expired)."""
        o = self._owners.get(response_id)
        if o is None:
            return None
        if o.learned_at + self._ttl < self._clock():
            del self._owners[response_id]
            return None
        return o

    def forget(self, response_id: str) -> None:
        """Drop ``response_id`` (deleted on its backend)."""
        self._owners.pop(response_id, None)

    def live(self) -> list[tuple[str, Owner]]:
        """Every id not expired and its owner, oldest learned first (fleet mode writes them
        back to a shared store that lost them)."""
        horizon = self._clock() - self._ttl
        return [(rid, o) for rid, o in self._owners.items() if o.learned_at >= horizon]

    def __len__(self) -> int:
        return len(self._owners)


def id_in_body(body: bytes) -> str | None:
    """The response id of a non-stream Responses API answer (its top-level ``id``), or None
    when ``body`` is not a JSON object with a string ``id``."""
    if b'"id"' not in body:
        return None
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None
    rid = obj.get("id") if isinstance(obj, dict) else None
    return rid if isinstance(rid, str) and rid else None


def id_in_events(block: bytes) -> str | None:
    """The response id in a ``response.created`` event among ``block``'s complete SSE
    events (LF framing), or None. A substring test comes first, so a block without that
    event costs one scan; only that event's ``data`` is parsed."""
    if _CREATED not in block:
        return None
    for event in block.split(b"\n\n"):
        if _CREATED not in event:
            continue
        data = b"\n".join(
            line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")
        )
        try:
            obj = json.loads(data)
        except (ValueError, RecursionError):
            continue
        if not isinstance(obj, dict) or obj.get("type") != CREATED_EVENT:
            continue
        response = obj.get("response")
        rid = response.get("id") if isinstance(response, dict) else None
        if isinstance(rid, str) and rid:
            return rid
    return None
