"""The entry layer of admission (pure): per-client-key token buckets for requests per
minute and tokens per minute, the way OpenAI's own ``x-ratelimit-*`` limits work.

A request costs one request and its estimated tokens
(:func:`gateway.traffic.admission.estimate_tokens`: the prompt read from the parsed body,
:mod:`gateway.traffic.estimate`, plus ``max_tokens``) when it is admitted; once its answer
reports the tokens it used, :meth:`KeyLimiter.settle` charges the difference (a refund when
the estimate was high, more when it was low), so the estimate only decides admission.
Times are monotonic seconds passed in; nothing here reads a clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol


class TokenBucket:
    """A token bucket of ``capacity`` refilled at ``capacity / period_s`` per second.

    ``per_minute=60`` means 60 per minute with bursts up to 60. Times are seconds.
    """

    __slots__ = ("_at", "capacity", "rate", "tokens")

    def __init__(self, capacity: float, period_s: float, now: float) -> None:
        self.capacity = capacity
        self.rate = capacity / period_s
        self.tokens = capacity
        self._at = now

    def _refill(self, now: float) -> None:
        if now > self._at:
            self.tokens = min(self.capacity, self.tokens + (now - self._at) * self.rate)
            self._at = now

    def level(self, now: float) -> float:
        """The tokens in the bucket now (refilled to ``now``; below zero: a debt)."""
        self._refill(now)
        return self.tokens

    def wait_for(self, n: float, now: float) -> float:
        """Seconds until ``n`` could be taken (0: now). ``inf`` if ``n`` exceeds capacity."""
        self._refill(now)
        if n <= self.tokens:
            return 0.0
        if n > self.capacity:
            return math.inf
        return (n - self.tokens) / self.rate

    def take(self, n: float, now: float) -> None:
        self._refill(now)
        self.tokens -= n

    def give(self, n: float, now: float) -> None:
        """Return ``n`` taken tokens (never above capacity)."""
        self._refill(now)
        self.tokens = min(self.capacity, self.tokens + n)

    def reset_in(self, now: float) -> float:
        """Seconds until the bucket is full again (OpenAI's ``x-ratelimit-reset-*``)."""
        self._refill(now)
        return (self.capacity - self.tokens) / self.rate


@dataclass(frozen=True, slots=True)
class EntryVerdict:
    """Outcome of the entry layer. ``retry_after_s`` is 0 when admitted; the limit fields
    feed the ``x-ratelimit-*`` headers (None when that limit is not configured).
    ``pending`` (fleet mode only, :mod:`gateway.traffic.quota`): not admitted *yet*: this
    replica's local quota is short but the global bucket, as last seen, holds what is
    missing; a fetch is running and the caller may wait for it (bounded) and ask again."""

    admitted: bool
    retry_after_s: float
    limit_requests: int | None
    remaining_requests: int | None
    reset_requests_s: float | None
    limit_tokens: int | None
    remaining_tokens: int | None
    reset_tokens_s: float | None
    reason: str = ""
    pending: bool = False


class EntryLimiter(Protocol):
    """What the entry layer asks of one client key's limits: :class:`KeyLimiter` (one
    process) or :class:`gateway.traffic.quota.GlobalKeyLimiter` (fleet mode: quota taken
    in chunks from global buckets). ``tokens`` / ``now``: estimated tokens, monotonic
    seconds."""

    def check(self, tokens: int, now: float, final: bool = False) -> EntryVerdict: ...
    def take_request(self, now: float) -> float: ...
    def refund(self, tokens: int, now: float) -> None: ...
    def settle(self, charged: int, used: int, now: float) -> None: ...
    def state(self, now: float) -> EntryVerdict: ...
    def full(self, now: float) -> bool: ...


class KeyLimiter:
    """Requests-per-minute and tokens-per-minute buckets of one client key."""

    def __init__(self, rpm: int | None, tpm: int | None, now: float) -> None:
        self.rpm = rpm
        self.tpm = tpm
        self.requests = TokenBucket(rpm, 60.0, now) if rpm else None
        self.tokens = TokenBucket(tpm, 60.0, now) if tpm else None

    def full(self, now: float) -> bool:
        """True when every bucket is full again: this limiter is then the same as a new
        one, so it may be dropped (a client seen once does not hold memory forever)."""
        return all(b is None or b.reset_in(now) <= 0.0 for b in (self.requests, self.tokens))

    def refund(self, tokens: int, now: float) -> None:
        """Give back what an admitted request was charged, when a later layer refused it
        (or its client left before it was sent): a refusal must not use up the quota."""
        if self.requests:
            self.requests.give(1, now)
        if self.tokens:
            self.tokens.give(tokens, now)

    def settle(self, charged: int, used: int, now: float) -> None:
        """An admitted request charged ``charged`` estimated tokens reported using ``used``
        (prompt + completion tokens, from the answer's ``usage``): the tokens-per-minute
        bucket is given the difference back when the estimate was high, and charged it
        when low. The bucket may then go below zero (the key waits until it has refilled
        what it used, as it would have had the estimate been exact), by at most one
        minute's limit: a degenerate usage (a backend reporting 10**12 tokens) cannot lock
        a key out for more than two minutes."""
        b = self.tokens
        if b is None or used == charged:
            return
        if used < charged:
            b.give(charged - used, now)
        else:
            b.take(used - charged, now)
            b.tokens = max(b.tokens, -b.capacity)

    def state(self, now: float) -> EntryVerdict:
        """The buckets now, as an admitting verdict (for the ``x-ratelimit-*`` headers of an
        answer whose charge was just settled); charges nothing."""
        return self._verdict(True, 0.0, "", now)

    def take_request(self, now: float) -> float:
        """A call that costs one request and no tokens (a Responses by-id call): take it
        and return 0, or return the seconds until one is free (nothing taken). The
        tokens-per-minute bucket is not asked (a deficit there does not refuse it)."""
        bucket = self.requests
        wait = bucket.wait_for(1, now) if bucket is not None else 0.0
        if wait == 0.0 and bucket is not None:
            bucket.take(1, now)
        return wait

    def check(self, tokens: int, now: float, final: bool = False) -> EntryVerdict:
        """Admit (and charge) one request costing ``tokens``, or say when to come back.
        (``final``: no verdict here is ever ``pending``, so it changes nothing.)"""
        wait_r = self.requests.wait_for(1, now) if self.requests else 0.0
        wait_t = self.tokens.wait_for(tokens, now) if self.tokens else 0.0
        admitted = wait_r == 0.0 and wait_t == 0.0
        if admitted:
            if self.requests:
                self.requests.take(1, now)
            if self.tokens:
                self.tokens.take(tokens, now)
        reason = ""
        if wait_t == math.inf:
            reason = (
                f"the request's estimated {tokens} tokens exceed the key's tokens-per-minute limit"
            )
        elif not admitted:
            reason = "requests per minute" if wait_r >= wait_t else "tokens per minute"
        return self._verdict(admitted, 0.0 if admitted else max(wait_r, wait_t), reason, now)

    def _verdict(self, admitted: bool, retry_s: float, reason: str, now: float) -> EntryVerdict:
        r, t = self.requests, self.tokens
        reset_r = None if r is None else r.reset_in(now)  # (refilled to now first)
        reset_t = None if t is None else t.reset_in(now)
        return EntryVerdict(
            admitted,
            retry_s,
            self.rpm,
            None if r is None else max(0, math.floor(r.tokens)),
            reset_r,
            self.tpm,
            None if t is None else max(0, math.floor(t.tokens)),
            reset_t,
            reason,
        )


def ratelimit_duration(seconds: float) -> str:
    """OpenAI's reset format: ``"20ms"``, ``"1.5s"``, ``"6m0s"``."""
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))}ms"
    if seconds < 60:
        return f"{seconds:.3g}s"
    m, s = divmod(round(seconds), 60)
    return f"{m}m{s}s"
