"""Global rate limits in fleet mode (pure): each client key's requests-per-minute and
tokens-per-minute limits are one token bucket in the shared store, and each replica admits
from a *local balance* taken from it in quota chunks, ahead of need, so no request waits on
the store (the I/O is :mod:`gateway.coord.quota`; the buckets' script lives there).

One limit of one key on one replica is a :class:`QuotaBucket`:

* **chunk** (:func:`chunk_size`): ``coordination.quota_chunk`` x the per-minute limit, at
  least 1. When an admitted request leaves the balance under the **low-water mark**
  (:func:`low_water`: half a chunk) a fetch tops it up to one chunk in the background, one
  fetch in flight per bucket. A request larger than a chunk (tokens) fetches what it needs.
* **empty balance**: when the global bucket, as last seen and refilled since at its rate,
  holds what is missing, the verdict is ``pending``: a fetch runs and the request may wait
  for it, bounded by ``coordination.quota_wait_s`` (the gate's choice), then is asked again
  with ``final``; otherwise it is refused at once with the honest ``retry_after_s`` of the
  global bucket's last known state (what is missing over the refill rate).
* **returns**: an idle bucket (``coordination.quota_idle_s`` without a request) gives its
  unspent balance back to the global bucket, and so does a refund above one chunk
  (:meth:`QuotaBucket.sync_delta`), so a replica cannot hoard. A settle that charges more
  than the estimate may leave a debt (at most one minute's limit, as in one process); the
  debt is forwarded to the global bucket (taken there even below zero).
* **fallback** (the store does not answer): each replica enforces ``limit / N`` (N: the
  replicas alive as last seen) with its own token bucket of that burst and rate, starting
  from this replica's unspent balance plus its 1/N part of the global bucket as last seen
  (:meth:`QuotaBucket.enter_share`). When the store answers again, what was used on the
  share beyond what was already paid is charged to the global bucket
  (:meth:`QuotaBucket.leave_share`), and admission goes back to chunks.

**Overshoot bound** (while the store answers): for a limit of ``L`` per minute (burst ``L``,
refill ``r = L / 60`` per second) over ``N`` replicas with chunk ``C``, what is admitted in
any window of ``W`` seconds is at most ``L + r * W + N * max(C, c)``, ``c`` the largest
single charge (1 for requests). A replica spends only what it took from the global bucket,
which gives out at most ``L + r * W`` in ``W`` seconds (a token bucket's own bound); what
the replicas held unspent when the window opened is at most ``max(C, c)`` each (a fetch
tops up to ``C``, or to one request's need). Example: 600 requests per minute, 3 replicas,
``quota_chunk`` 0.05 (C = 30): at most 600 + 600 + 90 = 1290 in any minute (a single
bucket: 1200). Settle's debt on tokens is as in one process. Around a store outage the
shares start from the global level last seen (their sum at most that level plus the
balances) and their use is charged to the global bucket afterwards, down to ``-L``: a window
spanning an outage may exceed the bound by that debt, at most ``L`` (and by one burst ``L``
when Redis restarted empty; the replicas alive are as last seen, so a replica that joined
unseen adds its share).

Times are local monotonic seconds passed in; the global bucket's state comes in already
converted (:meth:`QuotaBucket.granted`). Nothing here reads a clock or does I/O.
"""

from __future__ import annotations

import math
from typing import Protocol

from gateway.traffic.limits import EntryVerdict, TokenBucket

LOW_WATER = 0.5
"""The low-water mark as a fraction of a chunk: a fetch of the next chunk starts when the
balance falls below half a chunk, so a key spending a chunk in less than a store round trip
is the only one that can find its balance empty."""

SHARE_TOO_SMALL_S = 60.0
"""Retry-After of a request within the key's limit but larger than the local share: it can
only be admitted once the store answers again (60 s: the longest hint given)."""

REQUESTS = "req"
TOKENS = "tok"


