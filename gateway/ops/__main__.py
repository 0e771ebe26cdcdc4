"""``python -m gateway.ops``: write (or ``--check``) the dashboard and the alert rules.

Writes ``<out-dir>/grafana/llm-gateway.json`` (:mod:`gateway.ops.dashboard`) and
``<out-dir>/prometheus/alerts.yaml`` (:mod:`gateway.ops.alerts`), default out-dir
``deploy``; thresholds from ``--config FILE`` (a gateway config, as ``serve`` reads it),
else the config schema's defaults (the committed files). ``--check``: write nothing, exit 1
naming each file that differs from what the generator gives.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from gateway.config import load_config
from gateway.ops.alerts import render_rules
from gateway.ops.dashboard import build_dashboard
from gateway.ops.limits import Limits

DASHBOARD = Path("grafana/llm-gateway.json")
RULES = Path("prometheus/alerts.yaml")


def render_dashboard(lim: Limits) -> str:
    """The dashboard file's text (indented JSON, a final newline)."""
    return json.dumps(build_dashboard(lim), indent=2, ensure_ascii=False) + "\n"


def outputs(lim: Limits, source: str = "the config schema's defaults") -> dict[Path, str]:
    """Each generated file (relative to the out-dir) and its text."""
    return {DASHBOARD: render_dashboard(lim), RULES: render_rules(lim, source)}


def main(argv: list[str] | None = None) -> int:
    """The command; returns the exit status."""
    ap = argparse.ArgumentParser(prog="python -m gateway.ops", description=__doc__)
    ap.add_argument("--config", help="gateway config whose slo / thermal / calibration "
                    "thresholds and status window to use (default: the schema's defaults)")
    ap.add_argument("--out-dir", default="deploy", type=Path)
    ap.add_argument("--check", action="store_true",
                    help="compare with the files in --out-dir, write nothing")
    args = ap.parse_args(argv)
    if args.config:
        lim, source = Limits.from_config(load_config(args.config)), args.config
    else:
        lim, source = Limits.defaults(), "the config schema's defaults"
    stale = []
    for rel, text in outputs(lim, source).items():
        path = args.out_dir / rel
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(str(path))
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path}")
    if stale:
        print("out of date (run python -m gateway.ops): " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
