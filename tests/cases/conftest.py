"""Fixtures of the case tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.cases.default_waits import SCENARIOS, DefaultWaits


@pytest.fixture(scope="session")
def default_waits(request: pytest.FixtureRequest) -> Iterator[DefaultWaits]:
    """The scenarios that wait out production defaults (:mod:`tests.cases.default_waits`),
    started together for the tests of this session that read them."""
    waits = DefaultWaits()
    ids = [item.nodeid for item in request.session.items]
    waits.start([name for name, (tail, _) in SCENARIOS.items()
                 if any(i.endswith(tail) for i in ids)])
    yield waits
    waits.close()
