"""A simulated vLLM server in a process of its own, for the drills whose every part would
otherwise run in the test's process.

Every server a test starts in a thread (simulators, gateway replicas) shares the test's
interpreter and its GIL: however many cores the machine has, they all run on one. Measured on
the 2-core CI machine's twin: the 3-replica overload drill of
``tests/fleet/test_capacity_shares.py`` held its process at 97-100 % of one core with the
other half idle, so a client, a replica or a simulator waited for the others' turns and the
latencies it measured were the interpreter's queue as much as the system's. A
:class:`SimProcess` is the same simulator as :class:`tests.lifecycle.support.Sim` (same
config: model ``m1``, ``engine_label`` its name, a decode step of ``itl_s``) on its own
interpreter; the OS spreads the processes over the cores.

The child reads its spec from argv, prints its URL on stdout and serves until its stdin
closes: the test ending or dying ends it (no orphan).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]


class SimProcess:
    """``SimProcess(name, itl_s, max_num_seqs, **SimConfig fields)``: started and serving
    when the constructor returns (``url``). ``engine_load()``: its engine's running plus
    waiting requests, as it counts them. ``stop()`` ends it (idempotent)."""

    def __init__(self, name: str, itl_s: float = 0.01, max_num_seqs: int = 16,
                 **config: Any) -> None:
        self.name = name
        spec = json.dumps({"name": name, "itl_s": itl_s, "max_num_seqs": max_num_seqs,
                           "config": config})
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.sim_process", spec],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT, env=env, text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if not line.startswith("http://"):
            self.stop()
            raise RuntimeError(f"simulator {name} did not start: {line!r}")
        self.url = line

    def stats(self, client: httpx.Client | None = None) -> dict[str, Any]:
        """``GET /sim/stats`` (through ``client`` when given: a kept-alive connection)."""
        r = (client or httpx).get(self.url + "/sim/stats", timeout=5)
        return r.json()  # type: ignore[no-any-return]

    def engine_load(self, client: httpx.Client | None = None) -> int:
        """Requests its engine holds now, running plus waiting."""
        engine = self.stats(client)["engine"]
        return int(engine["running"]) + int(engine["waiting"])

    def stop(self) -> None:
        if self.proc.poll() is not None:
            return
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.close()  # the child's cue to stop
            self.proc.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(5)


def _main(spec_json: str) -> None:
    from gateway.sim import SimConfig, SimServerThread
    from gateway.sim.engine import EngineParams
    from tests.lifecycle.support import MODEL

    spec = json.loads(spec_json)
    engine = EngineParams(itl_base_s=spec["itl_s"], itl_per_seq_s=0.0,
                          max_num_seqs=spec["max_num_seqs"])
    config = SimConfig(model=MODEL, engine_label=spec["name"], engine=engine,
                       **spec["config"])
    server = SimServerThread(config)
    print(server.start(), flush=True)
    try:
        sys.stdin.read()  # until the parent closes it (or dies)
    finally:
        server.stop()


if __name__ == "__main__":
    _main(sys.argv[1])
