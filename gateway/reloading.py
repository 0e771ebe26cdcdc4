"""Live reload (issue 18): a new configuration applied to the running gateway without
dropping a request, from ``SIGHUP`` (the config file again), ``POST /admin/config`` (a YAML
or JSON body), the file watch (``reload.watch``) or ``POST /admin/config/rollback`` (a kept
snapshot).

One :class:`Reloader` per app. :meth:`Reloader.apply` is the one way in:

1. the new config was validated by its caller (:func:`gateway.config.config_from_mapping`:
   an invalid one never gets here, the running config untouched);
2. :func:`gateway.config_diff.plan_reload` says what changes and what cannot change live
   (refused: :class:`ReloadRefused`, nothing applied); its secrets are resolved
   (:func:`gateway.config.check_secrets`: an unset ``key_env`` is refused the same way);
3. the snapshot is written first (:class:`gateway.config_history.ConfigHistory`: a state
   directory that cannot be written refuses the change), then applied: the backends through
   :meth:`gateway.fleet.controller.FleetController.reconfigure_backends` (added cold,
   removed drained, changed in place), the client and admin keys on the
   :class:`gateway.wiring.Gateway` (a key whose limits changed gets new buckets), and
   the admission limits on the gate (and the batcher's queue), the routing weights on the
   ``load_thermal`` policy, the canary rollouts (:meth:`gateway.flow.rollouts.Rollouts
   .sync`: a new entry starts one, a removed one stops it); ``gateway.cfg`` becomes the
   new config;
4. counted in ``gateway_config_reloads_total{source,outcome}`` and
   ``gateway_config_version``, logged with what changed.

Applies run one at a time (a lock): two admin calls never interleave.

**Fleet mode** (:meth:`Reloader.join_fleet`; the rules: :mod:`gateway.coord.config_sync`): a
change is published to the shared store between steps 2 and 3 (:class:`ReloadUnpublished`
when it does not answer), and :meth:`Reloader.adopt_fleet` runs the others' (source
``fleet``); ``rollback`` and ``GET /admin/config/history`` use the store's kept configs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from gateway.config import (
    ConfigError,
    GatewayConfig,
    check_secrets,
    config_from_mapping,
)
from gateway.config_diff import ReloadPlan, plan_reload
from gateway.config_history import ConfigHistory, Snapshot, digest
from gateway.config_rollouts import version_problem
from gateway.coord.config_sync import FleetConfig, file_differs, shared_digest, with_local
from gateway.coord.link import CoordinationUnavailable
from gateway.reload_input import (
    InvalidConfig,
    first_field,
    named_field,
    read_config,
    read_view,
    source_digest,
    text_digest,
)
from gateway.reload_state import capture, restore
from gateway.routing.policy import LoadThermalPolicy

if TYPE_CHECKING:
    from gateway.fleet.controller import FleetController
    from gateway.flow.admission import AdmissionGate
    from gateway.flow.batching import BatchDispatcher
    from gateway.flow.rollouts import Rollouts
    from gateway.metrics import GatewayMetrics
    from gateway.routing.policies import Policy

log = logging.getLogger("gateway.config")


class Reloadable(Protocol):
    """What a reload changes: :class:`gateway.wiring.Gateway` (its ``cfg`` is replaced)."""

    cfg: GatewayConfig
    metrics: GatewayMetrics
    controller: FleetController
    gate: AdmissionGate
    batching: BatchDispatcher | None
    router: Policy
    rollouts: Rollouts | None

    def reconfigure_auth(self, new: GatewayConfig) -> None: ...


class ReloadRefused(Exception):
    """A new config that is not applied: invalid (``problem``), or with fields that cannot
    change live (``plan.refused``). Nothing changed."""

    def __init__(self, problem: str, plan: ReloadPlan | None = None,
                 param: str | None = None) -> None:
        super().__init__(problem)
        self.problem = problem
        self.plan = plan
        self.param = param


class ReloadConflict(ReloadRefused):
    """``GET /admin/config``'s view posted back with a ``version`` that is not the running
    one: the change was made on an outdated view (``POST /admin/config``'s 409)."""


class ReloadUnpublished(ReloadRefused):
    """Fleet mode: the shared store did not take the change (``problem``): applied nowhere."""


@dataclass
class ReloadResult:
    """An applied (or unchanged) config: its snapshot (None when nothing changed) and the
    plan."""

    plan: ReloadPlan
    snapshot: Snapshot | None
    added: list[str] = field(default_factory=list)
    leaving: list[str] = field(default_factory=list)

    def view(self) -> dict[str, Any]:
        """JSON for the admin API."""
        s = self.snapshot
        return {"applied": s is not None, "unchanged": self.plan.empty,
                "version": s.version if s else None, **self.plan.summary()}


class Reloader:
    """Applies new configs to ``gw`` (module docstring). ``path``: the config file the
    gateway was started from (None: none: SIGHUP and the watch have nothing to read);
    ``history``: the kept snapshots; ``wall``: Unix seconds; ``server_overrides``: the
    command line's ``--host`` / ``--port``, which beat every reloaded config as they beat
    the file at start."""

    def __init__(self, gw: Reloadable, history: ConfigHistory, path: str | Path | None,
                 wall: Callable[[], float] = time.time,
                 server_overrides: dict[str, object] | None = None) -> None:
        self.gw = gw
        self.server_overrides = dict(server_overrides or {})
        self.history = history
        self.path = Path(path) if path is not None else None
        self.wall = wall
        # what the gateway started from: the file, the environment, the command line
        self.file_digest = source_digest(path, self.server_overrides)
        self._lock = asyncio.Lock()
        self._watched = text_digest(path)  # the watch's: the file's text
        self._settling: str | None = None  # a changed text waiting one round to settle
        self.fleet: FleetConfig | None = None  # fleet mode: join_fleet
        self._unpublished: str | None = None  # the file digest the store did not take
        self._state_of: int | None = None  # the version whose kept state a start carried

    def start(self) -> None:
        """Record the running config as a ``start`` snapshot unless the last one kept is
        that config already (a restart resumed from it, or the same file); a new one carries
        the last one's kept state (:meth:`restore_at_start` names that version)."""
        data = self.gw.cfg.model_dump(mode="json")
        last = self.history.last
        if last is not None and last.digest == digest(data):
            self._set_version(last.version)
            return
        try:
            snap = self.history.record(data, "start", self.file_digest, {"changed": []},
                                       self.wall(), state=last.state if last else None)
        except OSError as e:
            log.error("config history: cannot write to %s: %s", self.history.dir, e)
            return
        if last is not None and last.state:
            self._state_of = last.version
        self._set_version(snap.version)

    def restore_at_start(self, phase: str) -> None:
        """A restart's return to the state kept with the last snapshot (the running config's
        own, or the one before an edited file; :func:`gateway.reload_state.restore`):
        ``phase`` ``backends`` (baselines and holds: before the first probe round; not in
        fleet mode, whose shared store keeps them) or ``rollouts`` (once the config's
        rollouts have been started). Never raises."""
        last = self.history.last
        if last is None or not last.state:
            return
        gw = self.gw
        kept = (f"kept with version {self._state_of}, carried to version {last.version} "
                "(this start)" if self._state_of is not None
                else f"kept with version {last.version}")
        try:
            if phase == "backends":
                if self.fleet is not None:
                    return
                done = restore(gw.controller, None, last.state, at_start=True)
            else:
                done = restore(None, gw.rollouts, last.state, at_start=True)
        except Exception as e:  # a damaged kept state never stops a start
            log.warning("config: the state %s not restored (%s): %s: %s", kept, phase,
                        type(e).__name__, e)
            return
        if done:
            log.info("config: restored the state %s: %s", kept, ", ".join(done))

    def checkpoint(self) -> None:
        """Keep the running state with the running snapshot (written only when it changed;
        the ``config_checkpoint`` loop, a config change, the gateway's stop). Never
        raises: a state directory that cannot be written is logged."""
        last = self.history.last
        if last is None:
            return
        try:
            self.history.keep_state(last.version, capture(self.gw.controller,
                                                          self.gw.rollouts))
        except OSError as e:
            log.error("config history: cannot write to %s: %s", self.history.dir, e)

    def _set_version(self, version: int) -> None:
        self.gw.metrics.config_version.set(version)

    @property
    def version(self) -> int:
        """The running config's version (0 before the first is recorded)."""
        last = self.history.last
        return last.version if last is not None else 0

    def join_fleet(self, fleet: FleetConfig) -> None:
        """Fleet mode: publish every change to ``fleet`` and apply the fleet's
        (:meth:`adopt_fleet`) in its sync round (module docstring)."""
        self.fleet = fleet
        fleet.bind(self.adopt_fleet, lambda: (self.gw.cfg.model_dump(mode="json"),
                                              self.version))
        self._ran()

    def _ran(self, refused: str | None = None, file_differs: bool | None = None) -> None:
        if self.fleet is not None:
            self.fleet.ran(self.version, {b.id: str(b.url) for b in self.gw.cfg.backends},
                           refused, file_differs)

    async def apply(self, new: GatewayConfig, source: str, from_file: str | None = None,
                    version: int | None = None, seen: int | None = None) -> ReloadResult:
        """Apply ``new`` (validated) as the module docstring says (``from_file``: the digest
        of the config file it was read from, which a restart then resumes from;
        ``version``: the fleet's version of a config from the store, ``source`` ``fleet``;
        ``seen``: the running version the change was made on, if known). Raises
        :class:`ReloadConflict` when ``seen`` is not the running version,
        :class:`ReloadRefused` when it cannot (nothing changed then), and
        :class:`ReloadUnpublished` in fleet mode when the shared store does not take it."""
        async with self._lock:
            if seen is not None and seen != self.version:
                self.gw.metrics.config_reloads.labels(source, "refused").inc()
                raise ReloadConflict(
                    f"version {seen} was the running config's when this view was read; it "
                    f"is {self.version} now: GET /admin/config again and make the change "
                    "on it", param="version")
            try:
                result = await self._apply(new, source, from_file or self.file_digest,
                                           version)
            except ReloadRefused:
                self.gw.metrics.config_reloads.labels(source, "refused").inc()
                raise
            outcome = "applied" if result.snapshot is not None else "unchanged"
            self.gw.metrics.config_reloads.labels(source, outcome).inc()
            return result

    async def _apply(self, new: GatewayConfig, source: str, from_file: str | None,
                     version: int | None) -> ReloadResult:
        gw = self.gw
        plan = plan_reload(gw.cfg, new)
        if not plan.ok:
            raise ReloadRefused(
                "these fields cannot change while the gateway runs: "
                + "; ".join(str(r) for r in plan.refused), plan, plan.refused[0].path)
        if plan.empty:
            log.info("config (%s): no change", source)
            return ReloadResult(plan, None)
        if plan.touches("backends") and gw.rollouts is not None:
            for run in gw.rollouts.runs.values():  # a running rollout keeps both versions
                stopped = run.origin == "config" and run.cfg not in new.rollouts
                problem = run.running and not stopped and version_problem(run.cfg, (
                    b.model_version for b in new.backends
                    if b.models is None or run.cfg.model in b.models))
                if problem:
                    raise ReloadRefused(
                        f"the rollout of {run.cfg.model} is running and this config would "
                        f"leave it without a version: {problem}; abort it first (POST "
                        f"/admin/rollouts/{run.cfg.model}/abort)", plan, "backends")
        for i in plan.added:  # an id still leaving the fleet comes back only as it was
            url = gw.controller.membership.leaving_at(i)
            new_url = next(b.base_url for b in new.backends if b.id == i)
            if url is not None and url != new_url:
                raise ReloadRefused(
                    f"backend {i} is still leaving the fleet (draining at {url}): wait until "
                    f"it has left (GET /admin/backends) to give its id to {new_url}, or give "
                    "the new server another id", plan, f"backends[{i}].url")
        try:
            check_secrets(new, discovery_credentials=False)
        except ConfigError as e:  # an unset key_env: the field that names it
            raise ReloadRefused(str(e), plan, named_field(str(e))) from None
        data = new.model_dump(mode="json")
        if self.fleet is not None and version is None:  # fleet mode: the store first
            try:
                published = await self.fleet.publish(data, source, plan.summary(),
                                                     self.version)
            except CoordinationUnavailable as e:
                raise ReloadUnpublished(
                    f"{e}: in fleet mode a config change goes through the shared store so "
                    "that every replica applies it; nothing changed on any replica", plan
                ) from None
            version = published.version
        self.checkpoint()  # the state of the config left, for a rollback to it
        try:
            snap = self.history.record(data, source, from_file, plan.summary(), self.wall(),
                                       version, capture(gw.controller, gw.rollouts))
        except OSError as e:
            if self.fleet is not None:  # published: the sync round tries it again
                self.fleet.seen = None
            raise ReloadRefused(f"the config history cannot be written to "
                                f"{self.history.dir}: {e}", plan, "reload.state_dir") from None
        added: list[str] = []
        leaving: list[str] = []
        if plan.touches("backends"):
            added, leaving = gw.controller.reconfigure_backends(new.backends,
                                                                plan.changed_backends)
            gw.gate.fleet_changed()
        if plan.auth:
            gw.reconfigure_auth(new)
        if plan.touches("admission"):
            gw.gate.reconfigure(new)
            if gw.batching is not None:
                gw.batching.reconfigure(new)
        if plan.touches("routing.weights"):
            policy = getattr(gw.router, "inner", gw.router)  # under spot steering
            if isinstance(policy, LoadThermalPolicy):
                policy.reweight(new.routing.weights)
        if plan.touches("rollouts") and gw.rollouts is not None:
            gw.rollouts.sync(new.rollouts, snap.version)  # started / stopped
        gw.cfg = new
        self._set_version(snap.version)
        self._ran()
        log.info("config (%s): version %d applied: %d field(s) changed; backends added %s, "
                 "draining %s, changed %s", source, snap.version, len(plan.changed),
                 added or "none", leaving or "none", plan.changed_backends or "none")
        return ReloadResult(plan, snap, added, leaving)

    # ---- the ways in --------------------------------------------------------------------
    def _read(self, text: str, where: str, source: str) -> GatewayConfig:
        """:func:`gateway.reload_input.read_config` of ``text``; an invalid one is counted
        (``outcome`` ``invalid``) and raised as :class:`ReloadRefused`."""
        try:
            return read_config(text, where, self.gw.cfg, self.server_overrides)
        except InvalidConfig as e:
            self.gw.metrics.config_reloads.labels(source, "invalid").inc()
            raise ReloadRefused(e.problem, param=e.param) from None

    async def apply_text(self, text: str, source: str) -> ReloadResult:
        """A config given as YAML or JSON text (``POST /admin/config``), or ``GET
        /admin/config``'s view of one posted back (:func:`gateway.reload_input.read_view`).
        Raises :class:`ReloadRefused` for text that is not a valid config,
        :class:`ReloadConflict` for a view of a version that is no longer running."""
        try:
            new, seen = read_view(text, "the new config", self.gw.cfg, self.server_overrides)
        except InvalidConfig as e:
            self.gw.metrics.config_reloads.labels(source, "invalid").inc()
            raise ReloadRefused(e.problem, param=e.param) from None
        return await self.apply(new, source, seen=seen)

    async def reload_file(self, source: str = "sighup") -> ReloadResult:
        """The config file again (``SIGHUP``, the watch). Raises :class:`ReloadRefused`
        without a file, or for one that is not a valid config."""
        if self.path is None:
            raise ReloadRefused("the gateway was started without a config file (-c): "
                                "nothing to reload; use POST /admin/config")
        try:
            text = self.path.read_text()
        except OSError as e:
            self.gw.metrics.config_reloads.labels(source, "invalid").inc()
            raise ReloadRefused(f"cannot read {self.path}: {e.strerror or e}") from None
        self._watched = digest(text)
        new = self._read(text, str(self.path), source)
        read = source_digest(self.path, self.server_overrides)
        result = await self.apply(new, source, from_file=read)
        self.file_digest = read  # the file now is what runs
        return result

    async def rollback(self, version: int | None) -> ReloadResult:
        """Return to the kept snapshot ``version`` (None: the one before the running one;
        fleet mode: the fleet's kept configs, :meth:`kept`). Raises :class:`ReloadRefused`
        when there is none, or it cannot apply live."""
        snaps = await self.kept()
        if version is None:
            if len(snaps) < 2:
                raise ReloadRefused("no earlier config is kept to roll back to",
                                    param="version")
            target = snaps[-2]
        else:
            found = next((s for s in snaps if s.version == version), None)
            if found is None:
                kept = [s.version for s in snaps]
                raise ReloadRefused(f"config version {version} is not kept (kept: {kept})",
                                    param="version")
            target = found
        config = target.config
        if self.fleet is not None:  # this replica's own server, coordination, reload
            config = with_local(config, self.gw.cfg.model_dump(mode="json"))
        try:
            new = config_from_mapping(config, f"config version {target.version}")
        except ConfigError as e:
            self.gw.metrics.config_reloads.labels("rollback", "invalid").inc()
            raise ReloadRefused(str(e), param=first_field(str(e))) from None
        own = self.history.get(target.version)  # fleet mode: this replica's own copy
        state = own.state if own is not None and own.state else target.state
        result = await self.apply(new, "rollback")  # (may drop the oldest kept: target)
        if state:
            done = restore(self.gw.controller if self.fleet is None else None,
                           self.gw.rollouts, state, at_start=False, returned=result.added)
            if done:
                log.info("config: rollback to version %d: restored %s", target.version,
                         ", ".join(done))
        return result

    async def kept(self) -> list[Snapshot]:
        """The kept configs, oldest first (fleet mode: the store's; :class:`ReloadUnpublished`
        while it does not answer)."""
        if self.fleet is None:
            return list(self.history.snapshots)
        try:
            return await self.fleet.history()
        except CoordinationUnavailable as e:
            raise ReloadUnpublished(f"{e}: the fleet's kept configs cannot be read") from None

    async def adopt_fleet(self, snap: Snapshot) -> None:
        """Run the fleet's config ``snap`` here (the sync round of
        :mod:`gateway.coord.config_sync`, whose ``LOCAL_FIELDS`` stay this replica's):
        applied as source ``fleet`` under the fleet's version, or only recorded under it
        when it runs here already. Refused (a field that cannot change live, an unset
        ``key_env``): the running config stays, the refusal is logged and published in the
        heartbeat (``config_refused``). Never raises."""
        running = self.gw.cfg.model_dump(mode="json")
        differs = file_differs(self.path, snap.digest)
        if differs:
            log.warning("config: the config file %s is not the fleet's current config "
                        "(version %d); running the fleet's. To make the file the fleet's "
                        "config, send SIGHUP to one replica (or POST it to /admin/config)",
                        self.path, snap.version)
        if shared_digest(running) == snap.digest:  # runs here already: numbered alike
            if self.version != snap.version:
                try:
                    self.history.record(running, "fleet", self.file_digest, {"changed": []},
                                        self.wall(), snap.version)
                    self._set_version(snap.version)
                except OSError as e:
                    log.error("config history: cannot write to %s: %s", self.history.dir, e)
            self._ran(file_differs=differs)
            return
        try:
            new = config_from_mapping(with_local(snap.config, running),
                                      f"the fleet's config version {snap.version}")
            await self.apply(new, "fleet", version=snap.version)
        except (ReloadRefused, ConfigError) as e:
            problem = e.problem if isinstance(e, ReloadRefused) else str(e)
            log.error("config (fleet): the fleet's config version %d not applied on this "
                      "replica (it keeps running version %d): %s", snap.version,
                      self.version, problem)
            self._ran(refused=f"version {snap.version}: {problem}", file_differs=differs)
            return
        self._ran(file_differs=differs)

    async def watch_round(self) -> None:
        """The file watch's body: reload when the file's content changed since it was last
        read and it has stayed the same for one more round (an editor that truncates the
        file then writes it is never read half-written; a rename is read the round after);
        a refused one is logged and not retried until the file changes again; one the
        shared store did not take, fleet mode, is tried again every round."""
        now, before = text_digest(self.path), self._watched
        if now is None or now == before:
            self._settling = None
            return
        if now != self._settling:  # changed since the last round: wait until it settles
            self._settling = now
            return
        self._settling = None
        self._watched = now
        try:
            await self.reload_file("watch")
        except ReloadRefused as e:
            if isinstance(e, ReloadUnpublished):
                self._watched = before  # again next round, until the store answers
            if not isinstance(e, ReloadUnpublished) or self._unpublished != now:
                log.error("config (watch): %s not applied: %s", self.path, e.problem)
            self._unpublished = now if isinstance(e, ReloadUnpublished) else None

