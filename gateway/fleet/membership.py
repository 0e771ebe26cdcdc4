"""Membership: the one :class:`~gateway.fleet.discovery.DiscoverySink`, and the only code
that adds backends to and removes them from the :class:`~gateway.fleet.fleet.Fleet`.

A discovery source (:mod:`gateway.fleet.discovery`: static, DNS, Kubernetes) runs as a task
owned here (:meth:`Membership.start`, cancelled by :meth:`Membership.stop`) and reports the
whole current set of endpoints each time; the pure :func:`gateway.fleet.membership_plan.plan`
turns it into actions (its module docstring has the rules), applied here:

* **add**: a :class:`~gateway.config.BackendConfig` from ``discovery.template`` plus the
  endpoint's id, url, zone, node, pod and namespace (``{host}`` / ``{node}`` substituted in
  the template's ``gpu_metrics_url`` and ``gpu_control_url``; zone, capacity type and
  instance type from the node watch when it knows the node), added with
  :meth:`Fleet.add`: ``cold``, so the probe loop, warm-up and slow start bring it in
  before it gets traffic;
* **leave**: drained through :meth:`gateway.fleet.drain.Drains.leave` (held ``leaving``, no
  new requests, in-flight ones finish). A terminating endpoint that still serves is never
  cut; one that stopped serving or is gone gets ``lifecycle.drain_deadline_s`` (60 s), after
  which what is left is cut (a request without a first byte is re-sent elsewhere);
* **gone**: removed from the fleet by the ``membership`` loop (every
  :data:`CHECK_INTERVAL_S`) once nothing is in flight there (or its deadline passed,
  :func:`~gateway.fleet.membership_plan.removable`); its series, upstream session and
  procedures go with it (the fleet's listeners);
* **rejoin**: an endpoint serving again while still in the fleet returns to rotation
  (:meth:`Drains.rejoin`); one already removed is added again as new (``cold``).

An **outage** of the source keeps the fleet exactly as it is (no removals), logged once
when it begins and when it ends, exported as ``gateway_discovery_up{source} 0`` and counted
in ``gateway_discovery_outages_total{source}``. Static ``backends:`` entries are never
removed; a discovered endpoint with the id or URL of a static one is ignored with a
warning. ``nodes()`` updates the placement of the backends on those nodes (:meth:`Backend.placed`);
``spot_notice()`` is handed to ``on_spot_notice`` (the spot handling; ignored when None).
:attr:`Membership.synced` says a first snapshot arrived (at once for the static source).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence

from gateway.config import TEMPLATED_URLS, BackendConfig, DiscoveryConfig, LifecycleConfig
from gateway.core.listening import url_host
from gateway.core.urls import redacted_url
from gateway.core.vocab import BackendState
from gateway.core.wording import plural
from gateway.fleet import membership_plan
from gateway.fleet.backend import Backend
from gateway.fleet.discovery import DiscoverySource, Endpoint, NodeInfo, SpotNotice
from gateway.fleet.drain import Drains
from gateway.fleet.fleet import Fleet
from gateway.fleet.membership_plan import Known, Plan
from gateway.fleet.records import Placement
from gateway.metrics import GatewayMetrics

log = logging.getLogger("gateway.discovery")

# Seconds between the membership loop's rounds (removing drained backends that are gone).
CHECK_INTERVAL_S = 0.25


class Membership:
    """The fleet's membership under ``cfg`` (``discovery:``), draining with ``drains``
    under ``lifecycle`` (``drain_deadline_s``). ``clock``: monotonic seconds;
    ``on_spot_notice``: the spot handling's callback (None: notices are logged only)."""

    def __init__(
        self,
        cfg: DiscoveryConfig,
        lifecycle: LifecycleConfig,
        fleet: Fleet,
        drains: Drains,
        metrics: GatewayMetrics,
        clock: Callable[[], float] = time.monotonic,
        on_spot_notice: Callable[[SpotNotice], object] | None = None,
    ) -> None:
        self.cfg = cfg
        self.lifecycle = lifecycle
        self.fleet = fleet
        self.drains = drains
        self.metrics = metrics
        self.clock = clock
        self.on_spot_notice = on_spot_notice
        self.static_ids = frozenset(b.id for b in fleet)
        self.static_urls = frozenset(b.base_url for b in fleet)
        self.source_name: str = cfg.source
        self.synced = not cfg.dynamic  # the static list is the whole fleet at once
        self.up = True
        self.outage_reason: str | None = None
        self._snapshot: tuple[Endpoint, ...] = ()
        self._nodes: dict[str, NodeInfo] = {}
        self._known: dict[str, Known] = {}  # discovered backends in the fleet, by id
        self._gone: set[str] = set()  # discovered ids drained to be removed
        self._deadline: dict[str, float] = {}  # monotonic cut time of each leaving one
        self._leaving: dict[str, membership_plan.Leave] = {}  # why each leaving one leaves
        self._collided: set[str] = set()  # collisions already warned about
        # backends a reload removed, serving until the ones it added are warm: id ->
        # (the added ids, monotonic time when they drain anyway)
        self._retiring: dict[str, tuple[frozenset[str], float]] = {}
        self._task: asyncio.Task[None] | None = None
        metrics.discovery_up.labels(self.source_name).set(1)
        metrics.discovery_endpoints.labels(self.source_name).set(0 if cfg.dynamic else len(fleet))

    # ---- the source's task --------------------------------------------------------------
    def start(self, source: DiscoverySource) -> None:
        """Run ``source`` as a task owned here (inside the event loop), reporting to this
        sink; a source that ends or fails is logged (a failure also as an outage)."""
        self.source_name = source.name

        async def run() -> None:
            try:
                await source.run(self)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.exception("discovery source %s failed; keeping the fleet", source.name)
                self.outage(f"source failed: {type(e).__name__}: {e}")

        self._task = asyncio.get_running_loop().create_task(run(), name="discovery")

    async def stop(self) -> None:
        """Cancel the source's task and wait for it to end."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    # ---- DiscoverySink ---------------------------------------------------------------------
    def endpoints(self, snapshot: Sequence[Endpoint]) -> None:
        """The source's whole current set: applied now (:meth:`apply`)."""
        if not self.up:
            log.warning("discovery (%s): source answers again", self.source_name)
        self.up, self.outage_reason, self.synced = True, None, True
        self.metrics.discovery_up.labels(self.source_name).set(1)
        self._snapshot = tuple(snapshot)
        self.metrics.discovery_endpoints.labels(self.source_name).set(len(self._snapshot))
        self.apply()

    def outage(self, reason: str) -> None:
        """The source cannot be read: the fleet is kept exactly as it is."""
        if self.up:
            self.metrics.discovery_outages.labels(self.source_name).inc()
            log.error(
                "discovery (%s) outage: %s; keeping the last known fleet (%d backends)",
                self.source_name,
                reason,
                len(self.fleet),
            )
        self.up, self.outage_reason = False, reason
        self.metrics.discovery_up.labels(self.source_name).set(0)

    def readiness(self) -> tuple[bool, str]:
        """The ``discovery`` readiness check (:mod:`gateway.core.readiness`): ready once the
        source has reported its first whole snapshot (a static fleet at once). A later
        outage keeps the last known fleet and the gateway ready (it still serves it)."""
        if not self.synced:
            return False, f"discovery ({self.source_name}) has not reported the fleet yet" + (
                f": {self.outage_reason}" if self.outage_reason else ""
            )
        if not self.up:
            return True, f"keeping the last known fleet: {self.outage_reason}"
        if not self.cfg.dynamic:
            return True, f"static: {plural(len(self.static_ids), 'backend')} from the config"
        # the count of gateway_discovery_endpoints{source}: the source's last snapshot
        return True, f"{self.source_name}: {plural(len(self._snapshot), 'endpoint')}" + (
            f" (and {len(self.static_ids)} static)" if self.static_ids else ""
        )

    def nodes(self, nodes: Mapping[str, NodeInfo]) -> None:
        """The node watch's whole set: placement of the backends on those nodes updated."""
        self._nodes = dict(nodes)
        by_id = {e.id: e for e in self._snapshot}
        for b in self.fleet:
            self._place(b, by_id.get(b.id) if b.id in self._known else None)

    def spot_notice(self, notice: SpotNotice) -> None:
        """Handed to the spot handling (``on_spot_notice``); logged."""
        log.warning(
            "spot interruption notice: node %s zone %s (%s)", notice.node, notice.zone,
            notice.reason,
        )
        if self.on_spot_notice is not None:
            self.on_spot_notice(notice)

    # ---- applying a snapshot ---------------------------------------------------------------
    def apply(self) -> Plan:
        """Plan the last snapshot against the fleet and apply it; returns the plan."""
        p = membership_plan.plan(
            self._known, self._snapshot, self.static_ids, self.static_urls
        )
        for i in p.collisions:
            if i not in self._collided:
                self._collided.add(i)
                self.metrics.discovery_changes.labels("ignored").inc()
                log.warning(
                    "discovery (%s): endpoint %s has the id or the URL of a static "
                    "backend; ignored",
                    self.source_name,
                    i,
                )
        for leave in p.leave:
            self._leave(leave)
        for i in p.rejoin:
            self._rejoin(i)
        self._gone = set(p.gone)
        for e in self._snapshot:  # zone or node of a known endpoint changed
            b = self.fleet.get(e.id) if e.id in self._known else None
            if b is not None and e.id not in self._gone:
                self._place(b, e)
        for e in p.add:
            self._add(e)
        self.round_now()
        return p

    def _add(self, e: Endpoint) -> None:
        try:
            cfg = self.backend_config(e)
            b = self.fleet.add(cfg)
        except Exception as err:  # a template the endpoint cannot fill: say so, go on
            log.error("discovery (%s): endpoint %s not added: %s", self.source_name, e.id, err)
            return
        self._known[e.id] = Known(e.url)
        self._place(b, e)
        self.metrics.discovery_changes.labels("added").inc()
        log.info("discovery (%s): backend %s added at %s (cold)", self.source_name, e.id,
                 redacted_url(e.url))

    def _leave(self, leave: membership_plan.Leave) -> None:
        b = self.fleet.get(leave.id)
        k = self._known.get(leave.id)
        if b is None or k is None:
            return
        deadline_s = self.lifecycle.drain_deadline_s if leave.deadline else None
        if not k.leaving:
            self.metrics.discovery_changes.labels("draining").inc()
            log.info(
                "discovery (%s): backend %s draining (%s%s)",
                self.source_name,
                b.id,
                leave.reason,
                f", cut after {deadline_s:g} s" if deadline_s is not None else ", not cut",
            )
        self.drains.leave(b, leave.reason, deadline_s)
        prior = self._leaving.get(b.id)
        self._leaving[b.id] = membership_plan.Leave(
            b.id, leave.reason, leave.deadline or (prior is not None and prior.deadline)
        )
        if deadline_s is not None:
            at = self.clock() + deadline_s
            self._deadline[b.id] = min(self._deadline.get(b.id, at), at)
        self._known[b.id] = Known(k.url, True, k.deadline or leave.deadline)

    def _rejoin(self, backend_id: str) -> None:
        b = self.fleet.get(backend_id)
        k = self._known.get(backend_id)
        if b is None or k is None:
            return
        self.drains.rejoin(b)
        self._deadline.pop(backend_id, None)
        self._leaving.pop(backend_id, None)
        self._known[backend_id] = Known(k.url)
        self.metrics.discovery_changes.labels("rejoined").inc()
        log.info("discovery (%s): backend %s serving again", self.source_name, backend_id)

    # ---- a live reload of the static list (gateway.reloading) -----------------------------
    def reconfigure_static(
        self, backends: Sequence[BackendConfig], changed: Sequence[str] = ()
    ) -> tuple[list[str], list[str]]:
        """The config's ``backends`` list after a live reload: ids not in the fleet are
        added (``cold``: probed, warmed up, slow start), static ids no longer listed leave
        (drained, ``config_removed``: in-flight requests finish, cut after
        ``lifecycle.drain_deadline_s``; removed by the membership loop once idle), and the
        ``changed`` ids get their new settings in place (:meth:`Backend.reconfigure`).
        Returns (added, leaving) ids. The caller checked the plan
        (:func:`gateway.config_diff.plan_reload`) and the secrets first."""
        by_id = {c.id: c for c in backends}
        for i in changed:
            b = self.fleet.get(i)
            if b is not None and i in by_id:
                b.reconfigure(by_id[i])
                log.info("config: backend %s reconfigured", i)
        added: list[str] = []
        for c in backends:
            b = self.fleet.get(c.id)
            if b is not None and self._retiring.pop(c.id, None) is not None:
                b.reconfigure(c)  # removed by an earlier reload, not yet drained: it stays
                log.info("config: backend %s listed again: it stays", c.id)
                continue
            if b is not None and c.id not in self.static_ids and c.id in self._gone:
                # removed by an earlier reload and still draining: listed again, it stays
                self._gone.discard(c.id)
                self._deadline.pop(c.id, None)
                self._leaving.pop(c.id, None)
                self._known.pop(c.id, None)
                b.reconfigure(c)
                self.drains.rejoin(b)
                log.info("config: backend %s listed again: back in rotation", c.id)
                continue
            if c.id in self.static_ids or b is not None:
                continue
            self.fleet.add(c)
            added.append(c.id)
            log.info("config: backend %s added at %s (cold)", c.id, redacted_url(c.base_url))
        leaving = sorted(self.static_ids - set(by_id))
        if added:  # make before break: the removed ones serve until the added are warm
            until = self.clock() + self.lifecycle.warmup_timeout_s
            for i in leaving:
                self._retiring[i] = (frozenset(added), until)
                log.info("config: backend %s removed from the config: serving until %s "
                         "%s warm (at most %g s), then draining", i, ", ".join(added),
                         "is" if len(added) == 1 else "are", self.lifecycle.warmup_timeout_s)
        else:
            for i in leaving:
                self._retire(i)
        self.static_ids = frozenset(by_id)
        self.static_urls = frozenset(c.base_url for c in backends)
        return added, leaving

    def _retire(self, backend_id: str) -> None:
        """Drain a backend the config no longer lists (``config_removed``), to be removed by
        the membership loop once idle (cut after ``lifecycle.drain_deadline_s``)."""
        self._retiring.pop(backend_id, None)
        b = self.fleet.get(backend_id)
        if b is None:
            return
        deadline_s = self.lifecycle.drain_deadline_s
        log.info("config: backend %s removed from the config: draining (cut after %g s)",
                 backend_id, deadline_s)
        self.drains.leave(b, "config_removed", deadline_s)
        self._known[backend_id] = Known(b.base_url, True, True)
        self._leaving[backend_id] = membership_plan.Leave(backend_id, "config_removed", True)
        at = self.clock() + deadline_s
        self._deadline[backend_id] = min(self._deadline.get(backend_id, at), at)
        self._gone.add(backend_id)

    def _retire_due(self, now: float) -> None:
        """Drain each backend a reload removed once the backends that reload added are
        warm (or gone, or their warm-up time is up)."""
        for i, (added, until) in list(self._retiring.items()):
            ready = all(b is None or b.state is BackendState.WARM
                        for b in (self.fleet.get(a) for a in added))
            if ready or now >= until:
                self._retire(i)

    def leaving_at(self, backend_id: str) -> str | None:
        """The URL of ``backend_id`` while it is still in the fleet but leaving it (a reload
        removed it, or discovery did), else None."""
        b = self.fleet.get(backend_id)
        if b is None or (backend_id not in self._gone and backend_id not in self._retiring):
            return None
        return b.base_url

    # ---- the membership loop ---------------------------------------------------------------
    async def round(self) -> None:
        """The ``membership`` loop's body: :meth:`round_now`."""
        self.round_now()

    def leaving(self, backend_id: str) -> str | None:
        """Why discovery is taking ``backend_id`` out of the fleet (``endpoint_terminating``,
        ``endpoint_removed``, ``endpoint_moved``), or None when it is not (the admin API
        refuses to undrain such a backend: discovery, not the operator, says it is going)."""
        leave = self._leaving.get(backend_id)
        return leave.reason if leave is not None else None

    def round_now(self) -> None:
        """Keep every leaving backend out of rotation, and remove every gone backend that
        :func:`membership_plan.removable` lets go; when one left, the snapshot is planned
        again (a moved endpoint's new address is added).

        A leaving backend whose ``leaving`` hold another hold replaced (an operator's drain,
        a preemption, a restart) is held ``leaving`` again here once that hold ends (it
        expired, an undrain), and drained again if it got back into service meanwhile, so
        nothing brings a terminating or gone endpoint back into rotation."""
        for leave in list(self._leaving.values()):
            b = self.fleet.get(leave.id)
            if b is not None and b.hold is None:
                log.info(
                    "discovery (%s): backend %s: its hold ended but its endpoint is "
                    "leaving (%s): held out again", self.source_name, b.id, leave.reason,
                )
                deadline_s = self.lifecycle.drain_deadline_s if leave.deadline else None
                self.drains.leave(b, leave.reason, deadline_s)
        now = self.clock()
        self._retire_due(now)
        removed = False
        for i in sorted(self._gone):
            b = self.fleet.get(i)
            if b is not None and not membership_plan.removable(
                b.in_flight, self._deadline.get(i), now
            ):
                continue
            self._gone.discard(i)
            self._known.pop(i, None)
            self._deadline.pop(i, None)
            self._leaving.pop(i, None)
            if b is not None:
                self.fleet.remove(i)
                removed = True
                self.metrics.discovery_changes.labels("removed").inc()
                log.info(
                    "discovery (%s): backend %s removed (%d in flight)",
                    self.source_name,
                    i,
                    b.in_flight,
                )
        if removed:
            self.apply()

    # ---- building a backend ------------------------------------------------------------------
    def backend_config(self, e: Endpoint) -> BackendConfig:
        """The :class:`BackendConfig` of endpoint ``e``: the template's fields, the
        endpoint's id, url and placement (zone, capacity type and instance type from the
        node when the node watch knows it). Raises ``ValueError`` (pydantic's) when the
        result is not a valid backend."""
        t = self.cfg.template
        node = self._nodes.get(e.node) if e.node is not None else None
        fields = t.model_dump(exclude_none=True)
        for name in TEMPLATED_URLS:  # gpu_metrics_url, gpu_control_url
            url = getattr(t, name)
            if url is not None and "{node}" in url and not e.node:
                # an EndpointSlice endpoint's nodeName is optional: without it the backend
                # is still served, only without GPU telemetry (thermal state unknown) or
                # without GPU control (no clock caps or power limits)
                fields.pop(name, None)
                log.warning(
                    "discovery (%s): endpoint %s names no node: no %s (the template's needs "
                    "{node}); %s", self.source_name, e.id, name,
                    "thermal state unknown" if name == "gpu_metrics_url" else "no GPU control",
                )
            elif url is not None:
                fields[name] = url.replace("{host}", url_host(e.host)).replace(
                    "{node}", e.node or ""
                )
        fields.update(id=e.id, url=e.url)
        for key, value in (
            ("zone", e.zone or (node.zone if node else None)),
            ("node", e.node),
            ("pod", e.pod),
            ("namespace", e.namespace),
            ("capacity_type", node.capacity_type if node else None),
            ("instance_type", node.instance_type if node else None),
        ):
            if value is not None:
                fields[key] = value
        return BackendConfig(**fields)

    def _place(self, b: Backend, e: Endpoint | None) -> None:
        """``b``'s placement from its endpoint ``e`` (zone, node; None: a static backend)
        and the node watch (zone, capacity type, instance type of its node, when known);
        what neither says stays as it was."""
        p = b.placement
        node_name = (e.node if e is not None else None) or p.node
        node = self._nodes.get(node_name) if node_name else None
        new = Placement(
            zone=(e.zone if e is not None else None) or (node.zone if node else None) or p.zone,
            node=node_name,
            capacity_type=(node.capacity_type if node else None) or p.capacity_type,
            instance_type=(node.instance_type if node else None) or p.instance_type,
        )
        if new != p:
            b.placed(new)
