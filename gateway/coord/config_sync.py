"""One config for the fleet (issue 18, Deliver 1 and 2 in fleet mode): a live reload applied
on one replica reaches every replica, and the last ``reload.keep`` applied configs are kept in
the shared store.

**Publish.** A reload from any source on any replica (``POST /admin/config``, ``SIGHUP``,
the file watch, a rollback) is validated and planned there first
(:meth:`gateway.reloading.Reloader.apply`), then written to the store by :data:`PUBLISH`
before it is applied there: the script allocates the fleet's next version (``INCR`` of
``<ns>:config:counter``: one version sequence for the fleet, never below the publisher's own
last version), stamps it with the store's clock (``TIME``), makes it the fleet's current
config (``<ns>:config:current``, and its version alone in ``<ns>:config:version``) and pushes
it on the kept list (``<ns>:config:history``, newest first, trimmed to ``reload.keep``). The
publishing replica then applies it under that version. The store down: nothing is applied
anywhere (the admin API answers 503 ``coordination_unavailable``; ``SIGHUP`` and the watch
log the refusal), as for every fleet-mode admin write.

**Apply everywhere.** Every replica reads ``<ns>:config:version`` in its sync round (one
``GET``); a version it has not seen yet is read whole and handed to the reloader
(:meth:`gateway.reloading.Reloader.adopt_fleet`: applied with ``source: fleet`` under the
fleet's version, or only mirrored into the local history when it runs that config already).
So a change reaches every replica within one sync round after the publisher's answer:
``coordination.sync_interval_s + op_timeout_s`` (0.5 s with the defaults) plus the apply.
A replica that starts, or that comes back after a store outage, reads the fleet's current
config the same way and runs it when it differs from its own. When the store holds none
(the first replica of a fleet, or a Redis that lost its data), the first replica to sync
offers its running config (:data:`PUBLISH` in ``seed`` mode: written only while there is
none, under that replica's own version).

**Per replica.** :data:`LOCAL_FIELDS` stay each replica's own (how it listens, how it joins
the fleet, how it takes changes: e.g. one replica watching a file, each its own state
directory): they are neither compared (:func:`shared_digest`) nor taken from the fleet's
config (:func:`with_local`). What each replica runs is in its
heartbeat description (:class:`gateway.coord.replicas.Replicas`' ``info``): its
``config_version``, ``config_refused`` (why it does not run the fleet's current version) and
``config_file_differs``; ``GET /admin/fleet`` shows them per replica. A replica that
refuses the fleet's config (a field that cannot change live differs in its own, an env var
its keys need is unset there) keeps running its own, logs why, and its
``gateway_config_version`` stays below ``gateway_config_fleet_version``; the refused version
is not tried again until a newer one. The replica that published keeps the change (it is
what the operator asked for, and the fleet's current config): fix the refusing replica and
restart it (it starts with the fleet's config), or roll the fleet back.

Two replicas publishing at once: each applies its own; the later version is the fleet's
current, and the other adopts it in its next round (last writer wins, like two operators).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.config import ConfigError, config_from_mapping, parse_config_text
from gateway.config_history import Snapshot, digest
from gateway.coord.link import RedisLink
from gateway.coord.replicas import Replicas
from gateway.metrics import GatewayMetrics

log = logging.getLogger("gateway.coord")

LOCAL_FIELDS: tuple[tuple[str, ...], ...] = (("server",), ("coordination",), ("reload",))
"""Dotted paths of a config that belong to one replica, not to the fleet: ``server`` (where
and how it listens), ``coordination`` (its replica id, its link to the store: none of it
changes live, and a difference would refuse every reload there), ``reload`` (its state
directory, whether it watches a file)."""

# KEYS: counter, current, version, history. ARGV: mode ('new' | 'seed'), config JSON,
# source, digest, replica id, summary JSON, the publisher's last version, keep.
# 'new': the next fleet version (INCR, at least ARGV[7] + 1). 'seed': only while the store
# holds no current config, under max(counter, ARGV[7]); else the current record is returned.
# Returns the record JSON.
PUBLISH = """
if ARGV[1] == 'seed' then
  local cur = redis.call('GET', KEYS[2])
  if cur then return cur end
end
local v
local floor = tonumber(ARGV[7])
if ARGV[1] == 'seed' then
  v = math.max(tonumber(redis.call('GET', KEYS[1]) or '0'), floor)
  redis.call('SET', KEYS[1], v)
