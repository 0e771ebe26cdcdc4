"""The request lease: everything one request holds, released exactly once each.

A client request holds, over its life: its admission ticket (a slot among
``admission.max_in_flight``), a place reserved for it on a backend by the batcher when it
was dispatched, a place in a backend's merge window (embeddings), and, per attempt, the
backend slot (its in-flight counts, the drain and hung watchdogs' handles) and a circuit
breaker slot (a half-open probe place), plus the upstream response once one answered.
:class:`RequestLease` is the one owner of all of them: the flow records each thing when it
is taken, with the function that gives it back, and the lease calls that function once,
whatever the exit (answer, error, client hang-up, cancellation, shutdown). No other code
releases them: a hold only moves between leases (:meth:`RequestLease.hand_over`, a merge
group's places going to the merged request's own lease), or is taken off a lease by the
code that has just given the thing back itself (the upstream response, released at its
answer's end; a dispatch whose request left in the meantime).

Use it as an async context manager around the whole request, the answer's sending
included (:func:`gateway.api.openai.serve`); :meth:`close` gives back whatever is left
at any moment before (a non-stream answer closes it before its bytes go out, a stream at
its end, so counts are final when the client sees the end), and leaving the ``with``
block closes it in every other case. Holding something on a closed lease gives it back at
once (a batcher dispatch racing a client that has already gone).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from types import TracebackType

from gateway.fleet.backend import Backend
from gateway.fleet.feedback import FleetFeedback
from gateway.fleet.records import Cuttable

log = logging.getLogger("gateway.flow.lease")


class Hold(Enum):
    """Things a lease holds besides the attempt (each at most once at a time)."""

    TICKET = "ticket"  # the admission slot (gateway.flow.admission.Ticket)
    RESERVATION = "reservation"  # places the batcher reserved on a backend at dispatch
    MERGE_SLOT = "merge_slot"  # an upstream request's place in a backend's merge window
    RESPONSE = "response"  # the upstream response, until released or closed


class Verdict(Enum):
    """What an ended attempt tells its backend's circuit breaker."""

    SUCCESS = "success"  # a good answer (a stream's: with the backend's own TTFT)
    FAILURE = "failure"  # the backend failed (5xx, timeout, broken connection)
    NEUTRAL = "neutral"  # not about the backend's health (4xx, 429, client gone, ours)


@dataclass(slots=True)
class Attempt:
    """One attempt's hold on ``backend``: ``places`` sequences and ``pooled_extra`` engine
    requests in its in-flight counts, and a breaker slot until a verdict is given
    (``probe``: the breaker's probe number when it was booked while half-open)."""

    backend: Backend
    places: int
    pooled_extra: int
    cut: Cuttable  # the request's gateway.proxy.relay.CutHandle
    probe: int | None


class RequestLease:
    """Owner of one request's holds (see the module docstring).

    ``signals``: the fleet's control plane, told when an attempt's failure opens its
    backend's breaker.
    ``slot_freed``: called after a backend slot (or a reservation) is given back, so that
    queued requests may be dispatched into it (the batcher's pump), or None.
    """

    __slots__ = ("_holds", "_slot_freed", "attempt", "closed", "signals")

    def __init__(
        self,
        signals: FleetFeedback | None = None,
        slot_freed: Callable[[], None] | None = None,
    ) -> None:
        self.signals = signals
        self._slot_freed = slot_freed
        self._holds: dict[Hold, Callable[[], None]] = {}
        self.attempt: Attempt | None = None
        self.closed = False

    async def __aenter__(self) -> RequestLease:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # ---- holds ----------------------------------------------------------------------
    def hold(self, what: Hold, release: Callable[[], None]) -> None:
        """Record ``what``, given back by calling ``release`` (once). On a closed lease
        ``release`` runs now. Raises ``RuntimeError`` if ``what`` is already held."""
        if self.closed:
            release()
            return
        if what in self._holds:
            raise RuntimeError(f"lease already holds {what.value}")
        self._holds[what] = release

    def release(self, what: Hold) -> None:
        """Give ``what`` back now, if held (idempotent)."""
        release = self._holds.pop(what, None)
        if release is not None:
            release()

    def hand_over(self, what: Hold) -> Callable[[], None] | None:
        """Stop holding ``what`` without giving it back and return its release function,
        for another lease to hold (a merge-window place moving to the merged request)."""
        return self._holds.pop(what, None)

    # ---- attempts -------------------------------------------------------------------
    def start_attempt(
        self,
        backend: Backend,
        cut: Cuttable,
        places: int,
        pooled_extra: int,
        now: float,
        resendable_model: str | None,
    ) -> None:
        """Take a slot on ``backend`` for an attempt (its breaker slot too); the batcher's
        reservation, if any, is given back as the slot replaces it. Raises
        ``RuntimeError`` while another attempt is open."""
        if self.attempt is not None:
            raise RuntimeError("an attempt is already open on this lease")
        probe = backend.breaker.acquire()
        backend.attempt_started(cut, places, pooled_extra, now, resendable_model)
        self.attempt = Attempt(backend, places, pooled_extra, cut, probe)
        self.release(Hold.RESERVATION)

    def end_attempt(self, verdict: Verdict, ttft_s: float | None = None) -> None:
        """End the open attempt (no-op without one): its breaker hears ``verdict``
        (``ttft_s``: the backend's own time to first token, for a stream's success), the
        backend slot and the merge-window place are given back, and queued requests may
        use them."""
        a = self.attempt
        if a is None:
            return
        self.attempt = None
        b = a.backend
        try:
            breaker = b.breaker
            if verdict is Verdict.SUCCESS:
                breaker.on_success(ttft_s, a.probe)
            elif verdict is Verdict.FAILURE:
                if breaker.on_failure(a.probe) and self.signals is not None:
                    self.signals.breaker_tripped(b)
            else:
                breaker.on_neutral(a.probe)
        finally:
            b.attempt_ended(a.cut, a.places, a.pooled_extra)
            self.release(Hold.MERGE_SLOT)
            if self._slot_freed is not None:
                self._slot_freed()

    # ---- the end --------------------------------------------------------------------
    def close(self) -> None:
        """Give back everything still held (an open attempt ends neutral); idempotent."""
        if self.closed:
            return
        self.closed = True
        errors: list[BaseException] = []
        if self.attempt is not None:
            try:
                self.end_attempt(Verdict.NEUTRAL)
            except Exception as e:  # keep releasing the rest
                errors.append(e)
        freed = False
        for what in (Hold.RESPONSE, Hold.MERGE_SLOT, Hold.RESERVATION, Hold.TICKET):
            release = self._holds.pop(what, None)
            if release is None:
                continue
            freed = freed or what is Hold.RESERVATION
            try:
                release()
            except Exception as e:
                errors.append(e)
        if freed and self._slot_freed is not None:
            self._slot_freed()
        if errors:
            log.error("releasing a request's holds failed: %r", errors)
            raise errors[0]
