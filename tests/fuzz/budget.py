"""Each fuzz test's share of the hypothesis profile's example count (tests/conftest.py)."""

from __future__ import annotations

from hypothesis import settings

PER_PROFILE = 100
"""``max_examples`` of the ``ci`` profile: a test asking for ``n`` runs ``n`` there, and
``n`` times the profile's ``max_examples / PER_PROFILE`` under another (``long``: 10 x)."""


def examples(n: int) -> settings:
    """Settings running ``n`` examples under ``ci``, scaled under the loaded profile."""
    scale = settings().max_examples / PER_PROFILE
    return settings(max_examples=max(1, round(n * scale)))