else
  v = redis.call('INCR', KEYS[1])
  if v <= floor then
    v = floor + 1
    redis.call('SET', KEYS[1], v)
  end
end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local rec = cjson.encode({version = v, applied_at = now, source = ARGV[3], digest = ARGV[4],
                          by = ARGV[5], summary_json = ARGV[6], config_json = ARGV[2]})
redis.call('SET', KEYS[2], rec)
redis.call('SET', KEYS[3], v)
redis.call('LPUSH', KEYS[4], rec)
redis.call('LTRIM', KEYS[4], 0, tonumber(ARGV[8]) - 1)
return rec
"""


def shared_view(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` (a config's JSON) without its :data:`LOCAL_FIELDS`: what the fleet shares.
    A new object."""
    out: dict[str, Any] = json.loads(json.dumps(config))
    for path in LOCAL_FIELDS:
        node = out
        for part in path[:-1]:
            node = node.get(part) if isinstance(node, dict) else None  # type: ignore[assignment]
            if node is None:
                break
        if isinstance(node, dict):
            node.pop(path[-1], None)
    return out


def shared_digest(config: dict[str, Any]) -> str:
    """sha256 of :func:`shared_view` (:func:`gateway.config_history.digest`): equal for two
    replicas running the same fleet config."""
    return digest(shared_view(config))


def with_local(fleet: dict[str, Any], running: dict[str, Any]) -> dict[str, Any]:
    """The fleet's config ``fleet`` with this replica's :data:`LOCAL_FIELDS` taken from its
    ``running`` config (both JSON). A new object."""
    out: dict[str, Any] = json.loads(json.dumps(fleet))
    for path in LOCAL_FIELDS:
        src: Any = running
        dst: Any = out
        for part in path[:-1]:
            src = src.get(part) if isinstance(src, dict) else None
            dst = dst.setdefault(part, {}) if isinstance(dst, dict) else None
        if not isinstance(src, dict) or not isinstance(dst, dict):
            continue
        if path[-1] in src:
            dst[path[-1]] = src[path[-1]]
        else:
            dst.pop(path[-1], None)
    return out


def file_differs(path: Path | None, fleet_digest: str) -> bool | None:
    """Whether the config file at ``path`` is not the fleet's config ``fleet_digest``
    (:func:`shared_digest`); None without a file, or for one unreadable or invalid."""
    if path is None:
        return None
    try:
        mine = config_from_mapping(parse_config_text(path.read_text(), str(path)), str(path))
    except (OSError, ConfigError):
        return None
    return shared_digest(mine.model_dump(mode="json")) != fleet_digest


@dataclass(frozen=True)
class FleetRecord:
    """One config published to the store: its :class:`Snapshot` (``applied_at``: Unix
    seconds of the store's clock; ``digest``: :func:`shared_digest`) and ``by``, the replica
    that published it."""

    snapshot: Snapshot
    by: str

    @staticmethod
    def parse(raw: str) -> FleetRecord | None:
        """A record from its JSON in the store, or None when it cannot be read."""
        try:
            d = json.loads(raw)
            config = json.loads(d["config_json"])
            summary = json.loads(d.get("summary_json") or "{}")
            snap = Snapshot(int(d["version"]), float(d["applied_at"]), str(d["source"]),
                            str(d["digest"]), None, config, {**summary, "by": d.get("by")})
        except (ValueError, KeyError, TypeError) as e:
            log.warning("fleet config: a record in the store cannot be read: %s", e)
            return None
        return FleetRecord(snap, str(d.get("by") or ""))


Adopt = Callable[[Snapshot], Awaitable[None]]


