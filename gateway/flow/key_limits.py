"""The entry layer's state: each client key's (or anonymous client address's) token buckets,
and what admission charged each admitted request to them (:class:`Charge`), settled once
with the answer's reported usage.

:class:`gateway.flow.admission.AdmissionGate` owns one :class:`KeyLimits` and decides with
it (the pure buckets are :class:`gateway.traffic.limits.KeyLimiter`); a request's
:class:`Charge` travels on its :class:`gateway.flow.context.RequestContext`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gateway.config import AdmissionConfig, ClientKey
from gateway.traffic.estimate import plausible_usage
from gateway.traffic.limits import EntryVerdict, KeyLimiter

LIMITER_SWEEP_MIN = 1024  # limiters kept before full (idle) ones are dropped


class KeyLimits:
    """Per-client token buckets: requests and tokens per minute from the key's ``rpm`` /
    ``tpm``, else ``admission.default_rpm`` / ``default_tpm``. ``clock``: monotonic
    seconds."""

    def __init__(self, cfg: AdmissionConfig, clock: Callable[[], float]) -> None:
        self.cfg = cfg
        self.clock = clock
        self.limiters: dict[str, KeyLimiter] = {}  # client key name or IP -> its buckets
        self._sweep_at = LIMITER_SWEEP_MIN

    def limiter(self, name: str, key: ClientKey | None) -> KeyLimiter | None:
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
                self.limiters = {n: x for n, x in self.limiters.items() if not x.full(now)}
                self._sweep_at = max(LIMITER_SWEEP_MIN, 2 * len(self.limiters))
            lim = self.limiters[name] = KeyLimiter(rpm, tpm, now)
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
    limiter: KeyLimiter
    tokens: int
    verdict: EntryVerdict
    settled: bool = False

    def settle(self, usage: tuple[int, int] | None) -> EntryVerdict | None:
        """See :meth:`KeyLimits.settle`."""
        return self.keys.settle(self, usage)
