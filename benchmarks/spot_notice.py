"""Spot notice drill: the next minute's traffic after ``POST /admin/zones/a/notice``.

Issue 15's must-hold, measured over the full minute with the default ``spot:`` settings
(``notice_penalty`` 0.5, ``half_life_s`` 600, so zone a's score recovers from 0.5 to 0.53
during the minute): five simulated vLLM backends behind the gateway (the test's placement,
``tests/lifecycle/test_spot_notice.py``: zone a: spot a1 on node n1, spot a2 on n2, on-demand
a3; zone b: spot b1, on-demand b2), steady load from ``--threads`` ``openai`` SDK clients
(every other one streaming, 4 tokens each). After ``--before`` seconds the notice for node n1
is sent; the load runs ``--after`` seconds more.

Reported (printed, and JSON to ``--out``): requests and failures per phase; a1's drain (notice
sent -> ``cold``, seconds; the bound is the 30 s preemption deadline) and the requests sent after
the notice that reached it (must be 0); a2's share before (5 candidates) and after (4), and
the documented expectation after: each request goes to a2 with probability ``score(t) / 4``
(``gateway/routing/spot.py``), i.e. over a window of ``T`` seconds
``(1 - 0.5 * h / (T ln 2) * (1 - 2^(-T/h))) / 4`` with ``h = half_life_s``; and its binomial
standard deviation. Exit status 1 when a request failed, a1 got one after the notice, its
drain took over 30 s, or a2's share is more than 4 standard deviations off.

Usage::

    python benchmarks/spot_notice.py                      # 30 s before, 60 s after
    python benchmarks/spot_notice.py --before 10 --after 60 --threads 8
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from tests.lifecycle.support import Sim, admin  # noqa: E402
from tests.lifecycle.test_spot_notice import PLACES, SdkLoad, ids, placed  # noqa: E402
from tests.support.servers import GatewayThread, gateway_config  # noqa: E402

DEFAULT_OUT = REPO / "benchmarks" / "results" / "spot_notice.json"


def expected_share(window_s: float, half_life_s: float, n: int = 4) -> float:
    """a2's expected share over ``window_s`` seconds after one notice (score 0.5 at 0)."""
    h, t = half_life_s, window_s
    mean_score = 1 - 0.5 * h / (t * math.log(2)) * (1 - 2 ** (-t / h))
    return mean_score / n


def run(before_s: float, after_s: float, threads: int) -> dict[str, Any]:
    sims = {k: Sim(k, itl_s=0.005) for k in PLACES}
    gw = GatewayThread(gateway_config(placed({k: s.url for k, s in sims.items()})))
    gw.start(wait_ready=False)
    try:
        gw.wait_ready(timeout=30, routable=len(sims))
        load = SdkLoad(gw.url, threads)
        time.sleep(2.0)  # connections open, rates steady
        a2_start = sims["a2"].chat_requests()
        load.phase = "before"
        time.sleep(before_s)
        a2_mid = sims["a2"].chat_requests()
        noticed = time.time()  # sent (the drain starts before the answer)
        r = httpx.post(gw.url + "/admin/zones/a/notice", json={"node": "n1"}, timeout=10)
        load.phase = "after"
        r.raise_for_status()
        time.sleep(after_s)
        a2_end = sims["a2"].chat_requests()
        load.stop()
        hist = admin(gw.url, "a1")["history"]
        cold = [t["at"] for t in hist if (t["from"], t["to"]) == ("draining", "cold")]
        zones = httpx.get(gw.url + "/admin/zones").json()["zones"]
        half_life = gw.cfg.spot.half_life_s
        n_after = load.count("after")
        p = expected_share(after_s, half_life)
        return {
            "threads": threads,
            "before_s": before_s,
            "after_s": after_s,
            "half_life_s": half_life,
            "requests": {"before": load.count("before"), "after": n_after},
            "failures": load.failures,
            "notice": r.json(),
            "a1_drain_s": round(cold[-1] - noticed, 3) if cold else None,
            "a1_after_notice": sorted(ids(sims["a1"], "after")),
            "a2_share_before": round((a2_mid - a2_start) / max(1, load.count("before")), 4),
            "a2_share_after": round((a2_end - a2_mid) / max(1, n_after), 4),
            "a2_expected_after": round(p, 4),
            "a2_expected_sd": round(math.sqrt(p * (1 - p) / max(1, n_after)), 4),
            "zone_scores_at_end": {z["zone"]: z["score"] for z in zones},
        }
    finally:
        gw.stop()
        for s in sims.values():
            s.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", type=float, default=30.0, help="seconds of load before")
    ap.add_argument("--after", type=float, default=60.0, help="seconds of load after")
    ap.add_argument("--threads", type=int, default=4, help="client threads")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    res = run(args.before, args.after, args.threads)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2))
    print(json.dumps({k: v for k, v in res.items() if k != "notice"}, indent=2))
    off = abs(res["a2_share_after"] - res["a2_expected_after"]) > 4 * res["a2_expected_sd"]
    bad = (res["failures"] or res["a1_after_notice"] or res["a1_drain_s"] is None
           or res["a1_drain_s"] > 30.0 or off)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
