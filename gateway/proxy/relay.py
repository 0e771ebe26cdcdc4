"""Client-side I/O of a proxied request: the disconnect watch and the SSE relay.

:class:`ClientWatch` notices a client that hangs up (the ASGI ``http.disconnect``
message) while the gateway waits on a backend, and cancels the request's task so the
upstream request is closed at once and vLLM aborts the generation (cases BUG-01/BUG-02:
Starlette abandons a streaming body without closing it, and LiteLLM kept generating for
nobody). It costs one small task per request.

:class:`RelayResponse` is an ASGI response that relays a backend's event stream as it
arrives: no buffering beyond one incomplete event, no compression, LF framing. After the
first byte reached the client nothing is retried; a failure ends the stream with one
OpenAI-shaped error event then ``data: [DONE]`` (as vLLM does), unless a
:class:`Resumer` continues it on another backend (issue 17, a chat or completions stream:
:mod:`gateway.flow.continuing`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
from starlette.responses import Response

from gateway.core.vocab import Cut
from gateway.proxy.continuation import hide_token_ids
from gateway.proxy.inband import StreamKind
from gateway.proxy.sse import DONE_EVENT, EventFramer, error_event, responses_error_event
from gateway.proxy.stitch import Stitcher
from gateway.proxy.transcript import StreamTranscript
from gateway.proxy.upstream import UpstreamResponse

AFTER_DONE_S = 2.0  # s: how long the body's end is awaited after ``[DONE]``

log = logging.getLogger("gateway.proxy")

Receive = Callable[[], Any]
Send = Callable[[dict[str, Any]], Any]


# What the client reads in the error event when its stream is cut (never a backend fault).
CUT_MESSAGES = {
    Cut.DRAIN_DEADLINE: "The backend serving this stream was drained and its deadline passed; "
    "the answer is incomplete.",
    Cut.SHUTDOWN: "The gateway is shutting down and its grace period ended; the answer is "
    "incomplete.",
    Cut.BACKEND_HUNG: "The backend serving this stream stopped answering (a 1-token probe "
    "timed out); the answer is incomplete.",
}


# Cuts a continuable stream turns into a continuation on another backend (issue 17).
DIVERTIBLE = frozenset({Cut.DRAIN_DEADLINE})


class CutHandle:
    """Lets others end a request early, with a reason, by cancelling its task.

    One handle per client request. The first :meth:`cut` wins (later ones are ignored) and
    cancels the request's task; the code that catches the ``CancelledError`` reads
    :attr:`reason` and calls :meth:`absorb` to un-cancel and answer properly (an error
    event for a stream, a retry elsewhere for a drained attempt, nothing for a client that
    left). A cancellation with no reason is someone else's and must propagate.

    A stream that can go on on another backend (issue 17) sets :attr:`divert` while it
    relays: a drain-deadline cut then calls it (it closes the upstream response) and is
    kept in :attr:`diverted` instead of cancelling the task, so the relay sees its backend
    end at a clean point (never inside a write to the client) and continues the stream.
    """

    __slots__ = ("divert", "diverted", "reason", "task")

    def __init__(self) -> None:
        self.task = asyncio.current_task()
        self.reason: str | None = None
        self.divert: Callable[[], None] | None = None
        self.diverted: str | None = None

    def cut(self, reason: str) -> None:
        if reason in DIVERTIBLE and self.divert is not None and self.reason is None:
            if self.diverted is None:
                self.diverted = reason
                self.divert()
            return
        if self.reason is None and self.task is not None and not self.task.done():
            self.reason = reason
            self.task.cancel(reason)

    def take_diverted(self) -> str | None:
        """Stop diverting; returns the diverted cut's reason (None: none came)."""
        reason, self.diverted, self.divert = self.diverted, None, None
        return reason

    def absorb(self) -> str:
        """Undo our cancellation; returns the reason. Call only when :attr:`reason` is set."""
        assert self.reason is not None and self.task is not None
        self.task.uncancel()
        return self.reason

    def rearm(self) -> None:
        """After an absorbed cut, allow a new one (a drained attempt retried elsewhere)."""
        self.reason = None


