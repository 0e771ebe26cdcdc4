"""A request's prompt tokens, estimated from its parsed JSON body (pure).

Admission charges a client key's tokens-per-minute bucket before the request is sent
(:mod:`gateway.traffic.limits`), so it needs the prompt's size before any tokenizer has
seen it. :func:`prompt_tokens` walks the body the edge has already parsed (once, never
again) and counts:

* **text**: every string, at :data:`TEXT_BYTES_PER_TOKEN` UTF-8 bytes per token (OpenAI's
  rule of thumb, "1 token ~= 4 chars in English",
  https://help.openai.com/en/articles/4936856-what-are-tokens-and-how-to-count-them; bytes
  rather than characters so that scripts of several bytes a character, about a token each,
  are not under-counted). Message text, ``tools`` schemas, ``instructions``, a completions
  ``prompt`` or embeddings ``input``, the texts of a pass-through route (``/v1/score``,
  ``/v1/rerank``, ``/tokenize``...): whatever the template will render counts;
* **token ids**: a list of integers (a completions ``prompt``, an embeddings ``input``, as a
  list or a list of lists) counts its length, one token per id;
* **media**: an image, audio, video or file item counts a fixed per-item cost
  (:class:`MediaCosts`, from ``admission.estimate``), never the length of its base64 data
  or URL. An item is a content part whose ``type`` names a medium (chat
  ``messages[].content[]``: ``image_url``, ``input_audio``, ``audio_url``, ``video_url``,
  ``file``, vLLM's ``image_embeds`` / ``audio_embeds`` / ``prompt_embeds``; the Responses
  API's ``input`` items: ``input_image``, ``input_file``; Anthropic-shaped ``image`` and
  ``document`` blocks), a field of such a name without a ``type`` (vLLM also reads
  ``{"image_url": "..."}``), or any other string that is a base64 ``data:`` URL of an
  ``image/``, ``audio/``, ``video/`` or ``application/`` type (its MIME type picks the
  medium; other text starting with ``data:`` is text).

vLLM reads the same part types (``MM_PARSER_MAP`` in ``vllm/entrypoints/chat_utils.py``).
The walk uses an explicit stack (no recursion limit on deep JSON) and touches each JSON
node once; the length of an ASCII string is O(1) (other text is encoded to UTF-8, in C), so
a typical chat body costs a few microseconds (4.6 us measured for a four-message chat).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

TEXT_BYTES_PER_TOKEN = 4

IMAGE, AUDIO, VIDEO, FILE = 0, 1, 2, 3

# Content-part types that carry a medium, as OpenAI's Chat Completions and Responses APIs,
# vLLM's chat parser (vllm/entrypoints/chat_utils.py MM_PARSER_MAP) and Anthropic's
# Messages API (which vLLM also serves: image, document) name them.
MEDIA_PARTS: dict[str, int] = {
    "image_url": IMAGE,
    "input_image": IMAGE,
    "image_embeds": IMAGE,
    "image_pil": IMAGE,
    "image": IMAGE,
    "input_audio": AUDIO,
    "audio_url": AUDIO,
    "audio_embeds": AUDIO,
    "audio": AUDIO,
    "video_url": VIDEO,
    "input_video": VIDEO,
    "video": VIDEO,
    "file": FILE,
    "input_file": FILE,
    "document": FILE,
    "prompt_embeds": FILE,
}

# Fields that carry a medium in a part without a ``type`` (vLLM reads
# ``{"image_url": ...}``, ``{"audio_url": ...}``...; vLLM's completions take
# ``prompt_embeds``; OpenAI's file parts ``file_data``). Narrower than MEDIA_PARTS: a tool's
# JSON schema with a property named ``image`` is text.
MEDIA_FIELDS: dict[str, int] = {
    "image_url": IMAGE,
    "image_embeds": IMAGE,
    "image_pil": IMAGE,
    "input_audio": AUDIO,
    "audio_url": AUDIO,
    "audio_embeds": AUDIO,
    "video_url": VIDEO,
    "file_data": FILE,
    "prompt_embeds": FILE,
}

_DATA_URL_MEDIA = {"image": IMAGE, "audio": AUDIO, "video": VIDEO}
# A data URL of a medium (RFC 2397: ``data:<type>/<subtype>[;param=value]*;base64,``): only
# such a string counts as a media item; any other text that starts with ``data:`` (an SSE log
# pasted into a prompt) is text and counted as text.
_MEDIA_DATA_URL = re.compile(
    r"data:(image|audio|video|application)/[\w.+-]+(?:;[\w.+-]+=[^;,\s]*)*;base64,"
)

MAX_REPORTED_TOKENS = 10_000_000
"""The most tokens (prompt or completion) one answer's ``usage`` may report and be believed:
the longest context window of an open model vLLM serves (Llama 4 Scout, 10M tokens, Meta's
model card). A larger (or negative) number is a broken backend's: it is neither counted in
``gateway_tokens_total`` nor charged to a client key (BerriAI/litellm#12970,
docs/wire-reports.md)."""


def plausible_usage(usage: tuple[int, int] | None) -> tuple[int, int] | None:
    """``usage`` (prompt, completion tokens) when both are in ``[0, MAX_REPORTED_TOKENS]``,
    else None (not reported, as far as counting and charging go)."""
    if usage is None:
        return None
    prompt, completion = usage
    if 0 <= prompt <= MAX_REPORTED_TOKENS and 0 <= completion <= MAX_REPORTED_TOKENS:
        return usage
    return None

# vLLM routes that generate nothing (pooling models and the tokenizer, vLLM's OpenAI-compatible
# server): a request to them has no completion budget to charge, whatever ``max_tokens``.
GENERATES_NOTHING = frozenset(
    {
        "/v1/embeddings",
        "/tokenize",
        "/detokenize",
        "/v1/score",
        "/score",
        "/v1/rerank",
        "/rerank",
        "/v2/rerank",
        "/pooling",
        "/classify",
    }
)


@dataclass(frozen=True, slots=True)
class MediaCosts:
    """Tokens one media item is estimated at (tokens per item; the defaults and their
    sources are in :class:`gateway.config.TokenEstimateConfig`). ``file`` also covers
    the other binary inputs (``prompt_embeds``)."""

    image: int = 765
    audio: int = 1500
    video: int = 4608
    file: int = 765

    def by_kind(self) -> tuple[int, int, int, int]:
        """The costs indexed by :data:`IMAGE`, :data:`AUDIO`, :data:`VIDEO`, :data:`FILE`."""
        return (self.image, self.audio, self.video, self.file)


def data_url_kind(url: str) -> int | None:
    """The medium of a base64 ``data:`` URL from its MIME type (``data:image/png;base64,...``):
    :data:`IMAGE`, :data:`AUDIO`, :data:`VIDEO`, :data:`FILE` (``application/...``), or None
    when ``url`` is not such a URL (then it is text)."""
    m = _MEDIA_DATA_URL.match(url)
    if m is None:
        return None
    return _DATA_URL_MEDIA.get(m.group(1), FILE)


def prompt_tokens(payload: object, costs: MediaCosts) -> int:
    """Estimated prompt tokens of a parsed JSON request body ``payload`` (see the module
    docstring): text bytes / :data:`TEXT_BYTES_PER_TOKEN` (rounded up), plus one token per
    token id, plus ``costs`` per media item. Every field counts, keys too (a tool schema's
    property names are rendered; the model name, keys, roles and part types add a few
    tokens a message, about what a chat template adds); numbers outside token-id lists,
    booleans and nulls count nothing."""
    cost = costs.by_kind()
    media, fields = MEDIA_PARTS, MEDIA_FIELDS
    text = 0  # UTF-8 bytes of text
    tokens = 0
    stack: list[object] = [payload]
    pop, push, extend = stack.pop, stack.append, stack.extend
    while stack:
        v = pop()
        if isinstance(v, str):
            if v.startswith("data:") and (kind := data_url_kind(v)) is not None:
                tokens += cost[kind]
            else:
                text += len(v) if v.isascii() else len(v.encode("utf-8", "replace"))
        elif isinstance(v, dict):
            t = v.get("type")
            kind = media.get(t) if isinstance(t, str) else None
            if kind is not None:
                tokens += cost[kind]  # a typed media part: nothing in it is text
                continue
            for k, x in v.items():
                kind = fields.get(k)
                if kind is None:
                    text += len(k)  # (a tool schema's property names are rendered too)
                    push(x)
                elif x is not None:
                    tokens += cost[kind]
        elif isinstance(v, list):
            if v and type(v[0]) is int:  # token ids; anything else in the list is walked
                others = [x for x in v if type(x) is not int]
                tokens += len(v) - len(others)
                extend(others)
            else:
                extend(v)
    return tokens + -(-text // TEXT_BYTES_PER_TOKEN)
