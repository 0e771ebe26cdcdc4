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
   ``load_thermal`` policy; ``gateway.cfg`` becomes the new config;
4. counted in ``gateway_config_reloads_total{source,outcome}`` and
   ``gateway_config_version``, logged with what changed.

Applies run one at a time (a lock): two admin calls never interleave.
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
    parse_config_text,
    with_server_overrides,
)
from gateway.config_diff import ReloadPlan, plan_reload
from gateway.config_history import ConfigHistory, Snapshot, digest
from gateway.routing.policy import LoadThermalPolicy

if TYPE_CHECKING:
    from gateway.fleet.controller import FleetController
    from gateway.flow.admission import AdmissionGate
    from gateway.flow.batching import BatchDispatcher
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
        return {"applied": s is not None, "version": s.version if s else None,
                **self.plan.summary()}


def file_digest(path: str | Path | None) -> str | None:
    """The digest of the config file's content, or None (no file, or unreadable)."""
    if path is None:
        return None
    try:
        return digest(Path(path).read_text())
    except OSError:
        return None


def resume_config(
    cfg: GatewayConfig, path: str | Path | None
) -> tuple[GatewayConfig, Snapshot | None]:
    """The config a start uses: with ``reload.state_dir``, the last applied one kept there
    when the config file (``path``) is the one it was started from
    (:meth:`ConfigHistory.resume`), else ``cfg`` (the file's). Returns it and the snapshot
    resumed (None: the file's). Raises ``ConfigError`` when the kept config is no longer
    valid (an upgrade changed the schema: move the state directory away to start from the
    file) and ``OSError`` when the state directory cannot be made."""
    if cfg.reload.state_dir is None:
        return cfg, None
    history = ConfigHistory(cfg.reload.state_dir, cfg.reload.keep)
    snap = history.resume(file_digest(path))
    if snap is None:
        return cfg, None
    return config_from_mapping(
        snap.config, f"config version {snap.version} kept in {history.dir}"), snap


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
        self.file_digest = file_digest(path)  # the file the gateway started from
        self._lock = asyncio.Lock()
        self._watched = self.file_digest

    def start(self) -> None:
        """Record the running config as a ``start`` snapshot unless the last one kept is
        that config already (a restart resumed from it, or the same file)."""
        data = self.gw.cfg.model_dump(mode="json")
        last = self.history.last
        if last is not None and last.digest == digest(data):
            self._set_version(last.version)
            return
        try:
            snap = self.history.record(data, "start", self.file_digest, {"changed": []},
                                       self.wall())
        except OSError as e:
            log.error("config history: cannot write to %s: %s", self.history.dir, e)
            return
        self._set_version(snap.version)

    def _set_version(self, version: int) -> None:
        self.gw.metrics.config_version.set(version)

    async def apply(self, new: GatewayConfig, source: str,
                    from_file: str | None = None) -> ReloadResult:
        """Apply ``new`` (validated) as the module docstring says (``from_file``: the digest
        of the config file it was read from, which a restart then resumes from). Raises
        :class:`ReloadRefused` when it cannot (nothing changed then)."""
        async with self._lock:
            try:
                result = self._apply(new, source, from_file or self.file_digest)
            except ReloadRefused:
                self.gw.metrics.config_reloads.labels(source, "refused").inc()
                raise
            outcome = "applied" if result.snapshot is not None else "unchanged"
            self.gw.metrics.config_reloads.labels(source, outcome).inc()
            return result

    def _apply(self, new: GatewayConfig, source: str, from_file: str | None) -> ReloadResult:
        gw = self.gw
        plan = plan_reload(gw.cfg, new)
        if not plan.ok:
            raise ReloadRefused(
                "these fields cannot change while the gateway runs: "
                + "; ".join(str(r) for r in plan.refused), plan, plan.refused[0].path)
        if plan.empty:
            log.info("config (%s): no change", source)
            return ReloadResult(plan, None)
        try:
            check_secrets(new, discovery_credentials=False)
        except ConfigError as e:
            raise ReloadRefused(str(e), plan) from None
        try:
            snap = self.history.record(new.model_dump(mode="json"), source, from_file,
                                       plan.summary(), self.wall())
        except OSError as e:
            raise ReloadRefused(f"the config history cannot be written to "
                                f"{self.history.dir}: {e}", plan) from None
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
        gw.cfg = new
        self._set_version(snap.version)
        log.info("config (%s): version %d applied: %d field(s) changed; backends added %s, "
                 "draining %s, changed %s", source, snap.version, len(plan.changed),
                 added or "none", leaving or "none", plan.changed_backends or "none")
        return ReloadResult(plan, snap, added, leaving)

    # ---- the ways in --------------------------------------------------------------------
    async def apply_text(self, text: str, source: str) -> ReloadResult:
        """A config given as YAML or JSON text (``POST /admin/config``). Raises
        :class:`ReloadRefused` for text that is not a valid config."""
        try:
            new = self._overridden(config_from_mapping(parse_config_text(text, "the new config"),
                                                       "the new config"))
        except ConfigError as e:
            raise ReloadRefused(str(e), param=_first_path(str(e))) from None
        return await self.apply(new, source)

    async def reload_file(self, source: str = "sighup") -> ReloadResult:
        """The config file again (``SIGHUP``, the watch). Raises :class:`ReloadRefused`
        without a file, or for one that is not a valid config."""
        if self.path is None:
            raise ReloadRefused("the gateway was started without a config file (-c): "
                                "nothing to reload; use POST /admin/config")
        try:
            text = self.path.read_text()
        except OSError as e:
            raise ReloadRefused(f"cannot read {self.path}: {e.strerror or e}") from None
        self._watched = digest(text)
        try:
            new = self._overridden(
                config_from_mapping(parse_config_text(text, str(self.path)), str(self.path)))
        except ConfigError as e:
            raise ReloadRefused(str(e), param=_first_path(str(e))) from None
        result = await self.apply(new, source, from_file=self._watched)
        self.file_digest = self._watched  # the file now is what runs
        return result

    def _overridden(self, cfg: GatewayConfig) -> GatewayConfig:
        """``cfg`` with the command line's server settings. Raises ``ConfigError``."""
        return with_server_overrides(cfg, **self.server_overrides)

    async def rollback(self, version: int | None) -> ReloadResult:
        """Return to the kept snapshot ``version`` (None: the one before the running one).
        Raises :class:`ReloadRefused` when there is none, or it cannot apply live."""
        snaps = self.history.snapshots
        if version is None:
            if len(snaps) < 2:
                raise ReloadRefused("no earlier config is kept to roll back to")
            target = snaps[-2]
        else:
            found = self.history.get(version)
            if found is None:
                kept = [s.version for s in snaps]
                raise ReloadRefused(f"config version {version} is not kept (kept: {kept})",
                                    param="version")
            target = found
        try:
            new = config_from_mapping(target.config, f"config version {target.version}")
        except ConfigError as e:
            raise ReloadRefused(str(e)) from None
        return await self.apply(new, "rollback")

    async def watch_round(self) -> None:
        """The file watch's body: reload when the file's content changed since it was last
        read (a refused one is logged and not retried until the file changes again)."""
        now = file_digest(self.path)
        if now is None or now == self._watched:
            return
        self._watched = now
        try:
            await self.reload_file("watch")
        except ReloadRefused as e:
            log.error("config (watch): %s not applied: %s", self.path, e.problem)


def _first_path(message: str) -> str | None:
    """The first dotted field path of a :func:`gateway.config._format_errors` message."""
    for line in message.splitlines()[1:]:
        head = line.strip().split(":", 1)[0]
        if head:
            return head
    return None