class FleetConfig:
    """The fleet's config in the store (module docstring), for one replica.

    ``link``: the store; ``replicas``: this replica's heartbeat (its ``info`` carries what
    it runs); ``keep``: configs kept in the store (``reload.keep``). :meth:`bind` gives it
    the reloader's ``adopt`` (how a fleet config is applied here) and ``running`` (this
    replica's running config JSON and its version)."""

    def __init__(self, link: RedisLink, replicas: Replicas, metrics: GatewayMetrics,
                 keep: int) -> None:
        self.link = link
        self.replicas = replicas
        self.metrics = metrics
        self.keep = keep
        self.seen: int | None = None  # the fleet version last handed to adopt (or published)
        self.fleet_version: int | None = None  # the fleet's current, as last read
        self._adopt: Adopt | None = None
        self._running: Callable[[], tuple[dict[str, Any], int]] | None = None
        self._script = link.client.register_script(PUBLISH)
        self.keys = [link.key("config", "counter"), link.key("config", "current"),
                     link.key("config", "version"), link.key("config", "history")]

    def bind(self, adopt: Adopt, running: Callable[[], tuple[dict[str, Any], int]]) -> None:
        """Set how a fleet config is applied here (``adopt``) and what runs here
        (``running()``: (config JSON, version))."""
        self._adopt = adopt
        self._running = running

    # ---- what this replica runs ---------------------------------------------------------
    def ran(self, version: int, backends: dict[str, str], refused: str | None = None,
            file_differs: bool | None = None) -> None:
        """Note what this replica runs now (its heartbeat carries it): ``version``,
        ``backends`` (id -> URL: what :func:`gateway.coord.replicas.config_differences`
        compares), ``refused`` (why the fleet's current version does not run here, or None),
        ``file_differs`` (its config file is not the fleet's config; None: unchanged)."""
        info = self.replicas.info
        info["config_version"] = version
        info["backends"] = backends
        info["config_refused"] = refused
        if file_differs is not None:
            info["config_file_differs"] = file_differs

    # ---- the store ------------------------------------------------------------------------
    async def publish(self, config: dict[str, Any], source: str, summary: dict[str, Any],
                      after: int, seed: bool = False) -> Snapshot:
        """Write ``config`` (JSON) as the fleet's current config (:data:`PUBLISH`;
        ``after``: this replica's last version, the floor of the new one; ``seed``: only
        when the store holds none, under ``after`` itself). Returns the fleet's current
        snapshot afterwards. Raises :class:`gateway.coord.link.CoordinationUnavailable`."""
        args = ["seed" if seed else "new", json.dumps(config, sort_keys=True), source,
                shared_digest(config), self.link.replica_id,
                json.dumps(summary, sort_keys=True), after, self.keep]
        raw = await self.link.call(
            "config_publish", lambda c: self._script(self.keys, args, client=c))
        rec = FleetRecord.parse(str(raw))
        if rec is None:  # only a store holding garbage under our key
            raise ValueError("the fleet's current config in the store cannot be read")
        self.fleet_version = rec.snapshot.version
        self.metrics.config_fleet_version.set(rec.snapshot.version)
        if not seed or rec.by == self.link.replica_id:
            self.seen = rec.snapshot.version
        return rec.snapshot

    async def current(self) -> Snapshot | None:
        """The fleet's current config, or None when the store holds none. Raises
        :class:`gateway.coord.link.CoordinationUnavailable`."""
        raw = await self.link.call("config_current", lambda c: c.get(self.keys[1]))
        rec = FleetRecord.parse(str(raw)) if raw else None
        return rec.snapshot if rec else None

    async def history(self) -> list[Snapshot]:
        """The configs kept in the store, oldest first (at most ``keep``). Raises
        :class:`gateway.coord.link.CoordinationUnavailable`."""
        raw = await self.link.call(
            "config_history", lambda c: c.lrange(self.keys[3], 0, self.keep - 1))
        recs = [FleetRecord.parse(str(r)) for r in raw or []]
        return sorted((r.snapshot for r in recs if r is not None), key=lambda s: s.version)

    # ---- the sync round ---------------------------------------------------------------------
    async def sync(self) -> None:
        """One round: read the fleet's version (``GET``); a version not seen yet is read
        and handed to ``adopt``; none in the store: this replica's running config is offered
        as the fleet's (seed). Raises :class:`gateway.coord.link.CoordinationUnavailable`."""
        if self._adopt is None or self._running is None:
            return
        raw = await self.link.call("config_version", lambda c: c.get(self.keys[2]))
        if raw is None:
            config, version = self._running()
            snap = await self.publish(config, "start", {"changed": []}, version, seed=True)
            if snap.version == self.seen:
                log.info("fleet config: this replica's config is the fleet's (version %d)",
                         snap.version)
        else:
            version_now = int(raw)
            self.fleet_version = version_now
            self.metrics.config_fleet_version.set(version_now)
            if version_now == self.seen:
                return
            current = await self.current()
            if current is None:
                return
            snap = current
        self.seen = snap.version
        await self._adopt(snap)
