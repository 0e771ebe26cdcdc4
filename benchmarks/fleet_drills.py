"""Issue 14's fleet-mode drills at their full length (the suite runs them shorter).

Runs, with ``FLEET_DRILLS=full`` (``tests/fleet/drills.py``), the tests whose must-hold
figures need minutes: three replicas under load for 120 s with fast maintenance cycles, 600
requests per minute through three replicas for 60 s, a TPM limit for 20 s, the store stopped
for 10 s under a 120 rpm limit, 3x overload for 30 s (twice), and the store stopped for 20 s
under load. Each prints its figures (``-s``);
pytest's own summary says whether every bound held. Needs ``redis-server`` on PATH.

    python benchmarks/fleet_drills.py            # all (about 6 minutes)
    python benchmarks/fleet_drills.py -k 600_rpm # one
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DRILLS = [
    "tests/fleet/test_maintenance_leases.py::"
    "test_three_replicas_under_load_take_one_backend_out_at_a_time_and_reset_it_once_per_cycle",
    "tests/fleet/test_global_limits.py::"
    "test_600_rpm_over_three_replicas_admits_at_most_the_bound_in_a_minute",
    "tests/fleet/test_global_limits.py::test_tpm_is_global_and_charged_the_reported_usage",
    "tests/fleet/test_global_limits.py::"
    "test_redis_stopped_mid_load_keeps_answering_on_the_local_share",
    "tests/fleet/test_capacity_shares.py",
    "tests/fleet/test_store_faults.py",
]


def main() -> int:
    """Run the drills; returns pytest's exit status."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-k", default=None, help="pytest -k expression: only these drills")
    args = ap.parse_args()
    cmd = [sys.executable, "-m", "pytest", "-s", "-p", "no:cacheprovider", *DRILLS]
    if args.k:
        cmd += ["-k", args.k]
    env = {**os.environ, "FLEET_DRILLS": "full"}
    return subprocess.call(cmd, cwd=ROOT, env=env)


if __name__ == "__main__":
    raise SystemExit(main())
