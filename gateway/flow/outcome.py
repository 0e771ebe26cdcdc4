"""What a request that no backend took ends with (:class:`gateway.flow.pipeline.Pipeline`
raises it): the last answer a backend gave, relayed as sent, or the gateway's own refusal.

Decisions only, over the request's context, its last failure, the fleet's backends and the
time passed in: no I/O, no state of its own.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from gateway.config import HealthConfig
from gateway.core.outcomes import NO_BACKEND_CODE, SERVER_ERROR, BackendAnswer, Refusal
from gateway.core.vocab import ErrorType, FailureKind
from gateway.fleet.backend import Backend
from gateway.flow.candidates import availability_s, recovery_s, wait_s
from gateway.flow.context import RequestContext
from gateway.proxy.upstream import UpstreamFailure
from gateway.traffic.retry_after import backend_retry_after, clamp_retry_after, says_when


def kept_answer(kept: BackendAnswer | None, new: BackendAnswer, now_unix: float) -> BackendAnswer:
    """Which backend answer to relay if no backend takes the request (``kept``: the one
    kept so far, ``new``: the latest; ``now_unix``: Unix seconds, for HTTP dates): the last
    one, except that between two 429s with a readable ``Retry-After`` or ``retry-after-ms``
    each the one that comes back sooner is kept (a client that waits what it was told then
    finds a backend ready: case BUG-05, A ``Retry-After: 7`` then B ``3`` is answered with
    B's 429)."""
    if kept is None or not (kept.status == new.status == 429):
        return new
    was = backend_retry_after(kept.headers, now_unix)
    now_s = backend_retry_after(new.headers, now_unix)
    return kept if was is not None and now_s is not None and was < now_s else new


def give_up(
    ctx: RequestContext,
    f: UpstreamFailure | None,
    backends: Iterable[Backend],
    health: HealthConfig,
    now: float,
) -> Refusal | BackendAnswer:
    """The typed outcome when no attempt (``f``: the last failure, None: none was made)
    gave an answer the client can have (``now``: monotonic seconds).

    The last answer a backend gave (``ctx.answered``: a 429 or a 5xx, even before a later
    attempt that got no answer at all; between 429s the sooner ``Retry-After``,
    :func:`kept_answer`) is relayed as sent; a 429 with neither ``Retry-After`` nor
    ``retry-after-ms`` gets the gateway's estimate of when a backend of the model (of a
    pinned request: its backend) is back added (one with either gets nothing added). Only
    when no backend answered does the gateway answer itself: :func:`unavailable` when it
    asked none, else from the last failure (a refused gateway key 502, a drained or hung
    backend 503, a timeout 504, a broken connection or a ``bad_answer`` 502). A 401/403 to
    the gateway's own key is never relayed: it would tell the client that its own key is
    wrong."""
    answer = ctx.answered
    if answer is not None:
        if answer.status == 429 and not says_when(answer.headers):
            # the backend said not when: the gateway tells when one of the model's
            # backends takes requests again (a pinned request: when its own backend does;
            # never a 429 without it: case BUG-05)
            pinned = ctx.pinned
            soon = wait_s(pinned, now) if pinned else availability_s(backends, ctx.model, now)
            return BackendAnswer(answer.status, answer.body, answer.headers, soon,
                                 answer.version)
        return answer
    if f is None:
        return unavailable(backends, ctx.model, health, now)
    if f.kind == FailureKind.AUTH:
        return Refusal(
            502,
            f"Backend '{f.backend.id}' rejected the gateway's credentials "
            f"({f.status}): the gateway's backend key is misconfigured.",
            SERVER_ERROR,
            "backend_auth_failed",
        )
    if f.kind in (FailureKind.DRAINED, FailureKind.BACKEND_HUNG):
        return Refusal(
            503,
            f"The backend serving model '{ctx.model}' was taken out of rotation "
            "(drained, hung, stalled or shutting down) before answering, and no other could "
            "take the request.",
            SERVER_ERROR,
            NO_BACKEND_CODE,
            retry_after_s=recovery_s(health),
        )
    if f.kind in (FailureKind.TTFB_TIMEOUT, FailureKind.IDLE_TIMEOUT):
        return Refusal(
            504,
            f"The backend did not answer in time: {client_reason(f)}.",
            SERVER_ERROR,
            "upstream_timeout",
        )
    return Refusal(
        502,
        f"Could not get an answer from a backend"
        f"{f' for model {ctx.model!r}' if ctx.model else ''}: {client_reason(f)}.",
        SERVER_ERROR,
        "upstream_unavailable",
    )


_CLIENT_REASONS = {
    FailureKind.CONNECT: "backend '{id}' could not be reached",
    FailureKind.TTFB_TIMEOUT: "backend '{id}' sent no answer within proxy.ttfb_timeout_s",
    FailureKind.IDLE_TIMEOUT: "backend '{id}' stalled for proxy.idle_timeout_s",
    FailureKind.DISCONNECTED: "the connection to backend '{id}' broke",
    FailureKind.STATUS: "backend '{id}' answered {status}",
    FailureKind.BAD_ANSWER: "backend '{id}' answered without a JSON body",
}


def client_reason(f: UpstreamFailure) -> str:
    """What a client is told about the failure ``f``: its kind and the backend's id, never
    the exception's text (``f.message``: ``Cannot connect to host 10.0.3.7:8000 ...``
    names addresses, which only the logs and ``/admin/backends``' ``last_error`` show)."""
    text = _CLIENT_REASONS.get(f.kind, "backend '{id}' failed ({kind})")
    return text.format(id=f.backend.id, status=f.status or 200, kind=f.kind.value)


def unavailable(
    backends: Iterable[Backend], model: str, health: HealthConfig, now: float
) -> Refusal:
    """The gateway's own answer when no backend of ``model`` can take a request now
    (``now``: monotonic seconds), given without asking any backend:

    * 429 ``rate_limit_exceeded`` (``upstream_rate_limited``) when a routable backend of
      the model (warm, breaker not open) is only cooling after its own 429 or 503
      ``Retry-After``: the backends refused, and the gateway passes their answer's meaning
      on, retry when the first is back;
    * 503 ``no_backend_available`` with ``Retry-After`` (``no_backend``) when the warm ones
      all have their circuit breaker open: an outage of the service, not a limit on the
      client (RFC 9110 section 15.6.4: 503 for a server temporarily unable to handle the
      request, ``Retry-After`` when it will be back; a 429 makes OpenAI's SDKs raise
      ``RateLimitError``, telling users their key is limited), retry when the first
      breaker half-opens;
    * else 503 (unhealthy, draining, gone) with the probe-recovery estimate.

    Never ``rate_limited``: that says the client's key is over its limit."""
    backends = list(backends)
    soon = availability_s(backends, model, now)
    if soon is not None:
        cooling = any(b.routable and b.cooling_until > now and model in b.models
                      for b in backends)
        retry = math.ceil(clamp_retry_after(soon))
        if cooling:
            return Refusal(
                429,
                f"Every backend serving model '{model}' is rate-limited; retry in {retry} s.",
                "requests",
                "rate_limit_exceeded",
                retry_after_s=soon,
                error_type=ErrorType.UPSTREAM_RATE_LIMITED,
            )
        return Refusal(
            503,
            f"No backend is available for model '{model}' right now (each has failed "
            f"repeatedly and is recovering); retry in {retry} s.",
            SERVER_ERROR,
            NO_BACKEND_CODE,
            retry_after_s=soon,
            error_type=ErrorType.NO_BACKEND,
        )
    return Refusal(
        503,
        f"No backend is available for model '{model}' right now (all are unhealthy, "
        "draining or restarting).",
        SERVER_ERROR,
        NO_BACKEND_CODE,
        retry_after_s=recovery_s(health),
        error_type=ErrorType.NO_BACKEND,
    )
