"""The project's shared vocabulary: the enums every layer speaks.

Backend lifecycle states, GPU thermal tiers, priority classes, why an upstream attempt
failed, and why a request was cut short by someone other than its backend. String enums
(``StrEnum``) where the value is a metric label or a wire value, so ``kind ==
"rate_limited"`` and ``labels(kind)`` read the same as before. Nothing here does I/O or
imports another gateway module.
"""

from __future__ import annotations

from enum import IntEnum, StrEnum


class BackendState(StrEnum):
    """Lifecycle states of a backend (docs/architecture.md, "Backend states")."""

    COLD = "cold"  # registered, not (yet) answering
    WARMING = "warming"  # answers; warm-up passes running
    WARM = "warm"  # routable
    DRAINING = "draining"  # no new requests; in-flight finish or the deadline passes
    COOLDOWN = "cooldown"  # quiet window before returning
    UNHEALTHY = "unhealthy"  # failed probes / passive outlier / GPU errors


class ThermalTier(StrEnum):
    """Thermal tier of a backend's hottest GPU (a metric label value)."""

    COOL = "cool"
    WARM = "warm"
    HOT = "hot"
    UNKNOWN = "unknown"


class Prio(IntEnum):
    """Priority classes; lower value is served first (the batcher's bucket index)."""

    HIGH = 0
    NORMAL = 1
    LOW = 2

    @classmethod
    def parse(cls, value: str | None, default: Prio) -> Prio:
        """``high|normal|low`` (case-insensitive); anything else -> ``default``."""
        if value:
            v = value.strip().lower()
            if v == "high":
                return cls.HIGH
            if v == "normal":
                return cls.NORMAL
            if v == "low":
                return cls.LOW
        return default

    @property
    def label(self) -> str:
        """``high``, ``normal`` or ``low`` (metric label, messages)."""
        return self.name.lower()


class FailureKind(StrEnum):
    """Why one upstream attempt failed (the ``outcome`` label of
    ``gateway_upstream_attempts_total``; :mod:`gateway.traffic.retry` decides on it)."""

    CONNECT = "connect"  # no connection (nothing was sent)
    TTFB_TIMEOUT = "ttfb_timeout"  # no answer start within proxy.ttfb_timeout_s
    IDLE_TIMEOUT = "idle_timeout"  # the body stalled for proxy.idle_timeout_s
    DISCONNECTED = "disconnected"  # the connection broke in the response
    STATUS = "status"  # the backend answered 5xx
    RATE_LIMITED = "rate_limited"  # the backend answered 429
    AUTH = "auth"  # 401/403 to the gateway's own (misconfigured) key
    BAD_ANSWER = "bad_answer"  # a 200 whose body is not the JSON it must be (empty, HTML, ...)
    DRAINED = "drained"  # the gateway ended it: its backend's drain deadline passed
    BACKEND_HUNG = "backend_hung"  # the gateway ended it: its backend hung


class Cut(StrEnum):
    """Why a request was ended early by someone other than its backend."""

    CLIENT_GONE = "client_gone"  # the client hung up
    DRAIN_DEADLINE = "drain_deadline"  # its backend's drain deadline passed
    BACKEND_HUNG = "backend_hung"  # its backend stopped answering even a 1-token probe
    SHUTDOWN = "gateway_shutdown"  # the gateway's own grace period ended


class ErrorType(StrEnum):
    """The ``error_type`` label of ``gateway_request_errors_total``: why a client request
    ended in an error the client saw (one per request, counted where it ended)."""

    TIMEOUT = "timeout"  # no answer in time (504), or a stream idle past proxy.idle_timeout_s
    UPSTREAM_5XX = "upstream_5xx"  # a backend's own 5xx answer, relayed
    CONNECT = "connect"  # no backend reachable: connection failed, none available (502/503)
    CUT = "cut"  # a stream broken after its first event (disconnected, incomplete, cut)
    IN_BAND_ERROR = "in_band_error"  # a 200 stream that carried the backend's error event
    RATE_LIMITED = "rate_limited"  # a 429: the client key's limits or the backends'
    ADMISSION_REFUSED = "admission_refused"  # refused by admission (load, power, degraded)
    CLIENT_DISCONNECT = "client_disconnect"  # the client hung up before the answer ended

