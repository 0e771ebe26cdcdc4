"""The Backend record and its parts (the fleet that holds them: :mod:`gateway.fleet.fleet`).

A :class:`Backend` is the live state of one backend, owned by the app's lifespan. Its
fields change only through its own methods:

* the request path's (:meth:`Backend.attempt_started`, :meth:`~Backend.answer_started`,
  :meth:`~Backend.attempt_ended`, :meth:`~Backend.heard`, :meth:`~Backend.cool_until`,
  :meth:`~Backend.count_served`, :meth:`~Backend.take`, :meth:`~Backend.give_back`,
  :meth:`~Backend.calibration_round`, :meth:`~Backend.note_error`);
* the control loops' observations (:meth:`~Backend.scraped`, :meth:`~Backend.models_listed`,
  :meth:`~Backend.count_probe`, calibration and GPU results, ...);
* the control-plane record (state, holds, drains, maintenance markers, deferrals, config
  errors: :class:`ControlRecord`), which only :class:`gateway.fleet.state.FleetState`
  changes, through its store, with :meth:`Backend.apply_control`.

Its parts (circuit breaker, cycle clock, GPU trackers, API key) are built with it, by
:class:`gateway.fleet.fleet.Fleet` from the configuration, never attached later. Pure decision code
(:mod:`gateway.routing.policy`) only reads the attributes described by
:class:`gateway.routing.policy.Candidate`.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from gateway.config import (
    BackendConfig,
    BackendRole,
)
from gateway.core.samples import LoadSample, prefix_cache_hit_ratio
from gateway.core.vocab import BackendState, serving_state
from gateway.fleet.cycles import CycleClock, never_due
from gateway.fleet.gpu_health import GpuHealth
from gateway.fleet.liveness import Liveness
from gateway.fleet.records import (
    ControlRecord,
    Cuttable,
    Deferral,
    ModelCard,
    Placement,
    Transition,
)
from gateway.routing.thermal import ThermalTracker
from gateway.traffic.breaker import BreakerConfig, CircuitBreaker
from gateway.traffic.capacity import EngineSample, ServiceModel

__all__ = ["Backend", "ControlRecord", "Cuttable", "Deferral", "ModelCard", "Transition"]


def _default_breaker() -> CircuitBreaker:
    return CircuitBreaker(BreakerConfig(), time.monotonic)


@dataclass(eq=False)
class Backend:
    """Live state of one backend. Identity (``id``) never changes; everything else changes
    through the methods below (module docstring)."""

    config: BackendConfig
    state: BackendState = BackendState.COLD
    models: tuple[str, ...] = ()
    model_cards: tuple[ModelCard, ...] = ()
    # its circuit breaker (passive outlier detection from real traffic)
    breaker: CircuitBreaker = field(default_factory=_default_breaker)
    # when its maintenance cycles are next due
    cycles: CycleClock = field(default_factory=never_due)
    # GPU telemetry parts, present when ``gpu_metrics_url`` is configured: the thermal
    # tracker and the Xid / ECC breaker
    thermal: ThermalTracker | None = None
    gpu_health: GpuHealth | None = None
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
    active: set[Cuttable] = field(default_factory=set)
    # Cut handles of the requests waiting here for their answer's start (nothing of it has
    # reached the client: safe to re-send elsewhere), with each one's model.
    awaiting: dict[Cuttable, str] = field(default_factory=dict)
    # Cut handles of every attempt sent here whose answer has not started (its prefill not
    # known done), and calibration rounds running here: :attr:`prefill_load`.
    unanswered: set[Cuttable] = field(default_factory=set)
    probing: int = 0
    # What it owes the control plane and when it was last heard from (the hung watchdog,
    # gateway.fleet.liveness); ``suspected``: silent long enough that new requests go
    # elsewhere when another backend can take them.
    liveness: Liveness = field(default_factory=Liveness)
    suspected: bool = False
    # The control-plane record (ControlRecord; monotonic seconds): FleetState's alone.
    first_seen: float | None = None  # when the gateway first knew it (cold start timer)
    joined_at: float | None = None  # monotonic: when it joined the fleet (cost accrues since)
    warm_since: float | None = None  # start of the slow-start ramp
    drain_deadline: float | None = None
    drained: bool = False  # a manual drain finished: no in-flight left, out of rotation
    hold: str | None = None
    hold_until: float | None = None
    maintenance: str | None = None  # the procedure running now (short/medium/long/drain/...)
    restart_seen_after: float | None = None
    deferred: Deferral | None = None
    # Calibration (gateway.fleet.calibration)
    calibration_baseline: dict[str, object] | None = None
    # the engine endpoint its own baseline was taken on (answers are compared on it alone)
    calibration_endpoint: str | None = None
    calibration_score: float | None = None
    needs_calibration: bool = False  # drifted: must pass calibration before warm again
    probe_ttft_s: float | None = None  # last application probe's time to first token
    # prefix-cache hits / queries between its last two scrapes with queries (0-1; None:
    # unknown), gateway.core.samples.prefix_cache_hit_ratio
    prefix_cache_hit_ratio: float | None = None
    cooling_until: float = 0.0  # monotonic; a 429/503 Retry-After keeps requests away
    busy_since: float = 0.0  # monotonic: when in-flight last went from 0 to 1
    last_answer_at: float = 0.0  # monotonic: the last answer (or first event) it gave
    gpu_error: str | None = None  # last GPU telemetry scrape error (None: last one worked)
    # Concurrency and service rate learned from the scrapes (:meth:`scraped` only;
    # admission and the lifecycle read it)
    service: ServiceModel = field(init=False)
    # the key the gateway sends it (resolved once; None: none configured). Raises
    # ConfigError at construction when its ``api_key_env`` is unset.
    api_key: str | None = field(init=False)
    # Where it runs (zone, node, capacity type, instance type): from its config, then
    # from discovery through :meth:`placed` (membership's alone).
    placement: Placement = field(init=False)

    def __post_init__(self) -> None:
        self.service = ServiceModel(self.config.max_num_seqs)
        self.api_key = self.config.resolved_api_key()
        c = self.config
        self.placement = Placement(c.zone, c.node, c.capacity_type, c.instance_type)

    def reconfigure(self, config: BackendConfig) -> None:
        """A live reload changed this backend's settings in place (same id, url, models and
        placement: :data:`gateway.config_diff.LIVE_BACKEND_FIELDS`): its role, key,
        ``max_num_seqs`` (the service model's configured bound) and ``model_version`` are
        the new ones from now on; what it learnt (service rate, breaker, state) is kept.
        Raises ``ConfigError`` for an unset ``api_key_env`` (nothing changed then)."""
        key = config.resolved_api_key()
        self.config = config
        self.api_key = key
        self.service.configured = config.max_num_seqs

    def refresh_key(self) -> None:
        """Read its key again (``api_key_file`` / ``api_key_env``: a rotated secret, on a
        reload whose config did not change it). Raises ``ConfigError`` (nothing changed)."""
        self.api_key = self.config.resolved_api_key()

    @property
    def id(self) -> str:
        return self.config.id

    def placed(self, placement: Placement) -> None:
        """Record where it runs now (discovery saw its zone, node or node labels change)."""
        self.placement = placement

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

    # ---- the request path's writes (gateway.flow: the lease, attempts, relay) ---------
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

    # ---- the control loops' observations ----------------------------------------------
    def count_probe(self, ok: bool) -> None:
        """Count one ``/health`` probe result in the consecutive pass / fail counters."""
        if ok:
            self.consecutive_probe_failures = 0
            self.consecutive_probe_successes += 1
        else:
            self.consecutive_probe_successes = 0
            self.consecutive_probe_failures += 1

    def ramp_from(self, now: float) -> None:
        """Start the slow-start ramp at monotonic ``now`` (the fleet simulator, which moves
        states with :func:`gateway.fleet.lifecycle.apply_transition` alone; the gateway's
        :class:`gateway.fleet.state.FleetState` sets it on every return to warm)."""
        self.warm_since = now

    def scraped(self, load: LoadSample, now: float) -> None:
        """A ``/metrics`` scrape answered at monotonic ``now`` with ``load``: the latest
        sample, one observation of the service model, and the prefix-cache hit ratio since
        the previous scrape (:func:`gateway.core.samples.prefix_cache_hit_ratio`; an
        interval without queries leaves the last one standing)."""
        ratio = prefix_cache_hit_ratio(self.load, load)
        if ratio is not None:
            self.prefix_cache_hit_ratio = ratio
        self.load = load
        self.last_scrape_ok_at = now
        self.service.observe(
            EngineSample(load.scraped_at, load.waiting, load.running, load.finished_total)
        )

    def models_listed(self, cards: tuple[ModelCard, ...]) -> None:
        """Its ``/v1/models`` answered ``cards``: kept whole; they are what it serves unless
        its configuration names the models."""
        self.model_cards = cards
        if self.config.models is None:
            self.models = tuple(c.id for c in cards)

    def gpu_scrape_result(self, error: str | None) -> None:
        """The last GPU telemetry scrape's error (None: it worked)."""
        self.gpu_error = error

    def set_suspected(self, suspected: bool) -> bool:
        """The hung watchdog's suspicion (new requests go elsewhere while set). Returns
        whether it changed."""
        if suspected == self.suspected:
            return False
        self.suspected = suspected
        return True

    def app_probe_passed(self, ttft_s: float | None) -> None:
        """An application probe through the engine passed (``ttft_s``: its time to first
        token, seconds, when measured)."""
        self.probe_ttft_s = ttft_s

    def stall_cleared(self, now: float) -> None:
        """A stall probe passed at monotonic ``now``: the stall timer starts again."""
        self.last_answer_at = now

    def baseline_taken(self, answers: dict[str, object] | None, endpoint: str | None) -> None:
        """Its calibration baseline (prompt -> answer) and the engine endpoint it was taken
        on; None, None: forgotten (a new one is taken at the next chance)."""
        self.calibration_baseline = answers
        self.calibration_endpoint = endpoint

    def calibrated(self, similarity: float) -> None:
        """The last calibration's similarity to the baseline (0-1)."""
        self.calibration_score = similarity

    def set_needs_calibration(self, needed: bool) -> None:
        """Whether it must pass calibration before it is warm again (it drifted)."""
        self.needs_calibration = needed

    # ---- the control-plane record (FleetState's store is the only caller) -------------
    def control(self) -> ControlRecord:
        """A snapshot of its control-plane record."""
        return ControlRecord(
            state=self.state,
            hold=self.hold,
            hold_until=self.hold_until,
            restart_seen_after=self.restart_seen_after,
            drained=self.drained,
            drain_deadline=self.drain_deadline,
            warm_since=self.warm_since,
            first_seen=self.first_seen,
            maintenance=self.maintenance,
            deferred=self.deferred,
            config_error=self.config_error,
        )

    def apply_control(self, record: ControlRecord, moved: Transition | None = None) -> None:
        """Make ``record`` its control-plane record. ``moved``: the state change it carries
        (appended to :attr:`history`; entering ``unhealthy`` restarts the passing-probe
        count, so it comes back only after ``recover_threshold`` passes from now)."""
        self.state = record.state
        self.hold = record.hold
        self.hold_until = record.hold_until
        self.restart_seen_after = record.restart_seen_after
        self.drained = record.drained
        self.drain_deadline = record.drain_deadline
        self.warm_since = record.warm_since
        self.first_seen = record.first_seen
        self.maintenance = record.maintenance
        self.deferred = record.deferred
        self.config_error = record.config_error
        if moved is not None:
            self.history.append(moved)
            if moved.to_state is BackendState.UNHEALTHY:
                self.consecutive_probe_successes = 0


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
        return self.breaker.consecutive

    @property
    def is_standby(self) -> bool:
        return self.config.role is BackendRole.STANDBY

    @property
    def serving_state(self) -> str:
        """Its state as the status page, ``/ready/fleet`` and ``gateway_model_backends``
        count it: the lifecycle state, or ``breaker_open`` while warm with its circuit
        breaker open (:func:`gateway.core.vocab.serving_state`)."""
        return serving_state(self.state, self.breaker.current().value)

    @property
    def routable(self) -> bool:
        """Whether new requests may be sent here now: warm and its circuit breaker not open
        (half-open lets its probes through). A moment's 429 cooldown does not count: the
        backend is up, it asked for a pause."""
        return self.serving_state == BackendState.WARM.value

    def serves(self, model: str) -> bool:
        return model in self.models

    def note_error(self, message: str) -> None:
        """Remember the latest error (shown in ``/admin/backends``)."""
        self.last_error = message
        self.last_error_at = time.time()
