"""The gateway's own readiness: named checks, each saying whether this process can take
requests now, and why not.

``GET /ready`` (:mod:`gateway.api.ops`) answers 200 only when every registered check
passes (and the gateway is not shutting down); a Kubernetes readiness probe or a load
balancer reads it. The checks are about *this gateway process*, never about its backends:
an empty or all-down fleet is answered by the gateway itself (503 with ``retry-after`` in
the OpenAI error shape), so it must stay in its load balancer to say so. Who registers
which check: :func:`gateway.wiring.build_gateway` (the control loops; the shared store in
fleet mode) and backend discovery (synced). Each part registers its own, so the seam knows
nothing of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

# A check: no arguments, returns (passes, detail). ``detail`` is one line for operators:
# what passes, or why not. It must be cheap and must not block (read memory, no I/O): the
# probe asks every few seconds.
Check = Callable[[], tuple[bool, str]]


@dataclass(frozen=True)
class CheckResult:
    """One check's answer: ``name`` as registered, ``ok``, ``detail`` (one line)."""

    name: str
    ok: bool
    detail: str


@dataclass(frozen=True)
class ReadinessReport:
    """Every check's answer, in registration order; ``ready`` when all pass (no check
    registered: ready)."""

    checks: tuple[CheckResult, ...]

    @property
    def ready(self) -> bool:
        """Whether every check passes."""
        return all(c.ok for c in self.checks)

    @property
    def failing(self) -> tuple[CheckResult, ...]:
        """The checks that do not pass, in registration order."""
        return tuple(c for c in self.checks if not c.ok)


class Readiness:
    """The named readiness checks of one gateway (held by :class:`gateway.wiring.Gateway`
    as ``readiness``)."""

    def __init__(self) -> None:
        self._checks: dict[str, Check] = {}

    def add(self, name: str, check: Check) -> None:
        """Register ``check`` under ``name`` (e.g. ``"control_loops"``, ``"coordination"``,
        ``"discovery"``). Raises ``ValueError`` when ``name`` is taken: a part registers
        its check once."""
        if name in self._checks:
            raise ValueError(f"readiness check {name!r} is already registered")
        self._checks[name] = check

    @property
    def names(self) -> tuple[str, ...]:
        """The registered checks' names, in registration order."""
        return tuple(self._checks)

    def report(self) -> ReadinessReport:
        """Ask every check now. A check that raises fails, its exception as the detail: a
        bug in one part's check says so instead of breaking the probe."""
        out = []
        for name, check in self._checks.items():
            try:
                ok, detail = check()
            except Exception as exc:
                ok, detail = False, f"the check raised {type(exc).__name__}: {exc}"
            out.append(CheckResult(name, bool(ok), detail))
        return ReadinessReport(tuple(out))
