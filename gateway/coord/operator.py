"""Operator actions and verdicts, fleet-wide (issue 14, item 2): what one replica is told or
finds out about a backend, every replica applies.

**Operator actions.** An admin drain, preemption or undrain sent to any replica is written to
the store as the backend's *op record* (:class:`OpRecord`, one per backend, the latest
replacing the one before) by :data:`SUBMIT`, which stamps it with the store's clock
(``TIME``) and turns the drain deadline and preemption hold into store times. The receiving
replica applies it at once; every other replica reads the records in its sync round
(``HGETALL``, every ``coordination.sync_interval_s``) and runs the same local procedure
(:meth:`gateway.fleet.drain.Drains.start_drain` / :meth:`~gateway.fleet.drain.Drains.undrain`),
so each drains its *own* in-flight requests and cuts them at the shared deadline. A record
is a standing order: an admin drain holds the backend out until an undrain replaces it, so a
replica that starts later applies it too. Seen on every replica within
``sync_interval_s + op_timeout_s`` of the operator's answer (the 1 s bound of the issue with
the defaults 0.25 s + 0.25 s).

**Verdicts.** A GPU fault (Xid burst, ECC DBE) is seen by every replica scraping the same
telemetry; the first to claim the restart (:data:`CLAIM`: ``SET NX`` of
``<ns>:ops:gpu_restart:<backend>`` with a TTL of ``coordination.gpu_restart_lease_s``, and
the backend's ``gpu_fault`` record in the same script) runs the restart hook; the others keep
the hold and run nothing. The ``restarting`` hold after the hook is published the same way.
A backend's calibration baseline is one for the fleet: the first offered for an engine
endpoint wins (:data:`OFFER`, hash ``<ns>:ops:baselines``).

**Store down** (``link.fallback``): admin writes are refused by the admin API (503, nothing
changes anywhere); a GPU fault runs its restart hook here (the pre-fleet behaviour: the
fault is real, and no replica can learn of another's claim) and its holds are kept as local
records; a baseline taken here is kept. **Store back** (:meth:`OperatorActions.resync`, also
after a Redis restart that lost everything): every replica writes back the records it knows
(:data:`WRITE_BACK`: the newer by store time wins) and the baselines it holds (first wins),
then adopts what the store has.

**Discovery**: a backend removed from the fleet takes its record with it (:data:`DROP`), so
one discovered again under the same id starts afresh on every replica, later ones included.

Keys: ``<ns>:ops:records`` (hash: backend id -> record JSON), ``<ns>:ops:baselines`` (hash:
backend id -> ``{"answers", "endpoint"}`` JSON), ``<ns>:ops:gpu_restart:<backend>`` (the
restart claim: holder replica id, TTL).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any

from gateway.config import CoordinationConfig
from gateway.coord.link import CoordinationUnavailable, RedisLink
from gateway.fleet.backend import Backend
from gateway.fleet.controller import FleetController
from gateway.fleet.sharing import Baseline
from gateway.metrics import GatewayMetrics

log = logging.getLogger("gateway.coord")

ACTIONS = ("drain", "preempt", "undrain", "gpu_fault", "restarting")
"""What an op record orders: an admin ``drain`` (standing hold until ``undrain``), a
``preempt`` (drain, then ``cold``; held until ``until_at``), ``undrain`` (back to rotation),
and the GPU verdicts ``gpu_fault`` (held out until the restart or an undrain) and
``restarting`` (held until ``until_at`` or the restart is seen)."""

# KEYS: records hash. ARGV: backend, op id, action, replica id, deadline seconds ('' none),
# hold seconds ('' none), reason. Stamps the record with the store's clock; returns its JSON.
SUBMIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local rec = {backend = ARGV[1], id = ARGV[2], action = ARGV[3], by = ARGV[4], at = now,
             reason = ARGV[7]}
if ARGV[5] ~= '' then rec.deadline_at = now + tonumber(ARGV[5]) end
if ARGV[6] ~= '' then rec.until_at = now + tonumber(ARGV[6]) end
local out = cjson.encode(rec)
redis.call('HSET', KEYS[1], ARGV[1], out)
return out
"""

