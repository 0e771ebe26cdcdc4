"""One client stream out of two backends' streams (pure, issue 17): the continuation's
events rewritten as the rest of the original stream, and the tail of a stream whose
generation is over. The request side (transcript, verdict, continuation body) is
:mod:`gateway.proxy.continuation`.

What the client sees after a continuation (:class:`Stitcher`):

* the original ``id``, ``created``, ``model`` and ``system_fingerprint`` (the latter once
  the original stream sent one) on every event, the original choice ``index``;
* no second role delta: the continuation's role-only first chunk (chat) is dropped, and a
  role on a chunk that also carries content is removed;
* no continuation prompt: ``prompt_token_ids`` / ``prompt_text`` (the original prompt plus
  the generated text) are set to null;
* no prompt text twice: vLLM 0.32 streams a token-id prompt's whole text back in the first
  delta when the prompt ends inside a UTF-8 sequence (vllm-project/vllm#48853: its fast
  incremental detokenizer; a completions continuation's prompt ends so when the last token
  the client got ended inside a character). The first text of a completions continuation
  that holds what the client already has (at least :data:`LEAK_MIN_CHARS` characters of
  it, or the original prompt string followed by it) is cut after it;
* one ``finish_reason`` (a second one is nulled) and one ``[DONE]``;
* usage as the client asked: the continuation is always asked for it
  (``include_usage: true``); its usage chunk is dropped when the client did not ask, else
  rewritten to ``prompt_tokens`` = the original request's (said by the original stream, else
  the continuation's prompt tokens less the produced ones: the continuation's prompt is the
  original plus them, exact for completions' token ids), ``completion_tokens`` = the
  produced tokens before the continuation plus the continuation's, ``total_tokens`` their
  sum. Per-chunk usage (``continuous_usage_stats``) is rewritten the same way, and dropped
  when the client did not ask ``include_usage`` (vLLM sends none then). A
  continuation that sends ``[DONE]`` without usage gets one built from the counts.

Events are re-serialized as vLLM writes them (compact JSON, UTF-8 unescaped, key order
kept) with LF framing (``data: ...\\n\\n``), as :mod:`gateway.proxy.sse` releases them.
Events without ``data`` (comments) and events that are not JSON (or in-band errors) pass
through unchanged: the relay's framer judges them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from gateway.core.wire_json import utf8_json
from gateway.proxy.continuation import (
    CHAT,
    StreamTranscript,
    Verdict,
    client_wants_usage,
    event_data,
    split_events,
)
from gateway.proxy.sse import DONE_EVENT


def encode_event(obj: Any) -> bytes:
    """One ``data:`` event of ``obj``: compact JSON, non-ASCII unescaped (pydantic's
    ``model_dump_json``, which vLLM streams with), LF framing."""
    return b"data: " + utf8_json(obj, (",", ":")) + b"\n\n"


def _chunk_object(endpoint: str, t: StreamTranscript) -> str:
    return t.object or ("chat.completion.chunk" if endpoint == CHAT else "text_completion")


LEAK_MIN_CHARS = 8
"""Characters of the client's text a leaked first delta must hold to be cut without the
prompt string to check (shorter, a genuine token could hold them)."""


def leaked_prefix(text: str, sent: str, prompt: str | None) -> int:
    """How many leading characters of a completions continuation's first ``text`` are vLLM's
    prompt leak (vllm-project/vllm#48853: the prompt's text, the original prompt then the
    generated ``sent``, before the new text), 0 when none: ``text`` starts with the original
    ``prompt`` string then ``sent``, or holds ``sent`` (``LEAK_MIN_CHARS`` or more
    characters; its first place: repetitive text, which the new text may go on, holds it
    again one period later)."""
    if prompt and text.startswith(prompt) and text[len(prompt):].startswith(sent):
        return len(prompt) + len(sent)
    if len(sent) >= LEAK_MIN_CHARS:
        k = text.find(sent)
        if k >= 0:
            return k + len(sent)
    return 0


def _usage_dict(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion,
            "completion_tokens": completion}


def closing_events(
    endpoint: str, request: Mapping[str, Any], transcript: StreamTranscript, verdict: Verdict
) -> bytes:
    """The events a stream whose generation is over (``verdict.closes``) still owes its
    client: for ``length`` (the budget is spent, no finish sent yet) a chunk with
    ``finish_reason: "length"``; the usage chunk if the client asked for it, none was sent
    and the counts are known (prompt tokens said by the stream, produced tokens); then
    ``[DONE]`` unless sent. ``b""`` when nothing is owed."""
    t = transcript
    if t.done:
        return b""
    out = b""
    rec = t.choice()
    head: dict[str, Any] = {
        "id": t.id, "object": _chunk_object(endpoint, t), "created": t.created, "model": t.model
    }
    if verdict.reason == "length" and rec.finish_reason is None:
        if endpoint == CHAT:
            choice: dict[str, Any] = {"index": rec.index, "delta": {}, "logprobs": None,
                                      "finish_reason": "length"}
        else:
            choice = {"index": rec.index, "text": "", "logprobs": None, "finish_reason": "length"}
        out += encode_event({**head, "choices": [choice]})
    if client_wants_usage(request) and not t.usage_final:
        prompt = t.prompt_tokens()
        if prompt is not None:
            usage = _usage_dict(prompt, t.produced()[0])
            chunk: dict[str, Any] = {**head, "choices": [], "usage": usage}
            if t.system_fingerprint is not None:
                chunk["system_fingerprint"] = t.system_fingerprint
            out += encode_event(chunk)
    return out + DONE_EVENT


class Stitcher:
    """Rewrites one continuation stream's events for the client of ``transcript``'s stream
    (module docstring). Make it when the continuation is sent, before the transcript is fed
    anything else; feed it blocks of complete events (LF framing: what
    :class:`gateway.proxy.sse.EventFramer` releases) and forward what it returns (and feed
    that to the transcript too)."""

    def __init__(self, endpoint: str, request: Mapping[str, Any], transcript: StreamTranscript):
        t = transcript
        self._chat = endpoint == CHAT
        self._want_usage = client_wants_usage(request)
        self._head = {"id": t.id, "created": t.created, "model": t.model}
        self._object = _chunk_object(endpoint, t)
        self._fingerprint = t.system_fingerprint
        self._index = t.choice().index
        self._drop_role = t.choice().role_sent
        rec = t.choice()
        # tokens the client got without their text (held back in a UTF-8 sequence): the
        # continuation generates them again; their ids / empty events are not sent twice
        if rec.token_ids is not None:
            self._held = len(rec.token_ids) - rec.settled_ids
        else:
            self._held = rec.token_events - rec.settled_events
        # the first text of a completions continuation is checked for vLLM's prompt leak
        self._leak_check = not self._chat
        self._sent = rec.text
        given = request.get("prompt")
        self._prompt_text = given if isinstance(given, str) else None
        self.prior: int = t.produced()[0]
        """Completion tokens the client got before this continuation."""
        self._prompt_tokens = t.prompt_tokens()
        self.own_ids = 0  # token ids the continuation streamed
        self.own_token_events = 0
        self.own_usage: dict[str, Any] | None = None  # the continuation's last usage
        self.finish_reason: str | None = None
        self.usage_sent = False
        self.done = False

    def feed(self, block: bytes) -> bytes:
        """The client's bytes for a block of the continuation's complete events."""
        out = bytearray()
        for event in split_events(block):
            out += self._event(event)
        return bytes(out)

    def _event(self, event: bytes) -> bytes:
        data = event_data(event)
        if data is None:
            return event + b"\n\n"
        if data.strip() == b"[DONE]":
            if self.done:
                return b""
            self.done = True
            return self._owed_usage() + DONE_EVENT
        try:
            obj = json.loads(data)
        except ValueError:
            return event + b"\n\n"
        if not isinstance(obj, dict) or ("error" in obj and "choices" not in obj):
            return event + b"\n\n"
        return self._chunk(obj)

    def _chunk(self, obj: dict[str, Any]) -> bytes:
        for k, v in self._head.items():
            if k in obj and v is not None:
                obj[k] = v
        if self._fingerprint is not None and obj.get("system_fingerprint") is not None:
            obj["system_fingerprint"] = self._fingerprint
        for k in ("prompt_token_ids", "prompt_text"):
            if obj.get(k) is not None:
                obj[k] = None
        choices = obj.get("choices")
        usage = obj.get("usage")
        if isinstance(usage, dict):
            self.own_usage = usage
            obj["usage"] = self._merged(usage)
            if choices and not self._want_usage:
                del obj["usage"]  # per-chunk usage (continuous_usage_stats) not asked for
            if not choices:
                if not self._want_usage or self.usage_sent:
                    return b""
                self.usage_sent = True
                return encode_event(obj)
        if isinstance(choices, list):
            kept = [c for c in (self._choice(c) for c in choices) if c is not None]
            if choices and not kept:
                return b""
            obj["choices"] = kept
        return encode_event(obj)

    def _choice(self, ch: Any) -> Any:
        if not isinstance(ch, dict):
            return ch
        ch["index"] = self._index
        delta = ch.get("delta")
        if self._chat and self._drop_role and isinstance(delta, dict) and "role" in delta:
            rest = {k: v for k, v in delta.items() if k != "role" and v not in (None, "", [])}
            if not rest and ch.get("finish_reason") is None and not ch.get("token_ids"):
                return None  # the continuation's role-only first chunk
            del delta["role"]
        for k in ("prompt_token_ids", "prompt_logprobs"):
            if ch.get(k) is not None:
                ch[k] = None
        ids = ch.get("token_ids")
        if isinstance(ids, list):
            self.own_ids += len(ids)
        text = delta.get("content") if isinstance(delta, dict) else ch.get("text")
        if self._leak_check and isinstance(text, str) and text and not isinstance(delta, dict):
            self._leak_check = False
            cut = leaked_prefix(text, self._sent, self._prompt_text)
            if cut:
                text = ch["text"] = text[cut:]
        reason = ch.get("finish_reason")
        if isinstance(text, str) and not (isinstance(delta, dict) and "role" in delta):
            self.own_token_events += 1
            if self._held > 0 and not self._skip_held(ch, ids, text) and reason is None:
                return None  # a held-back token the client already has
        if reason is not None:
            if self.finish_reason is None:
                self.finish_reason = reason
            else:
                ch["finish_reason"] = None
        return ch

    def _skip_held(self, ch: dict[str, Any], ids: Any, text: str) -> bool:
        """Drops held-back tokens from one token event; False when nothing of it is left."""
        if isinstance(ids, list) and ids:
            drop = min(self._held, len(ids))
            self._held -= drop
            ch["token_ids"] = ids[drop:]
            return bool(text) or drop < len(ids)
        if text:
            self._held = 0
            return True
        self._held -= 1
        return False

    def own_tokens(self) -> int:
        """Completion tokens the continuation produced: the larger of its last usage (per-chunk
        usage may be behind) and its ids' count, else its events that carried a token."""
        counted = self.own_ids or self.own_token_events
        if self.own_usage is not None and isinstance(self.own_usage.get("completion_tokens"), int):
            return max(int(self.own_usage["completion_tokens"]), counted)
        return counted

    def _merged(self, usage: dict[str, Any]) -> dict[str, Any]:
        own_completion = usage.get("completion_tokens")
        own_prompt = usage.get("prompt_tokens")
        if not isinstance(own_completion, int) or not isinstance(own_prompt, int):
            return usage
        prompt = self._prompt_tokens
        if prompt is None:
            prompt = max(0, own_prompt - self.prior)
        completion = self.prior + own_completion
        merged = dict(usage)
        merged["prompt_tokens"] = prompt
        merged["completion_tokens"] = completion
        merged["total_tokens"] = prompt + completion
        return merged

    def _prompt(self, own_prompt: int | None) -> int | None:
        """The original request's prompt tokens: as its stream said them, else the
        continuation's less the tokens produced before it (its prompt is the original
        plus them)."""
        if self._prompt_tokens is not None:
            return self._prompt_tokens
        return None if own_prompt is None else max(0, own_prompt - self.prior)

    def _owed_usage(self) -> bytes:
        """At the continuation's ``[DONE]``: a usage chunk if the client asked for one and
        the continuation sent none (built from the counts; needs the prompt tokens)."""
        own = self.own_usage.get("prompt_tokens") if self.own_usage is not None else None
        prompt = self._prompt(own if isinstance(own, int) else None)
        if not self._want_usage or self.usage_sent or prompt is None:
            return b""
        self.usage_sent = True
        usage = _usage_dict(prompt, self.prior + self.own_tokens())
        chunk: dict[str, Any] = {
            "id": self._head["id"], "object": self._object, "created": self._head["created"],
            "model": self._head["model"], "choices": [], "usage": usage,
        }
        return encode_event(chunk)