class ClientWatch:
    """Cuts the request (:attr:`Cut.CLIENT_GONE`) when the client disconnects, until
    :meth:`stop` is called.

    The watching task starts only after ``delay_s`` (50 ms): most answers that quick never
    need it, and a timer costs far less than a task. A client gone sooner is noticed at
    that moment (its ``http.disconnect`` is waiting), well inside the 2 s promise.
    """

    __slots__ = ("_cut", "_receive", "_timer", "_watcher", "done")

    def __init__(self, receive: Receive, cut: CutHandle, delay_s: float = 0.05) -> None:
        self._cut = cut
        self._receive = receive
        self.done = False
        self._watcher: asyncio.Task[None] | None = None
        self._timer = asyncio.get_running_loop().call_later(delay_s, self._start)

    def _start(self) -> None:
        if not self.done:
            self._watcher = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        receive = self._receive
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
        if not self.done:
            self._cut.cut(Cut.CLIENT_GONE)

    def stop(self) -> None:
        """Stop watching (the answer is complete or about to be)."""
        if self.done:
            return
        self.done = True
        self._timer.cancel()
        if self._watcher is not None:
            self._watcher.cancel()


class StreamOutcome:
    """How a relayed stream ended: ``ok``, ``in_band_error`` (complete, but the backend
    reported a request error inside it: :attr:`EventFramer.error`), a
    :class:`gateway.core.vocab.Cut` reason, or the error code the client saw
    (``upstream_incomplete``, ``upstream_idle_timeout``, ``upstream_disconnected``)."""

    OK = "ok"
    IN_BAND_ERROR = "in_band_error"
    CLIENT_GONE = Cut.CLIENT_GONE
    CANCELLED = "cancelled"  # the request's task was cancelled with no cut reason


@dataclass(slots=True)
class Resumed:
    """A continuation's accepted start on another backend (issue 17): its response, the
    complete events already read (``first``, raw: the relay stitches them), its framer,
    the :class:`Stitcher` that rewrites its events for the client, ``heard`` (told of
    each chunk's arrival, ``time.monotonic()`` seconds) for its backend and ``itl`` (the
    ITL observer of its backend: :class:`RelayResponse`'s)."""

    resp: UpstreamResponse
    first: bytes
    framer: EventFramer
    stitcher: Stitcher
    heard: Callable[[float], None] | None = None
    itl: Callable[[float], None] | None = None  # its backend's ITL observer, if any


class Resumer(Protocol):
    """What :class:`RelayResponse` needs to continue a stream (implemented by
    :class:`gateway.flow.continuing.StreamContinuer`)."""

    transcript: StreamTranscript
    hide_ids: bool  # hide vLLM's token ids from the client (it did not ask for them)

    async def resume(self, code: str) -> Resumed | bytes | None:
        """Continue after the stream failed with ``code`` (see :class:`RelayResponse`)."""
        ...


