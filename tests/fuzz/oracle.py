"""The fuzz tests' oracle (issue 20): what every generated input must get, and what must hold
after it.

Each answer is either relayed (a backend's own answer, 2xx or its error) or a clear 4xx the
gateway wrote itself in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``;
never a 5xx the gateway made of bad input, never a traceback or a Python repr in the bytes a
client gets. Afterwards (:func:`assert_settled`): no backend slot held (``in_flight`` 0 in
``/admin/backends``), no admission slot held (the fuzz gateways run with a small
``admission.max_in_flight``, so a leaked slot makes the next plain request wait and fail),
every backend still routable, and the control loops still running
(``gateway_loop_last_success_timestamp_seconds`` moving on for ``probe``, ``scrape`` and
``models``).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from typing import Any

import httpx

from tests.support.scripted import wait_for

WAIT_S = 20.0  # generous bound on any wait (a slow, shared machine)

# What Python leaks when an exception or an object reaches a client's bytes.
_LEAKS = re.compile(
    rb"Traceback \(most recent call last\)|File \"[^\"]+\.py\", line \d+"
    rb"|<[A-Za-z_][\w.]* object at 0x[0-9a-f]+>|<class '|<built-in |"
    rb"\b(?:KeyError|TypeError|AttributeError|IndexError|AssertionError|UnboundLocalError"
    rb"|NameError|RecursionError|UnicodeEncodeError|UnicodeDecodeError|ZeroDivisionError"
    rb"|OverflowError)\b"
)

ERROR_KEYS = {"message", "type", "param", "code"}


def leaks(data: bytes) -> str | None:
    """The first traceback, exception name or Python repr in ``data``, or None."""
    m = _LEAKS.search(data)
    return None if m is None else m.group(0).decode("latin-1")


def openai_error(body: bytes) -> str | None:
    """Why ``body`` is not one OpenAI error object, or None when it is."""
    try:
        obj = json.loads(body)
    except ValueError:
        return f"not JSON: {body[:200]!r}"
    if not isinstance(obj, dict) or set(obj) != {"error"}:
        return f"not {{'error': ...}}: {body[:200]!r}"
    err = obj["error"]
    if not isinstance(err, dict) or not ERROR_KEYS <= set(err):
        return f"error object without {sorted(ERROR_KEYS)}: {body[:200]!r}"
    if not isinstance(err["message"], str) or not err["message"]:
        return f"no message: {body[:200]!r}"
    if not isinstance(err["type"], str) or not err["type"]:
        return f"no type: {body[:200]!r}"
    return None


Relayed = Callable[[int, bytes], bool]


def check_answer(status: int, headers: dict[str, str], body: bytes,
                 backend_side: bool = False, relayed: Relayed | None = None) -> None:
    """The oracle on one answer (module docstring). ``relayed``: whether ``(status, body)``
    is a backend's own answer, relayed as it came (its shape is the backend's business,
    a 500 included); ``backend_side``: the backends misbehave, so the gateway's own 502,
    503 and 504 (OpenAI-shaped) are answers too, never its 500."""
    leak = leaks(body)
    assert leak is None, f"{status}: Python internals in the answer ({leak!r}): {body[:400]!r}"
    own = not (relayed is not None and relayed(status, body))
    if own:
        allowed = (502, 503, 504) if backend_side else ()
        assert status < 500 or status in allowed, f"{status} from the gateway: {body[:400]!r}"
        if status >= 400:
            why = openai_error(body)
            assert why is None, f"{status} {headers.get('content-type')}: {why}"


def check_raw(raw: bytes, relayed: Relayed | None = None) -> int:
    """:func:`check_answer` on one raw HTTP/1.1 answer (as read from a socket); its status
    (0: the connection was closed with no answer, which h11 / uvicorn do to a request line
    or head they cannot parse: nothing reached the gateway's code)."""
    if not raw:
        return 0
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(b":")
        headers[k.strip().lower().decode("latin-1")] = v.strip().decode("latin-1")
    if headers.get("transfer-encoding") == "chunked":
        body = dechunk(body)
    check_answer(status, headers, body, relayed=relayed)
    return status


def dechunk(data: bytes) -> bytes:
    """A chunked HTTP body's bytes (as much as arrived)."""
    out = b""
    while data:
        size_line, sep, rest = data.partition(b"\r\n")
        if not sep:
            break
        size = int(size_line.split(b";")[0] or b"0", 16)
        if size == 0:
            break
        out += rest[:size]
        data = rest[size + 2:]
    return out


def admin(http: httpx.Client, url: str) -> list[dict[str, Any]]:
    """``/admin/backends``' list (``http``: a client kept for the module: a new httpx
    client loads the CA bundle, ~0.1 s)."""
    r = http.get(url + "/admin/backends", timeout=WAIT_S)
    assert r.status_code == 200, r.text
    data = r.json()
    return data["backends"] if isinstance(data, dict) else data  # type: ignore[no-any-return]


def loop_marks(http: httpx.Client, url: str) -> dict[str, float]:
    """``gateway_loop_last_success_timestamp_seconds`` by loop."""
    marks: dict[str, float] = {}
    for line in http.get(url + "/metrics", timeout=WAIT_S).text.splitlines():
        m = re.match(r'gateway_loop_last_success_timestamp_seconds\{loop="(\w+)"\} (\S+)', line)
        if m:
            marks[m.group(1)] = float(m.group(2))
    return marks


def no_slot_held(http: httpx.Client, url: str) -> None:
    """Every backend's ``in_flight`` back to 0 (a stream's slot is given back just after
    its last bytes: waited for)."""
    assert wait_for(lambda: all(b["in_flight"] == 0 for b in admin(http, url)), WAIT_S), \
        admin(http, url)


def assert_settled(http: httpx.Client, url: str, plain: Callable[[], httpx.Response],
                   loops: tuple[str, ...] = ("probe", "scrape", "models"),
                   routable: int = 2) -> None:
    """What must hold after a run of fuzzed inputs (module docstring): every slot given back,
    ``routable`` backends routable, ``loops`` running, and ``plain`` (a normal request)
    answered 200."""
    no_slot_held(http, url)
    assert wait_for(
        lambda: len(http.get(url + "/ready/fleet", timeout=WAIT_S).json()["routable"])
        >= routable, WAIT_S), admin(http, url)
    before = loop_marks(http, url)
    assert set(loops) <= set(before), before
    t0 = time.time()
    assert wait_for(lambda: all(loop_marks(http, url)[n] > max(before[n], t0 - 0.001)
                                for n in loops), WAIT_S), (before, loop_marks(http, url))
    for _ in range(3):  # more than the admission slots: a leaked one would make these wait
        r = plain()
        assert r.status_code == 200, (r.status_code, r.text[:400])
