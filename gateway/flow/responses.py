"""Routing the stateful Responses API: each stored response is served where it was created.

vLLM (like OpenAI) stores a response on the server that created it, in its process memory:
a follow-up (``POST /v1/responses`` with ``previous_response_id``) or a by-id call
(``GET``/``DELETE /v1/responses/{id}``, ``POST .../cancel``, ``GET .../input_items``) sent
to another backend gets that backend's 404. :class:`ResponseRouting` is the one owner of
that state (built by :func:`gateway.wiring.build_gateway`): it learns each response id's
backend from the answer that created it (:meth:`learn`: a non-stream answer's ``id``, or a
stream's first event ``response.created``, read before the client sees anything, so the
relay is not touched) and decides where a request naming one must go.

The rules (README, "The Responses API"):

- **Follow-up** (:meth:`follow_up`): pinned to the owner (no other backend is tried). The
  owner must serve now: ``warm``; cooling after a 429 or with its breaker open, the
  gateway answers 429 with the seconds until it takes requests again; no longer in the
  fleet, restarted since it created the response (it passed through ``cold``, and vLLM's
  store is in memory), or in any other state (draining, cooldown, unhealthy, warming): a
  404 ``invalid_request_error`` on ``previous_response_id`` saying the backend that holds
  it is gone or not serving. An id the gateway does not know (created before a gateway
  restart, expired, evicted) is routed like any request.
- **By-id call** (:meth:`holder`): pinned to the owner in any state but ``cold`` (its state
  lives there and reading or cancelling it costs no generation: a draining, cooling or even
  unhealthy backend is still asked, and a failure to reach it is the usual 502); gone as
  above: 404 on ``response_id``; judged hung (``unhealthy``, reason ``backend_hung``,
  :func:`is_hung`): a prompt 503 (:func:`hung`; asking it would wait out
  ``proxy.ttfb_timeout_s``). An unknown id is asked of
  every backend that may hold one (:meth:`askable`) in turn by :mod:`gateway.api.responses`.
- **A by-id call waiting on a backend judged hung** is cut (:meth:`waiting_on`,
  :meth:`on_transition`: ``Cut.BACKEND_HUNG`` when it goes ``unhealthy``) while no byte of
  its answer has come back: the call then moves on to the next backend (unknown id) or
  gets a 503 (known owner). The fleet's hung watchdog only cuts requests it may re-send
  elsewhere, and a by-id call is pinned to one backend per attempt.
- **Remembered** (:meth:`found`): an unknown id only when the backend's answer names it
  (a response object whose ``id`` is that id), never from the path alone.
- **Fleet mode** (a :class:`ResponseDirectory`, ``gateway.coord.affinity``): each id learned
  is published to the shared store in the background, and an id unknown here is looked up
  there first (:meth:`recall`, the one store read on a request path: only for a follow-up or
  a by-id call whose id this replica does not know, bounded by ``coordination.op_timeout_s``
  and skipped while the store is down, when the rules above apply as in one process).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

from gateway.core.outcomes import INVALID_REQUEST, NO_BACKEND_CODE, SERVER_ERROR, Refusal
from gateway.core.vocab import BackendState, Cut, ErrorType
from gateway.fleet.backend import Backend
from gateway.fleet.fleet import Fleet
from gateway.fleet.records import Cuttable, Transition
from gateway.flow.candidates import wait_s
from gateway.flow.context import Opened
from gateway.routing.response_owners import ResponseOwners, id_in_body, id_in_events

RESPONSES = "/v1/responses"
HUNG = "backend_hung"  # the transition reason of a backend judged hung (gateway.fleet.health)

# States in which a backend runs a process that may hold stored responses and answers
_ASKABLE = frozenset(
    {BackendState.WARMING, BackendState.WARM, BackendState.DRAINING, BackendState.COOLDOWN}
)


def created_id(opened: Opened) -> str | None:
    """The id of the response object an accepted answer start carries, if any: a 200 whose
    body (non-stream, not content-encoded) has an ``id``, or whose first events hold
    ``response.created`` (:func:`gateway.routing.response_owners.id_in_body`,
    :func:`~gateway.routing.response_owners.id_in_events`)."""
    resp = opened.resp
    if resp.status != 200:
        return None
    if opened.framer is None:
        if resp.headers.get("content-encoding") is not None:
            return None
        return id_in_body(opened.data)
    return id_in_events(opened.data)


class ResponseDirectory(Protocol):
    """Where several replicas share what each learned (fleet mode; none in one process)."""

    def publish(self, response_id: str, backend_id: str, model: str) -> None:
        """``backend_id`` created ``response_id``: tell the others (in the background)."""

    async def lookup(self, response_id: str) -> tuple[str, str, float] | None:
        """``(backend id, model, seconds since it was learned)`` of an id another replica
        learned, or None (unknown, or the store did not answer in time)."""


class ResponseRouting:
    """The response-id table (:class:`gateway.routing.response_owners.ResponseOwners`) and
    the decisions that read the fleet. ``clock``: monotonic seconds (the table's too)."""

    def __init__(self, owners: ResponseOwners, fleet: Fleet, clock: Callable[[], float]) -> None:
        self.owners = owners
        self.fleet = fleet
        self.clock = clock
        # backend id -> when it last entered ``cold`` (restarted or preempted: its
        # in-memory store is gone): responses learned before then are lost
        self.lost_at: dict[str, float] = {}
        # backend id -> the by-id calls waiting there for an answer's start
        self.waiting: dict[str, set[Cuttable]] = {}
        self.directory: ResponseDirectory | None = None  # fleet mode (use_directory)

    def use_directory(self, directory: ResponseDirectory) -> None:
        """Fleet mode: publish what is learned here, look up what is not (wiring)."""
        self.directory = directory

    # ---- learning ---------------------------------------------------------------------
    def learn(self, opened: Opened, model: str) -> None:
        """Remember the backend of the response ``opened`` starts, if it created one: a
        200 whose body (non-stream, not content-encoded) has an ``id``, or whose first
        events hold ``response.created``."""
        rid = created_id(opened)
        if rid is not None:
            self.owners.remember(rid, opened.backend.id, model)
            if self.directory is not None:
                self.directory.publish(rid, opened.backend.id, model)

    def found(self, response_id: str, opened: Opened, model: str) -> None:
        """``opened`` answered a by-id call on ``response_id`` the gateway did not know:
        remember its backend when the answer is that response (a 200 whose response
        object, non-stream or in a ``response.created`` event, has ``id`` equal to
        ``response_id``); an answer that does not name it (a list of input items, a
        stream without that event) teaches nothing."""
        if created_id(opened) == response_id:
            self.owners.remember(response_id, opened.backend.id, model)
            if self.directory is not None:
                self.directory.publish(response_id, opened.backend.id, model)

    async def recall(self, response_id: str) -> None:
        """Fleet mode: an id this replica does not know is looked up in the shared store
        and, when another replica learned it, remembered here (with the time it was
        learned, so a backend restarted since still reads as gone). Nothing to do for an
        id known here or without a directory."""
        if self.directory is None or self.owners.owner(response_id) is not None:
            return
        found = await self.directory.lookup(response_id)
        if found is not None:
            backend_id, model, age_s = found
            self.owners.remember(response_id, backend_id, model, self.clock() - age_s)

    def forget(self, response_id: str) -> None:
        """``response_id`` was deleted on its backend."""
        self.owners.forget(response_id)

    def on_transition(self, backend: Backend, t: Transition) -> None:
        """A :class:`gateway.fleet.state.FleetState` listener: a backend entering ``cold``
        (restarted, preempted) lost the responses it stored."""
        if t.to_state is BackendState.COLD:
            self.lost_at[backend.id] = self.clock()
        if t.to_state is BackendState.UNHEALTHY and t.reason == HUNG:
            for cut in list(self.waiting.get(backend.id, ())):
                cut.cut(Cut.BACKEND_HUNG)

    def waiting_on(self, backend: Backend, cut: Cuttable) -> None:
        """A by-id call (``cut``: its :class:`gateway.proxy.relay.CutHandle`) now waits on
        ``backend`` for its answer's start; :meth:`answered_by` ends that."""
        self.waiting.setdefault(backend.id, set()).add(cut)

    def answered_by(self, backend: Backend, cut: Cuttable) -> None:
        """The by-id call ``cut`` waits on ``backend`` no more (answered, failed, gone)."""
        calls = self.waiting.get(backend.id)
        if calls is not None:
            calls.discard(cut)
            if not calls:
                del self.waiting[backend.id]

    # ---- routing ----------------------------------------------------------------------
    def follow_up(self, response_id: str) -> Backend | None:
        """The backend a request continuing ``response_id`` must go to, or None when the
        id is unknown (route it as usual). Raises :class:`Refusal`: 404 when its backend
        is gone or not serving, 429 while it is cooling after its own 429 / 503, 503
        (with Retry-After) while its breaker is open."""
        owner = self.owners.owner(response_id)
        if owner is None:
            return None
        b = self._present(response_id, owner.backend_id, owner.learned_at, "previous_response_id")
        if b.state is not BackendState.WARM:
            raise _gone(
                response_id,
                b.id,
                f"is not serving (state {b.state.value})",
                "previous_response_id",
            )
        now = self.clock()
        wait = wait_s(b, now)
        if wait > 0 or not b.breaker.can_take():
            if b.routable and b.cooling_until > now:  # cooling after its own 429 / 503
                raise Refusal(
                    429,
                    f"The backend holding response '{response_id}' ({b.id}) is "
                    f"rate-limited; retry in {max(1, math.ceil(wait))} s.",
                    "requests",
                    "rate_limit_exceeded",
                    retry_after_s=wait,
                    error_type=ErrorType.UPSTREAM_RATE_LIMITED,
                )
            # its breaker holds it: an outage of that backend, never the client's rate
            # limit (RFC 9110 section 15.6.4: 503 with Retry-After)
            raise Refusal(
                503,
                f"The backend holding response '{response_id}' ({b.id}) has failed "
                f"repeatedly and is recovering; retry in {max(1, math.ceil(wait))} s.",
                SERVER_ERROR,
                NO_BACKEND_CODE,
                retry_after_s=wait,
                error_type=ErrorType.NO_BACKEND,
            )
        return b

    def holder(self, response_id: str) -> tuple[Backend, str] | None:
        """The backend to ask about ``response_id`` and its model, or None when unknown.
        Raises a 404 :class:`Refusal` when that backend is gone (not in the fleet,
        restarted since, or ``cold``)."""
        owner = self.owners.owner(response_id)
        if owner is None:
            return None
        b = self._present(response_id, owner.backend_id, owner.learned_at, "response_id")
        if b.state is BackendState.COLD:
            raise _gone(response_id, b.id, "is not running (state cold)", "response_id")
        return b, owner.model

    def askable(self) -> list[Backend]:
        """Backends that may hold a response the gateway does not know of: those running
        (warming, warm, draining, cooldown), in config order, suspected hung ones last."""
        running = [b for b in self.fleet.backends if b.state in _ASKABLE]
        return sorted(running, key=lambda b: b.suspected)  # (a stable sort)

    def _present(self, response_id: str, backend_id: str, learned_at: float, param: str) -> Backend:
        b = self.fleet.get(backend_id)
        if b is None:
            raise _gone(response_id, backend_id, "is no longer in the fleet", param)
        if self.lost_at.get(b.id, -math.inf) >= learned_at:
            raise _gone(
                response_id, b.id, "was restarted since and lost its stored responses", param
            )
        return b


def is_hung(backend: Backend) -> bool:
    """Whether ``backend`` is ``unhealthy`` because the hung watchdog judged it hung
    (:meth:`gateway.fleet.health.HealthChecks.on_hung`)."""
    return (
        backend.state is BackendState.UNHEALTHY
        and bool(backend.history)
        and backend.history[-1].reason == HUNG
    )


def hung(response_id: str, backend: Backend, retry_after_s: float, known: bool = True) -> Refusal:
    """503 for a by-id call on ``response_id`` whose backend was judged hung (before or
    while it was asked), saying to come back in ``retry_after_s`` seconds. ``known``: the
    backend holds it (else it was one that may, for an id the gateway does not know)."""
    holds = "is held by" if known else "may be held by"
    return Refusal(
        503,
        f"Response with id '{response_id}' {holds} backend '{backend.id}', which stopped "
        "answering (judged hung); retry later.",
        SERVER_ERROR,
        "backend_unavailable",
        param="response_id",
        retry_after_s=retry_after_s,
    )


def _gone(response_id: str, backend_id: str, why: str, param: str) -> Refusal:
    """404 for a response whose backend is gone: OpenAI's ``invalid_request_error`` on
    ``param``, as vLLM and OpenAI answer an unknown response id."""
    return Refusal(
        404,
        f"Response with id '{response_id}' is held by backend '{backend_id}', which {why}; "
        "start a new response.",
        INVALID_REQUEST,
        "response_not_found",
        param=param,
        retryable=False,
    )
