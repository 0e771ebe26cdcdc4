"""``/status.json``'s facts as one HTML page (no script): plain semantic HTML (header,
sections, definition lists, a table), a viewport meta tag and CSS that lays it out in one
column on a phone; every value escaped. The page reloads itself every 30 s
(``<meta http-equiv="refresh">``).

Order on the page, as users feel it: the overall words (and what they mean), then each
model's availability and performance (every figure with its sample; one on too few
samples says so, with the count and the minimum), its last hour's words, then the fleet
(degraded mode, backends by serving state and tier, cooldowns), then the incidents.
"""

from __future__ import annotations

import time
from html import escape
from typing import Any

from gateway.traffic.status_verdict import too_few

_CSS = """
:root{color-scheme:light dark;font-family:system-ui,-apple-system,sans-serif}
body{margin:0 auto;max-width:60rem;padding:1rem;line-height:1.4}
h1{font-size:1.4rem;margin:0 0 .5rem}h2{font-size:1.15rem;margin:1.5rem 0 .5rem}
h3{font-size:1rem;margin:0 0 .25rem}
.words{display:inline-block;padding:.35rem .8rem;border-radius:.4rem;font-weight:600;
font-size:1.2rem}
.operational{background:#1b7f3b;color:#fff}.degraded-performance{background:#8a5a00;color:#fff}
.partial-outage{background:#c2410c;color:#fff}.major-outage{background:#b3261e;color:#fff}
.small{font-size:.85rem;padding:.1rem .4rem}
article{border:1px solid #8886;border-radius:.5rem;padding:.75rem;margin:.5rem 0}
dl{display:grid;grid-template-columns:max-content 1fr;gap:.2rem .75rem;margin:.5rem 0}
dt{font-weight:600}dd{margin:0}
.table{overflow-x:auto}table{border-collapse:collapse;width:100%}
th,td{text-align:left;padding:.3rem .5rem;border-bottom:1px solid #8886}
ol{padding-left:1.2rem}
@media (max-width:40rem){dl{grid-template-columns:1fr}dt{margin-top:.3rem}}
"""


def _cls(words: str) -> str:
    return words.replace(" ", "-")


def _when(unix_s: float) -> str:
    """Unix seconds as ``YYYY-MM-DD HH:MM:SS UTC``."""
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(unix_s))


def _time(unix_s: float) -> str:
    iso = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(unix_s))
    return f'<time datetime="{iso}">{escape(_when(unix_s))}</time>'


def _p99(v: float | None, count: int, unit: str, minimum: int) -> str:
    """A P99 with its sample: ``0.42 s (37 streams)``; on too few, the figure and
    ``over 3 streams: too few to judge (20 needed)``; none: ``no streams (20 needed to
    judge)``."""
    if v is None or count <= 0:
        return f"no {unit} ({minimum} needed to judge)"
    if count < minimum:
        return f"{v:.3g} s over {too_few(count, unit, minimum)}"
    return f"{v:.3g} s ({count} {unit})"


def _share(v: float | None, requests: int, failed: int, minimum: int) -> str:
    """An answered share with its sample: ``65.00 % (14 of 40 requests failed)``."""
    if v is None or requests <= 0:
        return f"no requests ({minimum} needed to judge)"
    figure = f"{v * 100:.2f} %"
    if requests < minimum:
        return f"{figure} over {too_few(requests, 'requests', minimum)}"
    return f"{figure} ({failed} of {requests} requests failed)"


def _window(seconds: float) -> str:
    return f"{seconds / 60:g} min" if seconds >= 60 else f"{seconds:g} s"


def _words(words: str, small: bool = False) -> str:
    extra = " small" if small else ""
    return f'<span class="words {_cls(words)}{extra}">{escape(words)}</span>'


def _model(m: dict[str, Any], view: dict[str, Any]) -> str:
    a, p, slo, n = m["availability"], m["performance"], view["slo"], view["min_samples"]
    now = _window(view["windows_s"]["now"])
    reasons = "".join(f"<li>{escape(r)}</li>" for r in m["reasons"])
    hour = m["last_hour"]
    hour_why = "; ".join(hour["reasons"])
    return (
        f'<article><h3>{escape(m["model"])} {_words(m["status"])}</h3>'
        + (f"<ul>{reasons}</ul>" if reasons else "")
        + "<dl>"
        f'<dt>Backends that can serve it</dt><dd>{a["routable_backends"]} of {a["backends"]}</dd>'
        f'<dt>Answered without an error</dt><dd>'
        f'{escape(_share(a["answered_share_now"], a["requests_now"], a["failed_now"], n))} '
        f'(last {now}), '
        f'{escape(_share(a["answered_share_hour"], a["requests_hour"], a["failed_hour"], n))} '
        "(last hour)</dd>"
        f'<dt>P99 TTFT (SLO {slo["ttft_s"]:g} s)</dt><dd>'
        f'{escape(_p99(p["ttft_p99_now_s"], p["streams_now"], "streams", n))} (last {now}), '
        f'{escape(_p99(p["ttft_p99_hour_s"], p["streams_hour"], "streams", n))} (last hour)</dd>'
        f'<dt>P99 ITL (SLO {slo["itl_s"]:g} s)</dt><dd>'
        f'{escape(_p99(p["itl_p99_now_s"], p["itl_samples_now"], "inter-token gaps", n))} '
        f'(last {now}), '
        f'{escape(_p99(p["itl_p99_hour_s"], p["itl_samples_hour"], "inter-token gaps", n))} '
        "(last hour)</dd>"
        f'<dt>Last hour</dt><dd>{_words(hour["status"], small=True)}'
        + (f" {escape(hour_why)}" if hour_why else "")
        + "</dd></dl></article>"
    )