class RelayResponse(Response):
    """ASGI response relaying an upstream SSE stream whose first events were already read.

    ``first`` holds the complete events read before the client's headers were sent (so a
    failure before them could still be retried elsewhere). ``kind``
    (:class:`gateway.proxy.inband.StreamKind`): ``DONE`` streams (chat, completions) must
    end with ``data: [DONE]`` and a failure is reported as ``data: {"error": ...}`` then
    ``[DONE]``; ``RESPONSES`` streams must end with a terminal event (``response.completed``,
    ``.incomplete``, ``.failed``) and ``OPEN`` ones (other pass-through streams) end with
    their body; both report a failure as an ``event: error``. A stream whose body ends
    without its end is incomplete (``upstream_incomplete``). One that carried an in-band
    error (the backend's own error event) ends ``in_band_error``, whatever followed, with
    ``[DONE]`` added when a ``DONE`` stream lacks it. ``on_done(outcome, framer,
    first_sent_at)`` is called exactly once with a :class:`StreamOutcome`.
    ``heard(now)`` (optional) is told of each chunk's arrival (``time.monotonic()``
    seconds): a backend that streams is alive, whatever its control plane answers.

    ``resumer`` (chat / completions streams with continuation on, issue 17): every block
    the client is sent is fed to its ``transcript``; when the backend fails after the
    first event (``upstream_disconnected``, ``upstream_idle_timeout``,
    ``upstream_incomplete``) the relay closes the response and awaits
    ``resumer.resume(code)``: a :class:`Resumed` (another backend's accepted start: the
    relay goes on with its events through its :class:`gateway.proxy.stitch.Stitcher`, on
    the same client stream, and may fail and resume again), ``bytes`` (the generation was
    over: the closing events, sent and the stream ends) or None (the stream ends as
    without a resumer: error event + ``[DONE]``). ``on_done`` is still called once, at the
    very end, with the last attempt's framer. The transcript gets the events as the
    backends sent them; the client gets them without vLLM's token ids when the gateway
    asked for them and the client did not (``resumer.hide_ids``,
    :func:`gateway.proxy.continuation.hide_token_ids`).

    ``itl`` (optional) observes the inter-token latency the client sees (seconds,
    ``time.perf_counter()``): for each content event written (a data event other than
    ``[DONE]``, as the framer counts them), the time since the previous one was written,
    0 for events written in the same block; a stream of n content events gives n - 1
    observations (a continuation's :class:`Resumed` brings its backend's observer).
    """

    def __init__(
        self,
        resp: UpstreamResponse,
        headers: list[tuple[bytes, bytes]],
        first: bytes,
        framer: EventFramer,
        watch: ClientWatch,
        cut: CutHandle,
        idle_timeout_s: float,
        on_done: Callable[[str, EventFramer, float | None], None],
        kind: StreamKind = StreamKind.DONE,
        heard: Callable[[float], None] | None = None,
        resumer: Resumer | None = None,
        itl: Callable[[float], None] | None = None,
    ) -> None:
        self.resp = resp
        self.raw_headers = headers
        self.first = first
        self.framer = framer
        self.watch = watch
        self.cut = cut
        self.idle_timeout_s = idle_timeout_s
        self.on_done = on_done
        self.kind = kind
        self.heard = heard  # told each chunk's arrival (monotonic s): the backend is alive
        self.resumer = resumer
        self.itl = itl
        self._last_event_at = 0.0  # perf_counter s: the last content event written
        self.status_code = 200
        self.background = None
        self.raw_headers = headers

    def _error(self, message: str, code: str) -> bytes:
        if self.kind is StreamKind.DONE:
            return error_event(message, code) + DONE_EVENT
        return responses_error_event(message, code)

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        framer, watch = self.framer, self.watch
        first_sent_at: float | None = None
        finished = False
        outcome = "relay_error"  # unless set below
        resumer = self.resumer
        transcript = resumer.transcript if resumer is not None else None

        def finish(result: str) -> None:
            # Release the upstream side and record the outcome once, BEFORE the last bytes
            # go out, so that metrics and in-flight counts are final when the client sees
            # the end of its stream.
            nonlocal finished
            if finished:
                return
            finished = True
            watch.stop()
            if result == StreamOutcome.OK:
                self.resp.release()
            else:
                self.resp.close()  # closes the socket: vLLM sees the disconnect and aborts
            self.on_done(result, framer, first_sent_at)

        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            hide = resumer is not None and resumer.hide_ids
            first = hide_token_ids(self.first) if hide else self.first
            await send({"type": "http.response.body", "body": first, "more_body": True})
            first_sent_at = time.perf_counter()
            self._events_sent(framer.events - framer.saw_done, first_sent_at, first=True)
            if transcript is not None:
                transcript.feed(self.first)
            stitcher: Stitcher | None = None
            heard = self.heard
            while True:
                if resumer is not None:
                    self.cut.divert = self._close_upstream
                code, message = await self._pump(framer, stitcher, heard, transcript, send)
                diverted = self.cut.take_diverted()
                if diverted is not None and code is not None:
                    code, message = diverted, CUT_MESSAGES[Cut(diverted)]
                if code is None or framer.error is not None or resumer is None:
                    break
                # the backend failed mid-stream: go on on another backend, if exact
                self.resp.close()  # vLLM sees the disconnect and aborts
                got = await resumer.resume(code)
                if got is None:
                    break
                if isinstance(got, bytes):  # the generation was over: close the stream
                    finish(code)
                    body = hide_token_ids(got) if hide else got
                    await send({"type": "http.response.body", "body": body, "more_body": False})
                    return
                self.resp, framer, stitcher, heard = got.resp, got.framer, got.stitcher, got.heard
                if got.itl is not None:
                    self.itl = got.itl
                self.cut.divert = self._close_upstream  # a drain of the new one diverts too
                out = stitcher.feed(got.first)
                if out:
                    body = hide_token_ids(out) if hide else out
                    await send({"type": "http.response.body", "body": body, "more_body": True})
                    self._events_sent(framer.events - framer.saw_done, time.perf_counter())
                    if transcript is not None:
                        transcript.feed(out)
            ends_with_done = self.kind is StreamKind.DONE
            if framer.error is not None:
                # the backend told the client itself; a DONE stream still gets its end
                finish(StreamOutcome.IN_BAND_ERROR)
                tail = DONE_EVENT if ends_with_done and not framer.saw_done else b""
                await send({"type": "http.response.body", "body": tail, "more_body": False})
            elif code is None:
                finish(StreamOutcome.OK)
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            else:
                finish(code)
                await send(
                    {
                        "type": "http.response.body",
                        "body": self._error(message, code),
                        "more_body": False,
                    }
                )
        except asyncio.CancelledError:
            if self.cut.reason is None:  # the server's own cancellation: not the backend's
                outcome = StreamOutcome.CANCELLED
                raise
            outcome = self.cut.absorb()
            finish(outcome)
            if outcome != Cut.CLIENT_GONE:
                await send(
                    {
                        "type": "http.response.body",
                        "body": self._error(CUT_MESSAGES[Cut(outcome)], outcome),
                        "more_body": False,
                    }
                )
        finally:
            self.cut.divert = None
            finish(outcome)

    def _events_sent(self, events: int, now: float, first: bool = False) -> None:
        """``events`` content events were just written to the client at ``now``
        (``time.perf_counter()`` s): observe the ITL of each (see the class docstring);
        ``first``: the stream's first block (its first event has no predecessor)."""
        itl = self.itl
        if itl is None or events <= 0:
            return
        if not first:
            itl(now - self._last_event_at)
        for _ in range(events - 1):
            itl(0.0)
        self._last_event_at = now

    def _close_upstream(self) -> None:
        """Divert a cut (:attr:`CutHandle.divert`): close the current upstream response, so
        the relay's read ends and the stream goes on elsewhere."""
        self.resp.close()

    async def _pump(
        self,
        framer: EventFramer,
        stitcher: Stitcher | None,
        heard: Callable[[float], None] | None,
        transcript: StreamTranscript | None,
        send: Send,
    ) -> tuple[str | None, str]:
        """Relay ``self.resp``'s body through ``framer`` (and ``stitcher``, a continuation's)
        to the client until it ends; returns ``(code, message)``: ``code`` None when the
        stream ended well (or carried an in-band error, ``framer.error``), else the error
        code the client would see (``upstream_incomplete``, ``upstream_idle_timeout``,
        ``upstream_disconnected``) and its message. Every block sent is fed to
        ``transcript``."""
        loop = asyncio.get_running_loop()
        content = self.resp.content
        hide = self.resumer is not None and self.resumer.hide_ids
        idle = self.idle_timeout_s
        kind = self.kind
        ends_with_done = kind is StreamKind.DONE
        ends_with_terminal = kind is StreamKind.RESPONSES

        def complete() -> bool:
            """The stream's end has been relayed (what follows cannot change it)."""
            if ends_with_done:
                return framer.saw_done
            if ends_with_terminal:
                return framer.terminal is not None or framer.error is not None
            return False

        try:
            # One timer for the whole stream: armed while waiting on the backend,
            # disarmed while a slow client is being written to (a client that reads
            # nothing is bounded by server.client_write_timeout_s: the server aborts
            # its connection, proxy/client_writes.py, and ClientWatch cuts us).
            async with asyncio.timeout(idle) as timer:
                while True:
                    chunk = await content.readany()
                    events = framer.events - framer.saw_done
                    out = framer.feed(chunk) if chunk else framer.finish()
                    if out and stitcher is not None:
                        out = stitcher.feed(out)
                    if out:
                        timer.reschedule(None)
                        body = hide_token_ids(out) if hide else out
                        await send({"type": "http.response.body", "body": body, "more_body": True})
                        if self.itl is not None:
                            events = framer.events - framer.saw_done - events
                            self._events_sent(events, time.perf_counter())
                        if transcript is not None:
                            transcript.feed(out)
                    if not chunk:
                        break
                    # after [DONE] only the body's end is awaited, briefly
                    wait = min(idle, AFTER_DONE_S) if complete() else idle
                    if heard is not None:
                        heard(time.monotonic())
                    timer.reschedule(loop.time() + wait)
            if kind is not StreamKind.OPEN and not complete():
                end = "[DONE]" if ends_with_done else "a terminal event"
                return "upstream_incomplete", (
                    f"The backend ended the stream without {end}; the answer is incomplete."
                )
        except TimeoutError:
            if not complete():
                return "upstream_idle_timeout", (
                    f"The backend sent nothing for {idle:g} s (idle_timeout_s); the stream "
                    "was closed and the answer is incomplete."
                )
        except (aiohttp.ClientError, ConnectionError) as e:
            if not complete():  # a break after [DONE] loses nothing
                return "upstream_disconnected", (
                    f"The backend connection broke mid-stream ({type(e).__name__}); the "
                    "answer is incomplete."
                )
        return None, ""
