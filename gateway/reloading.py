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

**Fleet mode** (:meth:`Reloader.join_fleet`, :mod:`gateway.reload_fleet`; the rules:
:mod:`gateway.coord.config_sync`): a change is published to the shared store between steps
2 and 3 (:class:`ReloadUnpublished` when it does not answer), and the others' are applied
here as source ``fleet`` (:meth:`gateway.reload_fleet.FleetReload.adopt`); ``rollback`` and
``GET /admin/config/history`` use the store's kept configs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from gateway.config import ConfigError, GatewayConfig, check_secrets, config_from_mapping
from gateway.config_diff import plan_reload
from gateway.config_history import ConfigHistory, Snapshot, digest
from gateway.config_rollouts import version_problem
from gateway.core.urls import redacted_url
from gateway.reload_errors import ReloadConflict, ReloadRefused, ReloadResult, ReloadUnpublished
from gateway.reload_input import (
    InvalidConfig,
    first_field,
    named_field,
    read_config,
    read_view,
    source_digest,
    text_digest,
)
from gateway.reload_state import KeptState, capture, restore
from gateway.routing.policy import LoadThermalPolicy

if TYPE_CHECKING:
    from gateway.fleet.controller import FleetController
    from gateway.flow.admission import AdmissionGate
    from gateway.flow.batching import BatchDispatcher
    from gateway.flow.rollouts import Rollouts
    from gateway.metrics import GatewayMetrics
    from gateway.reload_fleet import FleetReload
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
        self.fleet: FleetReload | None = None  # fleet mode: join_fleet
        self._unpublished: str | None = None  # the file digest the store did not take
        self.kept_state = KeptState(history, gw)  # the state kept with the snapshots

    def start(self) -> None:
        """Record the running config as a ``start`` snapshot unless the last one kept is
        that config already (:meth:`gateway.reload_state.KeptState.start`)."""
        version = self.kept_state.start(self.gw.cfg.model_dump(mode="json"),
                                        self.file_digest, self.wall())
        if version is not None:
            self._set_version(version)

    def restore_at_start(self, phase: str) -> None:
        """A restart's return to the kept state (:meth:`gateway.reload_state.KeptState
        .restore_at_start`; ``phase`` ``backends`` or ``rollouts``). Never raises."""
        self.kept_state.restore_at_start(phase, fleet_mode=self.fleet is not None)

    def checkpoint(self) -> None:
        """Keep the running state with the running snapshot (:meth:`gateway.reload_state
        .KeptState.checkpoint`). Never raises."""
        self.kept_state.checkpoint()

    def _set_version(self, version: int) -> None:
        self.gw.metrics.config_version.set(version)

    @property
    def version(self) -> int:
        """The running config's version (0 before the first is recorded)."""
        last = self.history.last
        return last.version if last is not None else 0

    def join_fleet(self, fleet: FleetReload) -> None:
        """Fleet mode: publish every change through ``fleet``, which applies the fleet's
        here (module docstring)."""
        self.fleet = fleet

    def number_as(self, version: int) -> None:
        """Fleet mode: record the running config again under the fleet's ``version`` (the
        fleet's config, which runs here already: numbered alike), unless it has that
        number. A state directory that cannot be written is logged."""
        if self.version == version:
            return
        try:
            self.history.record(self.gw.cfg.model_dump(mode="json"), "fleet",
                                self.file_digest, {"changed": []}, self.wall(), version)
            self._set_version(version)
        except OSError as e:
            log.error("config history: cannot write to %s: %s", self.history.dir, e)

    async def apply(self, new: GatewayConfig, source: str, from_file: str | None = None,
                    version: int | None = None, seen: int | None = None,
                    failed: dict[str, Any] | None = None) -> ReloadResult:
        """Apply ``new`` (validated) as the module docstring says (``from_file``: the digest
        of the config file it was read from, which a restart then resumes from;
        ``version``: the fleet's version of a config from the store, ``source`` ``fleet``;
        ``seen``: the running version the change was made on, if known; ``failed``: the
        failed rollout an automatic rollback returns from, a
        :class:`gateway.flow.rollout_ledger.Ended` as JSON: recorded in the ledger before
        the config's entries are started and in the snapshot's summary as
        ``rollout_failed``, so that in fleet mode every replica records it). Raises
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
                                           version, failed)
            except ReloadRefused:
                self.gw.metrics.config_reloads.labels(source, "refused").inc()
                raise
            outcome = "applied" if result.snapshot is not None else "unchanged"
            self.gw.metrics.config_reloads.labels(source, outcome).inc()
            return result

    def _reread_secrets(self, new: GatewayConfig) -> None:
        """Every reload reads the secrets from files and the environment again, whether or
        not the config changed (issue 20: a rotated Kubernetes or Docker secret is taken
        up by SIGHUP, ``reload.watch`` or ``POST /admin/config``): the client and admin
        keys and each backend's key. Raises :class:`ReloadRefused` naming the field when
        one cannot be read (nothing changed then)."""
        gw = self.gw
        try:
            check_secrets(new, discovery_credentials=False)
        except ConfigError as e:
            raise ReloadRefused(str(e), plan_reload(gw.cfg, new)) from None
        gw.reconfigure_auth(new)
        for b in gw.controller.fleet.backends:
            b.refresh_key()

    async def _apply(self, new: GatewayConfig, source: str, from_file: str | None,
                     version: int | None, failed: dict[str, Any] | None) -> ReloadResult:
        gw = self.gw
        plan = plan_reload(gw.cfg, new)
        if failed is not None and gw.rollouts is not None:  # blocks its canary here too
            gw.rollouts.ledger.load([failed])
        summary = {**plan.summary(), **({"rollout_failed": failed} if failed else {})}
        if not plan.ok:
            raise ReloadRefused(
                "these fields cannot change while the gateway runs: "
                + "; ".join(str(r) for r in plan.refused), plan, plan.refused[0].path)
        if plan.empty:
            self._reread_secrets(new)
            log.info("config (%s): no change (secrets from files and the environment read "
                     "again)", source)
            # an entry whose rollout was cleared (DELETE /admin/rollouts) starts again
            same = (gw.rollouts.sync(new.rollouts, self.version)
                    if gw.rollouts is not None else [])
            return ReloadResult(plan, None, rollouts=same)
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
                    f"backend {i} is still leaving the fleet (draining at {redacted_url(url)}): "
                    "wait until it has left (GET /admin/backends) to give its id to "
                    f"{redacted_url(new_url)}, or give "
                    "the new server another id", plan, f"backends[{i}].url")
        try:
            check_secrets(new, discovery_credentials=False)
        except ConfigError as e:  # an unset key_env: the field that names it
            raise ReloadRefused(str(e), plan, named_field(str(e))) from None
        data = new.model_dump(mode="json")
        if self.fleet is not None and version is None:  # fleet mode: the store first
            version = await self.fleet.publish(data, source, plan, summary)
        self.checkpoint()  # the state of the config left, for a rollback to it
        try:
            snap = self.history.record(data, source, from_file, summary, self.wall(),
                                       version, capture(gw.controller, gw.rollouts))
        except OSError as e:
            if self.fleet is not None:  # published: the sync round tries it again
                self.fleet.not_applied()
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
        report: list[dict[str, Any]] = []
        if gw.rollouts is not None:  # every apply: started / stopped / not started and why
            report = gw.rollouts.sync(new.rollouts, snap.version)
        gw.cfg = new
        self._reread_secrets(new)
        self._set_version(snap.version)
        if self.fleet is not None:
            self.fleet.ran()
        log.info("config (%s): version %d applied: %d field(s) changed; backends added %s, "
                 "draining %s, changed %s", source, snap.version, len(plan.changed),
                 added or "none", leaving or "none", plan.changed_backends or "none")
        return ReloadResult(plan, snap, added, leaving, report)

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

    async def rollback(self, version: int | None,
                       failed: dict[str, Any] | None = None) -> ReloadResult:
        """Return to the kept snapshot ``version`` (None: the one before the running one;
        fleet mode: the fleet's kept configs, :meth:`kept`); ``failed``: the failed
        rollout of an automatic rollback (:meth:`apply`). Raises :class:`ReloadRefused`
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
            config = self.fleet.local(config)
        try:
            new = config_from_mapping(config, f"config version {target.version}")
        except ConfigError as e:
            self.gw.metrics.config_reloads.labels("rollback", "invalid").inc()
            raise ReloadRefused(str(e), param=first_field(str(e))) from None
        own = self.history.get(target.version)  # fleet mode: this replica's own copy
        state = own.state if own is not None and own.state else target.state
        result = await self.apply(new, "rollback", failed=failed)  # (may drop target)
        if state:
            done = restore(self.gw.controller if self.fleet is None else None,
                           self.gw.rollouts, state, at_start=False, returned=result.added)
            if done:
                log.info("config: rollback to version %d: restored %s", target.version,
                         ", ".join(done))
            for item in result.rollouts:  # taken up from the snapshot: not a fresh start
                if f"rollout of {item['model']}" in done:
                    item.update(code="restored", reason=f"restored from version "
                                f"{target.version}'s kept state")
        return result

    async def kept(self) -> list[Snapshot]:
        """The kept configs, oldest first (fleet mode: the store's; :class:`ReloadUnpublished`
        while it does not answer)."""
        if self.fleet is None:
            return list(self.history.snapshots)
        return await self.fleet.kept()

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

