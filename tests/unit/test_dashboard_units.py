"""Every dashboard panel draws one unit on its axis (issue 19, finding 8): each query's unit
is read off the Prometheus base-unit suffix of the metrics it names (naming practice:
https://prometheus.io/docs/practices/naming/), and must be the panel's Grafana unit. A
panel mixing, say, a count and bytes on one axis fails here."""

from __future__ import annotations

import re

from gateway.ops.dashboard import rows
from gateway.ops.limits import Limits

SUFFIX_UNIT = {"seconds": "s", "bytes": "bytes", "celsius": "celsius", "watts": "watt",
               "ratio": "percentunit", "cost": "currency"}
COUNTS = {"short", "reqps"}  # counts, rates of counts, money and compound units
METRIC = re.compile(r"\b((?:gateway|process)_[a-z_]+)")
# a metric used only to pick series (a join for a label, a filter), not drawn
FILTERS = re.compile(r"(?:\b(?:and|unless) on \([^)]*\) \w+"
                     r"|\* on \([^)]*\) group_left \([^)]*\) \(\w+ == 1\))")


def target_unit(expr: str) -> str:
    """The Grafana unit of one query: the base unit its drawn metrics share; a quotient
    of two metrics of one unit is a ratio (``percentunit``), of two units a compound
    (drawn as a count); no unit suffix: a count."""
    drawn = FILTERS.sub("", expr)
    units = set()
    for name in METRIC.findall(drawn):
        base = re.sub(r"_(total|bucket|count|sum|info)$", "", name)
        suffix = base.rsplit("_", 1)[-1]
        units.add(SUFFIX_UNIT.get(suffix, "count"))
    if ") / " in drawn and "histogram_quantile" not in drawn:
        return "percentunit" if len(units) == 1 else "count"
    assert len(units) == 1, f"one query, several units {units}: {expr}"
    unit = units.pop()
    return "count" if unit == "currency" else unit


def test_each_panel_s_queries_share_the_panel_s_unit() -> None:
    wrong = []
    for row in rows(Limits.defaults()):
        for p in row.panels:
            for t in p.targets:
                unit = target_unit(t.expr)
                ok = p.unit in COUNTS if unit == "count" else p.unit == unit
                if not ok:
                    wrong.append(f"{p.title!r} ({p.unit}): {unit} in {t.expr}")
    assert not wrong, "\n".join(wrong)
