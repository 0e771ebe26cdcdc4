"""Server-sent events helpers for the relay (pure, bytes in -> bytes out).

The relay forwards upstream bytes unchanged, with two exceptions that keep clients safe:

* it releases only *complete* events (up to the last blank line), holding an incomplete
  tail, so an error event added after an upstream failure never lands inside a half event;
* CR and CRLF line endings (legal in SSE, https://html.spec.whatwg.org/multipage/server-sent-events.html)
  are rewritten to LF, the framing OpenAI clients expect. JSON payloads
  cannot contain a raw CR, so this never changes a payload.

Nothing is decoded: multi-byte UTF-8 split across chunks passes through intact.
"""

from __future__ import annotations

import json
import re

from gateway.proxy.inband import TERMINAL_MARKERS, InBandError, inspect_events

DONE_EVENT = b"data: [DONE]\n\n"
# the end marker as any SSE writer may frame it: ``data:`` then an optional space (the
# spec strips one), ``[DONE]``, on a line of its own, anywhere in a released block
_DONE_RE = re.compile(rb"(?m)^data: ?\[DONE\][ \t]*$")

_COMPLETED, _INCOMPLETE, _FAILED = TERMINAL_MARKERS

# Chat, completions and embeddings name them prompt/completion tokens; the Responses API
# input/output tokens (https://platform.openai.com/docs/api-reference/responses/object)
_PROMPT_RE = re.compile(rb'"(?:prompt|input)_tokens"\s*:\s*(\d+)')
_COMPLETION_RE = re.compile(rb'"(?:completion|output)_tokens"\s*:\s*(\d+)')


class EventFramer:
    """Cuts a byte stream into complete SSE events and normalises line endings to LF.

    ``feed(chunk)`` returns the bytes of the events completed by ``chunk`` (possibly
    ``b""``); ``pending`` is the incomplete tail. Each released block is searched (a
    substring test first, so ordinary token events cost almost nothing) for the ``[DONE]``
    marker (:attr:`saw_done`: seen at any point, however it was framed, whatever follows it),
    for a usage object (the last one seen is kept), for an in-band error (:attr:`error`, the
    first one) and for a Responses API terminal event (:attr:`terminal`), parsing only the
    events a substring test flags (:func:`gateway.proxy.inband.inspect_events`).
    """

    __slots__ = ("_buf", "_done", "_usage", "error", "events", "terminal")

    def __init__(self) -> None:
        self._buf = b""
        self.events = 0  # complete events released (a stream's mean ITL: canary rollouts)
        self._usage: tuple[int, int] | None = None
        self._done = False
        self.error: InBandError | None = None  # the first request error the stream carried
        self.terminal: str | None = None  # the Responses API terminal event type, once seen

    @property
    def pending(self) -> bytes:
        return self._buf

    def feed(self, chunk: bytes) -> bytes:
        data = self._buf + chunk if self._buf else chunk
        hold = b""
        if b"\r" in data:
            if data.endswith(b"\r"):  # maybe the first half of a CRLF split across chunks
                data, hold = data[:-1], b"\r"
            data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        cut = data.rfind(b"\n\n")
        if cut < 0:
            self._buf = data + hold
            return b""
        end = cut + 2
        if end == len(data):
            out, self._buf = data, hold
        else:
            out, self._buf = data[:end], data[end:] + hold
        self.events += out.count(b"\n\n")
        if b"[DONE]" in out and _DONE_RE.search(out):
            self._done = True
        if b'"usage"' in out:
            usage = extract_usage(out)
            if usage is not None:
                self._usage = usage
        if b"error" in out or (
            b"response." in out
            and (_COMPLETED in out or _INCOMPLETE in out or _FAILED in out)
        ):
            error, terminal = inspect_events(out)
            if self.error is None:
                self.error = error
            if terminal is not None:
                self.terminal = terminal
        return out

    def finish(self) -> bytes:
        """At end of stream: a held tail that is the last event cut short of its blank line
        only (``data: [DONE]\\n`` or ``data: [DONE]`` then the body ends: :func:`whole_tail`)
        is released with its line endings completed, as an SSE client (the OpenAI SDK's)
        reads it at end of input. A tail cut inside its last line (a backend that stopped
        mid-write, its body then ended cleanly) is dropped: half an event, perhaps half a
        UTF-8 sequence, never reaches the client, and the stream ends without its end
        (``[DONE]`` not seen). Returns the released bytes (``b""`` when nothing was held or
        the tail was dropped)."""
        buf, self._buf = self._buf, b""
        if buf.endswith(b"\r"):
            buf = buf[:-1] + b"\n"
        if not buf.strip(b"\r\n") or not whole_tail(buf):
            return b""
        buf = buf.rstrip(b"\r\n") + b"\n\n"
        return self.feed(buf)

    @property
    def saw_done(self) -> bool:
        """True once a released block held a ``data: [DONE]`` line (``data:[DONE]`` too)."""
        return self._done

    def usage(self) -> tuple[int, int] | None:
        """``(prompt_tokens, completion_tokens)`` from the last usage seen, if any."""
        return self._usage


