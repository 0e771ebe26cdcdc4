"""The components of one gateway (:class:`Gateway`) and their wiring (:func:`build_gateway`).

Everything mutable (fleet state, metrics registry, pools, loops) is built here, inside the
app's lifespan, and hangs off ``app.state.gateway``; nothing lives in module globals. Each
component gets what it needs through its constructor, but for one late binding: the
maintenance planner reads the arrival forecast (``Maintenance.use_forecast``), which is built
after the controller because it depends, through the routing policy and the accounting, on
the controller's GPU monitor.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Any

from gateway.config import ClientKey, ConfigError, GatewayConfig
from gateway.coord.affinity import SharedResponses
from gateway.coord.autoscale import SharedAutoscale
from gateway.coord.capacity import CapacityShares
from gateway.coord.clock_lease import ClockLease
from gateway.coord.coordination import Coordination
from gateway.coord.notices import SharedNotices
from gateway.coord.protection import SharedProtection
from gateway.coord.quota import GlobalQuotas
from gateway.core.keys import key_table
from gateway.core.readiness import Readiness
from gateway.fleet.backend import Backend
from gateway.fleet.controller import FleetController
from gateway.fleet.discovery import DiscoverySource, StaticSource
from gateway.fleet.dns_source import DnsSource
from gateway.fleet.fleet import Change, Fleet
from gateway.fleet.spot import SpotNotices
from gateway.flow.accounting import Accounting
from gateway.flow.admission import AdmissionGate
from gateway.flow.autoscaling import AutoscaleSignals
from gateway.flow.batching import BatchDispatcher
from gateway.flow.forecasts import ArrivalForecasts, forecast_params
from gateway.flow.lease import RequestLease
from gateway.flow.pipeline import Pipeline
from gateway.flow.responses import ResponseRouting
from gateway.flow.rollout_probes import RolloutProbes
from gateway.flow.rollouts import Rollouts
from gateway.flow.status import StatusRecorder
from gateway.metrics import GatewayMetrics
from gateway.proxy.upstream import Transport, UpstreamPool
from gateway.reloading import Reloader
from gateway.routing.policies import Policy, build_policy
from gateway.routing.policy import LoadThermalPolicy
from gateway.routing.response_owners import ResponseOwners
from gateway.routing.spot import SpotSteering, ZoneScores


@dataclass
class Gateway:
    """The live components of one gateway (one per app)."""

    cfg: GatewayConfig
    fleet: Fleet
    metrics: GatewayMetrics
    router: Policy
    transport: Transport
    controller: FleetController
    pipeline: Pipeline
    accounting: Accounting
    gate: AdmissionGate
    responses: ResponseRouting  # which backend holds each Responses API response
    client_keys: dict[bytes, ClientKey]  # by the key's SHA-256 (gateway.core.keys)
    admin_key: str | None
    # spot interruption notices: counted, the zone's score, preemption (gateway.fleet.spot)
    spot: SpotNotices
    shutting_down: bool = False
    # requests still receiving their body (their tasks), and whether the shutdown's grace
    # period ended for them (then they are answered 503 without the rest of the body)
    uploading: set[asyncio.Task[Any]] = field(default_factory=set)
    uploads_cut: bool = False
    forecasts: ArrivalForecasts | None = None  # arrival counts and forecasts (cfg.forecast)
    batching: BatchDispatcher | None = None  # the predictive batcher (cfg.batcher)
    coord: Coordination | None = None  # fleet mode (cfg.coordination.redis_url)
    # the gateway's own readiness checks (GET /ready): each part registers its own
    readiness: Readiness = field(default_factory=Readiness)
    # in fleet mode an admin spot notice is shared through the store (gateway.coord.notices)
    shared_notices: SharedNotices | None = None
    # where the backends come from (cfg.discovery; run by controller.membership)
    discovery: DiscoverySource = field(default_factory=StaticSource)
    # the autoscaling signals (cfg.autoscale; the `autoscale` loop, GET /autoscale)
    autoscaling: AutoscaleSignals | None = None
    # live reload and the kept configs (gateway.reloading; set by the app's lifespan)
    reloader: Reloader | None = None
    # canary rollouts (gateway.flow.rollouts; started by the lifespan from cfg.rollouts)
    rollouts: Rollouts | None = None
    rollout_probes: RolloutProbes | None = None  # their calibration rounds
    # the status page's memory: the last hour per model, incidents (GET /status)
    status: StatusRecorder | None = None

    @property
    def header_keys(self) -> tuple[bytes, bytes, bytes]:
        """Lower-case names of the request-id, session and priority headers (raw ASGI)."""
        return (
            self.cfg.server.request_id_header.lower().encode("latin-1"),
            self.cfg.routing.session_header.lower().encode("latin-1"),
            self.cfg.admission.priority_header.lower().encode("latin-1"),
        )

    def reconfigure_auth(self, new: GatewayConfig) -> None:
        """A live reload's ``auth`` (:mod:`gateway.reloading`; its secrets already resolved):
        the client keys and the admin key are the new ones from the next request on; a
        key removed, or whose ``rpm`` / ``tpm`` changed, loses its buckets (new ones at the
        new limits). Raises ``ConfigError`` for an unset ``key_env`` before changing
        anything."""
        keys = client_key_table(new)
        admin = new.auth.resolved_admin_key()
        after = {k.name: (k.rpm, k.tpm) for k in new.auth.client_keys}
        for k in self.cfg.auth.client_keys:
            if after.get(k.name) != (k.rpm, k.tpm):
                self.gate.keys.drop(k.name)
        self.client_keys = keys
        self.admin_key = admin

    def new_lease(self) -> RequestLease:
        """A lease for one client request (:mod:`gateway.flow.lease`): with the batcher
        on, the backend slots it frees wake the queue."""
        if self.batching is not None:
            return self.batching.new_lease()
        return RequestLease(self.controller)


def client_key_table(cfg: GatewayConfig) -> dict[bytes, ClientKey]:
    """``cfg``'s client keys by the SHA-256 digest of their secret (a presented key is
    looked up by its digest: :mod:`gateway.core.keys`). Raises ``ConfigError`` for a key
    that cannot be resolved or two keys with the same secret."""
    try:
        return key_table((k.resolve(), k) for k in cfg.auth.client_keys)
    except ValueError as e:
        raise ConfigError(f"auth.client_keys: {e}") from None


def build_gateway(
    cfg: GatewayConfig,
    transport: Transport | None = None,
    source: DiscoverySource | None = None,
) -> Gateway:
    """Wire the components for ``cfg`` (no I/O; the lifespan starts the loops).
    ``transport``: how upstream requests are sent (default: the aiohttp pool); ``source``:
    where discovered backends come from (default: :func:`build_source` of ``cfg``; tests
    pass a stand-in for the Kubernetes API)."""
    clock = time.monotonic
    fleet = Fleet.from_config(cfg, clock)
    metrics = GatewayMetrics()
    metrics.attach_fleet(fleet, cfg.telemetry.stale_after_s)  # a dead backend's go stale
    # fleet mode: a replica cannot know the fleet's tokens: the ratio is the dashboard's
    metrics.attach_cost(fleet, clock, replica_gauge=not cfg.coordination.enabled)
    controller = FleetController(cfg, fleet, metrics, clock=clock)
    coord = Coordination(cfg, metrics) if cfg.coordination.enabled else None
    if coord is not None:
        coord.share_operator_actions(controller)  # admin actions, GPU holds, baselines
        coord.leases.bind(controller)  # maintenance cycles under fleet-wide leases
        # coolings and breaker trips shared
        protection = SharedProtection(coord.link, fleet, metrics, clock)
        coord.add_part("protection", protection.sync, protection.resync)
        if controller.gpu.clocks is not None:  # one replica drives GPU clocks and limits
            lease = ClockLease(
                coord.link, controller.gpu.clocks, cfg.coordination.lease_ttl_s, clock
            )
            coord.add_part("clocks", lease.sync, stop=lease.stop)
    thermal_aware = cfg.thermal.enabled and (controller.gpu.active or cfg.power_domains)
    router = build_policy(
        cfg.routing,
        cfg.lifecycle,
        cfg.telemetry.stale_after_s,
        clock,
        thermal=controller.gpu.choose if thermal_aware else None,  # tiers, power caps, budgets
        rendezvous=coord is not None,  # fleet mode: a session maps alike on every replica
    )
    scores = ZoneScores(cfg.spot, clock)  # written by SpotNotices, read by the router
    metrics.attach_zone_scores(scores.snapshot)
    if cfg.discovery.dynamic or any(b.capacity_type == "spot" for b in cfg.backends):
        # a spot backend's share scaled by its zone's score (gateway.routing.spot); a fleet
        # that can have none routes exactly as before
        router = SpotSteering(
            router,
            scores,
            random.Random(),
            clock,
            thermal=router.thermal if isinstance(router, LoadThermalPolicy) else None,
        )
    spot = SpotNotices(cfg, fleet, controller.drains, scores, metrics, clock)
    shared_notices = None
    if coord is not None:  # fleet mode: an admin notice applied once by every replica
        shared_notices = SharedNotices(cfg, coord.link, spot, clock)
        coord.add_part("spot_notices", shared_notices.sync, shared_notices.sync)
    gate = AdmissionGate(
        cfg,
        fleet,
        metrics,
        clock,
        power_level=controller.gpu.power_level
        if cfg.thermal.enabled and cfg.power_domains
        else None,
    )
    if coord is not None:  # fleet mode: per-key limits are global, taken in chunks
        quotas = GlobalQuotas(coord.link, coord.replicas, metrics, cfg.coordination, clock)
        c = cfg.coordination
        gate.keys.use_quota(quotas, c.quota_chunk, c.quota_wait_s)
        coord.add_part("quota", quotas.sync, quotas.resync, quotas.stop)
    transport = transport if transport is not None else UpstreamPool(cfg.proxy)
    accounting = Accounting(metrics, clock, router.weight)
    pipeline = Pipeline(
        cfg, fleet, router, transport, controller, accounting, clock, wall=controller.wall
    )
    keys = client_key_table(cfg)
    responses = ResponseRouting(
        ResponseOwners(cfg.routing.responses_ttl_s, cfg.routing.responses_max_entries, clock),
        fleet,
        clock,
    )
    controller.state.listen(responses.on_transition)  # a restart loses a backend's store
    if coord is not None:  # fleet mode: response ids shared
        shared = SharedResponses(
            coord.link, metrics, responses.owners, cfg.routing.responses_ttl_s, clock
        )
        responses.use_directory(shared)
        coord.add_part("responses", resync=shared.resync, stop=shared.stop)
    batching = (
        BatchDispatcher(cfg, fleet, pipeline, router, gate, metrics, controller, clock)
        if cfg.batcher.enabled
        else None
    )
    shares = (
        _share_capacity(coord, fleet, gate, batching, metrics)
        if coord is not None and cfg.coordination.capacity_shares
        else None
    )
    forecasts = None
    if cfg.forecast.enabled or batching is not None:

        def slack() -> float | None:
            p99 = accounting.p99_ttft(30.0)
            return cfg.slo.ttft_s - (p99 if p99 is not None else 0.0)

        forecasts = ArrivalForecasts(
            forecast_params(cfg), metrics, batching.core if batching else None, slack
        )
        # read before a cycle takes a backend out
        controller.maintenance.use_forecast(forecasts.rate_rps)
    autoscaling = None
    if cfg.autoscale.enabled:  # desired replicas per model (gateway.flow.autoscaling)
        autoscaling = AutoscaleSignals(
            cfg, fleet, metrics, accounting, forecasts, controller.cold_starts, clock,
            controller.wall,
        )
        if coord is not None:  # fleet mode: one answer for the fleet
            signals = autoscaling
            shared_autoscale = SharedAutoscale(
                cfg, coord.link, coord.replicas, signals.local_inputs,
                lambda: (signals.own, signals.own_at), clock, controller.wall,
            )
            autoscaling.share(shared_autoscale)
            coord.add_part("autoscale", shared_autoscale.sync)
    readiness = Readiness()
    readiness.add("control_loops", controller.loops.readiness)
    membership = controller.membership
    readiness.add("discovery", membership.readiness)
    # spot notices from the node watch (Kubernetes discovery) go to the spot handling
    membership.on_spot_notice = spot.notice
    if coord is not None:
        readiness.add("coordination", coord.readiness)

    closing: set[asyncio.Task[None]] = set()  # removed backends' sessions being closed

    def membership_changed(backend: Backend, change: Change) -> None:
        """Discovery added or removed ``backend``: the parts that keep something per
        backend follow (the controller's own parts listen themselves)."""
        if change == "removed":
            metrics.forget_backend(backend.id)
            accounting.forget(backend.id)
            task = asyncio.get_running_loop().create_task(transport.forget(backend.id))
            closing.add(task)
            task.add_done_callback(closing.discard)
        gate.fleet_changed(resize=shares is None)
        if shares is not None:
            shares.total = gate.fleet_capacity

    fleet.on_change(membership_changed)
    rollouts = Rollouts(metrics, fleet, clock, controller.wall)
    controller.maintenance.use_rollouts(rollouts.running_versions)  # rollout_hold
    status = StatusRecorder(cfg.status, fleet, accounting, metrics, clock, controller.wall,
                            rollouts)
    controller.state.listen(status.on_transition)  # drains, unhealthy: the status page
    return Gateway(
        status=status,
        rollouts=rollouts,
        rollout_probes=RolloutProbes(rollouts, fleet, controller.calibrator, clock),
        cfg=cfg,
        fleet=fleet,
        metrics=metrics,
        router=router,
        transport=transport,
        controller=controller,
        pipeline=pipeline,
        accounting=accounting,
        gate=gate,
        responses=responses,
        client_keys=keys,
        admin_key=cfg.auth.resolved_admin_key(),
        forecasts=forecasts,
        batching=batching,
        coord=coord,
        readiness=readiness,
        spot=spot,
        shared_notices=shared_notices,
        discovery=source if source is not None else build_source(cfg),
        autoscaling=autoscaling,
    )


def build_source(cfg: GatewayConfig) -> DiscoverySource:
    """The discovery source ``cfg.discovery.source`` names: ``static`` (the ``backends:``
    list), ``dns`` (:class:`gateway.fleet.dns_source.DnsSource`), ``kubernetes``
    (:class:`gateway.fleet.kube_source.KubeSource`, imported only when chosen: the
    Kubernetes client is a heavy import)."""
    d = cfg.discovery
    if d.source == "dns":
        assert d.dns is not None  # DiscoveryConfig's validator
        return DnsSource(d.dns)
    if d.source == "kubernetes":
        from gateway.fleet.kube_source import KubeSource

        assert d.kubernetes is not None  # DiscoveryConfig's validator
        return KubeSource(d.kubernetes)
    return StaticSource()


def _share_capacity(
    coord: Coordination,
    fleet: Fleet,
    gate: AdmissionGate,
    batching: BatchDispatcher | None,
    metrics: GatewayMetrics,
) -> CapacityShares:
    """Fleet mode: this replica's share of the in-flight capacity, from its demand
    (:mod:`gateway.coord.capacity`), applied to the scheduler's bound and, with the
    batcher, to its places per backend."""

    def demand() -> tuple[int, int, int]:
        """Requests held here by class, (high, normal, low): high running and queued;
        normal and low running plus normal queued; low queued (the batcher's: all as
        normal). Running low requests count with normal: counted apart they moved slots
        between replicas at every completion (measured: coord/capacity.py)."""
        if batching is not None:
            return 0, sum(b.in_flight for b in fleet.backends) + batching.core.queued, 0
        sched = gate.scheduler
        run_high, run_normal, run_low = sched.running
        queued_high, queued_normal, queued_low = (len(q) for q in sched.queues)
        return run_high + queued_high, run_normal + run_low + queued_normal, queued_low

    def per_backend(shares: dict[str, int]) -> None:
        assert batching is not None
        batching.placement.set_shares(shares)
        batching.pump()  # a grown share may take queued requests now

    shares = CapacityShares(
        coord.link,
        coord.replicas,
        metrics,
        demand,
        lambda: gate.scheduler.in_flight,
        gate.fleet_capacity,
        gate.set_capacity_share,
        lambda: fleet.backends,
        batching.placement.backend_limit if batching is not None else None,
        per_backend if batching is not None else None,
    )
    coord.add_part("capacity", shares.sync)
    return shares
