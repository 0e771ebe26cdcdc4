"""The session's real vLLM servers: ``a`` (plain), ``b`` (with ``--api-key``), both with 4096
positions, and ``embed`` (the same model served as an embedding model); and, for the kill
drill only, a ``victim`` (:func:`make_victim`).

They take about two minutes of CPU to boot on two cores. When the session will run a test
under ``tests/realvllm``, :func:`launch_early` starts them as soon as collection is done,
at niceness 19: they boot on the CPU the rest of the suite leaves idle (most tests wait on
sockets and timers), without slowing its timing-sensitive tests, and are ready (or nearly)
when the first real-vLLM test asks for them. The ``real_vllm`` fixture waits for them
(``START_TIMEOUT_S`` from when it starts waiting) and stops them at the end."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from tests.support.vllm import (
    VllmServer,
    default_vllm_venv,
    ensure_tiny_model,
    vllm_unavailable_reason,
)

BACKEND_KEY = "backend-secret"
# vLLM keeps Responses API objects (for ``previous_response_id`` and GET by id) only with this
RESPONSES_STORE = {"VLLM_ENABLE_RESPONSES_API_STORE": "1"}
EARLY: pytest.StashKey[dict[str, VllmServer]] = pytest.StashKey()
# ``a`` and ``b`` take 4096 positions (the tiny model's config says 1024; random weights do not
# care): long enough generations (1500 tokens: ~6 s for 8 streams on 2 cores) to be still open
# at a 2 s drain deadline (tests/realvllm/test_continuation_drain_real_vllm.py)
LONG_CONTEXT = 4096
LONG_ARGS = ["--max-model-len", str(LONG_CONTEXT)]
LONG_ENV = {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1", "KV_BYTES": "256M"}
VICTIM_EARLY: pytest.StashKey[VllmServer] = pytest.StashKey()
VICTIM_TESTS = "tests/realvllm/test_continuation_real_vllm.py"
"""The tests that SIGKILL a server of their own (the session's ``a`` is never killed)."""
VICTIM_ARGS = ("--max-num-seqs", "32", "--stream-interval", "2")
"""The victim's extra vLLM arguments: room for all 32 streams of the kill drill at once
(the drill kills it while every stream is mid-generation, so none may wait in its queue);
two tokens per stream event (vLLM's ``--stream-interval``: what a lagging server does
anyway, made certain), so that a continuation must count tokens by their ids. It also runs
without ``FAST`` (its engine core a process of its own), so that the drill can stop the
engine while the 32 requests arrive and continue it once all are queued: they then start
in the same step (with the engine inside the API server's process, a loaded machine let
the first stream finish before the API server had passed on the others)."""


def make_servers(venv: Path, logs: Path, nice: int = 0) -> dict[str, VllmServer]:
    """The three servers (not launched), logging under ``logs``."""
    model = ensure_tiny_model(venv)
    return {
        "a": VllmServer(venv, model, log_path=logs / "a.log", env=RESPONSES_STORE | LONG_ENV,
                        extra_args=LONG_ARGS, nice=nice),
        "b": VllmServer(venv, model, api_key=BACKEND_KEY, log_path=logs / "b.log",
                        env=RESPONSES_STORE | LONG_ENV, extra_args=LONG_ARGS, nice=nice),
        "embed": VllmServer(venv, model, log_path=logs / "embed.log", nice=nice,
                            extra_args=["--runner", "pooling", "--convert", "embed"]),
    }


def make_victim(venv: Path, logs: Path, nice: int = 0) -> VllmServer:
    """The kill drill's own server (not launched): the same model as ``a``, with
    :data:`VICTIM_ARGS`."""
    return VllmServer(venv, ensure_tiny_model(venv), log_path=logs / "victim.log", nice=nice,
                      extra_args=VICTIM_ARGS, fast=False)


def launch_early(session: pytest.Session) -> None:
    """Launch the servers in the background (niceness 19) if a collected test will use
    them and vLLM is installed; the ``real_vllm`` fixture picks them up (and the
    ``victim_vllm`` fixture the victim, launched only when a test of
    :data:`VICTIM_TESTS` was collected)."""
    if not any(item.nodeid.startswith("tests/realvllm/") for item in session.items):
        return
    venv = default_vllm_venv()
    if vllm_unavailable_reason(venv):
        return  # the fixture skips with the reason
    logs = Path(tempfile.mkdtemp(prefix="vllm-logs-"))
    servers = make_servers(venv, logs, nice=19)
    if any(item.nodeid.startswith(VICTIM_TESTS) for item in session.items):
        session.config.stash[VICTIM_EARLY] = make_victim(venv, logs, nice=19)
    try:
        for s in servers.values():
            s.launch()
        if VICTIM_EARLY in session.config.stash:
            session.config.stash[VICTIM_EARLY].launch()
    except BaseException:
        for s in servers.values():
            s.stop()
        if VICTIM_EARLY in session.config.stash:
            session.config.stash[VICTIM_EARLY].stop()
        raise
    session.config.stash[EARLY] = servers


def stop_early(session: pytest.Session) -> None:
    """Stop servers launched early that no fixture took (e.g. the session was cut short)."""
    for s in session.config.stash.get(EARLY, {}).values():
        s.stop()
    victim = session.config.stash.get(VICTIM_EARLY, None)
    if victim is not None:
        victim.stop()
