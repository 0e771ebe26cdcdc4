"""The GPU control endpoint (issue 21): one protocol for ``llm-gateway agent`` and the simulator.

The gateway caps a backend's SM clocks and power limit through the host's agent (the
simulator serves the same endpoint for its simulated GPUs). Transport-free and pure: the
agent's HTTP server and the simulator's FastAPI route both call :meth:`ControlService.handle`
with the method, path, bearer token, JSON body and the time (monotonic seconds), and send back
the status and JSON it returns. What acts is a :class:`GpuActuator` (NVML on a GPU host:
``nvmlDeviceSetGpuLockedClocks`` / ``nvmlDeviceResetGpuLockedClocks`` /
``nvmlDeviceSetPowerManagementLimit``; :class:`gateway.sim.thermal.GpuThermal` in the
simulator).

Routes (JSON; every request needs ``Authorization: Bearer <token>``):

==========  =====================================  ===============================================
method      path                                   body / effect
==========  =====================================  ===============================================
GET         ``/control``                           every GPU's state (below); counts as contact
POST        ``/control/gpus/{i}/clocks``           ``{"max_mhz": 1500, "min_mhz": 210}`` (MHz;
                                                   ``min_mhz`` optional: the lowest supported);
                                                   within the supported range
DELETE      ``/control/gpus/{i}/clocks``           reset the lock
POST        ``/control/gpus/{i}/power-limit``      ``{"watts": 450}``, within the GPU's
                                                   constraints
DELETE      ``/control/gpus/{i}/power-limit``      back to the default limit
==========  =====================================  ===============================================

A GPU's state: ``{"index", "locked_clocks_mhz": [min, max] | null, "power_limit_w",
"power_limit_set", "supported_clocks_mhz": [min, max], "power_limit_range_w": [min, max],
"default_power_limit_w"}`` (``locked_clocks_mhz`` and ``power_limit_set``: what this service
set, so a gateway replica taking over the control finds the caps another one left);
the answer to every route is ``{"gpus": [...], "revert_after_s": s}``. Errors are the
OpenAI error shape (400 bad body: a value missing, not a finite number or outside the GPU's
``supported_clocks_mhz`` / ``power_limit_range_w``, with ``param`` the field and ``code``
``invalid_value``; nothing is clamped or changed; 401 no or wrong token, 404 no such GPU or
route, 405 another method, 503 the driver refused).

Never capped by accident: every authenticated request is contact; with no contact for
``revert_after_s`` (default 60 s: thirty of the gateway's 2-s GPU rounds)
:meth:`ControlService.tick` reverts every GPU the service changed (locks reset, default limits), and
:meth:`ControlService.revert_all` does the same when the agent stops.
"""

from __future__ import annotations

import hmac
import json
import math
import re
from dataclasses import dataclass
from typing import Any, Protocol

DEFAULT_REVERT_AFTER_S = 60.0
"""Seconds without contact from the gateway after which the agent reverts every cap."""

_ROUTE = re.compile(r"^/control/gpus/(\d+)/(clocks|power-limit)$")


class ActuatorError(RuntimeError):
    """The driver refused a change (no permission, not supported)."""


@dataclass(frozen=True, slots=True)
class GpuLimits:
    """What a GPU allows: SM clocks (MHz) it can be locked to and its power-limit range (W)."""

    min_mhz: float
    max_mhz: float
    min_power_w: float
    max_power_w: float
    default_power_w: float


class GpuActuator(Protocol):
    """The GPUs of one host, as the control endpoint sees them (index 0..count-1)."""

    @property
    def count(self) -> int: ...
    def limits(self, index: int) -> GpuLimits: ...
    def lock_clocks(self, index: int, min_mhz: float, max_mhz: float) -> None: ...
    def reset_clocks(self, index: int) -> None: ...
    def set_power_limit(self, index: int, watts: float) -> None: ...
    def power_limit_w(self, index: int) -> float: ...