def _fleet(view: dict[str, Any]) -> str:
    level = view["degraded_mode_level"]
    rows = "".join(
        f'<tr><td>{escape(b["id"])}</td><td>{escape(b["state"])}</td>'
        f'<td>{escape(b["tier"])}</td><td>{escape(", ".join(b["models"]))}</td>'
        f'<td>{escape(b["maintenance"] or "")}</td></tr>'
        for b in view["backends"]
    )
    counts = ", ".join(f"{n} {escape(s)}" for s, n in sorted(view["backend_states"].items()))
    tiers = ", ".join(f"{n} {escape(s)}" for s, n in sorted(view["backend_tiers"].items()))
    cd = view["cooldowns"]
    running = (", ".join(escape(b) for b in cd["running"]) or
               (f'{cd["running_count"]} backend(s)' if cd.get("running_count") else "none"))
    nxt = cd["next"]
    scheduled = ("none scheduled" if nxt is None else
                 f'{escape(nxt["backend"] or "a backend")} in {nxt["in_s"]:g} s '
                 f'({escape(nxt["cycle"])} cycle)')
    hidden = ("" if view.get("details", True) else
              '<tr><td colspan="5">Backend details are shown to loopback clients and the '
              "admin key's holders (status.public_details).</td></tr>")
    return (
        '<section id="fleet"><h2>Fleet</h2><dl>'
        f'<dt>Degraded mode</dt><dd>{"off" if level is None else f"level {level}"}</dd>'
        f"<dt>Backends by state</dt><dd>{counts or 'none'}</dd>"
        f"<dt>By thermal tier</dt><dd>{tiers or 'none'}</dd>"
        f"<dt>Cooldowns running</dt><dd>{running}</dd>"
        f"<dt>Next cooldown</dt><dd>{scheduled}</dd></dl>"
        '<div class="table"><table><thead><tr><th>Backend</th><th>State</th><th>Tier</th>'
        f"<th>Models</th><th>Maintenance</th></tr></thead><tbody>{rows}{hidden}</tbody>"
        "</table></div>"
        "</section>"
    )


def _incidents(view: dict[str, Any]) -> str:
    items = "".join(
        f'<li>{_time(i["at"])}: {escape(i["kind"].replace("_", " "))}'
        + (f', {escape(i["subject"])}' if i["subject"] is not None else "")
        + (f': {escape(i["detail"])}' if i["detail"] is not None else "") + "</li>"
        for i in view["incidents"]
    )
    return ('<section id="incidents"><h2>Recent incidents</h2>'
            + (f"<ol>{items}</ol>" if items else "<p>None.</p>") + "</section>")


def render_html(view: dict[str, Any]) -> str:
    """The page for ``view`` (:func:`gateway.api.status.status_view`'s dict)."""
    words = view["status"]
    models = "".join(_model(m, view) for m in view["models"]) or "<p>No model is served.</p>"
    n, t = view["min_samples"], view["availability_thresholds"]
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        '<meta http-equiv="refresh" content="30">'
        f"<title>llm-gateway: {escape(words)}</title><style>{_CSS}</style></head><body>"
        f'<header><h1>llm-gateway status</h1><p id="overall" class="words {_cls(words)}">'
        f"{escape(words)}</p><p>As of {_time(view['generated_at'])}.</p>"
        f"<p>Partial outage: under {t['partial_outage_below'] * 100:g} % of a model's "
        f"requests answered without an error; major outage: under "
        f"{t['major_outage_below'] * 100:g} %, or no backend can serve it. A figure is "
        f"judged on {n} requests, streams or inter-token gaps or more.</p></header>"
        f'<main><section id="models"><h2>Models</h2>{models}</section>'
        f"{_fleet(view)}{_incidents(view)}</main></body></html>"
    )
