"""JSON text as the UTF-8 bytes the gateway writes on the wire (pure).

``json.loads`` reads a lone surrogate escape (``"\\ud800"``, legal JSON by RFC 8259
section 7, which does not require escapes to pair) into a Python ``str`` that UTF-8 cannot
encode, so ``json.dumps(obj, ensure_ascii=False).encode()`` raises ``UnicodeEncodeError``
on a body or event holding one: a client's bad text became the gateway's 500 (found by
the fuzz tests, issue 20, tests/fuzz/test_request_bodies.py).
"""

from __future__ import annotations

import json
from typing import Any


def utf8_json(obj: Any, separators: tuple[str, str] | None = None) -> bytes:
    """``obj`` as UTF-8 JSON bytes: non-ASCII characters written as themselves (as vLLM's
    pydantic writes them; a third of the size of ``\\uXXXX`` escapes for most scripts), or,
    when some text holds a lone surrogate, with every non-ASCII character escaped (the same
    JSON value, RFC 8259 section 7). ``separators``: as :func:`json.dumps`'s."""
    text = json.dumps(obj, ensure_ascii=False, separators=separators)
    try:
        return text.encode()
    except UnicodeEncodeError:
        return json.dumps(obj, separators=separators).encode()
