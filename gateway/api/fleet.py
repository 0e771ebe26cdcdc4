"""``GET /admin/fleet``'s view of the fleet (fleet mode, issue 14), as this replica sees it.

Built only from what the ``coordination`` loop left in memory (:class:`gateway.coord.link.
RedisLink`'s ``up`` / ``reason``, :class:`gateway.coord.replicas.Replicas`' ``live``, the
maintenance leases' ``snapshot()``): no store call, so it answers the same, and says why,
while the store is down. The route itself sits at the end of :mod:`gateway.api.admin`,
behind the admin key.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gateway.core.urls import redacted_url

if TYPE_CHECKING:
    from gateway.wiring import Gateway

FLEET_MODE_OFF = (
    "fleet mode is off: this gateway is one process with its state in memory; set "
    "coordination.redis_url (or LLM_GATEWAY_COORDINATION__REDIS_URL) to share it with "
    "other replicas"
)


def fleet_summary(gw: Gateway) -> dict[str, Any]:
    """This replica's view of the fleet. ``fleet_mode``; ``replica_id`` (this one);
    ``namespace``; ``store``: ``url`` (password hidden), ``up``, ``fallback`` (running on the
    local share), ``reason`` (why, while down), ``down_for_s``; ``replicas_alive``;
    ``replicas``: the live ones as last read, sorted by id (``id``, ``self``, ``host``,
    ``pid``, ``listen``, ``started`` (unix s), ``last_seen`` (unix s, the store's clock),
    ``last_seen_s_ago``, ``config_differs``: what its config disagrees on with this one's
    about the shared backends, or null; ``config_version``: the config version it runs,
    ``config_refused``: why it does not run the fleet's current config (a live reload it
    refused, :mod:`gateway.coord.config_sync`), or null; ``config_file_differs``: its config
    file is not the fleet's config); ``config``: ``running_version`` (this replica's) and
    ``fleet_version`` (the fleet's current, as last read); ``leases``: the maintenance
    leases (``backend``, ``holder``, ``cycle``, ``phase``, ``expires_in_s``) from
    ``gw.coord.leases`` when that part is built, else empty. Without fleet mode:
    ``fleet_mode`` false and a ``message``."""
    coord = gw.coord
    if coord is None:
        return {"fleet_mode": False, "replica_id": None, "message": FLEET_MODE_OFF,
                "store": None, "replicas": [], "leases": []}
    link = coord.link
    now = link.now()
    replicas = [
        {
            "id": r.id,
            "self": r.id == link.replica_id,
            "host": r.info.get("host"),
            "pid": r.info.get("pid"),
            "listen": r.info.get("listen"),
            "started": r.info.get("started"),
            "last_seen": round(r.seen_at, 3),
            "last_seen_s_ago": round(max(0.0, now - r.seen_at), 3),
            "config_differs": coord.replicas.differences.get(r.id),
            "config_version": r.info.get("config_version"),
            "config_refused": r.info.get("config_refused"),
            "config_file_differs": r.info.get("config_file_differs"),
        }
        for r in sorted(coord.replicas.live, key=lambda r: r.id)
    ]
    leases = getattr(coord, "leases", None)  # the maintenance part's, once it is built
    return {
        "fleet_mode": True,
        "replica_id": link.replica_id,
        "namespace": link.cfg.namespace,
        "store": {
            "url": redacted_url(link.cfg.redis_url or ""),
            "up": link.up,
            "fallback": link.fallback,
            "reason": link.reason or None,
            "down_for_s": round(link.down_for_s(), 3),
        },
        "replicas_alive": coord.replicas.alive,
        "config": {
            "running_version": gw.reloader.version if gw.reloader is not None else None,
            "fleet_version": coord.config.fleet_version if coord.config is not None else None,
        },
        "replicas": replicas,
        "leases": list(leases.snapshot()) if leases is not None else [],
    }