def chunk_size(limit: int, fraction: float) -> int:
    """The quota chunk of a per-minute ``limit``: ``fraction`` of it, at least 1."""
    return max(1, math.floor(limit * fraction))


def low_water(chunk: int) -> float:
    """Below this balance a fetch starts: :data:`LOW_WATER` x ``chunk`` (at least 1, so a
    chunk of 1 is refetched once spent)."""
    return max(1.0, chunk * LOW_WATER)


def share_limit(limit: int, alive: int) -> float:
    """The local share of a per-minute ``limit`` while the store does not answer: an equal
    part for each of the ``alive`` replicas last seen (at least 1 replica)."""
    return limit / max(1, alive)


class QuotaSource(Protocol):
    """What a :class:`GlobalKeyLimiter` needs of fleet mode (filled by
    :class:`gateway.coord.quota.GlobalQuotas`): whether the store answers, how many replicas
    were last seen alive, and starting a background fetch. No method waits."""

    @property
    def fallback(self) -> bool:
        """True while the store does not answer: limits run on the local share."""
        ...

    @property
    def alive(self) -> int:
        """Replicas alive as last seen (at least 1)."""
        ...

    def refill(self, limiter: GlobalKeyLimiter, bucket: QuotaBucket, ask: int, need: int) -> None:
        """Start taking up to ``ask`` (but none unless at least ``need`` is there) from the
        global bucket of ``bucket`` in the background; ``bucket.fetching`` is already set,
        and :meth:`QuotaBucket.granted` or :meth:`QuotaBucket.fetch_failed` ends it."""
        ...


