"""Typed outcomes of a request that did not get a backend's good answer.

The request flow (admission, the queue, the attempts) raises these; only the HTTP edge
(:mod:`gateway.api.errors`) turns them into responses and headers, so a refusal's meaning
(status, OpenAI error type and code, when to retry) is decided where it happens and
written out in one place.

- :class:`Refusal`: the gateway answers itself (a 4xx/5xx in OpenAI's error shape), e.g.
  a 429 from admission with the seconds until a retry may succeed.
- :class:`BackendAnswer`: a backend's own error answer (a 429 or a 5xx) when no backend
  took the request, passed to the client as the backend sent it (status, body, headers).
"""

from __future__ import annotations

from gateway.core.vocab import Cut, ErrorType

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"


class Refusal(Exception):
    """An answer the gateway gives itself, in OpenAI's error shape.

    ``status``: HTTP status; ``message``/``type``/``code``/``param``: the OpenAI error
    object's fields. ``retry_after_s``: seconds until a retry may succeed (rendered as
    ``retry-after``, whole seconds rounded up and bounded to [1, 60], and
    ``retry-after-ms``; None: no such header). ``retryable=False`` adds
    ``x-should-retry: false`` (openai-python and other Stainless SDKs then do not retry).
    ``headers``: more headers for the answer (``x-ratelimit-*``), name and value.
    ``error_type``: its ``gateway_request_errors_total`` label when the status alone does
    not say it (admission's refusals); None: :func:`refusal_error_type` derives it.
    """

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = INVALID_REQUEST,
        code: str | None = None,
        param: str | None = None,
        retry_after_s: float | None = None,
        *,
        retryable: bool = True,
        headers: list[tuple[str, str]] | None = None,
        error_type: ErrorType | None = None,
    ) -> None:
        super().__init__(message)
        self.error_type = error_type
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.param = param
        self.retry_after_s = retry_after_s
        self.retryable = retryable
        self.headers = headers or []

    def __repr__(self) -> str:
        return f"Refusal({self.status}, {self.code!r}, {self.message!r})"


def shutting_down() -> Refusal:
    """503 ``gateway_shutting_down``, retry in 1 s: the answer to a request that arrives,
    or still waits in a queue, once the gateway is shutting down (a load balancer or the
    SDK sends it to another instance)."""
    return Refusal(
        503,
        "The gateway is shutting down; retry on another instance.",
        SERVER_ERROR,
        "gateway_shutting_down",
        retry_after_s=1.0,
        error_type=ErrorType.ADMISSION_REFUSED,
    )


class BackendAnswer(Exception):
    """A backend's own error answer (a 429 or a 5xx) that ends a request no backend took,
    relayed as sent: ``status``, raw ``body`` bytes and the response headers to forward
    in the order received, repeated names kept (hop-by-hop ones already dropped,
    :func:`gateway.proxy.upstream.response_headers`). ``retry_after_s``: seconds the
    gateway adds as ``retry-after`` / ``retry-after-ms`` to a 429 that came without a
    ``Retry-After`` of its own (None: nothing added). ``version``: the label of the
    answering backend's ``model_version`` in ``gateway_requests_total`` ("" for none:
    :func:`gateway.flow.context.version_label`)."""

    def __init__(
        self,
        status: int,
        body: bytes,
        headers: list[tuple[bytes, bytes]],
        retry_after_s: float | None = None,
        version: str = "",
    ) -> None:
        super().__init__(f"backend answered {status}")
        self.status = status
        self.body = body
        self.headers = headers
        self.retry_after_s = retry_after_s
        self.version = version


def status_error_type(status: int) -> ErrorType | None:
    """The error type of an answer known only by its HTTP ``status``: 499 (the client
    hung up) ``client_disconnect``, 429 ``rate_limited``, 504 ``timeout``, another 5xx
    ``upstream_5xx`` (a backend's own answer, relayed); None for the rest (a success, or a
    4xx: the request's own fault, not an error of the service)."""
    if status == 499:
        return ErrorType.CLIENT_DISCONNECT
    if status == 429:
        return ErrorType.RATE_LIMITED
    if status == 504:
        return ErrorType.TIMEOUT
    if 500 <= status <= 599:
        return ErrorType.UPSTREAM_5XX
    return None


def refusal_error_type(refusal: Refusal) -> ErrorType | None:
    """The error type of the gateway's own answer ``refusal``: its ``error_type`` when set
    (admission's), else ``timeout`` for ``upstream_timeout``, ``rate_limited`` for a 429,
    ``connect`` for another 5xx (no backend could be reached or none was available: the
    gateway answers itself only when no backend answered), None for a 4xx (the request's
    fault)."""
    if refusal.error_type is not None:
        return refusal.error_type
    if refusal.code == "upstream_timeout" or refusal.status == 504:
        return ErrorType.TIMEOUT
    if refusal.status == 429:
        return ErrorType.RATE_LIMITED
    if refusal.status >= 500:
        return ErrorType.CONNECT
    return None


_STREAM_TIMEOUTS = frozenset({"upstream_idle_timeout"})


def stream_error_type(outcome: str) -> ErrorType | None:
    """The error type of a relayed stream that ended with ``outcome``
    (:class:`gateway.proxy.relay.StreamOutcome`): None for ``ok``; ``client_disconnect``
    (the client hung up), ``in_band_error``, ``timeout`` (``upstream_idle_timeout``), and
    ``cut`` for every other end after the first event (``upstream_disconnected``,
    ``upstream_incomplete``, a drain deadline, a hung backend, the gateway's shutdown)."""
    if outcome == "ok":
        return None
    if outcome == Cut.CLIENT_GONE:
        return ErrorType.CLIENT_DISCONNECT
    if outcome == "in_band_error":
        return ErrorType.IN_BAND_ERROR
    if outcome in _STREAM_TIMEOUTS:
        return ErrorType.TIMEOUT
    return ErrorType.CUT

