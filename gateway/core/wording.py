"""Counted nouns in messages people read: ``plural(1, "backend")`` is "1 backend",
``plural(3, "backend")`` is "3 backends" (never "1 backends")."""

from __future__ import annotations


def plural(n: int, noun: str, nouns: str | None = None) -> str:
    """``n`` and ``noun``, in the plural unless ``n`` is 1 (English: 0 takes the plural).

    ``nouns`` is the plural form; default ``noun + "s"``. Returns e.g. "1 request",
    "0 requests", "2 GPUs"."""
    return f"{n} {noun if n == 1 else (nouns or noun + 's')}"
