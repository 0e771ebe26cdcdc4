"""The request path's bookkeeping on a backend: what each request and attempt sent there
counts (sequences in flight, engine requests of an embeddings list, the requests a drain
deadline may end, those the hung watchdog may re-send, those before their first token),
its answers heard, its ``Retry-After`` cooling and its served count.

:class:`BackendRequests` is a base class of :class:`gateway.fleet.backend.Backend`, which
declares (and documents) the fields these methods write; its callers are the request path
(:mod:`gateway.flow`: the lease, attempts, relay), the rollouts' calibration rounds and the
``/metrics`` scraper (:meth:`~BackendRequests.open_scrape_window`).
"""

from __future__ import annotations

from gateway.fleet.liveness import Liveness
from gateway.fleet.records import Cuttable


class BackendRequests:
    """The request path's writes to a backend's counts (fields: :class:`Backend`'s)."""

    in_flight: int
    pooled_extra: int
    scrape_peak: tuple[int, int]
    active: set[Cuttable]
    awaiting: dict[Cuttable, str]
    unanswered: set[Cuttable]
    probing: int
    liveness: Liveness
    requests_served: int
    cooling_until: float
    busy_since: float
    last_answer_at: float

    def take(self, places: int, pooled_extra: int) -> None:
        """Count a request sent here: ``places`` sequences (its :attr:`in_flight` share) and
        ``pooled_extra`` engine requests beyond one of an embeddings list."""
        self.in_flight += places
        self.pooled_extra += pooled_extra
        if self.in_flight + self.pooled_extra > sum(self.scrape_peak):
            self.scrape_peak = (self.in_flight, self.pooled_extra)

    def give_back(self, places: int, pooled_extra: int) -> None:
        """Undo :meth:`take` when the request ends here."""
        self.in_flight -= places
        self.pooled_extra -= pooled_extra

    def calibration_round(self, delta: int) -> None:
        """A rollout's calibration round starts here (``delta`` 1) or ends (-1, once): one
        sequence in flight and one request before its first token (:attr:`prefill_load`)."""
        (self.take if delta > 0 else self.give_back)(1, 0)
        self.probing += delta

    def attempt_started(
        self,
        cut: Cuttable,
        places: int,
        pooled_extra: int,
        now: float,
        resendable_model: str | None,
    ) -> None:
        """An attempt of a request (``cut``: its :class:`gateway.proxy.relay.CutHandle`) was
        sent here at monotonic ``now``: it takes ``places`` sequences and ``pooled_extra``
        engine requests (:meth:`take`), drain deadlines may end it (:attr:`active`), and,
        with ``resendable_model`` (the request's model, when an attempt is left), the hung
        watchdog may cut it to re-send it while no byte of its answer has come back
        (:attr:`awaiting`)."""
        if self.in_flight == 0:
            self.busy_since = now
        self.take(places, pooled_extra)
        self.active.add(cut)
        self.unanswered.add(cut)
        if resendable_model is not None:
            self.awaiting[cut] = resendable_model

    def answer_started(self, cut: Cuttable, now: float) -> None:
        """The attempt's answer start came back (a whole body or a stream's first events) at
        monotonic ``now``: the backend is alive, and the request can no longer be re-sent."""
        self.awaiting.pop(cut, None)
        self.unanswered.discard(cut)
        self.last_answer_at = now
        self.liveness.heard(now)

    def attempt_ended(self, cut: Cuttable, places: int, pooled_extra: int) -> None:
        """Undo :meth:`attempt_started` (exactly once per attempt, by the request's lease)."""
        self.awaiting.pop(cut, None)
        self.unanswered.discard(cut)
        self.give_back(places, pooled_extra)
        self.active.discard(cut)

    @property
    def prefill_load(self) -> int:
        """Requests here before their first token as the gateway sees it (a stream's first
        events, a non-stream's whole body; each attempt once, out at its answer, end or
        failure) plus calibration rounds (:mod:`gateway.traffic.rollout_strata`)."""
        return len(self.unanswered) + self.probing

    def heard(self, now: float) -> None:
        """The backend answered something (an error status, a stream chunk) at ``now``."""
        self.liveness.heard(now)

    def cool_until(self, until: float) -> bool:
        """Keep new requests away until monotonic ``until`` (a 429/503 ``Retry-After``);
        never shortens a longer cooling. Returns whether it was extended."""
        if until <= self.cooling_until:
            return False
        self.cooling_until = until
        return True

    def count_served(self) -> None:
        """One request's answer came from here (the 10,000-request cycle trigger)."""
        self.requests_served += 1

    def open_scrape_window(self) -> None:
        """Mark the sending of a ``/metrics`` scrape. vLLM renders its gauges at some
        instant before its answer's headers are read; a request that ended meanwhile may
        still be in them. The sample is therefore stamped with :attr:`scrape_peak`, the
        gateway's counts when its engine requests here were highest since this mark, never
        with lower ones, so its own finished requests never read as load that is still
        there (with the count on arrival, one request queued at render time and finished
        before the answer read as a queue of 1 until the next scrape, and steered traffic
        away from an idle backend). The price: a request that ended after the mark but
        before the render is taken off the sample once too often (the load reads lower,
        never below the gateway's own in flight), so the window is kept as short as the
        HTTP exchange allows (:func:`gateway.fleet.telemetry.scrape_load`)."""
        self.scrape_peak = (self.in_flight, self.pooled_extra)