class QuotaBucket:
    """One limit (``limit`` per minute, ``kind`` :data:`REQUESTS` or :data:`TOKENS`) of one
    key on this replica: its local balance from chunks, and the global bucket as last seen
    (``level`` at local monotonic ``level_at``; a bucket never seen is taken as full, the
    state of a new key). See the module docstring for the rules."""

    __slots__ = (
        "balance", "chunk", "fetching", "heard", "kind", "level", "level_at", "limit", "low",
        "owed", "rate", "share", "share_paid", "share_used", "surplus", "used_at",
    )

    def __init__(self, kind: str, limit: int, chunk_fraction: float, now: float) -> None:
        self.kind = kind
        self.limit = limit
        self.rate = limit / 60.0  # per second
        self.chunk = chunk_size(limit, chunk_fraction)
        self.low = low_water(self.chunk)
        self.balance = 0.0  # spendable here (below zero: a settle's debt)
        self.surplus = 0.0  # given back here above one chunk: returned at the next sync
        self.owed = 0.0  # used here and not yet charged to the global bucket
        self.fetching = False
        self.level = float(limit)
        self.level_at = now
        self.heard = False  # the store has told this replica the global bucket's level
        self.used_at = now
        self.share: TokenBucket | None = None  # the local share while the store is down
        self.share_paid = 0.0  # balance folded into the share (already taken globally)
        self.share_used = 0.0  # charged on the share since it started

    # ---- the global bucket as last seen ----------------------------------------------------
    def projected(self, now: float) -> float:
        """The global bucket's level now, from its last known state refilled at its rate
        (an upper guess: other replicas take from it too)."""
        return min(float(self.limit), self.level + max(0.0, now - self.level_at) * self.rate)

    def granted(self, n: float, level: float, at: float) -> None:
        """A fetch landed: ``n`` taken from the global bucket, left at ``level`` at local
        monotonic ``at``."""
        self.balance += n
        self.seen(level, at)
        self.fetching = False

    def seen(self, level: float, at: float) -> None:
        """The global bucket was at ``level`` at local monotonic ``at``."""
        self.level = level
        self.level_at = at
        self.heard = True

    def fetch_failed(self) -> None:
        """The running fetch got no answer (the store is down or slow)."""
        self.fetching = False

    # ---- the request path ------------------------------------------------------------------
    def spendable(self, now: float) -> float:
        """What may be charged here now (the share's level while on the share)."""
        if self.share is not None:
            return self.share.level(now)
        return self.balance

    def wait_for(self, n: int, now: float) -> float:
        """Seconds until ``n`` could be charged here: 0 now; ``inf`` when ``n`` exceeds the
        whole limit (or the share's). Otherwise, on the share its own wait; on chunks what
        is missing beyond the global bucket's projected level over the refill rate (one
        unit's refill when the global bucket seems to hold it: a fetch would get it)."""
        if n > self.limit:
            return math.inf
        if self.share is not None:
            if n > self.share.capacity:  # fits the global limit, never the share
                return SHARE_TOO_SMALL_S
            return self.share.wait_for(n, now)
        if n <= self.balance:
            return 0.0
        missing = n - self.balance - self.projected(now)
        return (missing if missing > 0 else 1.0) / self.rate

    def fetchable(self, n: int, now: float) -> bool:
        """Whether a fetch could cover ``n`` that the balance does not: on chunks, ``n``
        within the limit, and the global bucket as last seen holding what is missing."""
        if self.share is not None or n > self.limit or n <= self.balance:
            return False
        return self.projected(now) >= n - self.balance

    def begin_fetch(self, n: int, now: float) -> tuple[int, int] | None:
        """Mark a fetch running and say what to ask: ``(ask, need)``, or None when one runs
        already. For a request of ``n`` the balance does not cover: ``need`` is what is
        missing and ``ask`` tops the balance up to a chunk (or to ``n``); ``n`` = 0 (the
        low-water prefetch): anything (need 1) up to a chunk."""
        if self.fetching:
            return None
        self.fetching = True
        need = max(1, math.ceil(n - self.balance)) if n > 0 else 1
        ask = max(need, math.ceil(max(self.chunk, n) - self.balance))
        return ask, need

    def wants_prefetch(self, now: float) -> bool:
        """Under the low-water mark, no fetch running, on chunks, and something to get."""
        return (
            self.share is None
            and not self.fetching
            and self.balance < self.low
            and self.projected(now) >= 1.0
        )

    def take(self, n: float, now: float) -> None:
        """Charge ``n`` (admission)."""
        self.used_at = now
        if self.share is not None:
            self.share.take(n, now)
            self.share_used += n
        else:
            self.balance -= n

    def give(self, n: float, now: float) -> None:
        """Give ``n`` charged back (a refund, a settle's estimate that was high); above one
        chunk the rest waits as surplus for the next sync, which returns it."""
        if self.share is not None:
            self.share.give(n, now)  # (credited to the global bucket by leave_share)
            self.share_used -= n
            return
        self.balance += n
        cap = float(self.chunk)
        if self.balance > cap:
            self.surplus += self.balance - cap
            self.balance = cap

    def charge(self, n: float, now: float) -> None:
        """Charge ``n`` more after the fact (a settle's estimate that was low): the balance
        may go below zero, by at most one minute's limit (as :meth:`KeyLimiter.settle`)."""
        if self.share is not None:
            self.share.take(n, now)
            self.share_used += n
            self.share.tokens = max(self.share.tokens, -self.share.capacity)
            return
        self.balance = max(self.balance - n, -float(self.limit))

    # ---- the sync round ----------------------------------------------------------------------
    def sync_delta(self, now: float, idle_s: float) -> float:
        """What to move to the global bucket now, taken off here: positive gives back
        (surplus; the whole balance once ``idle_s`` passed without a request), negative
        charges it (a debt, use not yet charged). 0: nothing (nor while a fetch runs or on
        the share). If the store does not take it, :meth:`restore` it."""
        if self.fetching or self.share is not None:
            return 0.0
        delta = self.surplus - self.owed
        self.surplus = self.owed = 0.0
        if self.balance < 0 or (self.balance > 0 and now - self.used_at >= idle_s):
            delta += self.balance
            self.balance = 0.0
        return delta

    def restore(self, delta: float) -> None:
        """Keep a :meth:`sync_delta` the store did not take, for a later round."""
        if delta > 0:
            self.surplus += delta
        else:
            self.owed -= delta

    def idle(self) -> bool:
        """Nothing held here: no balance, surplus or debt, no fetch, not on the share (the
        same as a new bucket but for the global level seen)."""
        return (
            self.balance == 0.0 and self.surplus == 0.0 and self.owed == 0.0
            and not self.fetching and self.share is None
        )

    # ---- the local share ------------------------------------------------------------------
    def enter_share(self, alive: int, now: float) -> None:
        """The store stopped answering: enforce ``limit / alive`` here with a token bucket
        of that burst and rate, starting from the unspent balance plus this replica's part
        of the global bucket as last seen (never above the share's burst)."""
        if self.share is not None:
            return
        cap = share_limit(self.limit, alive)
        share = TokenBucket(cap, 60.0, now)
        start = self.balance + self.projected(now) / max(1, alive)
        share.tokens = max(-cap, min(cap, start))
        self.share = share
        self.share_paid = self.balance
        self.share_used = 0.0
        self.balance = 0.0

    def leave_share(self, now: float) -> None:
        """The store answers again: back to chunks. What the share charged beyond the
        balance folded into it is owed to the global bucket (a balance left unspent is
        surplus); both go out at the next sync."""
        if self.share is None:
            return
        delta = self.share_paid - self.share_used
        self.share = None
        self.share_paid = self.share_used = 0.0
        if delta > 0:
            self.surplus += delta
        else:
            self.owed -= delta

    # ---- headers ---------------------------------------------------------------------------
    def remaining(self, now: float) -> int:
        """``x-ratelimit-remaining-*``: the global bucket's projected level plus this
        replica's unspent balance (on the share: the share's level), within [0, limit]."""
        if self.share is not None:
            return max(0, math.floor(self.spendable(now)))
        return max(0, min(self.limit, math.floor(self.projected(now) + self.balance)))

    def reset_in(self, now: float) -> float:
        """``x-ratelimit-reset-*``: seconds until the global bucket (with this balance) is
        full again at the global refill rate (on the share: until the share is full)."""
        if self.share is not None:
            return self.share.reset_in(now)
        held = min(float(self.limit), self.projected(now) + self.balance)
        return max(0.0, (self.limit - held) / self.rate)


