"""``/v1/embeddings`` input checks (vLLM pooling server's messages) and deterministic vectors."""

from __future__ import annotations

import hashlib
import math
import random
import struct
from typing import Any

from gateway.sim import protocol as P
from gateway.sim import text as tx
from gateway.sim.config import SimConfig


def parse_embedding(
    body: dict[str, Any], cfg: SimConfig, served: list[str]
) -> tuple[str, list[list[int]], str]:
    """Check an embeddings body; return (model, inputs as token ids, encoding format)."""
    if "input" not in body:
        raise P.validation_error("missing", "body.input", "Field required", body)
    fmt = body.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):  # vLLM also has "bytes"/"bytes_only" (binary answers)
        raise P.validation_error(
            "literal_error",
            "body.encoding_format",
            "Input should be 'float', 'base64', 'bytes' or 'bytes_only'",
            fmt,
            {"expected": "'float', 'base64', 'bytes' or 'bytes_only'"},
        )
    model = body.get("model") or cfg.model
    if model not in served:  # the pooling server's wording: no aliases, no param
        raise P.error(404, f"The model `{model}` does not exist.", "NotFoundError")
    dims = body.get("dimensions")
    if dims is not None and dims != cfg.embedding_dim:
        raise P.error(
            400,
            f"Model '{model}' does not support Matryoshka embeddings; dimensions must be "
            f"unset (received dimensions={dims}).",
            "BadRequestError",
        )
    raw = body["input"]
    max_len = cfg.engine.max_model_len
    inputs: list[list[int]]
    if raw == []:
        raise P.error(400, "You must pass at least one prompt", "BadRequestError")
    if isinstance(raw, str):
        raw = [raw]
    if isinstance(raw, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in raw):
        inputs = [list(raw)]
    elif isinstance(raw, list) and all(isinstance(x, str) for x in raw):
        for x in raw:
            P.check_text_length(x, max_len)
        inputs = [tx.tokenize(x) for x in raw]
    elif isinstance(raw, list) and all(
        isinstance(x, list) and all(isinstance(t, int) for t in x) for x in raw
    ):
        inputs = [list(x) for x in raw]
    else:
        raise P.validation_error("string_type", "body.input", "Input should be a valid string", raw)
    for t in inputs:
        if len(t) > max_len:
            raise P.prompt_too_long(max_len, len(t), at_least=False)
    return model, inputs, fmt


def embedding_vector(model: str, tokens: list[int], dim: int) -> list[float]:
    """Deterministic unit vector of ``dim`` floats for (model, tokens), seeded by a hash."""
    h = hashlib.blake2b(
        model.encode() + b"\x00" + struct.pack(f"<{len(tokens)}q", *tokens), digest_size=8
    )
    rng = random.Random(int.from_bytes(h.digest(), "big"))
    vec = [rng.gauss(0.0, 1.0) for _ in range(dim)]
    norm = math.sqrt(sum(v * v for v in vec)) or 1.0
    # round-trip through float32 so float and base64 answers carry the same numbers
    packed = struct.pack(f"<{dim}f", *(v / norm for v in vec))
    return list(struct.unpack(f"<{dim}f", packed))
