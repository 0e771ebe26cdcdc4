"""Fixtures of the ops tests: the lifecycle tests' simulators and gateway."""

from tests.lifecycle.conftest import lc_gateway, sims  # noqa: F401 (fixtures)
