"""The entry layer's state: each client key's (or anonymous client address's) token buckets,
and what admission charged each admitted request to them (:class:`Charge`), settled once
with the answer's reported usage.

:class:`gateway.flow.admission.AdmissionGate` owns one :class:`KeyLimits` and decides with
it (the pure buckets are :class:`gateway.traffic.limits.KeyLimiter`); a request's
:class:`Charge` travels on its :class:`gateway.flow.context.RequestContext`.

In fleet mode (:meth:`KeyLimits.use_quota`, filled by :func:`gateway.wiring.build_gateway`)
the limiters are :class:`gateway.traffic.quota.GlobalKeyLimiter`: each key's limits are
global buckets in the shared store, admitted here from local chunks; a request whose local
quota is empty may wait for the running fetch, bounded (:meth:`KeyLimits.refilled`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from gateway.config import AdmissionConfig, ClientKey
from gateway.traffic.estimate import plausible_usage
from gateway.traffic.limits import EntryLimiter, EntryVerdict, KeyLimiter
from gateway.traffic.quota import GlobalKeyLimiter, QuotaSource

LIMITER_SWEEP_MIN = 1024  # limiters kept before full (idle) ones are dropped


class GlobalQuota(QuotaSource, Protocol):
    """Fleet mode's global limits as the entry layer sees them
    (:class:`gateway.coord.quota.GlobalQuotas`): a :class:`QuotaSource` that also tracks the
    limiters made here and lets a request wait for a running fetch."""

    def track(self, limiter: GlobalKeyLimiter) -> None: ...
    def forget(self, limiter: GlobalKeyLimiter) -> None: ...
    def wait(self, limiter: GlobalKeyLimiter, timeout_s: float) -> Awaitable[bool]: ...


class KeyLimits:
    """Per-client token buckets: requests and tokens per minute from the key's ``rpm`` /
    ``tpm``, else ``admission.default_rpm`` / ``default_tpm``. ``clock``: monotonic
    seconds."""

    def __init__(self, cfg: AdmissionConfig, clock: Callable[[], float]) -> None:
        self.cfg = cfg
        self.clock = clock
        self.limiters: dict[str, EntryLimiter] = {}  # client key name or IP -> its buckets
        self._sweep_at = LIMITER_SWEEP_MIN
        self.quota: GlobalQuota | None = None  # fleet mode's global limits
        self.quota_chunk = 0.05
        self.quota_wait_s = 0.0

    def use_quota(self, quota: GlobalQuota, chunk: float, wait_s: float) -> None:
        """Fleet mode: limiters made from now on are global (chunks of ``chunk`` x the
        limit from ``quota``); a request finding its quota empty waits for the running
        fetch at most ``wait_s`` seconds."""
        self.quota = quota
        self.quota_chunk = chunk
        self.quota_wait_s = wait_s

    async def refilled(self, limiter: EntryLimiter) -> None:
        """Wait (at most ``quota_wait_s``) for the fetches a ``pending`` verdict of
        ``limiter`` started; returns at once without fleet mode."""
        if self.quota is not None and isinstance(limiter, GlobalKeyLimiter):
            await self.quota.wait(limiter, self.quota_wait_s)

    def limiter(self, name: str, key: ClientKey | None) -> EntryLimiter | None:
        """The buckets of client ``name`` (its key's name, or its address), made on first
        use; None when neither the key nor the defaults set a limit. Limiters that are
        full again (exactly like new ones) are dropped when the table has doubled since the
        last sweep, so one-off clients cannot grow it without bound."""
        a = self.cfg
        rpm = (key.rpm if key else None) or a.default_rpm
        tpm = (key.tpm if key else None) or a.default_tpm
        if rpm is None and tpm is None:
            return None
        lim = self.limiters.get(name)
        if lim is None:
            now = self.clock()
            if len(self.limiters) >= self._sweep_at:
                # drop the limiters that are full again (exactly like new ones); amortised:
                # the next sweep waits until the table has doubled
                kept = {n: x for n, x in self.limiters.items() if not x.full(now)}
                if self.quota is not None:
                    for n, x in self.limiters.items():
                        if n not in kept and isinstance(x, GlobalKeyLimiter):
                            self.quota.forget(x)
                self.limiters = kept
                self._sweep_at = max(LIMITER_SWEEP_MIN, 2 * len(self.limiters))
            lim = self.limiters[name] = self._new(name, rpm, tpm, now)
        return lim

    def reconfigure(self, cfg: AdmissionConfig) -> None:
        """A live reload's ``admission``: when the default rates changed, every client's
        buckets start full at the new limits (a key's own ``rpm`` / ``tpm`` are
        :meth:`drop`'s)."""
        changed = (cfg.default_rpm, cfg.default_tpm) != (self.cfg.default_rpm,
                                                         self.cfg.default_tpm)
        self.cfg = cfg
        if changed:
            for name in list(self.limiters):
                self.drop(name)

    def drop(self, name: str) -> None:
        """Forget client ``name``'s buckets (a live reload changed or removed its key's
        limits): its next request starts with full buckets at the new limits."""
        lim = self.limiters.pop(name, None)
        if lim is not None and self.quota is not None and isinstance(lim, GlobalKeyLimiter):
            self.quota.forget(lim)

    def _new(self, name: str, rpm: int | None, tpm: int | None, now: float) -> EntryLimiter:
        if self.quota is None:
            return KeyLimiter(rpm, tpm, now)
        lim = GlobalKeyLimiter(name, rpm, tpm, now, self.quota_chunk, self.quota)
        self.quota.track(lim)
        return lim

    def settle(self, charge: Charge, usage: tuple[int, int] | None) -> EntryVerdict | None:
        """The answer of a request admitted with ``charge`` reported ``usage`` (prompt,
        completion tokens): the key is charged that instead of the estimate
        (:meth:`KeyLimiter.settle`), once. Returns the key's buckets now (for the
        answer's ``x-ratelimit-*`` headers), or None when nothing changed: no usage
        reported, or a usage out of range (:func:`gateway.traffic.estimate.plausible_usage`):
        the estimate stands; or already settled."""
        usage = plausible_usage(usage)  # a broken backend's numbers charge nothing
        if usage is None or charge.settled:
            return None
        charge.settled = True
        # the key's limiter now: the one charged, unless dropped as full meanwhile and
        # made anew (then that one; a dropped one with no successor is taken back)
        limiter = self.limiters.setdefault(charge.key, charge.limiter)
        if limiter is charge.limiter and self.quota is not None:
            if isinstance(limiter, GlobalKeyLimiter):
                self.quota.track(limiter)  # (again, if it had been dropped)
        now = self.clock()
        limiter.settle(charge.tokens, usage[0] + usage[1], now)
        return limiter.state(now)


@dataclass(slots=True, eq=False)
class Charge:
    """What admission charged one request to its client key ``key`` (name or address):
    ``tokens`` estimated tokens taken from ``limiter``, with the entry ``verdict`` then.
    Settled at most once, against the answer's reported usage (:meth:`KeyLimits.settle`)."""

    keys: KeyLimits
    key: str
    limiter: EntryLimiter
    tokens: int
    verdict: EntryVerdict
    settled: bool = False

    def settle(self, usage: tuple[int, int] | None) -> EntryVerdict | None:
        """See :meth:`KeyLimits.settle`."""
        return self.keys.settle(self, usage)
