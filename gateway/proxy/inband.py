"""What a stream says about its own end (pure): in-band errors, the Responses API's terminal
events, and which end each kind of stream must have.

A backend that already answered 200 can only report a request error inside the stream:

* chat and completions streams (vLLM ``serving_chat.py`` / ``serving_completion.py``:
  ``create_streaming_error_response``): ``data: {"error": {"message", "type", "param",
  "code"}}`` with ``code`` the HTTP status it would have answered, usually followed by
  ``data: [DONE]``;
* Responses API streams (OpenAI's streaming events reference, "error" and
  "response.failed"): ``event: error`` with ``{"type": "error", "code", "message",
  "param", "sequence_number"}``, or the terminal ``response.failed`` whose ``response``
  carries ``"error": {"code", "message"}``.

A Responses API stream ends with exactly one terminal event: ``response.completed``,
``response.incomplete`` (finished early, e.g. ``max_output_tokens``: still an answer) or
``response.failed``; a stream whose body ends without one is cut short.

:class:`gateway.proxy.sse.EventFramer` calls :func:`inspect_events` only on blocks that a
substring test flags, so ordinary token events cost one ``in`` test each. The word
"error" in a token's text is not an error: the event's JSON must be an error object at its
top level.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum
from typing import Any

# Responses API terminal event types (OpenAI streaming events reference; vLLM
# serving_responses.py emits the same names)
COMPLETED = "response.completed"
INCOMPLETE = "response.incomplete"
FAILED = "response.failed"
TERMINAL_EVENTS = frozenset({COMPLETED, INCOMPLETE, FAILED})
TERMINAL_MARKERS = (COMPLETED.encode(), INCOMPLETE.encode(), FAILED.encode())


class StreamKind(Enum):
    """How a stream of an endpoint must end to be complete."""

    DONE = "done"  # chat, completions: ``data: [DONE]`` (OpenAI, vLLM)
    RESPONSES = "responses"  # the Responses API: one terminal event, then the body ends
    OPEN = "open"  # another pass-through stream: the body's end is its end


_KINDS = {
    "/v1/chat/completions": StreamKind.DONE,
    "/v1/completions": StreamKind.DONE,
    # vLLM streams transcriptions and translations as chat-like chunks ending in [DONE]
    "/v1/audio/transcriptions": StreamKind.DONE,
    "/v1/audio/translations": StreamKind.DONE,
    "/v1/responses": StreamKind.RESPONSES,
}


def stream_kind(endpoint: str) -> StreamKind:
    """The kind of ``endpoint``'s streams (a path such as ``/v1/chat/completions``)."""
    return _KINDS.get(endpoint, StreamKind.OPEN)


@dataclass(frozen=True, slots=True)
class InBandError:
    """A request error a backend reported inside a 200 stream: its ``message``, its
    ``code`` as sent (vLLM: the HTTP status as an int; the Responses API: a string such
    as ``server_error``, or None) and ``type`` (may be None)."""

    message: str
    code: Any
    type: str | None = None

    @property
    def status(self) -> int:
        """The HTTP status the request is counted under: ``code`` when it is a 4xx or
        5xx status (vLLM's numeric codes), else 500."""
        code = self.code
        if isinstance(code, str) and code.isdigit():
            code = int(code)
        if isinstance(code, int) and not isinstance(code, bool) and 400 <= code <= 599:
            return code
        return 500


def _event_data(event: bytes) -> tuple[str | None, bytes]:
    """An SSE event's ``event:`` name (None if absent) and its joined ``data`` lines."""
    name: str | None = None
    data: list[bytes] = []
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            v = line[5:]
            data.append(v[1:] if v.startswith(b" ") else v)
        elif line.startswith(b"event:"):
            name = line[6:].strip().decode("utf-8", "replace")
    return name, b"\n".join(data)


def _as_error(obj: dict[str, Any], fallback: str) -> InBandError:
    message = obj.get("message")
    type_ = obj.get("type")
    return InBandError(
        message if isinstance(message, str) else fallback,
        obj.get("code"),
        type_ if isinstance(type_, str) else None,
    )


def _error_of(name: str | None, obj: Any) -> InBandError | None:
    """The in-band error ``obj`` (an event's parsed data; ``name``: its ``event:``) is, if
    any."""
    if not isinstance(obj, dict):
        return None
    err = obj.get("error")
    kind = obj.get("type")
    if kind == FAILED:  # the Responses API's terminal failure
        resp = obj.get("response")
        inner = resp.get("error") if isinstance(resp, dict) else None
        if isinstance(inner, dict):
            return _as_error(inner, "response.failed")
        return InBandError("response.failed", None)
    if kind == "error" or name == "error":  # the Responses API's error event
        if isinstance(err, dict):  # some servers nest it
            return _as_error(err, "error")
        return _as_error(obj, "error")
    if isinstance(err, dict):  # chat / completions: {"error": {...}} (vLLM, OpenAI)
        return _as_error(err, "error")
    if isinstance(err, str) and err:  # {"error": "..."}: the OpenAI SDK raises on it too
        return InBandError(err, None)
    return None


def inspect_events(block: bytes) -> tuple[InBandError | None, str | None]:
    """The first in-band error and the last Responses API terminal event type among the
    complete events in ``block`` (LF line endings). Parses only the events that mention
    ``error`` or a terminal event's name; data that is not JSON is ignored."""
    error: InBandError | None = None
    terminal: str | None = None
    for event in block.split(b"\n\n"):
        if b"error" not in event and not any(m in event for m in TERMINAL_MARKERS):
            continue
        name, data = _event_data(event)
        if not data or data == b"[DONE]":
            continue
        try:
            obj = json.loads(data)
        except ValueError:
            continue
        if error is None:
            error = _error_of(name, obj)
        if isinstance(obj, dict) and obj.get("type") in TERMINAL_EVENTS:
            terminal = obj["type"]
    return error, terminal
