"""What operators look at (issue 19), built from code: the Grafana dashboard
(:mod:`gateway.ops.dashboard`) and the Prometheus alert rules (:mod:`gateway.ops.alerts`),
written to ``deploy/grafana/llm-gateway.json`` and ``deploy/prometheus/alerts.yaml`` by
``python -m gateway.ops`` (:mod:`gateway.ops.__main__`). Declarative: no I/O but the
command's file writes; the thresholds come from the config schema (``slo``, ``thermal``,
``calibration``), so ``--config`` regenerates the rules for a fleet's own SLO."""
