"""Liveness watchdog: is a backend still making progress? (pure: no I/O; time passed in)

A hung backend (a ``SIGSTOP``-ed vLLM, a wedged host, a dead event loop) accepts TCP
connections (the kernel does) and never answers. Probes that each wait out their timeout
find it only after ``fail_threshold x (timeout_s + interval_s)`` (about 9 s by default),
while a dead one (connection refused) fails its probes in about 3 s. This module judges
*silence* instead, which needs no timeout to pass:

* the backend **owes** an answer while a control-plane request sent to it (``/health``
  probe, ``/metrics`` scrape, ``/v1/models``) is outstanding, or ended unanswered (a
  timeout); a request it refused (connection refused, reset) owes nothing: that backend is
  dead, not hung, and the probes' ``fail_threshold`` handles it;
* it is **heard from** whenever anything comes back from it: an answer to any control
  request (whatever its status), a response start on the data path (headers, a first
  event, an error answer), an answer to a warm-up or application probe;
* it is **silent** from the later of the send time of the oldest request it owes and the
  last time it was heard from, until it is heard from again.

Requests the clients sent do not make it owe anything: a long time to first token is the
engine being busy, not hung, and while the backend answers its scrapes and probes it is
alive however slowly it generates.

Silence is measured on the injected clock, except that a check coming more than
:attr:`LivenessRule.max_step_s` after the previous one adds only that much: when the
gateway's own event loop stalls (a CPU-starved host, a huge body parsed), answers that
arrived meanwhile are not read yet and that time says nothing about the backend.

Verdicts (:meth:`Liveness.check`):

* ``suspect`` after ``suspect_after_s`` (default 1 s: the scrape's 1 s timeout passed
  unanswered, and a probe too): the router sends new requests to another backend when one
  can take them;
* ``hung`` after ``hung_after_s`` (default 2 s) when another backend was heard from during
  the silence (the gateway and its network work; this backend does not), or after
  ``alone_factor`` (2) times that when none was (a one-backend fleet, or the gateway's
  own network is the problem): the controller marks it ``unhealthy`` (``backend_hung``) and
  re-sends elsewhere the requests waiting on it whose first byte has not reached a client.

With the default scrape period (0.5 s) and probe period (1 s, sent on a fixed tick), a
request is owed at most about 0.5 s after the backend stops, so ``hung`` comes 2-2.6 s
after it stops: as fast as a dead backend's three refused probes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

CHECK_INTERVAL_S = 0.1  # seconds between two checks of the controller's liveness loop


class Verdict(StrEnum):
    ALIVE = "alive"
    SUSPECT = "suspect"
    HUNG = "hung"


@dataclass(frozen=True, slots=True)
class LivenessRule:
    """Thresholds of the watchdog, seconds (0 disables that verdict).

    ``suspect_after_s``: silence after which new requests go elsewhere when possible;
    ``hung_after_s``: silence after which the backend is hung, when another backend was
    heard from meanwhile; ``alone_factor`` times that when none was; ``max_step_s``: the most
    one late check adds to the silence (see the module docstring).
    """

    suspect_after_s: float = 1.0
    hung_after_s: float = 2.0
    alone_factor: float = 2.0
    max_step_s: float = 0.5


class Liveness:
    """What one backend owes the gateway and when it was last heard from.

    Times are the controller's monotonic clock, in seconds, and every ``now`` passed in is
    the current time (non-decreasing). Outstanding requests are named by the integer token
    :meth:`sent` returns; each ends with exactly one of :meth:`answered`,
    :meth:`unanswered` or :meth:`dropped`.
    """

    __slots__ = (
        "_debt_since",
        "_next",
        "_owed",
        "checked_at",
        "heard_at",
        "peer_heard",
        "silence_s",
        "verdict",
    )

    def __init__(self) -> None:
        self.heard_at = -math.inf  # last time anything came back
        self._owed: dict[int, float] = {}  # token -> send time, outstanding
        self._debt_since: float | None = None  # oldest unanswered (ended) since heard_at
        self._next = 0
        self.silence_s = 0.0  # silence so far, as of the last check
        self.checked_at: float | None = None
        self.verdict = Verdict.ALIVE
        self.peer_heard = False  # at the last check: another backend answered meanwhile

    # ---- events -----------------------------------------------------------------------------
    def sent(self, now: float) -> int:
        """A control request was sent at ``now``; returns its token."""
        self._next += 1
        self._owed[self._next] = now
        return self._next

    def answered(self, token: int, now: float) -> None:
        """The request ``token`` got an answer (any status) at ``now``."""
        self._owed.pop(token, None)
        self.heard(now)

    def unanswered(self, token: int) -> None:
        """The request ``token`` ended without an answer (timed out): the backend still owes
        it until it is heard from again."""
        sent = self._owed.pop(token, None)
        if sent is not None:
            self._debt_since = sent if self._debt_since is None else min(self._debt_since, sent)

    def dropped(self, token: int) -> None:
        """The request ``token`` ended owing nothing: refused or reset (a dead backend,
        which the probes judge), or abandoned by the gateway (cancelled, no free pooled
        connection)."""
        self._owed.pop(token, None)

    def heard(self, now: float) -> None:
        """Something came back from the backend at ``now`` (any answer, on any path)."""
        if now > self.heard_at:
            self.heard_at = now
        self._debt_since = None

    # ---- judgement --------------------------------------------------------------------------
    def silent_since(self) -> float | None:
        """Start of the current silence (seconds), or None when the backend owes nothing."""
        owed = min(self._owed.values(), default=None)
        if self._debt_since is not None:
            owed = self._debt_since if owed is None else min(owed, self._debt_since)
        if owed is None:
            return None
        return max(owed, self.heard_at)

    def check(self, now: float, peers_heard_at: float, rule: LivenessRule) -> Verdict:
        """Advance the silence to ``now`` and return (and keep in :attr:`verdict`) the
        verdict. ``peers_heard_at``: the latest time any *other* backend was heard from
        (``-inf`` when there is none)."""
        since = self.silent_since()
        last, self.checked_at = self.checked_at, now
        if since is None:
            self.silence_s = 0.0
            self.peer_heard = False
            self.verdict = Verdict.ALIVE
            return self.verdict
        step = 0.0 if last is None else min(max(0.0, now - last), rule.max_step_s)
        self.silence_s = min(self.silence_s + step, max(0.0, now - since))
        self.peer_heard = peers_heard_at > since
        verdict = Verdict.ALIVE
        if rule.hung_after_s > 0:
            limit = rule.hung_after_s * (1.0 if self.peer_heard else rule.alone_factor)
            if self.silence_s >= limit:
                verdict = Verdict.HUNG
        if verdict is Verdict.ALIVE and 0 < rule.suspect_after_s <= self.silence_s:
            verdict = Verdict.SUSPECT
        self.verdict = verdict
        return verdict

    @property
    def owed(self) -> int:
        """Control requests outstanding now."""
        return len(self._owed)
