"""Mid-stream continuation, the pure side (issue 17): whether a stream whose backend failed
can go on exactly on another backend, and the request that continues it. What the stream
said is recorded by :mod:`gateway.proxy.transcript`; the continuation's events are rewritten
for the client by :mod:`gateway.proxy.stitch`. No I/O: bytes and parsed JSON in, bytes and
dicts out.

The relay (I/O, another module) uses it in four steps:

1. **Record**: every block of complete events it forwards to the client of a
   ``/v1/chat/completions`` or ``/v1/completions`` stream goes to
   :meth:`StreamTranscript.feed` (the bytes :class:`gateway.proxy.sse.EventFramer` released,
   LF framing). An event cut in the middle never reaches the client (the framer holds it),
   so the transcript never sees it: its text is generated again by the continuation.
2. **Judge**: on a backend failure after the first event, or a drain deadline,
   :func:`continuable` returns a :class:`Verdict`: ``ok``; or ``closes`` (the generation is
   over: ``finished``, or ``length`` when the reduced budget is spent), then
   :func:`gateway.proxy.stitch.closing_events` is the tail the client still needs (a
   ``finish_reason: "length"`` chunk, the usage chunk, ``[DONE]``); or a reason it cannot
   be exact, and the stream ends as before (error event + ``[DONE]``).
3. **Continue**: :func:`continuation_body` is the JSON to send to another backend.
4. **Stitch**: the continuation's complete events go through
   :meth:`gateway.proxy.stitch.Stitcher.feed`; its output is what the client gets, and is
   fed to the same transcript, so a second continuation (``proxy.max_continuations``)
   starts from everything the client saw.

Decisions (and why):

* **Completions continue only by token ids.** The continuation prompt is the original
  prompt's ids plus the generated ids (vLLM accepts a prompt as a list of ints, and streams
  ``prompt_token_ids`` / ``token_ids`` per choice with ``return_token_ids: true``).
  Re-tokenizing prompt text + generated text can split differently at the seam and change
  every later token, so without ids (original request sent without ``return_token_ids``)
  the verdict is ``no_token_ids`` once text was generated. :func:`with_token_ids` is the
  body the gateway should send on the first attempt so the ids exist.
* **Chat continues by text** (vLLM has no token-id input for chat): the generated text as a
  final assistant message with ``continue_final_message: true`` and
  ``add_generation_prompt: false`` (vLLM refuses both true: "Cannot set both
  `continue_final_message` and `add_generation_prompt` to True."). Exact when the chat
  template renders the prefix as the original prompt plus the text and the text re-tokenizes
  as generated; the I/O side measures the share. Its first attempt asks for the token ids
  all the same (:func:`with_token_ids`): they count the produced tokens exactly (vLLM may
  send several tokens in one event), for the continuation's budget and the usage, and the
  client's ``prompt_tokens`` come from the first attempt's ``prompt_token_ids`` (the
  continuation's prompt holds the re-tokenized text, whose count may differ).
* **Held-back tokens**: vLLM's detokenizer emits nothing for a token that ends inside a
  UTF-8 sequence (its text comes with a later token). Tokens that arrived after the last
  event that carried text are left out of the continuation's prefix and of the produced
  count (``ChoiceRecord.settled_ids`` / ``settled_events``), the continuation generates
  them again and the stitcher does not send them twice, so a cut inside a multi-byte
  character loses and duplicates nothing. An event that carries text *and*, after it,
  such a token (vLLM sends several tokens per event with ``--stream-interval`` > 1 or when
  its output lags) cannot be told apart without the tokenizer: when the last event with
  text carried more than one id, :func:`seam_ids` are the ids to ask a backend of the model
  about (vLLM's ``POST /detokenize``, the I/O side) and :func:`partial_tail` reads its
  answer; the ids that end inside a character are held back
  (:meth:`StreamTranscript.unsettle`). Without that check (measured on real vLLM 0.32,
  ``benchmarks/real_vllm.py continuation``) a completions continuation's prompt ended
  inside a UTF-8 sequence, vLLM 0.32 streamed that whole prompt's text back in its first
  delta (vllm-project/vllm#48853), and a chat continuation counted a token twice. When no
  backend answers the check, the stitcher still cuts such a leak
  (:func:`gateway.proxy.stitch.leaked_prefix`).
* **Not exact, so not continued**: more than one choice (``n_gt_1``); a tool call streamed,
  or ``tool_choice`` forcing one (``tool_call``); a constrained output (``structured_output``:
  ``response_format`` json_schema / json_object / structural_tag, ``guided_*``,
  ``structured_outputs``); ``logprobs`` asked or streamed (``logprobs``: the continuation's
  would be conditioned on a different prompt); a ``reasoning_content`` / ``reasoning``
  delta (``reasoning``: it cannot be handed back as the assistant message's content, and a
  continuation would start a new reasoning section); a ``refusal`` delta (``refusal``); an
  in-band error already sent (``error``); an event that is not JSON (``unparseable``);
  ``stop`` strings once text was generated (``stop``: vLLM holds back the text that may
  begin one while it streams every token id, and checks a stop string only in its own
  output: :func:`_stop_strings`); ``echo`` (``echo``: the echoed prompt is not generated
  text, and the first attempt is sent without ``return_token_ids``, which blanks vLLM's
  echo).
  Constrained or forced outputs are still continued when nothing was generated yet: the
  continuation is then the original request again. Tools with ``tool_choice`` auto and only
  content so far are continued (a tool call the continuation makes is its own whole call).
* **The endpoint** must be chat or completions (``endpoint``); ``x-gateway-continuation:
  off`` (``disabled``) and ``used >= max_continuations`` (``budget``) come from the caller.
* **Produced tokens** (budget and usage): the settled ids' count; else the completion
  tokens of the last usage seen (``stream_options.continuous_usage_stats``); else the count
  of token events up to the last one with text (a lower bound: vLLM emits at least one
  token per event). :meth:`StreamTranscript.produced` says which.
* ``max_tokens`` / ``max_completion_tokens`` (and vLLM's ``min_tokens``) are reduced by the
  produced tokens; completions' absent ``max_tokens`` is OpenAI's and vLLM's default 16; chat
  without a limit stays without one. ``echo`` is set false (the prefix is not the client's
  prompt). Every other field (seed, sampling, stop, user, unknown fields) passes unchanged.
  Known limit: a ``stop`` string that spans the seam is not seen by the continuation.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gateway.proxy.transcript import (
    ChoiceRecord,
    Reason,
    StreamTranscript,
    event_data,
    int_list,
    split_events,
)

__all__ = [
    "CHAT", "CLOSING", "COMPLETIONS", "ENDPOINTS", "HEADER", "ChoiceRecord", "Reason",
    "StreamTranscript", "Verdict", "client_wants_usage", "continuable", "continuation_body",
    "event_data", "partial_tail", "remaining", "seam_drops", "seam_ids", "split_events",
    "token_limit", "with_token_ids",
]

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
ENDPOINTS = frozenset({CHAT, COMPLETIONS})
"""The endpoints whose streams can be continued."""

HEADER = "x-gateway-continuation"
"""Request header; the value ``off`` (any case) turns continuation off for the request."""

COMPLETIONS_DEFAULT_MAX_TOKENS = 16
"""``max_tokens`` of a completions request that omits it (OpenAI API reference; vLLM's
``CompletionRequest`` default)."""

CLOSING: frozenset[str] = frozenset({"finished", "length"})
"""Reasons that mean the generation is over: close the stream with :func:`closing_events`."""

_STRUCTURED_FORMATS = frozenset({"json_schema", "json_object", "structural_tag"})
_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")


@dataclass(frozen=True, slots=True)
class Verdict:
    """Whether a stream may be continued: ``reason`` None means yes."""

    reason: Reason | None = None

    @property
    def ok(self) -> bool:
        """A continuation may be sent."""
        return self.reason is None

    @property
    def closes(self) -> bool:
        """Nothing is left to generate: end the stream with :func:`closing_events`."""
        return self.reason in CLOSING



# ---- the request side --------------------------------------------------------------------


def client_wants_usage(request: Mapping[str, Any]) -> bool:
    """``stream_options.include_usage`` as the client asked."""
    so = request.get("stream_options")
    return isinstance(so, dict) and so.get("include_usage") is True


def _limit_keys(endpoint: str, request: Mapping[str, Any]) -> list[str]:
    if endpoint == CHAT:
        return [k for k in ("max_completion_tokens", "max_tokens") if request.get(k) is not None]
    return ["max_tokens"]


def token_limit(endpoint: str, request: Mapping[str, Any]) -> int | None:
    """The completion-token limit the client set (chat: ``max_completion_tokens``, else
    ``max_tokens``; completions: ``max_tokens``, default 16); None: no limit."""
    for k in _limit_keys(endpoint, request):
        v = _limit_value(request, k)
        if v is not None:
            return v
    return None


def _limit_value(request: Mapping[str, Any], key: str) -> int | None:
    v = request.get(key, COMPLETIONS_DEFAULT_MAX_TOKENS)
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _disabled(headers: Mapping[str, str] | Iterable[tuple[str, str]]) -> bool:
    items = headers.items() if isinstance(headers, Mapping) else headers
    return any(k.lower() == HEADER and v.strip().lower() == "off" for k, v in items)


def _structured(request: Mapping[str, Any]) -> bool:
    rf = request.get("response_format")
    if isinstance(rf, dict) and rf.get("type") in _STRUCTURED_FORMATS:
        return True
    return any(request.get(k) is not None for k in _GUIDED)


def _stop_strings(stop: Any) -> bool:
    """``stop`` names at least one non-empty string: vLLM then holds back the text that may
    begin one (``max(len) - 1`` characters, ``vllm/v1/engine/detokenizer.py``) while it
    streams every token id, and checks a stop string only in its own output, so neither a
    continuation from the ids (text lost) nor one from the text (a stop string across the
    cut missed, the held tokens counted twice) can be exact."""
    if isinstance(stop, str):
        return bool(stop)
    return isinstance(stop, list) and any(isinstance(s, str) and s for s in stop)


def _forced_tool(request: Mapping[str, Any]) -> bool:
    tc = request.get("tool_choice")
    return bool(request.get("tools")) and (tc == "required" or isinstance(tc, dict))


def _asks_logprobs(endpoint: str, request: Mapping[str, Any]) -> bool:
    if request.get("prompt_logprobs") is not None:
        return True
    lp = request.get("logprobs")
    return lp is True if endpoint == CHAT else lp is not None and lp is not False


def continuable(
    endpoint: str,
    request: Mapping[str, Any],
    transcript: StreamTranscript,
    *,
    headers: Mapping[str, str] | Iterable[tuple[str, str]] = (),
    used: int = 0,
    max_continuations: int = 2,
) -> Verdict:
    """May ``transcript``'s stream (of ``request``, the client's parsed JSON body, on
    ``endpoint``) go on on another backend? ``headers``: the client's request headers (read
    case-insensitively); ``used``: continuations already sent for it, against
    ``max_continuations`` (``proxy.max_continuations``). Reasons are checked in this order:
    disabled, endpoint, unparseable, error, n_gt_1, finished, length, echo, the inexact
    ones (the transcript's obstacle, logprobs, tool_call, structured_output, stop),
    no_token_ids, budget."""
    if _disabled(headers):
        return Verdict("disabled")
    if endpoint not in ENDPOINTS:
        return Verdict("endpoint")
    t = transcript
    if t.obstacle in ("unparseable", "error", "n_gt_1"):
        return Verdict(t.obstacle)
    if _count(request.get("n")) > 1 or _count(request.get("best_of")) > 1:
        return Verdict("n_gt_1")
    if endpoint == COMPLETIONS and _multi_prompt(request.get("prompt")):
        return Verdict("n_gt_1")
    rec = t.choice()
    if t.done or rec.finish_reason is not None:
        return Verdict("finished")
    left = remaining(endpoint, request, t)
    if left is not None and left <= 0:
        return Verdict("length")
    if request.get("echo"):
        return Verdict("echo")
    if t.obstacle is not None:
        return Verdict(t.obstacle)
    if _asks_logprobs(endpoint, request):
        return Verdict("logprobs")
    generated = bool(rec.text) or bool(rec.settled_ids)
    if generated and endpoint == CHAT and _forced_tool(request):
        return Verdict("tool_call")
    if generated and _structured(request):
        return Verdict("structured_output")
    if generated and _stop_strings(request.get("stop")):
        return Verdict("stop")
    if generated and endpoint == COMPLETIONS and _prefix_ids(request, t) is None:
        return Verdict("no_token_ids")
    if used >= max_continuations:
        return Verdict("budget")
    return Verdict()


def _count(v: Any) -> int:
    """``n`` / ``best_of`` as an int (1 when absent or not an int: the backend judges it)."""
    return v if isinstance(v, int) and not isinstance(v, bool) else 1


def _multi_prompt(prompt: Any) -> bool:
    """A completions prompt that is a batch (several strings or id lists): several choices."""
    return isinstance(prompt, list) and len(prompt) > 1 and not int_list(prompt)


def remaining(
    endpoint: str, request: Mapping[str, Any], transcript: StreamTranscript
) -> int | None:
    """Completion tokens the continuation may still produce (None: no limit)."""
    limit = token_limit(endpoint, request)
    return None if limit is None else limit - transcript.produced()[0]


def _prefix_ids(request: Mapping[str, Any], t: StreamTranscript) -> list[int] | None:
    """Completions: the original prompt's ids plus the settled generated ids, if known."""
    rec = t.choice()
    if rec.token_ids is None:
        return None
    prompt = t.prompt_ids()
    if prompt is None:
        prompt = int_list(request.get("prompt"))
        if prompt is None and isinstance(request.get("prompt"), list):
            inner = request["prompt"]
            prompt = int_list(inner[0]) if len(inner) == 1 else None
    if prompt is None:
        return None
    return list(prompt) + rec.token_ids[: rec.settled_ids]


SEAM_CONTEXT_IDS = 4
"""Settled ids before the last text event's that :func:`seam_ids` adds, so that the decoded
tail does not start inside a character made of earlier tokens (it is only read at its end)."""
SEAM_MAX_HELD = 3
"""Ids that can end inside one character: a UTF-8 sequence is at most 4 bytes (RFC 3629),
so at most 3 byte tokens of it come before the one that completes it."""


def seam_ids(t: StreamTranscript) -> list[int] | None:
    """The settled generated ids whose decoded text says where the sent text really ends,
    when that needs asking: the last event with text carried more than one token id (vLLM's
    detokenizer sends no text for a token that ends inside a UTF-8 sequence, so an event of
    one id with text ends on a whole character, ``vllm/v1/engine/detokenizer.py``). The
    last text event's ids with up to :data:`SEAM_CONTEXT_IDS` before them; None when the
    check is not needed (ids not streamed, one id, nothing settled).

    The caller decodes them and then ``ids[:len(ids) - k]`` for ``k`` = 1, 2, ... up to
    :data:`SEAM_MAX_HELD` (and fewer than the event's ids) until :func:`partial_tail` is
    false, and holds back those ``k`` (:meth:`StreamTranscript.unsettle`)."""
    rec = t.choice()
    if rec.token_ids is None or rec.settled_event_ids < 2:
        return None
    start = max(0, rec.settled_ids - rec.settled_event_ids - SEAM_CONTEXT_IDS)
    return rec.token_ids[start:rec.settled_ids]


def seam_drops(t: StreamTranscript) -> int:
    """How many trailing ids of :func:`seam_ids` may be held back: the last text event's
    ids but one (its text came from at least one), at most :data:`SEAM_MAX_HELD`."""
    return max(0, min(SEAM_MAX_HELD, t.choice().settled_event_ids - 1))


def partial_tail(decoded: str) -> bool:
    """Whether a tokenizer's decoded text ends inside a UTF-8 sequence: it ends with U+FFFD
    (Hugging Face tokenizers decode incomplete bytes with ``errors="replace"``, and their
    byte-fallback decoder likewise). The text a client was sent never ends so (vLLM holds
    such text back), so a U+FFFD there is a partial character, not generated text."""
    return decoded.endswith("\ufffd")


def with_token_ids(endpoint: str, request: Mapping[str, Any]) -> dict[str, Any]:
    """The first attempt's body with ``return_token_ids: true`` (vLLM then streams the
    prompt's and each chunk's token ids: what an exact completions continuation needs, and
    the exact count of produced and prompt tokens for chat). A client that did not ask for
    them is sent vLLM's ``null`` instead (:func:`hide_token_ids`). Not for ``echo``: vLLM
    0.32 echoes nothing when ``return_token_ids`` is set (``serving.py``: ``prompt_text =
    ""``), and an echo stream is not continued anyway (its echo is not generated text)."""
    body = dict(request)
    if endpoint in ENDPOINTS and not request.get("echo"):
        body["return_token_ids"] = True
    return body


# vLLM's token-id fields with a list value, compact or spaced (a quote right before the key is
# structure: inside a JSON string it would be escaped)
_IDS = re.compile(rb'("(?:prompt_)?token_ids"\s*:\s*)\[[\d,\s]*\]')
# chat's first chunk also carries the rendered prompt (``prompt_text``, a JSON string)
_PROMPT_TEXT = re.compile(rb'("prompt_text"\s*:\s*)"(?:[^"\\]|\\.)*"')


def hide_token_ids(block: bytes) -> bytes:
    """``block`` (SSE events) with vLLM's ``token_ids`` / ``prompt_token_ids`` lists (and
    chat's ``prompt_text``, which comes with them) turned back into ``null``: the bytes vLLM
    0.32 sends a client that did not ask for them (``return_token_ids``), when the gateway
    asked for them itself (:func:`with_token_ids`). Everything else unchanged; a block
    without ids costs one substring search."""
    if b'token_ids"' not in block:
        return block
    block = _IDS.sub(rb"\1null", block)
    if b'"prompt_text"' in block:
        block = _PROMPT_TEXT.sub(rb"\1null", block)
    return block


def continuation_body(
    endpoint: str, request: Mapping[str, Any], transcript: StreamTranscript
) -> dict[str, Any]:
    """The request that continues ``transcript``'s stream on another backend (call it only
    after :func:`continuable` said ok). A new dict; ``request`` is not changed."""
    body = dict(request)
    t = transcript
    rec = t.choice()
    produced = t.produced()[0]
    if endpoint == COMPLETIONS:
        ids = _prefix_ids(request, t)
        if ids is not None and rec.settled_ids:
            body["prompt"] = ids
        if body.get("echo"):
            body["echo"] = False
    elif rec.text:
        given = request.get("messages")
        messages = [dict(m) if isinstance(m, dict) else m for m in given] if isinstance(
            given, list) else []
        last = messages[-1] if messages else None
        if (
            request.get("continue_final_message") is True
            and isinstance(last, dict)
            and last.get("role") == "assistant"
        ):
            content = last.get("content")
            if isinstance(content, list):
                last["content"] = [*content, {"type": "text", "text": rec.text}]
            else:
                last["content"] = (content or "") + rec.text
        else:
            messages.append({"role": "assistant", "content": rec.text})
        body["messages"] = messages
        body["continue_final_message"] = True
        body["add_generation_prompt"] = False
        if body.get("echo"):
            body["echo"] = False
    if produced:
        for k in _limit_keys(endpoint, request):
            limit = _limit_value(request, k)
            if limit is not None:
                body[k] = limit - produced
        mt = request.get("min_tokens")
        if isinstance(mt, int) and mt > 0:
            body["min_tokens"] = max(0, mt - produced)
    body["stream"] = True
    given_so = request.get("stream_options")
    so = dict(given_so) if isinstance(given_so, dict) else {}
    so["include_usage"] = True  # the stitcher sums it; dropped when the client did not ask
    body["stream_options"] = so
    return body