def whole_tail(tail: bytes) -> bool:
    """Whether ``tail`` (what was held at the body's end: no blank line, LF line endings) is
    a whole event short of its blank line, not one cut in the middle: its last line ended
    (a JSON payload holds no raw LF, so an ended ``data:`` line is whole), or that line is
    a ``data:`` line and the event's data (its ``data`` lines joined with LF, one leading
    space dropped: the SSE spec) is ``[DONE]`` or parses as JSON."""
    if tail.endswith(b"\n"):
        return True
    lines = tail.split(b"\n")
    if not lines[-1].startswith(b"data"):
        return False
    values = [line[5:] for line in lines if line.startswith(b"data:")]
    data = b"\n".join(v[1:] if v.startswith(b" ") else v for v in values)
    if data.strip() == b"[DONE]":
        return True
    try:
        json.loads(data)
    except ValueError:  # UnicodeDecodeError too: cut inside a UTF-8 sequence
        return False
    return True


def has_event(block: bytes) -> bool:
    """True when ``block`` (complete events, LF line endings) holds a ``data`` line: an
    event a client dispatches, which commits the stream to its backend. Comments
    (``: ping``) and events of fields without data (``retry:``, ``id:``, a bare ``event:``)
    are not dispatched (the SSE spec), so a failure after them may still be retried."""
    return any(line.startswith(b"data") for line in block.split(b"\n"))


def extract_usage(body: bytes) -> tuple[int, int] | None:
    """Token usage ``(prompt, completion)`` from the last ``"usage"`` object in ``body`` (a
    JSON body or SSE tail): ``prompt_tokens`` / ``completion_tokens``, or the Responses
    API's ``input_tokens`` / ``output_tokens``.

    Looks only after the last ``"usage"`` key (vLLM writes usage last), so the cost does
    not grow with the body. Returns None when absent or null.
    """
    i = body.rfind(b'"usage"')
    if i < 0:
        return None
    tail = body[i : i + 400]
    p = _PROMPT_RE.search(tail)
    if p is None:
        return None
    c = _COMPLETION_RE.search(tail)
    return int(p.group(1)), int(c.group(1)) if c else 0


def error_event(message: str, code: str, type_: str = "server_error") -> bytes:
    """One OpenAI-shaped error event: ``data: {"error": {...}}\\n\\n`` (chat and
    completions streams, as vLLM ends a failed stream)."""
    payload = {"error": {"message": message, "type": type_, "param": None, "code": code}}
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def responses_error_event(message: str, code: str) -> bytes:
    """The Responses API's error event (``event: error`` with ``{"type": "error", ...}``);
    those streams have no ``[DONE]``."""
    payload = {"type": "error", "code": code, "message": message, "param": None}
    return b"event: error\ndata: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"
