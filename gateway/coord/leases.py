"""Maintenance leases in the shared store: one replica runs each backend's cycle for the
whole fleet (issue 14, item 1; the seam is :mod:`gateway.fleet.leases`).

Keys (``<ns>`` is ``coordination.namespace``), one set per backend ``<b>``:

* ``<ns>:maint:lease:<b>``: the lease, a string (the holder's replica id) with a TTL of
  ``coordination.lease_ttl_s``, renewed by the holder every third of it (and at once when
  its cycle moves on). It is what dies with its holder.
* ``<ns>:maint:cycle:<b>``: the cycle record, a hash without TTL: ``token`` (the cycle's
  number, incremented by every grant and hand-over), ``holder``, ``cycle``, ``reason``,
  ``phase`` (``probing`` / ``draining`` / ``cooldown`` / ``restarting``; kept when the
  cycle ends, so a follower that missed a restart still sees it), ``open`` (``1`` until
  the cycle ends), ``takes_out``, ``drain_deadline`` and
  ``rest_end`` (milliseconds of the store's clock), ``slept``, ``reset_done``, and
  ``started_<kind>`` / ``started_by_<kind>`` (when and by whom each kind last started: a
  long cycle counts as a medium and a short one, a medium as a short one, as in
  :func:`gateway.fleet.cycles.cycle_started`).
* ``<ns>:maint:inflight:<b>``: replica id -> ``"<token>:<requests in flight>"``, published
  each round by every replica following an open cycle once it has the backend out of
  rotation; the holder's drain waits until every live replica reports 0
  (:func:`gateway.fleet.leases.drained_everywhere`).

Every decision that several replicas could race for is one script: :data:`ACQUIRE` (refused
while another replica's lease stands or an unfinished cycle waits for its hand-over; when
this kind was started since the caller last booked one; and, for a cycle that takes the
backend out, by the rule of :func:`gateway.fleet.lifecycle.may_take_out` counted over the
replica's own view plus every open cycle of the model's backends:
:func:`gateway.fleet.leases.may_take_out_fleet` is its twin in Python), :data:`RENEW`
(refused once the record's token moved on: the cycle was handed over), :data:`RELEASE` and
:data:`TAKE_OVER` (only an open cycle whose lease key expired). Times in the store are its
own clock (``TIME``); every time this replica keeps is its monotonic clock, converted as
``local = clock() + (store_s - link.now())``.

The sync step (:meth:`FleetLeases.sync`, every ``coordination.sync_interval_s``): renew the
held leases that are due or changed, read every backend's record and lease TTL (one
pipeline), adopt the cycle starts other replicas booked (:func:`gateway.fleet.cycles.
adopt_start`: each backend's cycles run once per period fleet-wide), follow the leases other
replicas hold (:class:`gateway.coord.lease_mirror.LeaseMirror`), take over an expired one
(``gateway_fleet_lease_handovers_total{backend}``), publish this replica's in-flight counts.

**Store down.** No lease is granted (the cycles stay due); a running cycle finishes, but
puts vLLM to sleep only while its lease was confirmed within its TTL; a follower keeps the
backend out until the lease it last saw would have expired (or the rest it announced ends,
if later), then returns it to rotation (:meth:`FleetLeases.fallback`). **Store back** (empty
after a restart): the holder writes its lease and record back, every replica the starts it
adopted (:meth:`FleetLeases.resync`); followers read the records again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gateway.config import GatewayConfig
from gateway.coord.lease_mirror import LeaseMirror
from gateway.coord.lease_scripts import ACQUIRE, RELEASE, RENEW, RESTORE_STARTS, TAKE_OVER
from gateway.coord.link import CoordinationUnavailable, RedisLink
from gateway.coord.replicas import Replicas
from gateway.fleet.backend import Backend
from gateway.fleet.controller import FleetController
from gateway.fleet.cycles import CycleKind, adopt_start
from gateway.fleet.leases import (
    LeasePhase,
    LeaseRecord,
    MaintenanceLease,
    drained_everywhere,
    stagger_groups,
    takes_out,
)
from gateway.metrics import GatewayMetrics

log = logging.getLogger("gateway.coord")

KINDS = (CycleKind.SHORT, CycleKind.MEDIUM, CycleKind.LONG)


def _phase(raw: str) -> LeasePhase:
    """A record's phase (anything unknown reads as draining)."""
    try:
        return LeasePhase(raw)
    except ValueError:
        return LeasePhase.DRAINING


