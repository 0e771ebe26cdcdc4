"""What the request flow passes along: the request (:class:`RequestContext`), a backend's
accepted answer start (:class:`Opened`), and a finished non-stream answer (:class:`Answer`).
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gateway.core.outcomes import BackendAnswer
from gateway.core.vocab import Prio
from gateway.fleet.backend import Backend
from gateway.flow.lease import RequestLease
from gateway.flow.shaping import ratelimit_headers
from gateway.proxy.relay import CutHandle
from gateway.proxy.sse import EventFramer
from gateway.proxy.upstream import UpstreamRequest, UpstreamResponse

if TYPE_CHECKING:
    from gateway.flow.key_limits import Charge
    from gateway.flow.merging import Part
    from gateway.tracing import RequestTrace


NOTHING_GENERATED = (0, 0)
"""The usage (prompt, completion tokens) a client key is charged for a request that no
backend served: a refusal after admission, a backend's 4xx, 429 or 5xx answer."""


@dataclass(slots=True)
class RequestContext:
    """One client request as the flow sees it (the body is never re-serialised).

    ``lease`` owns what the request holds (:mod:`gateway.flow.lease`). ``places``: the
    in-flight places it takes (sequences decoding: prompts x n; 1 for embeddings);
    ``pooled_extra``: the extra prefill-only engine requests of an embeddings request
    (inputs - 1). ``started``: ``time.perf_counter()`` at arrival (seconds).
    ``answered``: the last answer a backend gave this request without taking it (a 429
    or a 5xx; a merged request's, for its members), relayed when no backend takes it.
    ``charge``: what admission charged the client key (None without key limits), settled
    by :meth:`settle` when the answer's usage is known."""

    endpoint: str
    model: str
    stream: bool
    upstream: UpstreamRequest
    request_id: str
    cut: CutHandle
    lease: RequestLease
    session_key: str | None = None
    started: float = field(default_factory=time.perf_counter)
    # the x-ratelimit-* headers (name, value) of the client key's limits, on every answer
    ratelimit: list[tuple[str, str]] = field(default_factory=list)
    priority: Prio = Prio.NORMAL  # the batcher's bucket
    merge_key: Hashable | None = None  # set when the batcher may merge this request
    merge_part: Part | None = None  # its part of a merged body
    places: int = 1
    pooled_extra: int = 0
    answered: BackendAnswer | None = None
    # the one backend this request may go to (it holds the Responses API state the request
    # names: gateway.flow.responses); no other is tried
    pinned: Backend | None = None
    charge: Charge | None = None
    # ids of the backends this request's attempts went to (a continuation never goes back)
    tried: list[str] = field(default_factory=list)
    # of those, the attempts that never reached their backend (no connection: nothing was
    # sent), which proxy.max_attempts does not count (gateway.flow.pipeline)
    unreached: int = 0
    # the model_version a canary rollout assigned it (gateway.flow.rollouts): only backends
    # of that version are its candidates, its retries' and continuations' too; None: any
    version: str | None = None
    # the rollout's other version: where it goes when none of ``version`` can take it
    fallback_version: str | None = None
    # its spans when tracing is on (gateway.tracing); None: off
    trace: RequestTrace | None = None

    def settle(self, usage: tuple[int, int] | None) -> None:
        """The answer reported ``usage`` (prompt, completion tokens; None: not reported):
        the client key is charged that instead of admission's estimate
        (:meth:`gateway.flow.key_limits.KeyLimits.settle`, once), and the answer's
        ``x-ratelimit-*`` headers show the key's buckets after it."""
        if self.charge is not None:
            verdict = self.charge.settle(usage)
            if verdict is not None:
                self.ratelimit = list(ratelimit_headers(verdict).items())


@dataclass(slots=True)
class Opened:
    """A backend's accepted answer start: the response, and what was read of it (a
    non-stream's whole body, or a stream's first complete events and their framer)."""

    backend: Backend
    resp: UpstreamResponse
    data: bytes
    framer: EventFramer | None
    sent_at: float = 0.0  # time.perf_counter() when this attempt was sent upstream
    load: int = 0  # the backend's requests in flight when it was sent (this one included)
    # Backend.prefill_load, the larger of at the send and at the answer's start (this one
    # included): the prefills its first token waited for (gateway.traffic.rollout_strata)
    prefill_load: int = 0


@dataclass(slots=True)
class Answer:
    """A finished non-stream answer: status, body bytes, and the headers to send (the
    backend's, hop-by-hop dropped, plus the gateway's own; no content-length).
    ``version``: the :func:`version_label` of the backend that gave it."""

    status: int
    body: bytes
    headers: list[tuple[bytes, bytes]]
    version: str = ""


def version_label(backend: Backend | None, assigned: str | None = None) -> str:
    """The ``version`` label of a request in ``gateway_requests_total``: the
    ``model_version`` of ``backend``, the one whose answer (or own error answer) was
    relayed to the client ("" when it has none); when no backend's answer was (None: a
    refusal, the client gone before one), ``assigned``, the version a canary rollout gave
    the request (``RequestContext.version``), else ""."""
    if backend is not None:
        return backend.config.model_version or ""
    return assigned or ""
