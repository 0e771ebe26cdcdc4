"""Deterministic approximate tokenizer and generated text for the simulator.

The tokenizer is reversible and cheap, not a real BPE: text is split into pieces
(a word with its leading space, a run of digits, punctuation, whitespace); a piece
found in a small English vocabulary is one token, anything else is cut into chunks of
up to 3 UTF-8 bytes, one token each. English prose lands near the 4 characters per
token of real BPE tokenizers; ``detokenize(tokenize(s)) == s`` for any string.

Chat prompts are rendered with a ChatML template (the one in
``scripts/vllm-cpu/make_tiny_model.py``) with a BOS token in front, so
``[{"role": "user", "content": "hello world"}]`` counts 11 prompt tokens and the
completion prompt ``"hello world"`` counts 3, as the real tiny-llama server does.

Generated text is a pure function of the context (prompt ids + ids generated so far),
the seed (``GREEDY_SEED`` for greedy requests, temperature 0, as greedy decoding ignores
seeds) and the sample index, so that a generation can be continued elsewhere exactly:
``continuation_point`` finds where the generation in a context began (the longest tail
of the context that is exactly what the simulator would have generated after what comes
before it) and how many tokens it already has. Token ``k`` of a generation is
``generated_token_id(seed, prompt_key(start), sample, k)``, and ``natural_stop_length``
(a function of the same key) gives the length at which it emits EOS (finish "stop")
unless ``ignore_eos`` is set. A request whose prompt is an original prompt plus the
first ``k`` generated ids (completions with a token-id prompt, or chat with the generated
text as a continued final assistant message) therefore produces exactly the remaining
tokens and stops at the same place, as a real model does at temperature 0. A prompt whose
tail is not such a generation (nearly all fresh prompts) starts a new generation keyed by
the whole prompt, which is what the simulator always did.

A drifted build (``ReleaseConfig.drift``, issue 18: a canary whose answers differ from
the baseline's) replaces a share of the generated tokens by other words: a :class:`Drift`
passed to ``generated_token_id`` (and ``continuation_point``, so a drifted server still
continues its own generations). Which tokens drift, and to what, is again a pure
function of (drift seed, seed, key, sample, index), so a greedy request repeated gets the
same drifted answer. ``NO_DRIFT`` (the default) leaves every token as it was.

Chat with ``continue_final_message`` renders the final message without its end-of-turn
(``<|im_start|>assistant\ncontent``, as Hugging Face ``apply_chat_template`` cuts the
rendered text after the final message's content), so "original chat + k generated
tokens" and "chat continued with those k tokens' text" tokenize to the same context.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

BOS_ID = 0
EOS_ID = 1
PAD_ID = 2
IM_START_ID = 3
IM_END_ID = 4
SPECIAL_TOKENS: dict[int, str] = {
    BOS_ID: "<|begin_of_text|>",
    EOS_ID: "<|end_of_text|>",
    PAD_ID: "<|pad|>",
    IM_START_ID: "<|im_start|>",
    IM_END_ID: "<|im_end|>",
}
_SPECIAL_BY_TEXT = {v: k for k, v in SPECIAL_TOKENS.items()}

_WORDS: tuple[str, ...] = tuple(
    (
        "the of and to in is that it for was on are as with be at by this have from or one "
        "had not but what all were when we there can an your which their said if do will "
        "each about how up out them then she many some so these would other into has more "
        "her two like him see time could no make than first been its who now people my made "
        "over did down only way find use may water long little very after words called just "
        "where most know get through back much before go good new write our used me man too "
        "any day same right look think also around another came come work three word must "
        "because does part even place well such here take why things help put years "
        "different away again off went old number great tell men say small every found still "
        "between name should home big give air line set own under read last never us left "
        "end along while might next sound below saw something thought both few those always "
        "looked show large often together asked house world going want school important "
        "until form food keep children feet land side without boy once animals life enough "
        "took sometimes four head above kind began almost live page got earth need far hand "
        "high year mother light parts country father let night following picture being study "
        "second eyes soon times story boys since white days ever paper hard near sentence "
        "better best across during today others however sure means knew try told young "
        "miles sun ways thing whole hear example heard several change answer room sea "
        "against top turned learn point city play toward five using model server request "
        "response token stream router gateway latency queue cache prefix health metrics chat "
        "completion assistant user system hello python async await json http tool function "
        "data code test value error result question please thanks yes"
    ).split()
)
# Generated text draws from the lower-case words so that output reads like words.
_GEN_WORDS: tuple[str, ...] = _WORDS

_WORD_BASE = 16  # ids 0..15 reserved for special tokens
_VOCAB: dict[str, int] = {}
for _i, _w in enumerate(_WORDS):
    _VOCAB[_w] = _WORD_BASE + 2 * _i
    _VOCAB[" " + _w] = _WORD_BASE + 2 * _i + 1
_ID_TO_PIECE: dict[int, str] = {v: k for k, v in _VOCAB.items()}
MAX_CHARS_PER_TOKEN = max(3, *(len(p) for p in _VOCAB))
"""Longest token in characters (vLLM's ``tokenizer.max_chars_per_token``)."""
_BYTE_BASE = 4096  # byte-chunk ids: _BYTE_BASE + (len-1) * 2**24 + int(bytes)
VOCAB_SIZE_HINT = _BYTE_BASE + 3 * (1 << 24)

_PIECE_RE = re.compile(r" ?[A-Za-z]+| ?[0-9]{1,3}| ?[^\sA-Za-z0-9]+|\s+")
_SPECIAL_RE = re.compile("(" + "|".join(re.escape(s) for s in _SPECIAL_BY_TEXT) + ")")


def _chunk_ids(piece: str) -> list[int]:
    raw = piece.encode("utf-8")
    out = []
    for i in range(0, len(raw), 3):
        chunk = raw[i : i + 3]
        out.append(_BYTE_BASE + (len(chunk) - 1) * (1 << 24) + int.from_bytes(chunk, "big"))
    return out


def tokenize(text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of ``text``; with ``add_special_tokens`` a BOS id comes first.

    Special-token strings such as ``<|im_start|>`` map to their single ids.
    """
    ids: list[int] = [BOS_ID] if add_special_tokens else []
    for part in _SPECIAL_RE.split(text):
        if not part:
            continue
        special = _SPECIAL_BY_TEXT.get(part)
        if special is not None:
            ids.append(special)
            continue
        for m in _PIECE_RE.finditer(part):
            piece = m.group(0)
            tid = _VOCAB.get(piece)
            if tid is not None:
                ids.append(tid)
            else:
                ids.extend(_chunk_ids(piece))
    return ids


def token_bytes(token_id: int) -> bytes:
    """UTF-8 bytes of one token (special tokens render as their text)."""
    special = SPECIAL_TOKENS.get(token_id)
    if special is not None:
        return special.encode()
    piece = _ID_TO_PIECE.get(token_id)
    if piece is not None:
        return piece.encode()
    if token_id >= _BYTE_BASE:
        off = token_id - _BYTE_BASE
        length = off // (1 << 24) + 1
        if length <= 3:
            return (off % (1 << 24)).to_bytes(length, "big")
    return b""


def detokenize(token_ids: Iterable[int], skip_special_tokens: bool = False) -> str:
    """Text of ``token_ids`` (inverse of ``tokenize``); unknown ids render as nothing."""
    buf = bytearray()
    for tid in token_ids:
        if skip_special_tokens and tid in SPECIAL_TOKENS:
            continue
        buf += token_bytes(tid)
    return buf.decode("utf-8", errors="replace")


def token_str(token_id: int) -> str:
    """Display string of one token (for ``/tokenize`` ``return_token_strs``)."""
    return token_bytes(token_id).decode("utf-8", errors="replace")


def count_tokens(text: str, add_special_tokens: bool = True) -> int:
    """Number of tokens ``tokenize`` gives for ``text``."""
    return len(tokenize(text, add_special_tokens))


def message_text(content: Any) -> str:
    """Text of an OpenAI message ``content``: a string or a list of parts (text kept)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, Mapping) and part.get("type") == "text":
                parts.append(str(part.get("text", "")))
            elif isinstance(part, str):
                parts.append(part)
        return "".join(parts)
    return str(content)


def render_chat(
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> str:
    """ChatML rendering of ``messages`` (without the BOS, which ``tokenize`` adds).

    With ``continue_final_message`` the final message is left open (no ``<|im_end|>``)
    so that generation continues it; Hugging Face's ``apply_chat_template`` does the same
    by cutting the rendered text after the final message's content.
    """
    out = []
    last = len(messages) - 1
    for i, msg in enumerate(messages):
        role = str(msg.get("role", "user"))
        end = "" if continue_final_message and i == last else "<|im_end|>\n"
        out.append(f"<|im_start|>{role}\n{message_text(msg.get('content'))}{end}")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


def tokenize_chat(
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> list[int]:
    """Prompt token ids of a chat conversation: BOS + ChatML template."""
    return tokenize(
        render_chat(messages, add_generation_prompt, continue_final_message),
        add_special_tokens=True,
    )


def count_chat_tokens(
    messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
) -> int:
    """Prompt tokens of a chat conversation (see ``tokenize_chat``)."""
    return len(tokenize_chat(messages, add_generation_prompt))


def _digest(*parts: object) -> int:
    h = hashlib.blake2b(digest_size=8)
    for p in parts:
        h.update(repr(p).encode())
        h.update(b"\x1f")
    return int.from_bytes(h.digest(), "big")


def prompt_key(prompt_token_ids: Sequence[int]) -> int:
    """A stable 64-bit key of a prompt, used to seed its generated text."""
    h = hashlib.blake2b(digest_size=8)
    for tid in prompt_token_ids:
        h.update(tid.to_bytes(8, "big", signed=True))
    return int.from_bytes(h.digest(), "big")


GREEDY_SEED = 0
"""The seed of greedy text (``temperature`` 0): one for every server and request, since
greedy decoding depends on the model and the context only (vLLM ignores ``seed`` there).
0, the default server seed, so a default server's greedy text is what it always was."""


def natural_stop_length(seed: int, key: int, sample: int = 0, lo: int = 4, hi: int = 512) -> int:
    """Tokens after which a request emits EOS (the EOS token included).

    Log-uniform in [lo, hi] (median about sqrt(lo*hi), ~45 tokens by default), a pure
    function of (seed, prompt key, sample index).
    """
    u = (_digest("len", seed, key, sample) % 1_000_000) / 1_000_000
    return max(1, round(lo * float((hi / lo) ** u)))


@dataclass(frozen=True)
class Drift:
    """How a build's text drifts from the default build's (``ReleaseConfig``).

    ``share``: probability (0-1) that a generated token is replaced by another word, drawn
    per token from a hash (not a stateful RNG), so the same token of the same generation
    drifts the same way on every request. ``seed``: which tokens drift and to which words.
    """

    share: float = 0.0
    seed: int = 1

    def __post_init__(self) -> None:
        if not 0.0 <= self.share <= 1.0:
            raise ValueError(f"drift share must be in [0, 1], got {self.share}")


NO_DRIFT = Drift()
"""The default build's text: no token replaced."""

_UNIT = 1 << 53  # hash -> uniform [0, 1) at float precision


def generated_token_id(
    seed: int, key: int, sample: int, index: int, drift: Drift = NO_DRIFT
) -> int:
    """Id of generated token number ``index`` (0-based): a word, space-prefixed after the first.

    With ``drift``, the token is replaced with probability ``drift.share`` by another word
    (never the same one), keyed by (drift seed, seed, key, sample, index)."""
    n = len(_GEN_WORDS)
    w = _digest("tok", seed, key, sample, index) % n
    if drift.share > 0:
        u = (_digest("drift", drift.seed, seed, key, sample, index) % _UNIT) / _UNIT
        if u < drift.share:  # another word: a shift of 1..n-1 places
            w = (w + 1 + _digest("to", drift.seed, seed, key, sample, index) % (n - 1)) % n
    word = _GEN_WORDS[w]
    return _VOCAB[word if index == 0 else " " + word]


def generated_token_text(
    seed: int, key: int, sample: int, index: int, drift: Drift = NO_DRIFT
) -> str:
    """Text of generated token number ``index`` (see ``generated_token_id``)."""
    return _ID_TO_PIECE[generated_token_id(seed, key, sample, index, drift)]


def generated_text(
    seed: int, key: int, sample: int, num_tokens: int, drift: Drift = NO_DRIFT
) -> str:
    """Concatenated text of the first ``num_tokens`` generated tokens."""
    return "".join(generated_token_text(seed, key, sample, i, drift) for i in range(num_tokens))


_WORD_END = _WORD_BASE + 2 * len(_WORDS)


def _is_word(token_id: int, spaced: bool) -> bool:
    """Whether ``token_id`` is a vocabulary word, space-prefixed (odd id) or not (even)."""
    return _WORD_BASE <= token_id < _WORD_END and (token_id - _WORD_BASE) % 2 == int(spaced)


def continuation_point(
    seed: int, context: Sequence[int], drift: Drift = NO_DRIFT
) -> tuple[int, int]:
    """``(key, generated)``: where the generation in ``context`` began, and its progress.

    ``context`` is a prompt's token ids. Its tail ``context[s:]`` is taken as tokens
    already generated when it is exactly ``generated_token_id(seed, prompt_key(
    context[:s]), 0, i, drift)`` for each of its ``i`` (a build continues its own text:
    a drifted build's, drifted); ``s`` is the smallest such start (the
    tail is empty, ``s = len(context)``, for a fresh prompt). Returns the key of
    ``context[:s]`` and ``len(context) - s`` (tokens). Since token 0 is an unspaced word
    and later tokens are space-prefixed words, only one start can qualify: the token
    before the context's trailing run of spaced words, so this costs two prompt hashes
    at most (O(len(context))).

    It makes the next token a function of the context: appending the token generated
    from a context leaves its continuation point unchanged, so continuing from
    "prompt + k generated ids" yields the same remaining tokens (sample 0).
    """
    end = len(context)
    r = end
    while r > 0 and _is_word(context[r - 1], spaced=True):
        r -= 1
    s = r - 1
    if s >= 0 and _is_word(context[s], spaced=False):
        key = prompt_key(context[:s])
        if all(
            context[s + i] == generated_token_id(seed, key, 0, i, drift) for i in range(end - s)
        ):
            return key, end - s
    return prompt_key(context), 0
