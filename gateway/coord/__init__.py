"""Fleet mode: several gateway replicas acting as one over a shared store (Redis / Valkey).

Built only when ``coordination.redis_url`` is set (:class:`gateway.coord.coordination.
Coordination`); without it nothing here is imported on the request path and the gateway is
the one-process default. Each module has one job: :mod:`~gateway.coord.link` (the bounded,
fault-counting connection), :mod:`~gateway.coord.replicas` (who is alive), and the parts that
share one kind of state each (``docs/architecture.md``, "Fleet mode").
"""
