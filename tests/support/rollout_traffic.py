"""Canary rollout tests' helpers (issue 18): simulated servers of two model versions, each
known by its ``system_fingerprint``, and clients on the ``openai`` SDK that keep the version
of every answer (tests/lifecycle/test_rollouts.py, tests/fleet/test_rollouts_fleet.py)."""

from __future__ import annotations

import threading
from typing import Any

import openai

from gateway.config import FaultConfig
from gateway.sim import EngineParams, ReleaseConfig, SimConfig, SimServerThread
from tests.support.servers import gateway_config

MODEL = "m1"
# a prefill step (TTFT) well above the machine's jitter; short decode steps
ENGINE = EngineParams(prefill_base_s=0.03, prefill_per_token_s=0.0, itl_base_s=0.004,
                      itl_per_seq_s=0.0, max_num_seqs=64)
FAST_STEPS: dict[str, Any] = {"min_step_s": 0.3, "min_step_requests": 40, "recheck_s": 0.2,
                              "max_step_s": 60, "min_requests": 40, "min_samples": 20,
                              "calibration": {"interval_s": 0.1, "min_probes": 10}}

LOOSE_GATES: dict[str, Any] = {"gates": {"p50_tolerance": 1.0, "p99_tolerance": 2.0}}
"""Gates for a rollout test whose subject is not latency (a capacity hold, what follows a
rollback) but which needs its good canary to pass: these simulators, the gateway and the
clients share one process and one GIL, and on a loaded 2-core machine a lone canary
server's TTFT / ITL was measured up to x1.2-1.5 its pool's (ITL P50 x1.36, TTFT P99 x1.53)
with no build difference, which the default gates call inconclusive until ``max_step_s``.
The latency tests themselves keep the default gates."""


def config(backends: list[dict[str, Any]], **sections: Any) -> Any:
    """The test config: short calibration answers (4 tokens: a probe round is 6 of them)."""
    return gateway_config(backends, calibration={"max_tokens": 4}, **sections)


class Servers:
    """Simulated servers by name: (thread, url, version)."""

    def __init__(self) -> None:
        self.threads: list[SimServerThread] = []
        self.version_of: dict[str, str] = {}  # system_fingerprint -> version
        self.backends: list[dict[str, Any]] = []

    def add(self, name: str, version: str | None, model: str = MODEL,
            faults: dict[str, Any] | None = None, **release: Any) -> str:
        """Start server ``name`` of ``model`` at ``version`` (None: a backend without
        ``model_version``, known as version ""); ``faults``: its ``FaultConfig`` fields,
        ``release``: its ``ReleaseConfig`` fields."""
        t = SimServerThread(SimConfig(model=model, engine_label=name, engine=ENGINE,
                                      release=ReleaseConfig(**release),
                                      faults=FaultConfig(**(faults or {}))))
        url = t.start()
        self.threads.append(t)
        self.version_of[t.state.fingerprint] = version or ""
        backend: dict[str, Any] = {"id": name, "url": url, "models": [model]}
        if version is not None:
            backend["model_version"] = version
        self.backends.append(backend)
        return url

    def stop(self) -> None:
        for t in self.threads:
            t.stop()


class Traffic:
    """``clients`` threads sending short chat requests for ``model`` (every other one
    streamed) until :meth:`stop`; a request of client ``i`` carries session ``s<i>-<k>``
    every third time, each client pausing ``pause_s`` seconds after each answer (0: none;
    to set a request rate). Keeps every failure and the version of every answer by
    session."""

    def __init__(self, url: str, clients: int = 6, model: str = MODEL,
                 pause_s: float = 0.0) -> None:
        self.pause_s = pause_s
        self.failures: list[str] = []
        self.versions: list[str] = []  # fingerprints, in order
        self.sessions: dict[str, list[str]] = {}  # fingerprints in order
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(url, i, model), daemon=True)
                         for i in range(clients)]
        for t in self._threads:
            t.start()

    def _run(self, url: str, i: int, model: str) -> None:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                               timeout=30)
        n = 0
        while not self._stop.is_set():
            n += 1
            session = f"s{i}-{n % 4}" if n % 3 == 0 else None
            headers = {"x-session-id": session} if session else {}
            try:
                kwargs: dict[str, Any] = {
                    "model": model, "messages": [{"role": "user", "content": f"hi {i} {n}"}],
                    "max_tokens": 4, "temperature": 0, "extra_body": {"ignore_eos": True},
                    "extra_headers": headers}
                if n % 2:
                    stream = client.chat.completions.create(stream=True, **kwargs)
                    fps = {c.system_fingerprint for c in stream if c.system_fingerprint}
                    assert len(fps) == 1, fps
                    fp = fps.pop()
                else:
                    fp = client.chat.completions.create(**kwargs).system_fingerprint or ""
            except Exception as e:  # every failure a client sees is kept
                with self._lock:
                    self.failures.append(f"{type(e).__name__}: {e}")
                continue
            with self._lock:
                self.versions.append(fp)
                if session:
                    self.sessions.setdefault(session, []).append(fp)
            if self.pause_s:
                self._stop.wait(self.pause_s)
        client.close()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)