class GlobalKeyLimiter:
    """The requests-per-minute and tokens-per-minute limits of one client key ``name`` in
    fleet mode: a :class:`QuotaBucket` each (``rpm`` / ``tpm`` None: no such limit), with the
    interface of :class:`gateway.traffic.limits.KeyLimiter` (an
    :class:`~gateway.traffic.limits.EntryLimiter`). ``source`` says whether the store answers
    and starts fetches; ``chunk_fraction``: ``coordination.quota_chunk``."""

    def __init__(
        self,
        name: str,
        rpm: int | None,
        tpm: int | None,
        now: float,
        chunk_fraction: float,
        source: QuotaSource,
    ) -> None:
        self.name = name
        self.rpm = rpm
        self.tpm = tpm
        self.source = source
        self.requests = QuotaBucket(REQUESTS, rpm, chunk_fraction, now) if rpm else None
        self.tokens = QuotaBucket(TOKENS, tpm, chunk_fraction, now) if tpm else None

    def buckets(self) -> list[QuotaBucket]:
        """The configured limits' buckets (requests first)."""
        return [b for b in (self.requests, self.tokens) if b is not None]

    def _mode(self, now: float) -> None:
        """Follow the store: on the share while it does not answer, on chunks otherwise."""
        down = self.source.fallback
        for b in (self.requests, self.tokens):
            if b is None:
                continue
            if down and b.share is None:
                b.enter_share(self.source.alive, now)
            elif not down and b.share is not None:
                b.leave_share(now)

    def _prefetch(self, now: float) -> None:
        for b in (self.requests, self.tokens):
            if b is not None and b.wants_prefetch(now):
                asked = b.begin_fetch(0, now)
                if asked is not None:
                    self.source.refill(self, b, *asked)

    def check(self, tokens: int, now: float, final: bool = False) -> EntryVerdict:
        """Admit (and charge) one request costing ``tokens`` from the local balances (or the
        share), or say when to come back. Short here while the global bucket seems to hold
        what is missing: a fetch starts and the verdict is ``pending`` (unless ``final``,
        the second ask after waiting: then refused, ``retry_after_s`` from what is known)."""
        self._mode(now)
        r, t = self.requests, self.tokens
        wait_r = r.wait_for(1, now) if r is not None else 0.0
        wait_t = t.wait_for(tokens, now) if t is not None else 0.0
        admitted = wait_r == 0.0 and wait_t == 0.0
        if admitted:
            if r is not None:
                r.take(1, now)
            if t is not None:
                t.take(tokens, now)
            self._prefetch(now)
            return self._verdict(True, 0.0, "", now)
        if wait_t == math.inf:
            reason = (
                f"the request's estimated {tokens} tokens exceed the key's tokens-per-minute limit"
            )
            return self._verdict(False, math.inf, reason, now)
        short = [(b, n) for b, n, w in ((r, 1, wait_r), (t, tokens, wait_t)) if b and w > 0]
        if not final and all(b.fetchable(n, now) for b, n in short):
            for b, n in short:
                asked = b.begin_fetch(n, now)
                if asked is not None:
                    self.source.refill(self, b, *asked)
            return self._verdict(False, max(wait_r, wait_t), "", now, pending=True)
        reason = "requests per minute" if wait_r >= wait_t else "tokens per minute"
        return self._verdict(False, max(wait_r, wait_t), reason, now)

    def take_request(self, now: float) -> float:
        """A call that costs one request and no tokens: take it from the balance (or the
        share) and return 0, else the seconds to wait (a fetch starts when the global
        bucket seems to hold one; this call does not wait for it)."""
        self._mode(now)
        r = self.requests
        if r is None:
            return 0.0
        wait = r.wait_for(1, now)
        if wait == 0.0:
            r.take(1, now)
            self._prefetch(now)
        elif r.fetchable(1, now):
            asked = r.begin_fetch(1, now)
            if asked is not None:
                self.source.refill(self, r, *asked)
        return wait

    def refund(self, tokens: int, now: float) -> None:
        """Give back what an admitted request was charged (a later layer refused it)."""
        if self.requests is not None:
            self.requests.give(1, now)
        if self.tokens is not None:
            self.tokens.give(tokens, now)

    def settle(self, charged: int, used: int, now: float) -> None:
        """Charge the reported usage ``used`` instead of the estimate ``charged`` (tokens
        bucket only): the difference is given back or charged (a debt of at most one
        minute's limit, forwarded to the global bucket at the next sync)."""
        b = self.tokens
        if b is None or used == charged:
            return
        if used < charged:
            b.give(charged - used, now)
        else:
            b.charge(used - charged, now)

    def state(self, now: float) -> EntryVerdict:
        """The limits now as an admitting verdict (headers of a settled answer)."""
        return self._verdict(True, 0.0, "", now)

    def full(self, now: float) -> bool:
        """True when nothing is held here (no balance, debt or fetch, not on the share):
        dropping this limiter loses only the global level last seen."""
        return all(b.idle() for b in self.buckets())

    def _verdict(
        self, admitted: bool, retry_s: float, reason: str, now: float, pending: bool = False
    ) -> EntryVerdict:
        r, t = self.requests, self.tokens
        return EntryVerdict(
            admitted,
            retry_s,
            self.rpm,
            None if r is None else r.remaining(now),
            None if r is None else r.reset_in(now),
            self.tpm,
            None if t is None else t.remaining(now),
            None if t is None else t.reset_in(now),
            reason,
            pending,
        )
