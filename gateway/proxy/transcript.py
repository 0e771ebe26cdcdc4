"""What the client of one chat / completions stream has been sent (pure, issue 17): the
record a mid-stream continuation starts from (:mod:`gateway.proxy.continuation`).

:class:`StreamTranscript` is fed every block of complete events the relay forwards (LF
framing, as :class:`gateway.proxy.sse.EventFramer` releases them). It keeps the stream's
``id``, ``created``, ``model``, ``object`` and first non-null ``system_fingerprint``; per
choice the text (chat ``delta.content``, completions ``text``), the token ids (vLLM's
``token_ids`` per choice with ``return_token_ids: true``), the prompt's ids
(``prompt_token_ids``: per choice for completions, at the top of the first chunk for chat),
whether the role delta was sent, the ``finish_reason``; the last ``usage`` and whether the
final usage chunk (``choices: []``) was sent; ``[DONE]``; and the first thing that rules out
an exact continuation (:attr:`StreamTranscript.obstacle`, a :data:`Reason`): a second choice
index (``n_gt_1``), a ``tool_calls`` / ``function_call`` delta (``tool_call``), non-null
``logprobs`` (``logprobs``), a non-empty ``reasoning_content`` / ``reasoning`` delta
(``reasoning``: thinking cannot be handed back as the assistant message's content, and a
continuation would open a new reasoning section), a ``refusal`` delta (``refusal``), an
in-band error (``error``), data that is not a JSON object (``unparseable``).

**Held-back tokens**: vLLM's detokenizer emits no text for a token that ends inside a UTF-8
sequence; its id may arrive (with ``""``) before the event that carries the character.
``ChoiceRecord.settled_ids`` / ``settled_events`` count only the tokens up to the last event
with text, so a continuation regenerates the held-back ones instead of losing their bytes.

Cost per event: one JSON parse of the event and O(1) bookkeeping besides appending the text
and ids.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

Reason = Literal[
    "disabled", "unparseable", "error", "n_gt_1", "finished", "length", "tool_call",
    "structured_output", "logprobs", "reasoning", "refusal", "no_token_ids", "budget",
    "endpoint", "echo", "stop",
]
"""A verdict's reason code (a metric label value: ``reason`` of
``gateway_stream_continuations_total``)."""


@dataclass(slots=True)
class ChoiceRecord:
    """What one choice has streamed so far. ``token_ids`` is None until a backend sends
    ids; ``settled_ids`` is how many of them the sent text covers (see the module's
    "held-back tokens"); ``token_events`` counts the events that carried a token (text, even
    empty, outside the role chunk) and ``settled_events`` those up to the last one whose
    text was not empty."""

    index: int
    parts: list[str] = field(default_factory=list)
    token_ids: list[int] | None = None
    settled_ids: int = 0
    prompt_token_ids: list[int] | None = None
    role_sent: bool = False
    finish_reason: str | None = None
    token_events: int = 0
    settled_events: int = 0
    settled_event_ids: int = 0
    """Token ids the last event with text carried (``token_ids`` streamed)."""

    @property
    def text(self) -> str:
        """The text generated so far."""
        return "".join(self.parts)


def int_list(v: Any) -> list[int] | None:
    """``v`` when it is a list of ints (token ids), else None."""
    if isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        return v
    return None


def event_data(event: bytes) -> bytes | None:
    """The joined ``data`` lines of one SSE event (LF framing), None when it has none."""
    data: list[bytes] = []
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            v = line[5:]
            data.append(v[1:] if v.startswith(b" ") else v)
    return b"\n".join(data) if data else None


def split_events(block: bytes) -> list[bytes]:
    """The events of a block of complete events, each without its blank line."""
    return [e for e in block.split(b"\n\n") if e.strip(b"\n")]


class StreamTranscript:
    """Everything the client of one chat / completions stream has been sent, for a
    continuation. ``feed`` takes blocks of complete events; cost per event: one JSON parse
    and O(1) bookkeeping besides appending text and ids."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.id: str | None = None
        self.created: int | None = None
        self.model: str | None = None
        self.object: str | None = None
        self.system_fingerprint: str | None = None
        self.prompt_token_ids: list[int] | None = None
        self.choices: dict[int, ChoiceRecord] = {}
        self.usage: dict[str, Any] | None = None  # the last usage object sent
        self.usage_final = False  # the usage chunk (``choices: []``) was sent
        self.done = False  # ``data: [DONE]`` was sent
        self.obstacle: Reason | None = None  # the first thing that rules out exactness
        self.events = 0

    def _block(self, reason: Reason) -> None:
        if self.obstacle is None:
            self.obstacle = reason

    def feed(self, block: bytes) -> None:
        """Record a block of complete events (as the relay forwarded them to the client)."""
        for event in split_events(block):
            data = event_data(event)
            if data is None:
                continue  # a comment or a field without data: clients dispatch nothing
            self.events += 1
            if data.strip() == b"[DONE]":
                self.done = True
                continue
            try:
                obj = json.loads(data)
            except ValueError:
                self._block("unparseable")
                continue
            if not isinstance(obj, dict):
                self._block("unparseable")
                continue
            self._chunk(obj)

    def _chunk(self, obj: dict[str, Any]) -> None:
        if "error" in obj and "choices" not in obj:
            self._block("error")
            return
        if self.id is None:
            self.id = obj.get("id")
            self.created = obj.get("created")
            self.model = obj.get("model")
            self.object = obj.get("object")
        fp = obj.get("system_fingerprint")
        if fp is not None and self.system_fingerprint is None:
            self.system_fingerprint = fp
        ids = int_list(obj.get("prompt_token_ids"))
        if ids is not None:
            self.prompt_token_ids = ids
        usage = obj.get("usage")
        choices = obj.get("choices")
        if isinstance(usage, dict):
            self.usage = usage
            if not choices:
                self.usage_final = True
        if not isinstance(choices, list):
            return
        for ch in choices:
            if isinstance(ch, dict):
                self._choice(ch)

    def _choice(self, ch: dict[str, Any]) -> None:
        index = ch.get("index", 0)
        if not isinstance(index, int):
            self._block("unparseable")
            return
        rec = self.choices.get(index)
        if rec is None:
            rec = self.choices[index] = ChoiceRecord(index)
            if len(self.choices) > 1:
                self._block("n_gt_1")
        if ch.get("logprobs") is not None:
            self._block("logprobs")
        text: Any = None
        delta = ch.get("delta")
        if isinstance(delta, dict):
            text = delta.get("content")
            if delta.get("role"):
                rec.role_sent = True
                text = text or None  # the role chunk's "" is no token
            if delta.get("tool_calls") or delta.get("function_call"):
                self._block("tool_call")
            if delta.get("reasoning_content") or delta.get("reasoning"):
                self._block("reasoning")
            if delta.get("refusal"):
                self._block("refusal")
        else:
            text = ch.get("text")
        pids = int_list(ch.get("prompt_token_ids"))
        if pids is not None:
            rec.prompt_token_ids = pids
        ids = int_list(ch.get("token_ids"))
        if ids is not None:
            if rec.token_ids is None:
                rec.token_ids = []
            rec.token_ids.extend(ids)
        if isinstance(text, str):
            rec.token_events += 1
            if text:
                rec.parts.append(text)
        reason = ch.get("finish_reason")
        if reason is not None:
            rec.finish_reason = reason
        if (isinstance(text, str) and text) or reason is not None:
            rec.settled_ids = len(rec.token_ids) if rec.token_ids is not None else 0
            rec.settled_events = rec.token_events
            rec.settled_event_ids = len(ids) if ids is not None else 0

    # ---- reading --------------------------------------------------------------------------

    def unsettle(self, n: int) -> None:
        """The last ``n`` settled token ids (of the last event with text) are held back after
        all: their text was not sent (they end inside a UTF-8 sequence, as the tokenizer
        said: :func:`gateway.proxy.continuation.seam_ids`). At most that event's ids but
        one; no-op for ``n`` <= 0."""
        rec = self.choice()
        n = min(n, rec.settled_event_ids - 1)
        if n > 0 and rec.token_ids is not None:
            rec.settled_ids -= n
            rec.settled_event_ids -= n

    def choice(self) -> ChoiceRecord:
        """The stream's one choice (index 0 when none was streamed yet)."""
        if self.choices:
            return next(iter(self.choices.values()))
        return ChoiceRecord(0)

    def text(self) -> str:
        """The one choice's text so far."""
        return self.choice().text

    def prompt_ids(self) -> list[int] | None:
        """The original prompt's token ids, as the backend sent them."""
        return self.choice().prompt_token_ids or self.prompt_token_ids

    def produced(self) -> tuple[int, Literal["token_ids", "usage", "events"]]:
        """Completion tokens produced so far and where the count comes from (module
        docstring, "produced tokens")."""
        rec = self.choice()
        if rec.token_ids is not None:
            return rec.settled_ids, "token_ids"
        if self.usage is not None and isinstance(self.usage.get("completion_tokens"), int):
            held = rec.token_events - rec.settled_events  # counted by usage, text not sent
            return max(0, int(self.usage["completion_tokens"]) - held), "usage"
        return rec.settled_events, "events"

    def prompt_tokens(self) -> int | None:
        """The original request's prompt tokens, when the stream said them."""
        if self.usage is not None and isinstance(self.usage.get("prompt_tokens"), int):
            return int(self.usage["prompt_tokens"])
        ids = self.prompt_ids()
        return len(ids) if ids is not None else None

