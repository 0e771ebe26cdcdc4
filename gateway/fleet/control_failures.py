"""How the gateway reports failed calls to the agents' GPU control endpoints (issue 21):
once per backend per change of state, not at every GPU round, with a hint for the mistake a
new fleet makes most (a token the agent refuses). Used by
:class:`gateway.fleet.clock_driver.ClockDriver`, which still counts every failure in
``gateway_clock_control_errors_total``."""

from __future__ import annotations

import logging

import httpx

log = logging.getLogger("gateway.fleet.clocks")


def failure_kind(e: Exception) -> str:
    """A short name of what failed: ``HTTP 401`` for an answer, else the exception's type
    (``ConnectError``, ``ValueError``...): the state whose change is logged."""
    if isinstance(e, httpx.HTTPStatusError):
        return f"HTTP {e.response.status_code}"
    return type(e).__name__


def in_range(value: float, lo: float, hi: float) -> float:
    """``value`` rounded to a whole number, then kept within the agent's ``[lo, hi]`` (the
    endpoint refuses a value outside the GPU's supported range instead of clamping it;
    rounding must not push one out, e.g. 100.4 W of a 100.4-700 W range)."""
    return min(hi, max(lo, float(round(value))))


class ControlFailures:
    """The failure state of each backend's control endpoint; ``token_env`` names the
    variable holding the token (``thermal.clocks.agent_token_env``)."""

    def __init__(self, token_env: str) -> None:
        self.token_env = token_env
        self._state: dict[str, tuple[str, str]] = {}  # backend -> (what, failure kind)

    def failed(self, backend_id: str, what: str, e: Exception) -> None:
        """A call (``what``: read, set, power limit) failed: logged when the backend's
        state changes (that call answered before, or failed another way), else at DEBUG."""
        kind = failure_kind(e)
        if self._state.get(backend_id) == (what, kind):
            log.debug("backend %s: GPU control %s failed again: %s", backend_id, what, e)
            return
        self._state[backend_id] = (what, kind)
        if kind in ("HTTP 401", "HTTP 403"):
            log.error(
                "backend %s: its agent refuses the gateway's GPU control token (%s): set %s "
                "(thermal.clocks.agent_token_env) to the token the agent was started with "
                "(llm-gateway agent --control-token, or the simulator's gpu.control_token); no "
                "clock caps or power limits on this backend until then (logged once; "
                "gateway_clock_control_errors_total counts every failure)",
                backend_id,
                kind,
                self.token_env,
            )
            return
        log.warning(
            "backend %s: GPU control %s failed: %s: %s (logged once until it changes; "
            "gateway_clock_control_errors_total counts every failure)",
            backend_id,
            what,
            type(e).__name__,
            e,
        )

    def answered(self, backend_id: str, what: str) -> None:
        """A call ``what`` succeeded: logged when that call had been failing (a read that
        succeeds does not end a failing set's state, so a set refused every round is
        logged once, not at every round's read)."""
        was = self._state.get(backend_id)
        if was is not None and was[0] == what:
            del self._state[backend_id]
            log.info("backend %s: GPU control %s works again (was %s)", backend_id, what, was[1])

    def forget(self, backend_id: str) -> None:
        """The backend left the fleet or this replica stopped driving: no state kept."""
        self._state.pop(backend_id, None)