def error(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> tuple[int, dict[str, Any]]:
    """An OpenAI-shaped error answer."""
    kind = {401: "authentication_error", 404: "not_found_error", 503: "server_error"}.get(
        status, "invalid_request_error"
    )
    return status, {"error": {"message": message, "type": kind, "param": param, "code": code}}


def number(
    data: dict[str, Any], name: str, default: float | None, lo: float, hi: float, unit: str
) -> float | tuple[int, dict[str, Any]]:
    """``data[name]`` as a float within the GPU's supported ``[lo, hi]`` (``unit``), or the
    400 answer that says why not (``param``: ``name``): missing (when ``default`` is None),
    not a number, not finite (NaN, Infinity, an overflowing ``1e999``: Python's JSON reader
    accepts them) or out of range (``code`` ``invalid_value``, the range named; never
    clamped, so a caller learns its value was not applied)."""
    v = data.get(name, default)
    if v is None:
        return error(400, f"{name} is required ({unit})", name, "missing_required_parameter")
    if isinstance(v, bool) or not isinstance(v, int | float):
        return error(400, f"{name} must be a number of {unit}", name, "invalid_type")
    if not math.isfinite(v):
        return error(400, f"{name} must be a finite number of {unit}", name, "invalid_value")
    if not lo <= v <= hi:
        return error(
            400,
            f"{name} {v:g} {unit} is outside this GPU's supported range {lo:g}-{hi:g} {unit}",
            name,
            "invalid_value",
        )
    return float(v)


class ControlService:
    """The control endpoint's logic over ``actuator``; ``token`` is the bearer token the
    gateway sends (compared in constant time)."""

    def __init__(
        self,
        actuator: GpuActuator,
        token: str,
        now: float,
        revert_after_s: float = DEFAULT_REVERT_AFTER_S,
    ) -> None:
        if not token:
            raise ValueError("the control endpoint needs a token")
        self.actuator = actuator
        self.token = token
        self.revert_after_s = revert_after_s
        self.last_contact = now
        self.locked: dict[int, tuple[float, float]] = {}
        self.limited: set[int] = set()
        self.reverts = 0

    def state(self) -> dict[str, Any]:
        """Every GPU's state (see the module docstring)."""
        a = self.actuator
        gpus = []
        for i in range(a.count):
            lim = a.limits(i)
            lock = self.locked.get(i)
            gpus.append(
                {
                    "index": i,
                    "locked_clocks_mhz": list(lock) if lock else None,
                    "power_limit_w": a.power_limit_w(i),
                    "power_limit_set": i in self.limited,
                    "supported_clocks_mhz": [lim.min_mhz, lim.max_mhz],
                    "power_limit_range_w": [lim.min_power_w, lim.max_power_w],
                    "default_power_limit_w": lim.default_power_w,
                }
            )
        return {"gpus": gpus, "revert_after_s": self.revert_after_s}

    def handle(
        self, method: str, path: str, token: str | None, body: bytes, now: float
    ) -> tuple[int, dict[str, Any]]:
        """One request: ``(status, JSON body)``."""
        if token is None or not hmac.compare_digest(token.encode(), self.token.encode()):
            return error(401, "a valid bearer token is required for the GPU control endpoint")
        self.last_contact = now
        if path.rstrip("/") == "/control":
            return (200, self.state()) if method == "GET" else error(405, "use GET /control")
        m = _ROUTE.match(path)
        if m is None:
            return error(404, f"no control route {path}")
        index, what = int(m.group(1)), m.group(2)
        if not 0 <= index < self.actuator.count:
            return error(404, f"no GPU {index} on this host", "index")
        try:
            if method == "DELETE":
                self._clear(index, what)
            elif method == "POST":
                bad = self._set(index, what, body)
                if bad is not None:
                    return bad
            else:
                return error(405, f"use POST or DELETE on {path}")
        except ActuatorError as e:
            return error(503, f"GPU {index}: the driver refused: {e}")
        return 200, self.state()

    def _set(self, index: int, what: str, body: bytes) -> tuple[int, dict[str, Any]] | None:
        try:
            data = json.loads(body or b"{}")
        except ValueError:
            return error(400, "the body must be JSON")
        if not isinstance(data, dict):
            return error(400, "the body must be a JSON object")
        lim = self.actuator.limits(index)
        if what == "clocks":
            hi = number(data, "max_mhz", None, lim.min_mhz, lim.max_mhz, "MHz")
            if not isinstance(hi, float):
                return hi
            lo = number(data, "min_mhz", lim.min_mhz, lim.min_mhz, lim.max_mhz, "MHz")
            if not isinstance(lo, float):
                return lo
            if lo > hi:
                return error(
                    400,
                    f"min_mhz ({lo:g}) must not be above max_mhz ({hi:g})",
                    "min_mhz",
                    "invalid_value",
                )
            self.actuator.lock_clocks(index, lo, hi)
            self.locked[index] = (lo, hi)
            return None
        w = number(data, "watts", None, lim.min_power_w, lim.max_power_w, "W")
        if not isinstance(w, float):
            return w
        self.actuator.set_power_limit(index, w)
        self.limited.add(index)
        return None

    def _clear(self, index: int, what: str) -> None:
        if what == "clocks":
            self.actuator.reset_clocks(index)
            self.locked.pop(index, None)
        else:
            self.actuator.set_power_limit(index, self.actuator.limits(index).default_power_w)
            self.limited.discard(index)

    def tick(self, now: float) -> bool:
        """Revert every change when the gateway has not been heard for ``revert_after_s``;
        True when it reverted something."""
        if now - self.last_contact < self.revert_after_s or not (self.locked or self.limited):
            return False
        self.revert_all()
        return True

    def revert_all(self) -> None:
        """Reset every lock and limit this service set (on stop, or lost contact); a GPU the
        driver refuses to reset is kept in the lists, to be retried at the next tick."""
        for i in list(self.locked):
            try:
                self._clear(i, "clocks")
            except ActuatorError:
                pass
        for i in list(self.limited):
            try:
                self._clear(i, "power-limit")
            except ActuatorError:
                pass
        self.reverts += 1
