"""Fleet mode's side of live reload (issue 18) on one replica: the config that arrives from
another replica through the shared store is applied here, and this replica's own changes
go through the store first. The rules of the store (versions, the current record, the kept
list, this replica's ``LOCAL_FIELDS``) are :mod:`gateway.coord.config_sync`'s; applying a
config is :class:`gateway.reloading.Reloader`'s.

One :class:`FleetReload` per replica in fleet mode, bound to the reloader by
:meth:`gateway.reloading.Reloader.join_fleet` (``app.py``):

* :meth:`FleetReload.adopt` (the ``config`` sync step, :meth:`gateway.coord.config_sync
  .FleetConfig.sync`, with each fleet version not seen yet): the fleet's config with this
  replica's own ``server``, ``coordination`` and ``reload`` sections
  (:func:`gateway.coord.config_sync.with_local`) applied as source ``fleet`` under the
  fleet's version (an automatic rollback's ``rollout_failed`` recorded here too: the
  failed canary is blocked on every replica, :mod:`gateway.flow.rollout_ledger`); one
  that runs here already is only numbered alike
  (:meth:`gateway.reloading.Reloader.number_as`); refused (a field that cannot change live,
  an unset ``key_env``): the running config stays, the refusal is logged and published in
  the heartbeat (``config_refused``); a config file that is not the fleet's is said;
* :meth:`FleetReload.publish`: a change made here, written to the store before it is applied
  (:class:`gateway.reloading.ReloadUnpublished` while the store does not answer: applied on
  no replica);
* :meth:`FleetReload.kept`: the fleet's kept configs (rollback, ``GET /admin/config/history``);
* :meth:`FleetReload.ran`: what this replica runs, in its heartbeat
  (:meth:`gateway.coord.config_sync.FleetConfig.ran`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Protocol

from gateway.config import ConfigError, GatewayConfig, config_from_mapping
from gateway.config_diff import ReloadPlan
from gateway.config_history import Snapshot
from gateway.coord.config_sync import FleetConfig, file_differs, shared_digest, with_local
from gateway.coord.link import CoordinationUnavailable
from gateway.reload_errors import ReloadRefused, ReloadUnpublished

log = logging.getLogger("gateway.config")


class Configured(Protocol):
    """The running gateway as :class:`FleetReload` reads it: its config."""

    @property
    def cfg(self) -> GatewayConfig: ...


class Applier(Protocol):
    """What :class:`FleetReload` uses of :class:`gateway.reloading.Reloader`: the running
    gateway, its version, the config file it was started from, ``apply`` and
    ``number_as``."""

    @property
    def gw(self) -> Configured: ...

    @property
    def version(self) -> int: ...

    @property
    def path(self) -> Path | None: ...

    async def apply(self, new: GatewayConfig, source: str, from_file: str | None = None,
                    version: int | None = None, seen: int | None = None,
                    failed: dict[str, Any] | None = None) -> object: ...

    def number_as(self, version: int) -> None: ...


class FleetReload:
    """The fleet's config on this replica (module docstring): ``reloader`` applies,
    ``store`` is the shared store's config part (``Coordination.share_config``). Binds
    itself to the store's sync round and publishes what runs here."""

    def __init__(self, reloader: Applier, store: FleetConfig) -> None:
        self.reloader = reloader
        self.store = store
        store.bind(self.adopt, self._running)
        self.ran()

    def _running(self) -> tuple[dict[str, Any], int]:
        """The running config (JSON) and its version: what a seed offers as the fleet's."""
        return self.reloader.gw.cfg.model_dump(mode="json"), self.reloader.version

    def ran(self, refused: str | None = None, differs: bool | None = None) -> None:
        """Publish what this replica runs (version, backends by id with URL), the fleet
        version it ``refused`` (why) and whether its config file ``differs`` from the
        fleet's config, in its heartbeat."""
        r = self.reloader
        self.store.ran(r.version, {b.id: str(b.url) for b in r.gw.cfg.backends}, refused,
                       differs)

    async def publish(self, data: dict[str, Any], source: str, plan: ReloadPlan,
                      summary: dict[str, Any] | None = None) -> int:
        """Write the config ``data`` (JSON) changed here (``source``, what ``plan`` changes;
        ``summary``: the snapshot's, default the plan's) to the store as the fleet's next
        version, returned. Raises
        :class:`gateway.reloading.ReloadUnpublished` while the store does not answer."""
        try:
            published = await self.store.publish(data, source, summary or plan.summary(),
                                                  self.reloader.version)
        except CoordinationUnavailable as e:
            raise ReloadUnpublished(
                f"{e}: in fleet mode a config change goes through the shared store so that "
                "every replica applies it; nothing changed on any replica", plan) from None
        return published.version

    def not_applied(self) -> None:
        """A version published here could not be applied here (its snapshot not written):
        the next sync round hands it to :meth:`adopt` again."""
        self.store.seen = None

    async def kept(self) -> list[Snapshot]:
        """The fleet's kept configs, oldest first. Raises
        :class:`gateway.reloading.ReloadUnpublished` while the store does not answer."""
        try:
            return await self.store.history()
        except CoordinationUnavailable as e:
            raise ReloadUnpublished(f"{e}: the fleet's kept configs cannot be read") from None

    def local(self, config: dict[str, Any]) -> dict[str, Any]:
        """A fleet config (JSON) with this replica's own ``LOCAL_FIELDS`` sections."""
        return with_local(config, self.reloader.gw.cfg.model_dump(mode="json"))

    async def adopt(self, snap: Snapshot) -> None:
        """Run the fleet's config ``snap`` here (module docstring). Never raises."""
        r = self.reloader
        running = r.gw.cfg.model_dump(mode="json")
        differs = file_differs(r.path, snap.digest)
        if differs:
            log.warning("config: the config file %s is not the fleet's current config "
                        "(version %d); running the fleet's. To make the file the fleet's "
                        "config, send SIGHUP to one replica (or POST it to /admin/config)",
                        r.path, snap.version)
        if shared_digest(running) == snap.digest:  # runs here already: numbered alike
            r.number_as(snap.version)
            self.ran(differs=differs)
            return
        try:
            new = config_from_mapping(with_local(snap.config, running),
                                      f"the fleet's config version {snap.version}")
            failed = snap.summary.get("rollout_failed")  # a replica's rollout that failed
            await r.apply(new, "fleet", version=snap.version,
                          failed=failed if isinstance(failed, dict) else None)
        except (ReloadRefused, ConfigError) as e:
            problem = e.problem if isinstance(e, ReloadRefused) else str(e)
            log.error("config (fleet): the fleet's config version %d not applied on this "
                      "replica (it keeps running version %d): %s", snap.version, r.version,
                      problem)
            self.ran(refused=f"version {snap.version}: {problem}", differs=differs)
            return
        self.ran(differs=differs)
