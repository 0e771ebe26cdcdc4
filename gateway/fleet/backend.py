"""The Backend record, its states, and the Fleet that holds them.

A :class:`Backend` is mutable state owned by the app's lifespan: control loops write its
load sample and state; the request path reads them and keeps its in-flight count. Pure
decision code (:mod:`gateway.routing.policy`) only reads the attributes described by
:class:`gateway.routing.policy.Candidate`.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from gateway.config import BackendConfig, BackendRole
from gateway.core.samples import LoadSample
from gateway.core.vocab import BackendState
from gateway.fleet.liveness import Liveness
from gateway.traffic.capacity import ServiceModel


@dataclass(slots=True, frozen=True)
class Transition:
    """One state change: wall-clock time (unix seconds), from, to, reason."""

    at: float
    from_state: BackendState
    to_state: BackendState
    reason: str


@dataclass(slots=True, frozen=True)
class ModelCard:
    """One entry of a backend's ``/v1/models``, kept whole so vLLM's fields survive."""

    id: str
    raw: dict


@dataclass(eq=False)
class Backend:
    """Live state of one backend. Identity (``id``) never changes; everything else does."""

    config: BackendConfig
    state: BackendState = BackendState.COLD
    models: tuple[str, ...] = ()
    model_cards: tuple[ModelCard, ...] = ()
    in_flight: int = 0
    load: LoadSample | None = None
    last_scrape_ok_at: float | None = None  # monotonic seconds
    last_error: str | None = None
    last_error_at: float | None = None  # unix seconds
    consecutive_probe_failures: int = 0
    consecutive_probe_successes: int = 0
    config_error: str | None = None  # e.g. backend answered 401 to our own key
    requests_served: int = 0
    # Engine requests beyond one of the embeddings requests in flight here (one of k
    # inputs: k - 1; vLLM runs them as k engine requests of one prefill step, whether a
    # client sent the list or the batcher merged it), see routing.policy.estimated_load.
    # (Completions with k prompts count k in ``in_flight`` instead: k sequences decoding.)
    pooled_extra: int = 0
    # (in_flight, pooled_extra) when the gateway's engine requests here (their sum) were
    # highest since the scrape now under way was sent (see open_scrape_window).
    scrape_peak: tuple[int, int] = (0, 0)
    history: deque[Transition] = field(default_factory=lambda: deque(maxlen=20))
    # Cut handles of the requests open on this backend (drain deadlines end them).
    active: set[Any] = field(default_factory=set)
    # Cut handles of the requests waiting here for their answer's start (nothing of it has
    # reached the client: safe to re-send elsewhere), with each one's model.
    awaiting: dict[Any, str] = field(default_factory=dict)
    # What it owes the control plane and when it was last heard from (the hung watchdog,
    # gateway.fleet.liveness); ``suspected``: silent long enough that new requests go
    # elsewhere when another backend can take them.
    liveness: Liveness = field(default_factory=Liveness)
    suspected: bool = False
    # Lifecycle bookkeeping (monotonic seconds unless said otherwise).
    first_seen: float | None = None  # when the gateway first knew it (cold start timer)
    warm_since: float | None = None  # start of the slow-start ramp
    drain_deadline: float | None = None
    drained: bool = False  # a manual drain finished: no in-flight left, out of rotation
    # Kept out of rotation even when probes pass: "admin_drain" (until undrain),
    # "preempted" / "restarting" (until the instance goes away, or hold_until passes).
    hold: str | None = None
    hold_until: float | None = None
    maintenance: str | None = None  # the cycle running now (short/medium/long/drain/...)
    cycles: Any = None  # lifecycle.CycleClock, set by the controller
    calibration_baseline: dict[str, object] | None = None
    # the engine endpoint its own baseline was taken on (answers are compared on it alone)
    calibration_endpoint: str | None = None
    calibration_score: float | None = None
    needs_calibration: bool = False  # drifted: must pass calibration before warm again
    probe_ttft_s: float | None = None  # last application probe's time to first token
    breaker: Any = None  # traffic.breaker.CircuitBreaker, set by the controller
    cooling_until: float = 0.0  # monotonic; a 429/503 Retry-After keeps requests away
    busy_since: float = 0.0  # monotonic: when in-flight last went from 0 to 1
    last_answer_at: float = 0.0  # monotonic: the last answer (or first event) it gave
    stall_probe: Any = None  # the running stall probe task, if any
    # process_start_time_seconds before a restart hook: another value means it restarted
    restart_seen_after: float | None = None
    # GPU telemetry (set by the controller when ``gpu_metrics_url`` is configured):
    thermal: Any = None  # routing.thermal.ThermalTracker
    gpu_health: Any = None  # fleet.gpu_health.GpuHealth (Xid / ECC breaker)
    gpu_error: str | None = None  # last GPU telemetry scrape error (None: last one worked)
    # Concurrency and service rate learned from the scrapes (written by the controller's
    # scrape loop only; admission and the lifecycle read it)
    service: ServiceModel = field(init=False)
    # A due maintenance cycle held back because the others could not carry the load:
    # (cycle kind, monotonic time it was first deferred, why); None when not deferred
    deferred: tuple[str, float, str] | None = None

    def __post_init__(self) -> None:
        self.service = ServiceModel(self.config.max_num_seqs)

    @property
    def id(self) -> str:
        return self.config.id

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

    # ---- the request path's writes (gateway.flow.lease is their only caller) ----------
    def attempt_started(
        self, cut: Any, places: int, pooled_extra: int, now: float, resendable_model: str | None
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
        if resendable_model is not None:
            self.awaiting[cut] = resendable_model

    def answer_started(self, cut: Any, now: float) -> None:
        """The attempt's answer start came back (a whole body or a stream's first events) at
        monotonic ``now``: the backend is alive, and the request can no longer be re-sent."""
        self.awaiting.pop(cut, None)
        self.last_answer_at = now
        self.liveness.heard(now)

    def attempt_ended(self, cut: Any, places: int, pooled_extra: int) -> None:
        """Undo :meth:`attempt_started` (exactly once per attempt, by the request's lease)."""
        self.awaiting.pop(cut, None)
        self.give_back(places, pooled_extra)
        self.active.discard(cut)

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

    @property
    def base_url(self) -> str:
        return self.config.base_url

    @property
    def capacity(self) -> int | None:
        """Batch capacity in sequences (``max_num_seqs``) when configured."""
        return self.config.max_num_seqs

    @property
    def recent_failures(self) -> int:
        """Consecutive failures on this backend's breaker (0 when healthy)."""
        return self.breaker.consecutive if self.breaker is not None else 0

    @property
    def is_standby(self) -> bool:
        return self.config.role is BackendRole.STANDBY

    @property
    def routable(self) -> bool:
        """Whether new requests may be sent here now."""
        return self.state is BackendState.WARM

    def serves(self, model: str) -> bool:
        return model in self.models

    def note_error(self, message: str) -> None:
        """Remember the latest error (shown in ``/admin/backends``)."""
        self.last_error = message
        self.last_error_at = time.time()


class Fleet:
    """The set of backends, in config order, with lookups by id and by model."""

    def __init__(self, configs: list[BackendConfig]) -> None:
        self.backends: list[Backend] = []
        self._by_id: dict[str, Backend] = {}
        for c in configs:
            b = Backend(config=c, models=tuple(c.models or ()))
            self.backends.append(b)
            self._by_id[c.id] = b

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.backends)

    def __len__(self) -> int:
        return len(self.backends)

    def get(self, backend_id: str) -> Backend | None:
        return self._by_id.get(backend_id)

    def serving(self, model: str) -> list[Backend]:
        """Backends that list ``model`` (any state)."""
        return [b for b in self.backends if model in b.models]

    def known_models(self) -> set[str]:
        out: set[str] = set()
        for b in self.backends:
            out.update(b.models)
        return out

    def any_routable(self) -> bool:
        return any(b.routable for b in self.backends)