# KEYS: restart claim key, records hash. ARGV: backend, op id, replica id, claim TTL ms,
# reason. The first replica to claim a backend's GPU restart (SET NX PX) publishes its
# gpu_fault record and gets it back; the others get nil.
CLAIM = """
if not redis.call('SET', KEYS[1], ARGV[3], 'NX', 'PX', ARGV[4]) then return false end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local out = cjson.encode({backend = ARGV[1], id = ARGV[2], action = 'gpu_fault',
                          by = ARGV[3], at = now, reason = ARGV[5]})
redis.call('HSET', KEYS[2], ARGV[1], out)
return out
"""

# KEYS: records hash. ARGV: record JSONs. Each replaces the backend's record unless the
# store holds one at least as new (store time 'at'). Returns how many were written.
WRITE_BACK = """
local n = 0
for i = 1, #ARGV do
  local rec = cjson.decode(ARGV[i])
  local cur = redis.call('HGET', KEYS[1], rec.backend)
  if (not cur) or cjson.decode(cur).at < rec.at then
    redis.call('HSET', KEYS[1], rec.backend, ARGV[i])
    n = n + 1
  end
end
return n
"""

# KEYS: records hash. ARGV: backend, op id. Deletes the backend's record only while it is
# that op (a newer one, e.g. for a pod of the same name discovered again, stays).
DROP = """
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if cur and cjson.decode(cur).id == ARGV[2] then
  redis.call('HDEL', KEYS[1], ARGV[1])
  return 1
end
return 0
"""

# KEYS: baselines hash. ARGV: backend, baseline JSON {answers, endpoint}. The stored one is
# kept unless it is for another engine endpoint (that one is no longer served: the new one
# replaces it). Returns the fleet's baseline JSON.
OFFER = """
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if cur and cjson.decode(cur).endpoint == cjson.decode(ARGV[2]).endpoint then return cur end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return ARGV[2]
"""


@dataclass(frozen=True, slots=True)
class OpRecord:
    """A backend's standing op. ``at``, ``deadline_at`` (a drain's cut), ``until_at`` (a
    hold's end): unix seconds of the store's clock. ``by``: the replica that wrote it; ``id``:
    unique per op (a replica applies each once)."""

    backend: str
    id: str
    action: str
    by: str
    at: float
    reason: str = ""
    deadline_at: float | None = None
    until_at: float | None = None

    @classmethod
    def parse(cls, raw: str) -> OpRecord | None:
        """A record from its JSON (None: unreadable or an unknown action)."""
        try:
            d = json.loads(raw)
            rec = cls(
                backend=str(d["backend"]), id=str(d["id"]), action=str(d["action"]),
                by=str(d.get("by", "")), at=float(d["at"]), reason=str(d.get("reason", "")),
                deadline_at=None if d.get("deadline_at") is None else float(d["deadline_at"]),
                until_at=None if d.get("until_at") is None else float(d["until_at"]),
            )
        except (ValueError, KeyError, TypeError):
            return None
        return rec if rec.action in ACTIONS else None

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))