@dataclass(slots=True)
class _Held:
    """A lease this replica holds: the lease, when it was last renewed (monotonic), the
    lease version then, and until when the store is known to hold it (monotonic)."""

    lease: MaintenanceLease
    renewed_at: float
    version: int
    confirmed_until: float


class FleetLeases:
    """The maintenance leases of one replica in fleet mode (the module docstring). Built by
    :class:`gateway.coord.coordination.Coordination`; :meth:`bind` hands it to the fleet
    controller (:meth:`gateway.fleet.controller.FleetController.use_leases`)."""

    def __init__(
        self,
        link: RedisLink,
        replicas: Replicas,
        metrics: GatewayMetrics,
        cfg: GatewayConfig,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.link = link
        self.replicas = replicas
        self.metrics = metrics
        self.cfg = cfg
        self.clock = clock
        self.ttl_s = cfg.coordination.lease_ttl_s
        self.held: dict[str, _Held] = {}
        self.records: dict[str, LeaseRecord] = {}  # open cycles as last read (by backend)
        self._starts: dict[str, dict[str, str]] = {}  # each backend's record as last read
        self.adopted: dict[str, dict[CycleKind, tuple[int, str]]] = {}  # (start ms, by)
        self._releases: dict[str, tuple[MaintenanceLease, str]] = {}  # to give back when up
        self._acquiring: set[str] = set()  # backends whose acquire script is under way
        self.controller: FleetController | None = None
        self.mirror: LeaseMirror | None = None
        self._acquire = link.client.register_script(ACQUIRE)
        self._renew = link.client.register_script(RENEW)
        self._release = link.client.register_script(RELEASE)
        self._take_over = link.client.register_script(TAKE_OVER)
        self._restore = link.client.register_script(RESTORE_STARTS)

    def bind(self, controller: FleetController) -> None:
        """Serve ``controller``'s maintenance (its cycles take their leases here) and
        follow the others' leases on its backends."""
        self.controller = controller
        self.mirror = LeaseMirror(controller, self.link.replica_id, self.clock)
        controller.use_leases(self)
        controller.fleet.on_change(self._membership_changed)

    def _membership_changed(self, backend: Backend, change: str) -> None:
        """Discovery removed ``backend`` (its cycle, if any, was cancelled with it): the
        lease held on it is given back at the next sync round (renewed forever otherwise:
        every other replica would hold a backend discovered again under that id out of
        rotation, and none could run its cycles), and it is no longer followed here."""
        if change != "removed":
            return
        h = self.held.pop(backend.id, None)
        if h is not None:
            self.metrics.leases_held.set(len(self.held))
            self._releases[backend.id] = (h.lease, self.link.replica_id)
        if self.mirror is not None:
            self.mirror.following.pop(backend.id, None)

    # ---- keys and clocks -------------------------------------------------------------------
    def _keys(self, backend_id: str) -> tuple[str, str, str]:
        k = self.link.key
        return (
            k("maint", "lease", backend_id),
            k("maint", "cycle", backend_id),
            k("maint", "inflight", backend_id),
        )

    def local_time(self, store_ms: float) -> float:
        """Store-clock milliseconds as this replica's monotonic seconds."""
        return self.link.to_local(store_ms / 1000.0, self.clock())

    def _in_ms(self, local: float | None) -> int:
        return -1 if local is None else max(0, int((local - self.clock()) * 1000))

    # ---- the MaintenanceLeases protocol ---------------------------------------------------------
    @property
    def shared(self) -> bool:
        """Always: the leases are the fleet's."""
        return True

    async def acquire(
        self,
        backend: Backend,
        cycle: CycleKind,
        reason: str,
        drain_deadline: float | None,
        force: bool = False,
    ) -> MaintenanceLease | None:
        """Run :data:`ACQUIRE` for ``backend`` (None: refused, or the store down)."""
        if self.controller is None or backend.id in self.held:
            return None
        fleet = self.controller.fleet.backends
        groups = stagger_groups(backend, fleet, self.cfg.lifecycle)
        peer_ids = sorted({p for g in groups for p in g.peers} - {backend.id})
        phase = LeasePhase.DRAINING if takes_out(cycle) else LeasePhase.PROBING
        known = self.adopted.get(backend.id, {}).get(cycle, (0, ""))[0]
        args = {
            "backend": backend.id,
            "holder": self.link.replica_id,
            "cycle": cycle.value,
            "reason": reason,
            "phase": phase.value,
            "ttl_ms": int(self.ttl_s * 1000),
            "takes_out": 1 if takes_out(cycle) else 0,
            "force": 1 if force else 0,
            "known_start_ms": known,
            "drain_ms": self._in_ms(drain_deadline),
            "peer_ids": peer_ids,
            "groups": [
                {"model": g.model, "peers": list(g.peers), "limit": g.limit, "out": list(g.out)}
                for g in groups
            ],
        }
        lease_k, cycle_k, _ = self._keys(backend.id)
        keys = [lease_k, cycle_k, *(self._keys(p)[1] for p in peer_ids)]
        self._acquiring.add(backend.id)  # the sync step leaves it alone meanwhile
        try:
            got = await self.link.call(
                "lease_acquire", lambda c: self._acquire(keys, [json.dumps(args)], client=c)
            )
        except CoordinationUnavailable:
            return None
        finally:
            self._acquiring.discard(backend.id)
        token, detail = int(got[0]), got[1]
        if token == 0:
            log.debug("backend %s: %s lease refused: %s", backend.id, cycle.value, detail)
            return None
        now_ms = int(detail)
        self._booked(backend.id, cycle, now_ms, self.link.replica_id)
        lease = MaintenanceLease(
            backend.id, cycle, reason, phase, drain_deadline, token=token
        )
        self.held[backend.id] = _Held(lease, self.clock(), 0, self.clock() + self.ttl_s)
        self.metrics.leases_held.set(len(self.held))
        log.info(
            "backend %s: %s maintenance lease taken (%s, cycle %d)",
            backend.id, cycle.value, reason, token,
        )
        return lease

    def _booked(self, backend_id: str, cycle: CycleKind, ms: int, by: str) -> None:
        kinds = {
            CycleKind.LONG: KINDS,
            CycleKind.MEDIUM: (CycleKind.SHORT, CycleKind.MEDIUM),
            CycleKind.SHORT: (CycleKind.SHORT,),
        }[cycle]
        mine = self.adopted.setdefault(backend_id, {})
        for k in kinds:
            if mine.get(k, (0, ""))[0] < ms:
                mine[k] = (ms, by)

    async def fleet_drained(self, backend: Backend, lease: MaintenanceLease) -> None:
        """Wait until every other live replica reports nothing in flight on ``backend`` for
        this cycle, at most until a little after the drain deadline (every replica cuts its
        own requests then; the margin covers one report: two sync rounds and a call)."""
        c = self.cfg.coordination
        margin = 2 * c.sync_interval_s + 2 * c.op_timeout_s + 1.0
        until = (lease.drain_deadline or self.clock()) + margin
        inflight = self._keys(backend.id)[2]
        while self.clock() < until and not lease.lost:
            others = [r for r in self.replicas.ids() if r != self.link.replica_id]
            if not others:
                return
            acks: dict[str, str] | None
            try:
                raw = await self.link.call("lease_acks", lambda cl: cl.hgetall(inflight))
                acks = {str(k): str(v) for k, v in raw.items()}
            except CoordinationUnavailable:
                acks = None
            if acks is not None and drained_everywhere(acks, lease.token, others):
                return
            await asyncio.sleep(c.sync_interval_s)
        if not lease.lost:
            log.warning(
                "backend %s: not every replica reported its requests drained by the deadline; "
                "going on (each cut its own)", backend.id,
            )

    def confirmed(self, lease: MaintenanceLease) -> bool:
        """Whether the store renewed ``lease`` within its TTL."""
        h = self.held.get(lease.backend)
        return h is not None and h.lease is lease and self.clock() < h.confirmed_until

    async def publish(self, lease: MaintenanceLease) -> bool:
        """Renew ``lease`` now with its latest fields; False when the store did not take
        them (down: the next round tries again; refused: the lease is lost)."""
        h = self.held.get(lease.backend)
        if h is None or h.lease is not lease:
            return False
        try:
            await self._renew_one(h)
        except CoordinationUnavailable:
            return False
        return not lease.lost

    async def release(self, lease: MaintenanceLease) -> None:
        """Give ``lease`` back now (or, with the store down, at its next answer)."""
        h = self.held.get(lease.backend)
        if h is not None and h.lease is lease:
            del self.held[lease.backend]
            self.metrics.leases_held.set(len(self.held))
        if lease.lost:
            return
        try:
            await self._give_back(lease)
        except CoordinationUnavailable:
            self._releases[lease.backend] = (lease, self.link.replica_id)

    async def _give_back(self, lease: MaintenanceLease) -> None:
        lease_k, cycle_k, _ = self._keys(lease.backend)
        args = [self.link.replica_id, str(lease.token)]
        await self.link.call(
            "lease_release", lambda c: self._release([lease_k, cycle_k], args, client=c)
        )
        log.info(
            "backend %s: %s maintenance lease given back (cycle %d)",
            lease.backend, lease.cycle.value, lease.token,
        )

    # ---- renewing ----------------------------------------------------------------------------
    async def _renew_one(self, h: _Held) -> None:
        lease = h.lease
        lease_k, cycle_k, _ = self._keys(lease.backend)
        fields = {
            "cycle": lease.cycle.value,
            "reason": lease.reason,
            "phase": lease.phase.value,
            "takes_out": 1 if takes_out(lease.cycle) else 0,
            "drain_in_ms": self._in_ms(lease.drain_deadline),
            "rest_in_ms": self._in_ms(lease.rest_end),
            "slept": "1" if lease.slept else "0",
            "reset_done": "1" if lease.reset_done else "0",
        }
        version = lease.version
        args = [
            self.link.replica_id,
            str(lease.token),
            str(int(self.ttl_s * 1000)),
            json.dumps(fields),
        ]
        ok = await self.link.call(
            "lease_renew", lambda c: self._renew([lease_k, cycle_k], args, client=c)
        )
        if int(ok) == 1:
            late = self.clock() - h.renewed_at
            if late > self.ttl_s * 2 / 3:
                log.warning(
                    "backend %s: maintenance lease renewed %.1f s after the last renewal "
                    "(TTL %g s): this replica's loop or the store was held up",
                    lease.backend, late, self.ttl_s,
                )
            h.renewed_at = self.clock()
            h.version = version
            h.confirmed_until = h.renewed_at + self.ttl_s
            return
        log.warning(
            "backend %s: maintenance lease lost (another replica holds the cycle now); "
            "stopping its side effects here", lease.backend,
        )
        lease.lose()
        if self.held.get(lease.backend) is h:
            del self.held[lease.backend]
            self.metrics.leases_held.set(len(self.held))

    async def _renew_due(self, force: bool = False) -> None:
        for h in list(self.held.values()):
            if (
                force
                or h.lease.version != h.version
                or self.clock() - h.renewed_at >= self.ttl_s / 3
            ):
                await self._renew_one(h)

    # ---- the sync step ----------------------------------------------------------------------
    async def sync(self) -> None:
        """One round (the module docstring). Raises :class:`CoordinationUnavailable` when
        the store stops answering (the round ends)."""
        if self.controller is None:
            return
        for backend_id, (lease, _) in list(self._releases.items()):
            await self._give_back(lease)
            del self._releases[backend_id]
        await self._renew_due()
        fleet = self.controller.fleet.backends
        records = await self._read(fleet)
        self._adopt(fleet, records)
        assert self.mirror is not None
        acks: dict[str, str] = {}
        for b in fleet:
            rec = records.get(b.id)
            if b.id in self.held or b.id in self._acquiring:
                continue
            if await self.mirror.apply(b, rec) and rec is not None:
                await self._try_take_over(b, rec)
            token = self.mirror.ack_token(b)
            if token is not None:
                acks[b.id] = f"{token}:{b.in_flight}"
        if acks:
            await self._publish_acks(acks)

    async def fallback(self) -> None:
        """A round while the store does not answer: followers return backends whose last
        seen lease ran out."""
        if self.controller is None or self.mirror is None:
            return
        for b in self.controller.fleet.backends:
            if b.id not in self.held and b.id not in self._acquiring:
                await self.mirror.apply(b, None)

    async def _read(self, fleet: list[Backend]) -> dict[str, LeaseRecord]:
        """Every backend's cycle record (open or not) with its lease's TTL, one pipeline."""

        async def read(c: Any) -> list[Any]:
            pipe = c.pipeline(transaction=False)
            for b in fleet:
                lease_k, cycle_k, _ = self._keys(b.id)
                pipe.hgetall(cycle_k)
                pipe.pttl(lease_k)
            return await pipe.execute()  # type: ignore[no-any-return]

        raw = await self.link.call("lease_read", read)
        out: dict[str, LeaseRecord] = {}
        self._starts = {}
        for i, b in enumerate(fleet):
            h: dict[str, str] = raw[2 * i] or {}
            pttl = int(raw[2 * i + 1])
            self._starts[b.id] = h
            rec = self._record(b.id, h, pttl)
            if rec is not None:
                out[b.id] = rec
        self.records = {k: r for k, r in out.items() if r.open}
        return out

    def _record(self, backend_id: str, h: dict[str, str], pttl: int) -> LeaseRecord | None:
        if "token" not in h or "cycle" not in h:
            return None

        def at(field: str) -> float | None:
            v = h.get(field, "")
            return self.local_time(float(v)) if v else None

        try:
            return LeaseRecord(
                backend=backend_id,
                holder=h.get("holder", ""),
                token=int(h["token"]),
                cycle=CycleKind(h["cycle"]),
                reason=h.get("reason", ""),
                phase=_phase(h.get("phase", "")),
                open=h.get("open") == "1",
                expires_at=self.clock() + pttl / 1000.0 if pttl > 0 else None,
                drain_deadline=at("drain_deadline"),
                rest_end=at("rest_end"),
                slept=h.get("slept") == "1",
                reset_done=h.get("reset_done") == "1",
            )
        except (KeyError, ValueError):
            return None

    def _adopt(self, fleet: list[Backend], records: dict[str, LeaseRecord]) -> None:
        """Book on each backend's local cycle clock the starts other replicas recorded."""
        lc = self.cfg.lifecycle
        for b in fleet:
            h = self._starts.get(b.id, {})
            mine = self.adopted.setdefault(b.id, {})
            for kind in KINDS:
                v = h.get(f"started_{kind.value}")
                if not v:
                    continue
                ms = int(float(v))
                if ms <= mine.get(kind, (0, ""))[0]:
                    continue
                mine[kind] = (ms, h.get(f"started_by_{kind.value}", ""))
                adopt_start(b.cycles, kind, self.local_time(ms), b.requests_served, lc)

    async def _try_take_over(self, b: Backend, rec: LeaseRecord) -> None:
        """The holder of ``rec`` stopped renewing: take the cycle over (one replica wins)
        and finish it (:meth:`gateway.fleet.maintenance.Maintenance.take_over`)."""
        assert self.controller is not None
        lease_k, cycle_k, _ = self._keys(b.id)
        args = [self.link.replica_id, str(int(self.ttl_s * 1000)), str(rec.token)]
        got = await self.link.call(
            "lease_take_over", lambda c: self._take_over([lease_k, cycle_k], args, client=c)
        )
        if not got:
            return
        token = int(got[0])
        flat = got[2:]
        h = {str(flat[i]): str(flat[i + 1]) for i in range(0, len(flat), 2)}
        now_rec = self._record(b.id, h, int(self.ttl_s * 1000))
        if now_rec is None:
            return
        lease = MaintenanceLease(
            b.id,
            now_rec.cycle,
            now_rec.reason,
            now_rec.phase,
            now_rec.drain_deadline,
            now_rec.rest_end,
            now_rec.slept,
            now_rec.reset_done,
            token=token,
            taken_over=True,
        )
        self.held[b.id] = _Held(lease, self.clock(), lease.version, self.clock() + self.ttl_s)
        self.metrics.leases_held.set(len(self.held))
        self.metrics.lease_handovers.labels(b.id).inc()
        log.warning(
            "backend %s: took over the %s cycle of %s (its lease expired at phase %s); "
            "finishing it here", b.id, lease.cycle.value, rec.holder, lease.phase.value,
        )
        await self.controller.maintenance.take_over(b, lease)

    async def _publish_acks(self, acks: dict[str, str]) -> None:
        rid = self.link.replica_id

        async def write(c: Any) -> None:
            pipe = c.pipeline(transaction=False)
            for backend_id, value in acks.items():
                key = self._keys(backend_id)[2]
                pipe.hset(key, rid, value)
                pipe.expire(key, 60)
            await pipe.execute()

        await self.link.call("lease_acks", write)

    # ---- resync --------------------------------------------------------------------------------
    async def resync(self) -> None:
        """The store answers again (perhaps empty): give back what ended meanwhile, write
        the held leases back (or learn they were handed over), and the starts adopted."""
        for backend_id, (lease, _) in list(self._releases.items()):
            await self._give_back(lease)
            del self._releases[backend_id]
        await self._renew_due(force=True)
        for backend_id, starts in self.adopted.items():
            argv: list[str] = []
            for kind, (ms, by) in starts.items():
                argv += [kind.value, str(ms), by]
            if argv:
                await self._restore_starts(self._keys(backend_id)[1], argv)

    async def _restore_starts(self, key: str, argv: list[str]) -> None:
        await self.link.call("lease_restore", lambda c: self._restore([key], argv, client=c))

    # ---- seen from outside ----------------------------------------------------------------------
    def snapshot(self) -> list[dict[str, Any]]:
        """The open maintenance cycles as last read (and the leases held here): backend,
        holder, cycle, reason, phase, expires_in_s (seconds until the lease runs out unless
        renewed; 0: it has, awaiting a hand-over)."""
        now = self.clock()
        out: dict[str, dict[str, Any]] = {}
        for rec in self.records.values():
            out[rec.backend] = {
                "backend": rec.backend,
                "holder": rec.holder,
                "cycle": rec.cycle.value,
                "reason": rec.reason,
                "phase": rec.phase.value,
                "expires_in_s": round(max(0.0, (rec.expires_at or now) - now), 3),
            }
        for backend_id, h in self.held.items():
            out[backend_id] = {
                "backend": backend_id,
                "holder": self.link.replica_id,
                "cycle": h.lease.cycle.value,
                "reason": h.lease.reason,
                "phase": h.lease.phase.value,
                "expires_in_s": round(max(0.0, h.confirmed_until - now), 3),
            }
        return [out[k] for k in sorted(out)]