class OperatorActions:
    """One replica's part in fleet-wide operator actions and verdicts (the
    :class:`gateway.fleet.sharing.SharedHolds` and :class:`~gateway.fleet.sharing.
    SharedBaselines` of ``controller``'s drains and calibrator). ``clock``: monotonic
    seconds (deadlines applied locally)."""

    def __init__(
        self,
        cfg: CoordinationConfig,
        link: RedisLink,
        controller: FleetController,
        metrics: GatewayMetrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.link = link
        self.controller = controller
        self.metrics = metrics
        self.clock = clock
        # backend id -> the last record applied here (or set here while the store was down)
        self.known: dict[str, OpRecord] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._submit = link.client.register_script(SUBMIT)
        self._claim = link.client.register_script(CLAIM)
        self._write_back = link.client.register_script(WRITE_BACK)
        self._offer = link.client.register_script(OFFER)
        self._drop = link.client.register_script(DROP)
        self.records_key = link.key("ops", "records")
        self.baselines_key = link.key("ops", "baselines")
        controller.fleet.on_change(self._membership_changed)

    # ---- operator actions (the admin API) -----------------------------------------------------
    async def submit(
        self,
        backend: Backend,
        action: str,
        deadline_s: float | None = None,
        hold_s: float | None = None,
    ) -> OpRecord:
        """Write ``action`` on ``backend`` for the fleet (``deadline_s``: seconds until the
        drain cuts what is left; ``hold_s``: the hold's length), then apply it here. Raises
        :class:`CoordinationUnavailable` (nothing written, nothing applied)."""
        args = [
            backend.id, secrets.token_hex(8), action, self.link.replica_id,
            "" if deadline_s is None else repr(float(deadline_s)),
            "" if hold_s is None else repr(float(hold_s)), "admin",
        ]
        raw = await self.link.call(
            "ops_submit", lambda c: self._submit([self.records_key], args, client=c)
        )
        rec = OpRecord.parse(str(raw))
        if rec is None:  # cannot happen with SUBMIT's output; refuse rather than guess
            raise CoordinationUnavailable(f"the store returned an unreadable op record: {raw}")
        self.metrics.operator_actions.labels(action, "submitted").inc()
        self._apply(backend, rec)
        return rec

    def holds(self, backend: Backend) -> bool:
        """Whether the last record known here for ``backend`` holds it out (anything but an
        undrain): an undrain then has something to release on some replica."""
        rec = self.known.get(backend.id)
        return rec is not None and rec.action != "undrain"

    # ---- the sync round and resync -------------------------------------------------------------
    async def sync(self) -> None:
        """Apply every record not applied here yet (one ``HGETALL``). Raises
        :class:`CoordinationUnavailable`."""
        raw = await self.link.call("ops_sync", lambda c: c.hgetall(self.records_key))
        self._apply_all(raw)

    def _apply_all(self, raw: dict[Any, Any]) -> None:
        for field, value in raw.items():
            rec = OpRecord.parse(str(value))
            b = self.controller.fleet.get(str(field))
            if rec is None or b is None:
                continue
            seen = self.known.get(b.id)
            if seen is not None and (seen.id == rec.id or seen.at > rec.at):
                continue
            self.metrics.operator_actions.labels(rec.action, "applied").inc()
            self._apply(b, rec)

    async def resync(self) -> None:
        """The store answers again (or for the first time): write back the records and
        baselines held here (a restarted store lost them), then adopt the store's."""
        if self.known:
            recs = [r.to_json() for r in self.known.values()]
            await self.link.call(
                "ops_write_back", lambda c: self._write_back([self.records_key], recs, client=c)
            )
        for b in self.controller.fleet:
            if b.calibration_baseline is not None:
                mine = (b.calibration_baseline, b.calibration_endpoint)
                fleet = await self._offer_raw(b, mine)
                if fleet != mine:
                    b.baseline_taken(*fleet)  # another replica's came first: adopt it
        await self.sync()

    # ---- applying a record here ------------------------------------------------------------------
    def _apply(self, b: Backend, rec: OpRecord) -> None:
        """Run the local procedure ``rec`` orders on ``b`` (store times turned into local
        ones: ``local = clock() + (store_t - link.now())``)."""
        self.known[b.id] = rec
        drains = self.controller.drains
        now = self.link.now()
        if rec.action in ("drain", "preempt"):
            preempt = rec.action == "preempt"
            if preempt and rec.until_at is not None and rec.until_at <= now:
                return  # a preemption long over: the instance went away and came back
            left = max(0.0, (rec.deadline_at if rec.deadline_at is not None else now) - now)
            if drains.start_drain(b, left, preempt=preempt) and rec.by != self.link.replica_id:
                log.info("backend %s: %s from replica %s applied (cut in %.1f s)",
                         b.id, rec.action, rec.by, left)
        elif rec.action == "undrain":
            if drains.undrain(b) and rec.by != self.link.replica_id:
                log.info("backend %s: undrain from replica %s applied", b.id, rec.by)
        elif rec.action == "gpu_fault":
            drains.apply_shared_hold(b, "gpu_fault", None, rec.reason or "gpu_xid")
        elif rec.action == "restarting" and rec.until_at is not None and rec.until_at > now:
            drains.apply_shared_hold(b, "restarting", self.clock() + (rec.until_at - now), "")

    def _local(self, b: Backend, action: str, reason: str, hold_s: float | None) -> OpRecord:
        """A record made here while the store does not answer (written back at resync)."""
        now = self.link.now()
        rec = OpRecord(b.id, secrets.token_hex(8), action, self.link.replica_id, now, reason,
                       until_at=None if hold_s is None else now + hold_s)
        self.known[b.id] = rec
        return rec

    # ---- SharedHolds (gateway.fleet.sharing) -------------------------------------------------
    async def claim_gpu_restart(self, backend: Backend, reason: str) -> bool:
        """True when this replica claimed ``backend``'s restart (it publishes the
        ``gpu_fault`` hold and runs the hook); False when another replica holds the claim.
        Store down: True (the hook runs here; the hold is written back at resync)."""
        keys = [self.link.key("ops", "gpu_restart", backend.id), self.records_key]
        args: list[str | int] = [backend.id, secrets.token_hex(8), self.link.replica_id,
                                 int(self.cfg.gpu_restart_lease_s * 1000), reason]
        try:
            raw = await self.link.call("ops_gpu_claim",
                                       lambda c: self._claim(keys, args, client=c))
        except CoordinationUnavailable:
            self._local(backend, "gpu_fault", reason, None)
            self.metrics.gpu_restart_claims.labels(backend.id, "local").inc()
            return True
        rec = OpRecord.parse(str(raw)) if raw else None
        if rec is None:
            self.metrics.gpu_restart_claims.labels(backend.id, "lost").inc()
            return False
        self.known[backend.id] = rec
        self.metrics.gpu_restart_claims.labels(backend.id, "won").inc()
        return True

    def restart_held(self, backend: Backend, hold_s: float) -> None:
        """Publish ``backend``'s ``restarting`` hold in an owned background task (store down
        or failing: kept as a local record, written back at resync)."""
        if self.link.fallback:
            self._local(backend, "restarting", "", hold_s)
            return

        async def publish() -> None:
            args = [backend.id, secrets.token_hex(8), "restarting", self.link.replica_id, "",
                    repr(float(hold_s)), ""]
            try:
                raw = await self.link.call(
                    "ops_submit", lambda c: self._submit([self.records_key], args, client=c)
                )
            except CoordinationUnavailable:
                self._local(backend, "restarting", "", hold_s)
                return
            rec = OpRecord.parse(str(raw))
            if rec is not None:
                self.known[backend.id] = rec

        self._spawn(publish())

    # ---- SharedBaselines (gateway.fleet.sharing) ---------------------------------------------
    async def offer_baseline(self, backend: Backend, baseline: Baseline) -> Baseline:
        """The fleet's baseline for ``backend`` after offering ``baseline`` (store down:
        ``baseline``; offered again at resync)."""
        try:
            return await self._offer_raw(backend, baseline)
        except CoordinationUnavailable:
            return baseline

    async def _offer_raw(self, backend: Backend, baseline: Baseline) -> Baseline:
        """Offer ``baseline`` (:data:`OFFER`); returns the fleet's. Raises
        :class:`CoordinationUnavailable`."""
        answers, endpoint = baseline
        mine = json.dumps({"answers": answers, "endpoint": endpoint}, separators=(",", ":"))
        raw = await self.link.call(
            "ops_baseline",
            lambda c: self._offer([self.baselines_key], [backend.id, mine], client=c),
        )
        try:
            d: dict[str, Any] = json.loads(str(raw))
            fleet: Baseline = (d.get("answers"), d.get("endpoint"))
        except (ValueError, AttributeError):
            return baseline
        return fleet

    # ---- discovery: a backend left the fleet ----------------------------------------------------
    def _membership_changed(self, backend: Backend, change: str) -> None:
        """Discovery removed ``backend``: its op record is forgotten here and deleted from
        the store (:data:`DROP`, only while it is still the record applied here), so a
        backend discovered again under the same id (a StatefulSet's pod, a reused
        address) starts afresh on every replica, as in the one-process gateway, instead of
        inheriting a drain that replicas started later would apply and running ones would
        not. The store down: the record stays there (nothing else is lost)."""
        if change != "removed":
            return
        rec = self.known.pop(backend.id, None)
        if rec is None or self.link.fallback:
            return
        args = [backend.id, rec.id]

        async def drop() -> None:
            try:
                await self.link.call(
                    "ops_drop", lambda c: self._drop([self.records_key], args, client=c)
                )
            except CoordinationUnavailable:
                pass

        self._spawn(drop())

    # ---- tasks ----------------------------------------------------------------------------------
    def _spawn(self, coro: Awaitable[None]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stop(self) -> None:
        """Cancel the publishing tasks still running."""
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
