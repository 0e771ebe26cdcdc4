"""Gateway configuration: pydantic models of `config/*.yaml`, env overrides, clear errors.

The YAML file is the base; environment variables override any field with the prefix
``LLM_GATEWAY_`` and ``__`` between nesting levels, e.g. ``LLM_GATEWAY_SERVER__PORT=9000`` or
``LLM_GATEWAY_PROXY__IDLE_TIMEOUT_S=30``. A list (``backends``) is overridden as JSON:
``LLM_GATEWAY_BACKENDS='[{"id": "a", "url": "http://10.0.0.5:8000"}]'``.

Every model forbids unknown keys, so a typo fails at start with the field's dotted path and the
problem (:class:`ConfigError`), never silently.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    AnyHttpUrl,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
)

from gateway.config_rollouts import ModelVersion, RolloutConfig, check_versions, key_problem

ENV_PREFIX = "LLM_GATEWAY_"

# vLLM OpenAI-server routes (besides chat/completions/embeddings) that carry a "model" field.
VLLM_PASSTHROUGH_PATHS = (
    "/tokenize",
    "/detokenize",
    "/v1/score",
    "/score",
    "/v1/rerank",
    "/rerank",
    "/v2/rerank",
    "/pooling",
    "/classify",
    "/v1/responses",
)


class ConfigError(Exception):
    """The configuration is invalid; the message names the file, each field and its problem."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Priority(StrEnum):
    """Request priority classes (header ``x-priority`` or per client key)."""

    HIGH = "high"
    NORMAL = "normal"
    LOW = "low"


class OtelConfig(_Strict):
    """OpenTelemetry spans (``server.otel``; needs the ``otel`` extra:
    ``pip install 'llm-gateway[otel]'``). Spans are exported over OTLP/HTTP when
    ``endpoint`` is set, or else when the standard ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or
    ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) environment variable is; with neither, or
    without the SDK installed, the gateway makes no spans (:mod:`gateway.tracing`)."""

    endpoint: str | None = Field(
        None,
        description="the OTLP/HTTP collector's base URL, e.g. http://otel-collector:4318 "
        "(spans go to its /v1/traces, as the OTLP exporter spec builds the signal URL from "
        "OTEL_EXPORTER_OTLP_ENDPOINT); None: the OTEL_EXPORTER_OTLP_* environment",
    )
    service_name: str = Field(
        "llm-gateway", min_length=1, description="the spans' service.name resource attribute"
    )
    sample_ratio: float = Field(
        1.0,
        ge=0.0,
        le=1.0,
        description="share of new traces recorded (TraceIdRatioBased); a request with an "
        "incoming traceparent follows its caller's sampled flag (ParentBased)",
    )
    enabled: bool = Field(
        True, description="false: no spans even when an endpoint or the environment is set"
    )

    @field_validator("endpoint")
    @classmethod
    def _http_url(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("http://", "https://")):
            raise ValueError(f"an http:// or https:// URL (OTLP/HTTP), not {v!r}")
        return v


class ServerConfig(_Strict):
    """The gateway's own HTTP server."""

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    max_body_bytes: int = Field(
        64 * 1024 * 1024,
        gt=0,
        description="Largest accepted request body in bytes; larger bodies get 413.",
    )
    body_idle_timeout_s: float = Field(
        30.0, gt=0, description="a request body that stops arriving for this long: 408"
    )
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    access_log: bool = Field(False, description="uvicorn's per-request access log line.")
    log_format: Literal["text", "json"] = Field(
        "text",
        description="text: 'time LEVEL logger: message' lines (uvicorn's own format for its "
        "loggers); json: one JSON object per line (time in RFC 3339 UTC, level, logger, "
        "message, extra fields; request_id and backend on every line logged while serving a "
        "request), uvicorn's lines included (gateway/logs.py)",
    )
    otel: OtelConfig = Field(
        default_factory=OtelConfig, description="OpenTelemetry spans (gateway/tracing.py)"
    )
    graceful_shutdown_s: float = Field(
        30.0, ge=0, description="On SIGTERM, seconds in-flight requests get to finish."
    )
    request_id_header: str = "x-request-id"
    client_write_timeout_s: float = Field(
        30.0,
        gt=0,
        description="seconds a write to a client may make no progress (the client reads "
        "nothing while the connection's buffers are full): then the connection is closed "
        "and its request ends as a client disconnect (a stream's upstream request is closed, "
        "so vLLM aborts, and its admission and backend slots are freed). Slow but steady "
        "readers are not cut: a paused write resumes once the client has taken 48 KiB "
        "(asyncio's 64 KiB / 16 KiB write-buffer marks). uvicorn has no write timeout.",
    )
    keep_alive_s: float = Field(
        75.0,
        gt=0,
        description="seconds an idle client connection stays open: longer than a load "
        "balancer's idle timeout (AWS ALB 60 s) and a client pool's keep-alive (httpx 5 s), "
        "so the other side closes first and never reuses a connection as the gateway drops "
        "it (the race behind intermittent 502s and connection errors)",
    )


def read_secret(field: str, value: str | None, env: str | None, file: str | None) -> str | None:
    """A secret from the first of its three sources that is set: inline (``value``), the
    environment variable named ``env``, or the file named ``file`` (read now: at start and
    at each reload; one trailing newline stripped, as ``echo`` and ``kubectl create secret
    --from-file`` leave one). None when none is set. ``field`` is the dotted config path
    of the inline field (``auth.admin_key``); errors name ``<field>_env`` / ``<field>_file``
    and never show the secret. Raises :class:`ConfigError` for an unset or empty variable
    and an unreadable or empty file."""
    if value is not None:
        return value
    if env:
        got = os.environ.get(env)
        if not got:
            raise ConfigError(f"{field}_env: {env} is not set")
        return got
    if file:
        try:
            text = Path(file).expanduser().read_text()
        except (OSError, UnicodeDecodeError) as e:
            why = e.strerror if isinstance(e, OSError) and e.strerror else type(e).__name__
            raise ConfigError(f"{field}_file: cannot read {file}: {why}") from None
        if text.endswith("\n"):
            text = text[:-2] if text.endswith("\r\n") else text[:-1]
        if not text.strip():
            raise ConfigError(f"{field}_file: {file} is empty")
        return text
    return None


def _sources(value: str | None, env: str | None, file: str | None) -> int:
    """How many of a secret's three sources are set."""
    return sum(x is not None for x in (value, env, file))


class ClientKey(_Strict):
    """A key a client presents as ``Authorization: Bearer <key>``.

    Give exactly one of: the key inline (``key``), the name of an environment variable
    holding it (``key_env``), or a file holding it (``key_file``, e.g. a mounted Kubernetes
    or Docker secret; read at start and at each reload, a trailing newline stripped).

    ``priority`` is the class of its requests without an ``x-priority`` header;
    ``max_priority`` the most urgent class the header may ask for (issue 20: priority is
    granted, not claimed). A request asking for more is served at ``max_priority`` and
    counted in ``gateway_priority_capped_total``. Unset, it is the key's own
    ``priority``: a key asks for less than it was given, never more, unless the operator
    grants it.
    """

    name: str
    key: str | None = None
    key_env: str | None = None
    key_file: str | None = Field(None, description="a file holding the key (a mounted secret)")
    priority: Priority = Priority.NORMAL
    max_priority: Priority | None = Field(
        None,
        description="the most urgent x-priority this key may ask for (high, normal, low); "
        "null: the key's priority",
    )
    rpm: int | None = Field(None, ge=1, description="requests per minute (None: default)")
    tpm: int | None = Field(None, ge=1, description="tokens per minute (None: default)")

    @model_validator(mode="after")
    def _one_source(self) -> ClientKey:
        if _sources(self.key, self.key_env, self.key_file) != 1:
            raise ValueError("give exactly one of 'key' or 'key_env' (or 'key_file')")
        if self.key is not None and not self.key.strip():
            raise ValueError("'key' is empty: every client would pass with an empty bearer")
        if _URGENCY[self.priority] < _URGENCY[self.bound]:
            raise ValueError(f"priority {self.priority.value!r} is above max_priority "
                             f"{self.bound.value!r}")
        return self

    @property
    def bound(self) -> Priority:
        """The most urgent priority its requests may have (``max_priority``, else
        ``priority``)."""
        return self.max_priority if self.max_priority is not None else self.priority

    def resolve(self) -> str:
        """The secret itself. Raises :class:`ConfigError` when ``key_env`` is unset or
        ``key_file`` cannot be read."""
        got = read_secret(f"auth.client_keys[{self.name}].key", self.key, self.key_env,
                          self.key_file)
        assert got is not None  # one source is set (validated)
        return got


_URGENCY = {Priority.HIGH: 0, Priority.NORMAL: 1, Priority.LOW: 2}  # lower: more urgent


class AuthConfig(_Strict):
    """Client authentication, the admin key and how far a client may raise its priority.

    With no client keys, the gateway accepts every client (anonymous), whose ``x-priority``
    is bounded by ``anonymous_max_priority``. The admin key (``admin_key``, or better
    ``admin_key_env`` / ``admin_key_file``, so that it is not in the YAML) guards
    ``/admin/*`` (``Authorization: Bearer <key>``, compared in constant time); without one
    the admin API answers loopback clients only (:mod:`gateway.api.access`; README,
    "Security").
    """

    client_keys: list[ClientKey] = Field(default_factory=list)
    admin_key: str | None = None
    admin_key_env: str | None = Field(
        None, description="the environment variable holding the admin key")
    admin_key_file: str | None = Field(
        None, description="a file holding the admin key (a mounted secret; read at start "
        "and each reload, a trailing newline stripped)")
    anonymous_max_priority: Priority = Field(
        Priority.NORMAL,
        description="the most urgent x-priority a client without a key may ask for. "
        "Default normal: anyone who reaches the port could otherwise put every request "
        "ahead of everyone else's with 'x-priority: high'; asking for low still works. A "
        "gateway whose network is trusted sets high",
    )

    def resolved_admin_key(self) -> str | None:
        """The admin key, or None. Raises :class:`ConfigError` if ``admin_key_env`` is
        unset or ``admin_key_file`` cannot be read."""
        return read_secret("auth.admin_key", self.admin_key, self.admin_key_env,
                           self.admin_key_file)

    @model_validator(mode="after")
    def _distinct(self) -> AuthConfig:
        if _sources(self.admin_key, self.admin_key_env, self.admin_key_file) > 1:
            raise ValueError("give at most one of admin_key, admin_key_env, admin_key_file")
        if self.admin_key is not None and not self.admin_key.strip():
            raise ValueError(
                "admin_key is empty (an unset ${VAR} in compose?): /admin would accept an "
                "empty bearer; leave admin_key out to run without one"
            )
        names: set[str] = set()
        inline: dict[str, str] = {}
        for k in self.client_keys:
            if k.name in names:
                raise ValueError(f"client key name {k.name!r} is used twice")
            names.add(k.name)
            if k.key is not None:
                if k.key in inline:
                    raise ValueError(
                        f"client keys {inline[k.key]!r} and {k.name!r} have the same key: "
                        "the limits and priority of one would silently apply"
                    )
                inline[k.key] = k.name
        return self


class RoutingWeights(_Strict):
    """Weights of the load score (lower score wins); see :mod:`gateway.routing.policy`."""

    waiting: float = Field(1.0, ge=0, description="per request queued on the backend")
    running: float = Field(0.5, ge=0, description="per unit of batch occupancy (0-1)")
    kv_cache: float = Field(1.0, ge=0, description="per unit of KV-cache usage (0-1)")
    failures: float = Field(
        0.0,
        ge=0,
        description=(
            "per consecutive failure on the backend's breaker; 0 (default) leaves failing "
            "backends to the circuit breaker (it opens after breaker.consecutive_failures); "
            "> 0 steers traffic away after the first failure, so the breaker sees fewer"
        ),
    )


class RoutingPolicy(StrEnum):
    """The backend-choice policy (:func:`gateway.routing.policies.build_policy`)."""

    LOAD_THERMAL = "load_thermal"
    LEAST_REQUEST = "least_request"
    ROUND_ROBIN = "round_robin"


class RoutingConfig(_Strict):
    """Backend choice (the routing policy) and session affinity."""

    policy: RoutingPolicy = Field(
        RoutingPolicy.LOAD_THERMAL,
        description=(
            "load_thermal (default): least load score (vLLM queue, batch occupancy, KV "
            "cache, corrected by the gateway's in-flight count), thermal/power penalties "
            "when GPU telemetry or power domains are configured, session affinity; "
            "least_request: fewest requests in flight; round_robin: each backend in turn. "
            "The last two ignore load samples, GPU telemetry and session affinity; all "
            "three ramp a newly warm backend over lifecycle.slow_start_s"
        ),
    )
    session_header: str = Field("x-session-id", description="header that pins a session")
    session_ttl_s: float = Field(3600.0, gt=0)
    session_max_entries: int = Field(100_000, gt=0)
    responses_ttl_s: float = Field(
        86_400.0,
        gt=0,
        description="seconds the gateway remembers which backend created a Responses API "
        "response (follow-ups with previous_response_id and GET/DELETE/cancel by id go "
        "there); after it the id is unknown: a follow-up is routed as usual, a by-id call "
        "asks every backend",
    )
    responses_max_entries: int = Field(
        100_000,
        gt=0,
        description="response ids remembered at most (the oldest learned goes first; about "
        "200 bytes each)",
    )
    weights: RoutingWeights = Field(default_factory=RoutingWeights)


class TelemetryConfig(_Strict):
    """Scraping of each backend's vLLM ``/metrics`` and ``/v1/models``."""

    scrape_interval_s: float = Field(0.5, gt=0, le=60)
    scrape_timeout_s: float = Field(1.0, gt=0)
    stale_after_s: float = Field(
        5.0, gt=0, description="a load sample older than this is ignored by the router"
    )
    models_refresh_s: float = Field(10.0, gt=0)


class HealthConfig(_Strict):
    """Active probes (``GET /health``).

    Defaults: a backend is ``unhealthy`` after 3 failed probes in a row (so within about
    ``3 * interval_s`` of dying); it returns after 2 passing probes. Probes go out on a fixed
    tick (every ``interval_s``, one outstanding per backend), so a backend that does not
    answer does not delay the others'. Passive outlier detection from real traffic is the
    circuit breaker's job (``breaker:``).

    A backend that stops answering without refusing connections (hung: a stopped process,
    a wedged host) is judged by its silence (:mod:`gateway.fleet.liveness`): once it owes
    an answer to a probe or a ``/metrics`` scrape and nothing at all came back from it for
    ``suspect_after_s`` (1 s), new requests go to another backend when one can take them;
    after ``hung_after_s`` (2 s; twice that when no other backend was heard from meanwhile)
    it is ``unhealthy`` (reason ``backend_hung``) and its requests whose first byte has not
    reached the client are re-sent elsewhere (streams already started are left alone).
    Slow generation never counts: requests waiting for their first token owe nothing while
    the backend answers its probes and scrapes.
    """

    interval_s: float = Field(1.0, gt=0)
    timeout_s: float = Field(2.0, gt=0)
    stall_after_s: float = Field(
        30.0, gt=0, description="requests in flight and no answer for this long: probe now"
    )
    stall_probe_timeout_s: float = Field(30.0, gt=0)
    fail_threshold: int = Field(3, ge=1)
    recover_threshold: int = Field(2, ge=1)
    suspect_after_s: float = Field(
        1.0,
        ge=0,
        description="silent this long while owing a probe/scrape answer: new requests go "
        "elsewhere when another backend can take them (0: off)",
    )
    hung_after_s: float = Field(
        2.0,
        ge=0,
        description="silent this long (twice that with no other backend heard meanwhile): "
        "unhealthy (backend_hung), requests without a first byte re-sent (0: off)",
    )


class ProxyConfig(_Strict):
    """The data path toward backends.

    There is deliberately no wall-clock cap on a request: ``ttfb_timeout_s`` bounds the wait
    for the response to start (a non-streaming generation answers only when complete, so it
    is generous), ``idle_timeout_s`` bounds silence between two chunks once bytes flow.

    ``max_continuations`` (default 2; 0 turns it off): how many times one chat / completions
    stream whose backend failed after events reached the client may be continued on another
    backend (issue 17, :mod:`gateway.proxy.continuation`); each continuation is an attempt
    that must also fit the retry budget. A client turns it off for one request with the
    header ``x-gateway-continuation: off``.
    """

    connect_timeout_s: float = Field(5.0, gt=0)
    ttfb_timeout_s: float = Field(
        900.0, gt=0, description="request sent -> first response byte (headers/first event)"
    )
    idle_timeout_s: float = Field(120.0, gt=0, description="max silence between chunks")
    pool_size_per_backend: int = Field(1024, ge=1)
    keepalive_timeout_s: float = Field(
        4.0, gt=0, description="idle pooled connections close after this (below uvicorn's 5 s)"
    )
    max_attempts: int = Field(
        2, ge=1, le=5, description="attempts per request, each on a different backend"
    )
    max_continuations: int = Field(
        2,
        ge=0,
        le=10,
        description="continuations per stream on another backend after a mid-stream "
        "failure (0: off)",
    )
    max_error_body_bytes: int = Field(
        2**20,
        ge=1024,
        description="most of a backend's error answer (status >= 400) read and relayed, "
        "bytes; the rest is dropped and the connection closed (vLLM's ErrorResponse is a "
        "few hundred bytes)",
    )
    max_n: int = Field(
        128,
        ge=1,
        le=1 << 16,
        description="most choices (``n``) and candidates (``best_of``) one request may ask "
        "for; above it, 400 invalid_value (param n / best_of). vLLM has no bound and makes "
        "one sequence each: one request with n=65536 and max_tokens=1 stalls a backend. "
        "128 is OpenAI's own bound (its OpenAPI spec, github.com/openai/openai-openapi: "
        "CreateChatCompletionRequest and CreateCompletionRequest n, minimum 1, maximum 128)",
    )
    passthrough_paths: list[str] = Field(
        default_factory=lambda: list(VLLM_PASSTHROUGH_PATHS),
        description="other vLLM POST routes whose JSON body names a model",
    )


class CycleConfig(_Strict):
    """One maintenance cycle's period (seconds; 0 disables it): each backend runs it once per
    period. Backends the gateway starts with are first due within the first period, spread
    by config order; a backend that joins later (a reload, discovery, the autoscaler) or is
    warm again after an outage (a restart, a crash) was just started, so it is first due one
    full period after that plus its share of the next, by a hash of its id
    (:func:`gateway.fleet.cycles.joined_cycle_clock`)."""

    every_s: float = Field(..., ge=0)


class ShortCycleConfig(CycleConfig):
    """The short cycle: an application probe (a tiny completion) every ``every_s``."""

    every_s: float = Field(300.0, ge=0)


class LongCycleConfig(CycleConfig):
    """The long cycle: drain, then the restart hook, every ``every_s``."""

    every_s: float = Field(4 * 3600.0, ge=0)


class MediumCycleConfig(CycleConfig):
    """Drain -> ``POST /reset_prefix_cache`` -> rest (probes only; optional vLLM ``/sleep``
    then ``/wake_up``) -> calibration -> slow-start return. Due every ``every_s`` seconds or
    every ``every_requests`` requests served, whichever comes first, and started only when
    the other backends can carry the load (``lifecycle.carry_utilization``).

    The rest is as long as the GPU needs and no longer: with GPU telemetry
    (``gpu_metrics_url``) it ends once the GPU reads below ``thermal.resume_c`` (at most
    ``thermal.max_cooldown_s``); without telemetry (or when it is stale) it is
    ``cooldown_s``, short by default (10 s: a quiet period for the prefix-cache reset)."""

    every_s: float = Field(1800.0, ge=0)
    every_requests: int = Field(10_000, ge=0, description="0 disables the request trigger")
    cooldown_s: float = Field(10.0, ge=0, description="rest without GPU telemetry, seconds")
    sleep: bool = Field(False, description="put vLLM to sleep (level 1) while resting")


class RestartHook(_Strict):
    """How the long cycle restarts a backend: a command, an HTTP call, or deleting its pod
    through the Kubernetes API (exactly one).

    ``{backend_id}`` and ``{url}`` in the command's arguments or the URL are replaced, e.g.
    ``url: "http://ops:9000/restart/{backend_id}"``. ``delete_pod: true`` deletes the
    backend's pod (``BackendConfig.pod`` in ``namespace``, both filled in by Kubernetes
    discovery from the EndpointSlice's ``targetRef``) with the gateway's service account
    (RBAC: ``pods: delete``); its Deployment or StatefulSet starts a new one. No binary is
    needed in the image.
    """

    command: list[str] | None = None
    url: str | None = None
    method: Literal["POST", "PUT", "DELETE", "GET"] = "POST"
    delete_pod: bool = False
    kubeconfig: str | None = Field(
        None, description="for delete_pod: a kubeconfig file; None: in-cluster, then ~/.kube/config"
    )
    timeout_s: float = Field(60.0, gt=0)

    @model_validator(mode="after")
    def _one_way(self) -> RestartHook:
        if (self.command is not None) + (self.url is not None) + self.delete_pod != 1:
            raise ValueError("give exactly one of 'command', 'url' or 'delete_pod: true'")
        return self


class LifecycleConfig(_Strict):
    """Warm-up, slow start, drain and the three maintenance cycles (seed 000).

    Defaults: short every 5 min (probe only), medium every 30 min or 10,000 requests, long
    every 4 h. Per model at most ``max_unavailable`` backends are out of rotation at once
    (default: 1 or 25% of the model's backends, whichever is larger), and never its last warm
    backend; while a canary rollout of the model runs, never the last routable backend of
    its baseline or canary version either (the cycle is deferred, with its reason).
    """

    warmup_batch_shapes: list[int] = Field(default_factory=lambda: [1, 2, 4, 8])
    warmup_max_tokens: int = Field(8, ge=1)
    warmup_timeout_s: float = Field(120.0, gt=0)
    slow_start_s: float = Field(30.0, ge=0, description="traffic share ramps over this")
    slow_start_min_weight: float = Field(0.1, gt=0, le=1)
    drain_deadline_s: float = Field(60.0, ge=0)
    preempt_deadline_s: float = Field(30.0, ge=0)
    preempt_hold_s: float = Field(
        600.0, gt=0, description="a preempted backend stays out until it goes away, or this"
    )
    restart_hold_s: float = Field(
        120.0, gt=0, description="after a restart hook, out until a probe fails, or this"
    )
    max_unavailable: int | None = Field(None, ge=1)
    carry_utilization: float = Field(
        0.8,
        gt=0,
        le=1,
        description="a cycle takes a backend out only while the others' learned service "
        "rate carries the demand (measured and forecast) at no more than this utilization",
    )
    max_defer_s: float = Field(
        3600.0,
        gt=0,
        description="a cycle deferred this long (the others never could carry the load) is "
        "skipped until its next period, counted",
    )
    check_interval_s: float = Field(1.0, gt=0, description="how often cycles are evaluated")
    # each cycle has its own defaults, so one field of it can be set alone
    short: ShortCycleConfig = Field(default_factory=ShortCycleConfig)
    medium: MediumCycleConfig = Field(default_factory=MediumCycleConfig)
    long: LongCycleConfig = Field(default_factory=LongCycleConfig)
    restart_hook: RestartHook | None = None
    app_probe_max_tokens: int = Field(1, ge=1)


class CalibrationConfig(_Strict):
    """Answer checks after each cooldown: fixed prompts at temperature 0 and a fixed seed.

    The first answers of a backend once warm (or ``baseline_file``: JSON ``{model: {prompt:
    text}}``) are its baseline. Below ``threshold`` token-overlap similarity the backend is
    ``unhealthy`` (``calibration_drift``) and the restart hook runs.
    """

    enabled: bool = True
    prompts: list[str] = Field(
        default_factory=lambda: [
            "List the first five prime numbers.",
            "Translate 'good morning' into French.",
            "What is the capital of Japan?",
        ]
    )
    max_tokens: int = Field(16, ge=1)
    seed: int = 1234
    threshold: float = Field(0.95, ge=0, le=1)
    baseline_file: str | None = None


class SLOConfig(_Strict):
    """Service-level objectives (seconds): what "fast enough" means for this fleet."""

    ttft_s: float = Field(2.0, gt=0, description="time to first token")
    itl_s: float = Field(0.1, gt=0, description="inter-token latency")


class StatusConfig(_Strict):
    """The status page (``GET /status``, ``/status.json``; :mod:`gateway.api.status`).

    A model is a "major outage" while no backend can serve it or under 90 % of its
    requests over the last ``now_s`` seconds were answered without an error of the
    service, a "partial outage" under 99 %, "degraded performance" while its P99 TTFT or
    ITL over the window is over ``slo`` (:mod:`gateway.traffic.status_verdict`). A window
    is judged on ``min_samples`` or more (requests for availability, streams for TTFT,
    inter-token gaps for ITL); fewer is said as too few to judge, with the count. The
    latency and error-ratio alert rules (``python -m gateway.ops``) take the same window
    and minimum, so the page and the alerts agree. The last hour is kept per minute
    (:mod:`gateway.traffic.status_rollup`). ``tick_s``: how often the recorder reads the
    request and error counters, the new first tokens and the incidents' sources (an
    incident's time is exact for backend transitions, to the tick for the others)."""

    now_s: float = Field(
        300.0, gt=0, description="the 'now' window of the status page's words, seconds "
        "(5 min; also the rate window of the latency and error-ratio alerts)"
    )
    min_samples: int = Field(
        20, ge=1, description="requests (availability), streams (P99 TTFT) or inter-token "
        "gaps (P99 ITL) a window needs to be judged (20: P99 rests on the largest; one "
        "failure in 20 is 95 %); also the alerts' minimum"
    )
    tick_s: float = Field(2.0, gt=0, description="recorder period, seconds")
    incidents: int = Field(100, ge=1, description="incidents kept (the newest)")
    public_details: bool = Field(
        False,
        description="show every client the backends' ids, their cooldowns and the "
        "incidents' subjects and reasons; false (default): only loopback clients and "
        "holders of the admin key see them, others get the models' status, counts by "
        "state and tier, and incidents without subject or detail (backend ids embed hosts "
        "when discovered, and error reasons can quote URLs)",
    )


class BreakerSettings(_Strict):
    """Per-backend circuit breaker (see :mod:`gateway.traffic.breaker`)."""

    consecutive_failures: int = Field(5, ge=1)
    error_rate: float = Field(0.5, gt=0, le=1)
    min_requests: int = Field(20, ge=1)
    window_s: float = Field(30.0, gt=0)
    open_base_s: float = Field(5.0, gt=0)
    open_max_s: float = Field(120.0, gt=0)
    half_open_max: int = Field(1, ge=1)
    latency_fuse_factor: float = Field(5.0, gt=1, description="x the TTFT SLO, on P99")
    unhealthy_after_trips: int = Field(
        3, ge=1, description="trips in a row (no success between) that make it unhealthy"
    )

    @model_validator(mode="after")
    def _ordered(self) -> BreakerSettings:
        if self.open_base_s > self.open_max_s:
            raise ValueError("open_base_s must not exceed open_max_s")
        return self


class RetrySettings(_Strict):
    """Backoff and retry budget (see :mod:`gateway.traffic.retry`)."""

    backoff_base_s: float = Field(0.025, ge=0, description="Envoy's default base interval")
    backoff_max_s: float = Field(1.0, ge=0)
    budget_ratio: float = Field(0.2, ge=0, le=1)
    budget_window_s: float = Field(10.0, gt=0)
    budget_min_per_s: float = Field(1.0, ge=0, description="retry floor, per second")
    default_retry_after_s: float = Field(
        1.0, gt=0, description="cooling time of a backend 429 without Retry-After"
    )
    max_cooling_s: float = Field(
        60.0, gt=0, description="longest a backend's Retry-After keeps it cooling"
    )

    @model_validator(mode="after")
    def _ordered(self) -> RetrySettings:
        if self.backoff_base_s > self.backoff_max_s:
            raise ValueError("backoff_base_s must not exceed backoff_max_s")
        return self


class TokenEstimateConfig(_Strict):
    """How admission estimates a request's prompt tokens before it is sent
    (:mod:`gateway.traffic.estimate`): text at 4 UTF-8 bytes per token, token-id lists at
    their length, and each media item at a fixed cost below, never by the size of its
    base64 data. The estimate only decides admission: after the answer the client key is
    charged the ``usage`` the backend reported, when it reported one."""

    image_tokens: int = Field(
        765,
        ge=0,
        description="tokens per image: OpenAI's vision pricing for a 1024x1024 image at high "
        "detail, 85 + 170 per 512 px tile x 4 tiles (LLaVA-1.5 in vLLM: 576)",
    )
    audio_tokens: int = Field(
        1500,
        ge=0,
        description="tokens per audio item: one 30 s window of a Whisper-style encoder, "
        "1500 positions (Whisper's encoder; vLLM's Whisper and Qwen2-Audio models)",
    )
    video_tokens: int = Field(
        4608,
        ge=0,
        description="tokens per video: LLaVA-NeXT-Video in vLLM, 32 frames x 144 tokens "
        "(a 24x24 CLIP patch grid pooled by 2)",
    )
    file_tokens: int = Field(
        765,
        ge=0,
        description="tokens per file part (and other binary input: prompt_embeds): one page "
        "given as an image (OpenAI file inputs pass each PDF page as an image and its text)",
    )


class AdmissionConfig(_Strict):
    """Admission control (see :mod:`gateway.traffic.admission`).

    ``max_in_flight`` None: the sum of the backends' ``max_num_seqs`` times
    ``in_flight_per_seq``, or unbounded when a capacity is unknown. At 1.0 (default) extra
    requests wait in the gateway's priority queue, not in vLLM's FIFO queue, so a
    high-priority request takes the next free sequence slot: measured with
    ``benchmarks/overload.py`` at 3x capacity, high-priority P99 TTFT 0.9 s at 1.0 against
    2.4 s at 2.0, for about 2% less throughput; raise it for throughput-bound fleets.

    The resource layer sheds by the queue wait a new request would meet on the model's
    least-loaded backend, predicted from that backend's scraped queue and its concurrency
    and service rate learned from its own ``/metrics`` (:mod:`gateway.traffic.capacity`):
    ``shed_levels`` are that wait in multiples of ``slo.ttft_s`` at which high, normal and
    low priority are shed (defaults 4, 2, 1: with the 2 s SLO, low is refused when it would
    wait 2 s before its prefill starts, normal at 4 s, high at 8 s). A queue inside vLLM that
    drains in time sheds nothing.
    """

    enabled: bool = True
    default_rpm: int | None = Field(None, ge=1)
    default_tpm: int | None = Field(None, ge=1)
    default_max_tokens: int = Field(256, ge=1, description="token estimate when not given")
    estimate: TokenEstimateConfig = Field(
        default_factory=TokenEstimateConfig,
        description="per-item token costs of images, audio, video and files in the estimate",
    )
    priority_header: str = "x-priority"
    max_in_flight: int | None = Field(None, ge=1)
    in_flight_per_seq: float = Field(1.0, gt=0)
    max_queued: int = Field(1024, ge=0)
    max_queue_wait_s: float = Field(
        10.0,
        ge=0,
        description="bound on a request's wait for a slot: refused at once (429) when its "
        "predicted wait exceeds it, and refused when it has waited that long",
    )
    waiting_full: float | None = Field(
        None, gt=0, description="deprecated, ignored: the resource layer sheds by predicted wait"
    )
    kv_full: float | None = Field(
        None, gt=0, le=1, description="deprecated, ignored (see shed_levels)"
    )
    shed_levels: tuple[float, float, float] = Field(
        (4.0, 2.0, 1.0),
        description="predicted queue wait, in multiples of slo.ttft_s, at which high, normal "
        "and low priority are shed",
    )

    @model_validator(mode="after")
    def _deprecated(self) -> AdmissionConfig:
        if self.waiting_full is not None or self.kv_full is not None:
            logging.getLogger("gateway.config").warning(
                "admission.waiting_full and admission.kv_full are deprecated and ignored: the "
                "resource layer sheds by the predicted queue wait (admission.shed_levels, in "
                "multiples of slo.ttft_s)"
            )
        return self

    @model_validator(mode="after")
    def _low_sheds_first(self) -> AdmissionConfig:
        high, normal, low = self.shed_levels
        if not high >= normal >= low > 0:
            raise ValueError(
                "shed_levels are (high, normal, low) and must not increase (low is shed "
                f"first): got {list(self.shed_levels)}"
            )
        return self


class DegradedConfig(_Strict):
    """Optional degraded mode under sustained overload (off by default)."""

    enabled: bool = False
    enter_after_s: float = Field(10.0, gt=0)
    step_s: float = Field(30.0, gt=0)
    window_s: float = Field(30.0, gt=0, description="P99 TTFT window it watches")
    tick_s: float = Field(1.0, gt=0, description="how often it looks at P99 TTFT and the queue")
    max_tokens_cap: int = Field(512, ge=1, description="cap at level 1; halves per level")
    low_priority_max_prompt_tokens: int = Field(4096, ge=1)


class BucketConfig(_Strict):
    """One priority bucket of the batcher: requests per batch and longest wait (ms)."""

    max_batch_size: int = Field(..., ge=1)
    max_wait_ms: float = Field(..., ge=0)


class ForecastConfig(_Strict):
    """Arrival-rate forecast per model (see :mod:`gateway.traffic.forecast`): Holt-Winters
    with damped trend and daily seasonality, ticked every second."""

    enabled: bool = True
    horizon_s: int = Field(30, ge=1, description="forecast of the mean rate over this")
    alpha: float = Field(0.1, gt=0, le=1, description="level weight per 1 s tick")
    beta: float = Field(0.02, ge=0, le=1, description="trend weight per tick")
    gamma: float = Field(0.3, ge=0, le=1, description="seasonal weight per period")
    phi: float = Field(0.9, gt=0, le=1, description="trend damping")
    season_s: float = Field(86_400.0, gt=0, description="seasonal period (a day)")
    season_bins: int = Field(288, ge=1, description="seasonal states per period")


class BatcherConfig(_Strict):
    """The predictive batcher (see :mod:`gateway.traffic.batcher`); off by default.

    With it on, admitted requests wait in the batcher's priority buckets (which replace the
    admission scheduler's queue: same ``admission.max_queued`` bound, class shares and
    ``admission.max_queue_wait_s``) and are bound to a backend when dispatched, only while
    that backend has room: in flight below ``max_num_seqs * in_flight_per_seq``
    (``default_capacity`` for backends without ``max_num_seqs``; neither: no flow control).
    ``predictive`` False gives the fixed-wait batcher (dispatch only when full or timed out).
    """

    enabled: bool = False
    predictive: bool = True
    high: BucketConfig = Field(
        default_factory=lambda: BucketConfig(max_batch_size=4, max_wait_ms=2.0)
    )
    normal: BucketConfig = Field(
        default_factory=lambda: BucketConfig(max_batch_size=16, max_wait_ms=10.0)
    )
    low: BucketConfig = Field(
        default_factory=lambda: BucketConfig(max_batch_size=64, max_wait_ms=50.0)
    )
    slack_share: float = Field(
        0.5, gt=0, le=1, description="wait budget cap: this share of the TTFT SLO slack"
    )
    in_flight_per_seq: float = Field(1.0, gt=0)
    default_capacity: int | None = Field(None, ge=1)
    merge: bool = Field(True, description="merge embeddings/completions (non-streaming)")
    merge_max: int = Field(64, ge=1, description="most client requests in one merge")
    merge_window: int = Field(
        3,
        ge=0,
        description="embeddings upstream requests in flight per backend; more wait in the "
        "gateway (flow control) and merge into the next (Nagle's algorithm, RFC 896, with a "
        "window; see gateway.flow.batching); 0: no window",
    )


class ClockControlConfig(_Strict):
    """Clocks before shedding (issue 21; :mod:`gateway.routing.clocks`): the gateway caps the
    SM clocks of a power domain's GPUs, through each backend's agent, before it refuses
    requests for power, and caps a warm GPU's clock instead of draining it.

    Shares are of the GPU's maximum SM clock. LLM decode is bound by HBM bandwidth and
    barely slows at a lower SM clock while power falls about as ``f^3`` (Maliakel et al.,
    arXiv:2501.08219: about 42% less energy for 1-6% more latency; DynamoLLM, Stojkovic et
    al., HPCA 2025; GreenLLM, arXiv:2508.16449), so a clock cap trades a little latency for
    a lot of power. Off by default: it needs agents that may set clocks (``agent.control``).
    """

    enabled: bool = False
    floor_ratio: float = Field(
        0.5,
        gt=0,
        le=1,
        description="lowest cap (share of the max SM clock): shedding starts only when the "
        "caps of a domain's GPUs sit here; 0.5: decode about 3% slower in the measured range",
    )
    step_ratio: float = Field(
        0.05, gt=0, le=0.5, description="one step of a cap (share of the max SM clock)"
    )
    interval_s: float = Field(
        2.0,
        gt=0,
        description="s, least time between two steps of one domain or one GPU (a telemetry "
        "round: a step's effect is seen before the next)",
    )
    domain_high_ratio: float = Field(
        0.85, gt=0, description="domain draw / budget above which its clocks step down"
    )
    domain_low_ratio: float = Field(
        0.75, gt=0, description="... below which they step back up (hysteresis band between)"
    )
    hot_margin_c: float = Field(
        2.0, ge=0, description="°C; a GPU from hot_c - this steps its clock down (not drained)"
    )
    release_margin_c: float = Field(
        5.0, ge=0, description="°C; ... and below hot_c - this steps it back up"
    )
    efficient_ratio: float = Field(
        1.0,
        gt=0,
        le=1,
        description="cap of a backend with no queue (DynamoLLM: the lowest clock meeting the "
        "SLO); lifted while requests wait. 1: off",
    )
    agent_token_env: str = Field(
        "LLM_GATEWAY_AGENT_TOKEN",
        description="environment variable holding the agents' control token (never in the "
        "config file)",
    )
    efficient_after_s: float = Field(
        10.0,
        ge=0,
        description="s without a request waiting before the efficient cap applies (so a "
        "backend between two bursts does not flip its clock at every scrape)",
    )
    power_shed_release: float = Field(
        0.05,
        ge=0,
        description="power shedding stops only when the domain's draw / budget is this much "
        "below the level that started it (hysteresis)",
    )
    power_limits: bool = Field(
        True,
        description="after the clocks: once a domain's clock caps sit at their floor and its "
        "draw is still over domain_high_ratio, set its GPUs' power limits to their share of "
        "the budget (gateway/routing/power_limits.py) before any request is shed for power",
    )
    smooth_intervals: int = Field(
        3,
        ge=1,
        description="the clock and power-limit rules decide on the domain's mean draw over the "
        "last smooth_intervals x interval_s (gateway/routing/draw_window.py): one noisy "
        "sample under a mark does not move a lever",
    )
    min_hold_intervals: int = Field(
        5,
        ge=1,
        description="a power limit, once set, stays set at least min_hold_intervals x "
        "interval_s before it may be released (no set/release flapping)",
    )
    release_stable_intervals: int = Field(
        5,
        ge=0,
        description="a power limit is released only once the domain's draw has read under "
        "domain_low_ratio for release_stable_intervals x interval_s without a break (a "
        "stabilization window on the way down: short dips of the load release nothing; 0: "
        "at the first reading under it)",
    )
    power_limit_ratio: float = Field(
        0.78,
        gt=0,
        le=1,
        description="domain draw / budget the power limits aim at (the budget split over the "
        "domain's GPUs): inside the clocks' hysteresis band, so limits that bind do not "
        "release themselves, and under the lowest power_shed_levels (0.8), so they do not shed",
    )

    @model_validator(mode="after")
    def _ordered(self) -> ClockControlConfig:
        if not self.domain_low_ratio < self.domain_high_ratio:
            raise ValueError("domain_low_ratio must be below domain_high_ratio")
        band = self.domain_low_ratio < self.power_limit_ratio < self.domain_high_ratio
        if self.power_limits and not band:
            raise ValueError(
                "power_limit_ratio must lie between domain_low_ratio and domain_high_ratio "
                "(limits that bind must neither release themselves nor call for more); set it "
                "inside the band, or power_limits: false"
            )
        if not self.hot_margin_c < self.release_margin_c:
            raise ValueError("hot_margin_c must be below release_margin_c")
        if self.efficient_ratio < self.floor_ratio:
            raise ValueError("efficient_ratio must not be below floor_ratio")
        return self


class ThermalConfig(_Strict):
    """Thermal- and power-aware routing (see :mod:`gateway.routing.thermal`).

    Tiers of a backend's hottest GPU (seed 000): cool below ``warm_c`` (75 °C), warm from
    ``warm_c`` to ``hot_c`` (85 °C), hot from ``hot_c``. A hot backend gets no new requests
    and is sent to cooldown; it counts as hot until it reads below ``resume_c`` (70 °C,
    hysteresis) and returns after at least ``cooldown_s`` of rest (never more than
    ``max_cooldown_s``). The router prefers the backend whose temperature predicted
    ``predict_ahead_s`` (60 s) ahead, from the slope over ``trend_window_s``, is lowest
    (TAPAS, Stojkovic et al., ASPLOS 2025, arXiv:2501.02600, routes on predicted headroom).
    A backend drawing more than ``power_cap_ratio`` (80%, seed 000) of its power limit is
    deprioritised. Penalties are in load-score units (one unit = one queued request).
    """

    enabled: bool = True
    scrape_interval_s: float = Field(2.0, gt=0, le=60, description="GPU telemetry period")
    scrape_timeout_s: float = Field(1.5, gt=0)
    stale_after_s: float = Field(
        10.0, gt=0, description="a GPU sample older than this makes the tier 'unknown'"
    )
    warm_c: float = Field(75.0, description="°C; cool below, warm from here")
    hot_c: float = Field(85.0, description="°C; hot from here: no new requests, cooldown")
    resume_c: float = Field(70.0, description="°C; a hot backend stays hot until below this")
    cooldown_s: float = Field(60.0, ge=0, description="least rest of a thermal cooldown")
    max_cooldown_s: float = Field(
        900.0, gt=0, description="a thermal cooldown ends after this even if still hot"
    )
    trend_window_s: float = Field(30.0, gt=0, description="samples used for the slope")
    predict_ahead_s: float = Field(60.0, ge=0, description="prediction horizon (TAPAS)")
    max_slope_c_per_s: float = Field(
        1.0, gt=0, description="the slope used for prediction is clamped to +/- this"
    )
    power_cap_ratio: float = Field(
        0.8, gt=0, le=1, description="share of the power limit above which it is avoided"
    )
    domain_target_ratio: float = Field(
        0.8, gt=0, le=1, description="share of a power domain's budget the router keeps under"
    )
    # Penalties are in load-score units (1.0 = one request queued on the backend). Light
    # by default: measured with benchmarks/thermal.py (24 h, 16 GPUs, 4 racks at 70% load),
    # heavy steering (8 for warm, 0.1 per °C) piles queues on the cool racks and costs 30%
    # of goodput; these defaults, against least-request: no thermal throttling (294 events),
    # 81% fewer rack power-cap events, goodput x1.04.
    warm_penalty: float = Field(
        0.15, ge=0, description="score added to a warm backend, or one predicted to get hot"
    )
    unknown_penalty: float = Field(
        0.6, ge=0, description="score added to a backend whose GPU telemetry is missing/stale"
    )
    power_penalty: float = Field(0.15, ge=0, description="score added above power_cap_ratio")
    domain_penalty: float = Field(
        1.0, ge=0, description="score added in a power domain above its target draw"
    )
    predicted_weight: float = Field(
        0.0, ge=0, description="score per °C of predicted temperature above the coolest"
    )
    power_shed_levels: tuple[float, float, float] = Field(
        (1.0, 0.9, 0.8),
        description="domain draw / budget at which high, normal, low requests are refused",
    )
    xid_threshold: int = Field(3, ge=1, description="new Xid errors that make it unhealthy")
    xid_window_s: float = Field(3600.0, gt=0, description="... within this window")
    clocks: ClockControlConfig = Field(
        default_factory=ClockControlConfig,
        description="clock caps before shedding (issue 21; off by default)",
    )

    @model_validator(mode="after")
    def _ordered(self) -> ThermalConfig:
        if not self.resume_c < self.hot_c:
            raise ValueError("resume_c must be below hot_c")
        if not self.warm_c <= self.hot_c:
            raise ValueError("warm_c must not be above hot_c")
        if self.max_cooldown_s < self.cooldown_s:
            raise ValueError("max_cooldown_s must be at least cooldown_s")
        return self


class PowerDomainConfig(_Strict):
    """A power domain (a rack, a PDU): the backends in it share ``budget_w`` watts.

    The router keeps the domain's summed GPU draw under ``thermal.domain_target_ratio`` of
    ``budget_w`` (80%: 20% headroom, seed 000) by steering load to other domains; above it,
    admission for the domain's backends tightens (``thermal.power_shed_levels``).
    """

    name: str = Field(pattern=r"^[A-Za-z0-9_.:-]+$")
    budget_w: float = Field(gt=0, description="W, the domain's power budget")


# --- The simulator's configuration (``backends[].sim``, ``llm-gateway sim``) ----------------
# Declared here, beside the gateway's schema, so that validating a config never imports the
# simulator; :mod:`gateway.sim` reads these types from here.


@dataclass(frozen=True)
class EngineParams:
    """Capacity and speed of one simulated vLLM engine.

    Times are seconds, sizes are tokens. Defaults give roughly 10 ms + 0.5 ms per running
    sequence per decode step and 5 ms + 0.02 ms per prompt token of prefill.
    """

    max_num_seqs: int = 16
    kv_cache_tokens: int = 32768
    block_size: int = 16
    prefill_base_s: float = 0.005
    prefill_per_token_s: float = 0.00002
    itl_base_s: float = 0.010
    itl_per_seq_s: float = 0.0005
    max_model_len: int = 4096
    speed: float = 1.0
    enable_prefix_caching: bool = True
    max_pending_metrics: int = 100_000

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.speed <= 0:
            raise ValueError("speed must be > 0")
        if self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        if self.kv_cache_tokens < self.max_model_len + self.block_size:
            raise ValueError(
                f"kv_cache_tokens ({self.kv_cache_tokens}) must hold one request of "
                f"max_model_len ({self.max_model_len}) plus one block"
            )
        for name in ("prefill_base_s", "prefill_per_token_s", "itl_base_s", "itl_per_seq_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")

    @property
    def num_blocks(self) -> int:
        """Total KV-cache blocks (``kv_cache_tokens // block_size``)."""
        return self.kv_cache_tokens // self.block_size

    def decode_time_s(self, batch_size: int) -> float:
        """Seconds of one decode step for ``batch_size`` running sequences."""
        return (self.itl_base_s + self.itl_per_seq_s * batch_size) / self.speed

    def prefill_time_s(self, uncached_tokens: int) -> float:
        """Seconds added to a step by prefilling ``uncached_tokens`` tokens of one request."""
        return (self.prefill_base_s + self.prefill_per_token_s * uncached_tokens) / self.speed


class FaultConfig(BaseModel):
    """What the simulator does wrong, and how often.

    Rates are probabilities per request (0-1); times are seconds.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    error_rate: float = Field(0.0, ge=0.0, le=1.0, description="share answered with a 5xx")
    error_status: int = Field(500, description="status of injected errors (500 or 503, any 5xx)")
    rate_limit_rate: float = Field(0.0, ge=0.0, le=1.0, description="share answered with 429")
    retry_after_s: float = Field(1.0, ge=0.0, description="Retry-After of injected 429s")
    added_latency_s: float = Field(0.0, ge=0.0, description="delay before the response starts")
    hang: bool = Field(False, description="accept requests and never answer")
    drop_after_chunks: int | None = Field(
        None,
        ge=0,
        description="streams: cut the TCP connection after N SSE events; "
        "non-stream: close the connection without a response",
    )
    drop_after_tokens: int | None = Field(
        None,
        ge=0,
        description="streams: cut the TCP connection right after the event that carries "
        "generated token N of the request (0: before the first event), for mid-stream "
        "continuation drills; non-stream: close the connection without a response",
    )
    unhealthy: bool = Field(False, description="GET /health answers 503")
    seed: int = Field(0, description="seed of the fault dice")
    # GPU faults (``/gpu/metrics``, :mod:`gateway.sim.gpu`): state, not dice.
    cooling_failure: bool = Field(
        False, description="GPU cooling failed: thermal resistance x cooling_failure_factor"
    )
    cooling_failure_factor: float = Field(
        2.5, gt=0, description="R_th multiplier during a cooling failure (fan / CRAC failure)"
    )
    xid_errors: int = Field(
        0, ge=0, description="Xid errors the GPU has reported; raise it to inject new ones"
    )
    xid_code: int = Field(79, ge=1, description="code of injected Xid errors (79: off the bus)")
    ecc_dbe_errors: int = Field(
        0, ge=0, description="volatile double-bit ECC errors; raise it to inject new ones"
    )
    fault_gpu: int = Field(0, ge=0, description="which GPU (index) the GPU faults hit")

    @field_validator("error_status")
    @classmethod
    def _five_hundreds(cls, v: int) -> int:
        if not 500 <= v <= 599:
            raise ValueError("error_status must be a 5xx status")
        return v


class ReleaseConfig(BaseModel):
    """The build this simulated server plays: a good release (the defaults) or a bad one,
    so that a canary rollout (issue 18) can be tested end to end against simulators.

    * ``ttft_factor``: every engine step that prefills (admits at least one request, and so
      ends with those requests' first token) lasts this many times as long. An unloaded
      server's TTFT is then exactly ``ttft_factor`` times the default build's; under load
      the queue before admission grows with it, and the running requests' tokens of such a
      step come late too (no chunked prefill: a prefill stalls the batch, see
      :mod:`gateway.sim.engine`).
    * ``itl_factor``: every other step (decode only) lasts this many times as long, so an
      unloaded stream's inter-token latency (ITL) is ``itl_factor`` times the default's.
    * ``drift``: the share of generated tokens replaced by other words (0-1). Which tokens
      and by what is a function of the context, the text seed and ``drift_seed``, so a
      repeated request, greedy (``temperature`` 0) ones included, gets the same drifted
      answer, as a real model of another version answers greedy prompts the same way every
      time but not as the baseline does. Stop lengths are unchanged. 0 (the default):
      the text is exactly what it always was.
    * ``drift_seed``: which drift (another value drifts other tokens to other words).

    Factors below 1 make a faster build. A higher error rate is ``faults.error_rate``
    (:class:`FaultConfig`), and the version a build reports is ``vllm_version``
    (``/version`` and ``system_fingerprint``): vLLM's ``/v1/models`` has no version field,
    so none is added there.
    """

    model_config = ConfigDict(extra="forbid")

    ttft_factor: float = Field(
        1.0,
        gt=0,
        le=100,
        description="multiplier of the duration of a step that prefills (TTFT of a lone "
        "request x ttft_factor); 1: the default build",
    )
    itl_factor: float = Field(
        1.0,
        gt=0,
        le=100,
        description="multiplier of the duration of a decode-only step (ITL of a lone "
        "stream x itl_factor); 1: the default build",
    )
    drift: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="share of generated tokens replaced by other words, the same for a "
        "repeated request (greedy included); 0: text exactly as the default build's",
    )
    drift_seed: int = Field(1, description="seed of which tokens drift and to what")


class GpuConfig(BaseModel):
    """The simulated backend's GPUs and where they sit (°C, K/W, seconds)."""

    model_config = ConfigDict(extra="forbid")

    model: Literal["h100", "a100"] = Field("h100", description="GPU model (datasheet constants)")
    count: int = Field(1, ge=1, le=16, description="GPUs (tensor-parallel size)")
    ambient_c: float = Field(25.0, ge=-20, le=60, description="rack inlet temperature, °C")
    r_th_k_per_w: float = Field(0.075, gt=0, description="thermal resistance, K/W")
    temp_c: float | None = Field(None, description="starting temperature (default: idle steady)")
    thermal_mass_j_per_k: float | None = Field(
        None, gt=0, description="override C_th, J/K (default: the GPU model's; small = fast demo)"
    )
    tick_s: float = Field(0.5, gt=0, le=10, description="thermal model step in real time")
    hostname: str = Field("sim-gpu-host", description="'Hostname' label of the DCGM metrics")
    control_token: str | None = Field(
        None,
        description="serve the agent's GPU control endpoint (/control, issue 21) to this bearer "
        "token; None: no control endpoint",
    )
    revert_after_s: float = Field(
        60.0, gt=0, description="s without contact after which the control endpoint reverts"
    )


class LoraAdapter(BaseModel):
    """An extra served model id: a LoRA adapter on a parent model.

    Listed by ``/v1/models`` with ``parent`` (default: the base model) and ``root``
    (``path``, default ``/adapters/<name>``), as vLLM lists ``--lora-modules``.
    """

    model_config = ConfigDict(extra="forbid")

    name: str
    parent: str | None = None
    path: str | None = None


class SimConfig(BaseModel):
    """Everything one simulated vLLM server needs.

    ``engine`` holds capacity and speed (seconds, tokens), ``faults`` the injected
    faults, ``release`` the build played (a slower or drifted one: :class:`ReleaseConfig`),
    ``seed`` the default seed of generated text (a request's ``seed`` wins; a greedy
    request, ``temperature`` 0, uses neither: vLLM's greedy decoding ignores seeds).
    With ``api_key`` set, routes under ``/v1`` (and ``/v2``, ``/inference``,
    ``/cohere``, as vLLM's ``AuthenticationMiddleware``) need
    ``Authorization: Bearer <key>``.
    """

    model_config = ConfigDict(extra="forbid")

    model: str = "demo-model"
    model_root: str | None = Field(None, description="'root' of the base model in /v1/models")
    lora_adapters: list[LoraAdapter] = Field(default_factory=list)
    seed: int = 0
    engine: EngineParams = Field(default_factory=EngineParams)
    faults: FaultConfig = Field(default_factory=FaultConfig)
    release: ReleaseConfig = Field(
        default_factory=ReleaseConfig,
        description="the build played: slower TTFT / ITL, drifted text (a canary's drills)",
    )
    gpu: GpuConfig = Field(default_factory=GpuConfig, description="GPUs behind /gpu/metrics")
    api_key: str | None = None
    embedding_dim: int = Field(64, ge=1)
    request_overhead_s: float = Field(
        0.0,
        ge=0,
        description="s of API-server time per /v1/embeddings request, one at a time: vLLM's "
        "single frontend process parses, tokenizes and serialises each HTTP request (the CPU "
        "bottleneck of small embeddings, vllm-project/vllm#11320, #22941); 0: not modelled. "
        "Measured on vLLM 0.32.0's CPU build: 1.08 ms (benchmarks/embed_merge_real.py --costs)",
    )
    input_overhead_s: float = Field(
        0.0,
        ge=0,
        description="s of API-server time per input of a /v1/embeddings request, added to "
        "request_overhead_s (vLLM makes one engine request per input and serialises each "
        "vector). Measured on vLLM 0.32.0's CPU build: 0.50 ms",
    )
    engine_label: str = Field("0", description="value of the 'engine' metric label")
    vllm_version: str = Field("0.32.0", description="reported by /version and fingerprints")
    stop_length_min: int = Field(4, ge=1, description="shortest natural (EOS) length, tokens")
    stop_length_max: int = Field(512, ge=1, description="longest natural (EOS) length, tokens")

    @model_validator(mode="after")
    def _check(self) -> SimConfig:
        names = [self.model, *(a.name for a in self.lora_adapters)]
        if len(set(names)) != len(names):
            raise ValueError(f"served model ids must be unique: {names}")
        if self.stop_length_min > self.stop_length_max:
            raise ValueError("stop_length_min must be <= stop_length_max")
        return self

    @property
    def served_ids(self) -> list[str]:
        """Every model id this server answers to: the base model, then the adapters."""
        return [self.model, *(a.name for a in self.lora_adapters)]


class BackendRole(StrEnum):
    PRIMARY = "primary"
    STANDBY = "standby"


class BackendConfig(_Strict):
    """One vLLM OpenAI server.

    ``models`` may be left out: the gateway then learns them from the backend's
    ``/v1/models`` (LoRA adapters included). ``max_num_seqs`` is the backend's batch capacity
    (vLLM's ``--max-num-seqs``, times its data-parallel size: the server's total), used to
    normalise its load, predict its queue wait and plan maintenance; without it the gateway
    learns it from the backend's ``/metrics`` (:mod:`gateway.traffic.capacity`). ``sim`` is
    read only by ``llm-gateway demo``, which starts a simulated vLLM for this entry.
    """

    id: str = Field(pattern=r"^[A-Za-z0-9_.:-]+$")
    url: AnyHttpUrl
    models: list[str] | None = None
    api_key: str | None = None
    api_key_env: str | None = None
    api_key_file: str | None = Field(
        None, description="a file holding the key sent to it (a mounted secret; read at "
        "start and each reload, a trailing newline stripped)")
    max_num_seqs: int | None = Field(None, ge=1)
    role: BackendRole = BackendRole.PRIMARY
    sim: dict[str, Any] | None = None
    gpu_metrics_url: AnyHttpUrl | None = Field(
        None,
        description="DCGM-exporter-style metrics of this backend's GPUs (dcgm-exporter, or "
        "llm-gateway agent); unset: thermal state unknown by design, routed as before",
    )
    gpu_control_url: AnyHttpUrl | None = Field(
        None,
        description="base URL of the agent's GPU control endpoint (llm-gateway agent "
        "--control-token, or the simulator's gpu.control_token; issue 21): the gateway caps "
        "this backend's SM clocks through it when thermal.clocks is enabled",
    )
    gpu_indices: list[int] | None = Field(
        None,
        description="the GPUs (the exporter's 'gpu' label) this backend uses, when the "
        "exporter serves a whole node shared by several backends; None: all it reports",
    )
    power_domain: str | None = Field(None, description="name of a power_domains entry")
    zone: str | None = Field(
        None, description="topology zone (EndpointSlice 'zone', topology.kubernetes.io/zone)"
    )
    node: str | None = Field(None, description="the node it runs on (EndpointSlice 'nodeName')")
    capacity_type: Literal["on-demand", "spot"] = Field(
        "on-demand",
        description="spot backends can be reclaimed; their zone's spot score steers traffic",
    )
    instance_type: str | None = Field(
        None, description="node instance type (node.kubernetes.io/instance-type)"
    )
    pod: str | None = Field(None, description="its pod's name (restart_hook.delete_pod)")
    namespace: str | None = Field(None, description="its pod's namespace (delete_pod)")
    model_version: ModelVersion | None = Field(
        None,
        description="the version of the model(s) it serves (a release: weights, engine "
        "build); clients keep asking for the model name, and a rollout moves a model's "
        "traffic from one version to another; null: unversioned. A Kubernetes label value "
        "(it is a metric label): at most 63 characters, letters, digits, '-', '_', '.', "
        "beginning and ending with a letter or digit (config_rollouts.MODEL_VERSION_PATTERN)",
    )
    gpu_hour_price: float | None = Field(
        None,
        ge=0,
        description="what one of its GPUs costs per hour, in the operator's currency units "
        "(e.g. 2.5 for a GPU rented at 2.50 USD an hour); with gpus it gives "
        "gateway_backend_cost_total and gateway_cost_per_million_tokens; null: no cost "
        "is exported for it",
    )
    gpus: int = Field(
        1, ge=1, description="GPUs it runs on (tensor x pipeline parallel): what it costs "
        "is gpu_hour_price x gpus per hour",
    )

    @field_validator("url")
    @classmethod
    def _no_path(cls, v: AnyHttpUrl) -> AnyHttpUrl:
        if v.path not in (None, "", "/"):
            raise ValueError("give the server root (scheme://host:port), not a path like /v1")
        return v

    @field_validator("sim")
    @classmethod
    def _sim_block(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        """A ``sim`` block must be a valid :class:`SimConfig` (checked
        here, so ``check-config`` names a typo instead of ``demo`` failing later)."""
        if v is None:
            return v
        try:
            SimConfig(**v)
        except ValidationError as e:
            problems = "; ".join(
                f"sim.{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors()
            )
            raise ValueError(problems) from None
        return v

    @property
    def base_url(self) -> str:
        """``scheme://host:port`` without a trailing slash."""
        return str(self.url).rstrip("/")

    def resolved_api_key(self) -> str | None:
        """The key sent to this backend, or None. Raises :class:`ConfigError` for an
        unset ``api_key_env`` or an unreadable ``api_key_file``."""
        return read_secret(f"backends[{self.id}].api_key", self.api_key, self.api_key_env,
                           self.api_key_file)

    @model_validator(mode="after")
    def _one_key_source(self) -> BackendConfig:
        if _sources(self.api_key, self.api_key_env, self.api_key_file) > 1:
            raise ValueError("give at most one of api_key, api_key_env, api_key_file")
        return self


TEMPLATED_URLS = ("gpu_metrics_url", "gpu_control_url")
"""The discovery template's URL fields in which ``{host}`` and ``{node}`` are filled in."""


class BackendTemplate(_Strict):
    """What every discovered backend gets that discovery cannot see (the fields of a
    ``backends:`` entry other than ``id``, ``url`` and placement). In ``gpu_metrics_url``
    and ``gpu_control_url``, ``{host}`` is replaced by the endpoint's address and ``{node}``
    by its node's name (a dcgm-exporter DaemonSet behind a per-node address, or an agent
    sidecar)."""

    models: list[str] | None = None
    api_key_env: str | None = None
    api_key_file: str | None = Field(None, description="as backends[].api_key_file")
    max_num_seqs: int | None = Field(None, ge=1)
    role: BackendRole = BackendRole.PRIMARY
    gpu_metrics_url: str | None = None
    gpu_control_url: str | None = Field(
        None,
        description="as backends[].gpu_control_url, with the same '{host}' / '{node}' "
        "substitution as gpu_metrics_url (an agent sidecar, or a per-node agent)",
    )
    gpu_indices: list[int] | None = None
    power_domain: str | None = None
    capacity_type: Literal["on-demand", "spot"] = Field(
        "on-demand", description="unless the node's labels say otherwise"
    )
    gpu_hour_price: float | None = Field(
        None, ge=0, description="per GPU-hour, as backends[].gpu_hour_price"
    )
    gpus: int = Field(1, ge=1, description="as backends[].gpus")


def parse_nameserver(entry: str) -> tuple[str, int]:
    """A ``discovery.dns.nameservers`` entry -> (IP address, UDP/TCP port): ``10.96.0.10``,
    ``127.0.0.1:5353``, an IPv6 address, or ``[v6]:port``; the port defaults to 53.
    dnspython queries addresses only, so a host name is refused here, at load, rather than
    timing out at every resolution. Raises ``ValueError`` saying what is wrong."""
    text = entry.strip()
    host, port_text = text, ""
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        if rest and not rest.startswith(":"):
            raise ValueError(f"{entry!r}: expected [IPv6]:port")
        port_text = rest[1:]
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(
            f"{entry!r}: not an IP address (a nameserver is an address, optionally with "
            "':port', e.g. 10.96.0.10 or 127.0.0.1:5353)"
        ) from None
    if not port_text:
        return host, 53
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise ValueError(f"{entry!r}: the port must be a number from 1 to 65535")
    return host, int(port_text)


class DnsDiscoveryConfig(_Strict):
    """Backends from a headless Service's A/AAAA records, re-resolved every ``interval_s``
    seconds; each address is one backend (id ``host-port``, url ``scheme://host:port``).
    ``nameservers``: ``host`` or ``host:port`` entries (IP addresses,
    :func:`parse_nameserver`, checked at load); None: the system's resolver.
    ``timeout_s``: one resolution's bound; past it, it is an outage (the fleet is kept).
    NXDOMAIN / no record means no endpoint (cluster DNS answers so for a headless Service
    without ready endpoints), acted on once two answers in a row say so and logged as an
    error (``gateway/fleet/dns_source.py``)."""

    name: str = Field(min_length=1, description="e.g. vllm.default.svc.cluster.local")
    port: int = Field(8000, ge=1, le=65535)
    scheme: Literal["http", "https"] = "http"
    interval_s: float = Field(10.0, gt=0)
    timeout_s: float = Field(2.0, gt=0)
    nameservers: list[str] | None = None

    @field_validator("nameservers")
    @classmethod
    def _nameservers(cls, v: list[str] | None) -> list[str] | None:
        for entry in v or ():
            parse_nameserver(entry)
        return v


class KubernetesDiscoveryConfig(_Strict):
    """Backends from the EndpointSlices matching ``label_selector`` in ``namespace`` (list,
    then watch; relist on 410 Gone and on every reconnect). ``port_name``: which named port
    of the slice (None: the first). ``kubeconfig``: None means in-cluster config (the pod's
    service account), falling back to ``~/.kube/config``; checked at start (a named file
    must exist, and without one some credentials must be there: :func:`check_secrets`).
    ``watch_nodes``: also watch the
    nodes, for capacity type and zone labels and spot interruption taints and conditions.
    ``watch_timeout_s``: each watch call's server-side timeout; ``retry_s``: the wait before
    reconnecting after a failure (the last known fleet is kept meanwhile)."""

    namespace: str | None = Field(
        None, description="None: the gateway pod's own namespace, else 'default'"
    )
    label_selector: str = Field(
        "app.kubernetes.io/name=vllm",
        description="on EndpointSlices, e.g. kubernetes.io/service-name=vllm",
    )
    port_name: str | None = None
    scheme: Literal["http", "https"] = "http"
    kubeconfig: str | None = None
    watch_nodes: bool = True
    watch_timeout_s: int = Field(300, ge=1)
    retry_s: float = Field(5.0, gt=0)


class DiscoveryConfig(_Strict):
    """Where the backends come from. ``static`` (the default): the ``backends:`` list, as
    always. ``dns`` and ``kubernetes`` add and remove backends while the gateway runs
    (``gateway/fleet/discovery.py``): a new endpoint enters ``cold`` (warm-up, slow start), a
    terminating one is drained, a removed one leaves; while the source cannot be read the
    last known fleet is kept. ``backends:`` entries are kept beside discovered ones.
    ``template``: the settings every discovered backend gets."""

    source: Literal["static", "dns", "kubernetes"] = "static"
    dns: DnsDiscoveryConfig | None = None
    kubernetes: KubernetesDiscoveryConfig | None = None
    template: BackendTemplate = Field(default_factory=BackendTemplate)

    @model_validator(mode="after")
    def _source_block(self) -> DiscoveryConfig:
        if self.source == "dns" and self.dns is None:
            raise ValueError("source 'dns' needs a 'dns:' block (at least its 'name')")
        for block in ("dns", "kubernetes"):
            if self.source == "static" and getattr(self, block) is not None:
                raise ValueError(
                    f"a '{block}:' block is given but source is 'static' (the default), which "
                    f"reads only the backends: list: add 'source: {block}'"
                )
        if self.source == "kubernetes" and self.kubernetes is None:
            object.__setattr__(self, "kubernetes", KubernetesDiscoveryConfig())
        self._check_template()
        return self

    def _check_template(self) -> None:
        """The template must make a valid backend for every endpoint (checked here, with a
        sample address and node, so a bad template fails at load instead of leaving every
        discovered endpoint out of the fleet)."""
        t = self.template
        fields = t.model_dump(exclude_none=True)
        for name in TEMPLATED_URLS:
            url = getattr(t, name)
            if self.source == "dns" and url and "{node}" in url:
                raise ValueError(
                    f"template.{name}: DNS records name no node, so '{{node}}' cannot be "
                    "filled in: use '{host}' (the endpoint's address)"
                )
            if url is not None:
                fields[name] = url.replace("{host}", "192.0.2.1").replace("{node}", "node-1")
        try:
            BackendConfig.model_validate(
                {**fields, "id": "template", "url": "http://192.0.2.1:8000"}
            )
        except ValidationError as e:
            raise ValueError("; ".join(
                f"template.{'.'.join(str(p) for p in err['loc'])}: {err['msg']}"
                for err in e.errors()
            )) from None

    @property
    def dynamic(self) -> bool:
        """Whether backends come and go while the gateway runs."""
        return self.source != "static"


class SpotConfig(_Strict):
    """Spot capacity: each zone has a spot health score in [``min_score``, 1] (1: no recent
    notice). A spot interruption notice in a zone multiplies its score by
    ``1 - notice_penalty``; what is missing from 1 then halves every ``half_life_s``
    seconds. A spot backend's share of traffic is scaled by its zone's score
    (``gateway/routing/spot.py``), so traffic leaves a zone's remaining spot backends before
    the provider reclaims them too (providers reclaim by zone and instance type).

    ``notice_penalty`` (0.5, in (0, 1]): one notice halves the score, so a zone's spot
    backends lose half their share at once, two notices three quarters. ``half_life_s``
    (600 s): a zone is back to 0.75 ten minutes after one notice and to 0.97 after half an
    hour (a choice, not a measurement: set it to how long interruptions in one zone keep
    coming with your provider; AWS warns each instance 2 minutes ahead).
    ``min_score`` (0.05, in [0, 1]): the floor, so a zone's spot backends keep a trickle of
    traffic (and their warm caches) however many notices arrive; 0 lets them go idle. A
    zone within 0.001 of 1 counts as recovered."""

    notice_penalty: float = Field(0.5, gt=0, le=1)
    half_life_s: float = Field(600.0, gt=0)
    min_score: float = Field(0.05, ge=0, le=1)


class AutoscaleModelLimits(_Strict):
    """One model's replica bounds (``autoscale.models.<model>``)."""

    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(64, ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> AutoscaleModelLimits:
        if self.min_replicas > self.max_replicas:
            raise ValueError("min_replicas must not exceed max_replicas")
        return self


class AutoscaleConfig(_Strict):
    """Autoscaling signals (see :mod:`gateway.autoscale`): how many vLLM replicas each model
    needs, exported as ``gateway_autoscale_desired_replicas{model}`` and ``GET /autoscale``
    for KEDA / an HPA. The gateway never starts or stops a replica itself.

    Desired replicas per model = the largest of three paradigms, bounded by
    ``min_replicas`` / ``max_replicas`` (per model in ``models``):

    * fast (every ``interval_s``): requests on the replicas (running + waiting, vLLM's
      gauges) over ``target_concurrency`` x a replica's slots (``max_num_seqs``), and KV-cache
      use over ``target_kv_cache``;
    * fine: P99 TTFT over ``ttft_window_s`` against ``ttft_target_s`` (default ``slo.ttft_s``),
      ``ceil(ready x p99 / target)``, at most ``fine_max_step`` x the ready replicas;
    * ahead: the forecast mean arrival rate over ``[now + cold start, + lead_s]`` times the
      time a request spends on a replica (Little's law), over the same per-replica target,
      plus the warm pool: ``warm_pool_share`` (0.3-0.7) of the forecast interval's width in
      replicas.

    Up at once; down only to the largest value recommended over the last
    ``scale_down_cooldown_s`` (Kubernetes HPA's scale-down stabilization window; 60 s,
    Knative's stable window, within the 60-120 s recommended). Defaults
    ``target_concurrency`` 0.85, ``warm_pool_share`` 0.3, ``scale_down_cooldown_s`` 60 s:
    chosen on the fleet simulator's day (``benchmarks/autoscale.py``; the reasons are in
    :mod:`gateway.autoscale`). ``cold_start_s``: assumed until a replica's cold start
    was measured from discovery (endpoint seen -> warm).

    Bounds (finite; checked at load, so ``check-config`` refuses what ``serve`` could not
    run): ``interval_s`` at most 300 s (an older decision is no answer for KEDA's 15-30 s
    polling); ``cold_start_s`` and ``scale_down_cooldown_s`` at most 3600 s (the HPA's own
    limit on ``stabilizationWindowSeconds``); ``lead_s`` at most 86400 s (one day, the
    forecaster's season: a longer window only repeats it, and each decision walks the
    season's bins over the whole window); ``ttft_window_s`` at most 3600 s."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    enabled: bool = True
    interval_s: float = Field(5.0, gt=0, le=300, description="decision period (s)")
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(64, ge=1)
    models: dict[str, AutoscaleModelLimits] = Field(default_factory=dict)
    target_concurrency: float = Field(
        0.85, gt=0, le=1, description="requests per replica over its max_num_seqs, aimed at"
    )
    target_kv_cache: float = Field(0.8, gt=0, le=1, description="KV-cache use aimed at")
    default_slots: int = Field(
        256, ge=1, description="a replica's max_num_seqs when neither config nor scrapes say"
    )
    ttft_target_s: float | None = Field(None, gt=0, description="default: slo.ttft_s")
    ttft_window_s: float = Field(30.0, gt=0, le=3600)
    fine_max_step: float = Field(2.0, ge=1)
    cold_start_s: float = Field(
        90.0, ge=0, le=3600, description="assumed until one is measured"
    )
    lead_s: float = Field(
        600.0, ge=0, le=86400, description="forecast window after the cold start"
    )
    warm_pool_share: float = Field(0.3, ge=0, le=1)
    scale_down_cooldown_s: float = Field(60.0, ge=0, le=3600)

    @model_validator(mode="after")
    def _ordered(self) -> AutoscaleConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError("min_replicas must not exceed max_replicas")
        return self

    def limits(self, model: str) -> AutoscaleModelLimits:
        """``model``'s bounds: its ``models`` entry, else the defaults."""
        return self.models.get(model) or AutoscaleModelLimits(
            min_replicas=self.min_replicas, max_replicas=self.max_replicas
        )


class CoordinationConfig(_Strict):
    """Fleet mode: several gateway replicas acting as one over a shared Redis (or Valkey).

    Without ``redis_url`` (the default) the gateway is one process with its state in memory
    and nothing to install. With it (``coordination.redis_url`` or the env override
    ``LLM_GATEWAY_COORDINATION__REDIS_URL``) every replica with the same ``namespace`` shares
    maintenance leases, operator actions, GPU verdicts, rate limits, backend protection,
    capacity, affinity and the config itself (a live reload reaches every replica:
    :mod:`gateway.coord.config_sync`) (``docs/architecture.md``, "Fleet mode").

    ``op_timeout_s`` bounds every Redis call (seconds): a slow or dead store never holds a
    request longer than that, and then the replica runs on its local share until the store
    answers again (tried every ``retry_interval_s``). ``sync_interval_s``: how often a
    replica reads the shared state and reports its own (the 1 s visibility bound is
    ``sync_interval_s + op_timeout_s`` plus one round trip). ``replica_ttl_s``: a replica not
    heard from for this long counts as gone. ``lease_ttl_s``: a maintenance lease's time to
    live in Redis (seconds, default 10, at least 1), renewed every third of it by its holder
    (and at each step of its cycle); a holder that dies lets it expire and another replica
    takes the cycle over and finishes it, so its backend is back in rotation within
    ``lease_ttl_s`` plus the rest the cycle had given it (``gateway/coord/leases.py``). A
    follower that cannot read the store keeps a backend out no longer than the lease it last
    saw (or the rest it announced, if later). ``gpu_restart_lease_s``: how long one
    replica's claim on a backend's GPU-fault restart lasts (seconds, default 30): every
    replica sees the same Xid / ECC fault within a GPU scrape interval
    (``thermal.scrape_interval_s``, 2 s) of the first, so the claim must outlast that by a
    margin; the restart hook runs once per claim (``gateway/coord/operator.py``).

    Rate limits are global (``gateway/traffic/quota.py``, ``gateway/coord/quota.py``): each
    client key's ``rpm`` / ``tpm`` is one token bucket in Redis (burst = the per-minute limit,
    refilled from the store's clock), and each replica admits from a local balance taken
    from it in chunks, in the background, so no request waits on Redis. ``quota_chunk``
    (0.05): the chunk as a share of the per-minute limit (at least 1); a fetch starts when
    the balance falls below half a chunk. ``quota_wait_s`` (0.02 s): how long a request
    that finds its balance empty, while the global bucket as last seen holds what it needs,
    waits for the running fetch (one store round trip; a dead store is never waited on);
    then it is refused with an honest ``retry-after``. ``quota_idle_s`` (2 s): a key
    without requests on a replica for this long gives its unspent balance back. **Bound**:
    while the store answers, a limit of ``L`` per minute over ``N`` replicas admits in any
    window of ``W`` seconds at most ``L + L / 60 * W + N * chunk`` (for tokens, the chunk or
    the largest request's estimate, whichever is larger): 600 requests per minute over 3
    replicas admit at most 600 + 600 + 3 x 30 = 1290 in a minute (one process: 1200). While
    the store does not answer each replica enforces ``L / N`` (``N`` alive as last seen)
    with its own bucket, starting from its unspent balance plus its part of the global
    bucket as last seen; when it answers again what was used on the share is charged to the
    global bucket (a restarted Redis starts every bucket full, less that); a window that
    spans an outage may exceed the bound by at most one more ``L``.

    Backend protection (``coord/protection.py``): ``breaker_hold_s`` is how long a breaker
    record outlives its owner's last renewal (seconds, default 3.0, the replica TTL): the
    other replicas hold the backend's breaker open while the owner (the replica that
    tripped it) probes half-open, and a dead owner's record ends that long after its open
    time, when each replica probes on its own again. ``capacity_shares`` (default on): each
    replica takes a share of every backend's in-flight capacity proportional to its demand
    (``traffic/shares.py``), so N replicas together stay within what one allows.

    Readiness (``/ready``): a replica is ready once the store has answered it since start,
    and stays ready through later outages. One that has never reached it is not ready for
    ``ready_grace_s`` (30 s), then ready on its local share (``null``: wait for the store
    however long), so a Redis outage during a restart of every replica cannot leave the
    fleet with no ready gateway (``gateway/coord/coordination.py`` ``readiness``)."""

    redis_url: str | None = None
    namespace: str = Field("llm-gateway", min_length=1, pattern=r"^[A-Za-z0-9_.:-]+$")
    replica_id: str | None = Field(None, min_length=1, pattern=r"^[A-Za-z0-9_.:-]+$")
    op_timeout_s: float = Field(0.25, gt=0, le=5)
    sync_interval_s: float = Field(0.25, gt=0, le=1)
    replica_ttl_s: float = Field(3.0, gt=0)
    lease_ttl_s: float = Field(10.0, ge=1)
    retry_interval_s: float = Field(1.0, gt=0)
    quota_chunk: float = Field(0.05, gt=0, le=1)
    gpu_restart_lease_s: float = Field(30.0, ge=1, le=3600)
    quota_wait_s: float = Field(0.02, ge=0, le=1)
    quota_idle_s: float = Field(2.0, gt=0, le=60)
    breaker_hold_s: float = Field(3.0, gt=0, le=60)
    capacity_shares: bool = True
    ready_grace_s: float | None = Field(30.0, ge=0)

    @field_validator("redis_url")
    @classmethod
    def _parseable_url(cls, v: str | None) -> str | None:
        """Refuse a URL the Redis client cannot use, at load time (``check-config`` and
        ``serve`` then say which field is wrong instead of failing at startup): parsed by
        redis-py's own ``parse_url`` (no connection is made), plus a database that must be
        a number (redis-py ignores ``redis://host/abc`` and would use database 0)."""
        if not v:
            return v
        from urllib.parse import urlsplit

        from redis.connection import parse_url

        try:
            parse_url(v)
        except ValueError as e:
            raise ValueError(
                f"{e} (want redis://[:password@]host[:port][/db], rediss://... or "
                "unix:///path/to/redis.sock)"
            ) from None
        parts = urlsplit(v)
        db = parts.path.strip("/")
        if parts.scheme != "unix" and db and not db.isdigit():
            raise ValueError(f"the database in the URL must be a number, got {db!r}")
        return v

    @property
    def enabled(self) -> bool:
        """Whether fleet mode is on (a ``redis_url`` is set)."""
        return bool(self.redis_url)


class ReloadConfig(_Strict):
    """Live configuration changes (:mod:`gateway.reloading`): ``SIGHUP``, ``POST
    /admin/config`` and, with ``watch``, the config file checked every
    ``watch_interval_s`` seconds (its content's digest: an editor's save, a Kubernetes
    ConfigMap update). What may change live is :mod:`gateway.config_diff`'s.

    The last ``keep`` applied configs (default 3) are kept for ``GET
    /admin/config/history`` and ``POST /admin/config/rollback``: in memory, and in
    ``state_dir`` when set (one JSON file each, mode 0600: they hold what the config
    holds, inline keys included), so that a restart starts from the last applied config
    when the config file is the one it started from (an edited file wins). Null: kept in
    memory only, and a restart starts from the file. Each snapshot also keeps the state
    needed to return to it (calibration baselines, holds, rollouts:
    :mod:`gateway.reload_state`), saved every ``checkpoint_s`` while it runs.

    Fleet mode (``coordination.redis_url``): a change reaches every replica and the last
    ``keep`` are kept in the shared store too (:mod:`gateway.coord.config_sync`); this
    section, like ``server`` and ``coordination``, stays each replica's own."""

    state_dir: str | None = Field(None, description="directory of the applied configs")
    keep: int = Field(3, ge=1, le=100, description="applied configs kept")
    watch: bool = Field(False, description="re-read the config file when its content changes")
    watch_interval_s: float = Field(2.0, gt=0, description="seconds between file checks")
    checkpoint_s: float = Field(
        10.0, gt=0,
        description="seconds between two saves of the running state (calibration baselines, "
        "holds, rollouts) with the running snapshot, when changed (also at each change and "
        "at stop): what a restart loses at most")


class GatewayConfig(BaseSettings):
    """The whole configuration (one YAML file plus ``LLM_GATEWAY_*`` env overrides)."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_nested_delimiter="__", extra="forbid", frozen=True
    )

    server: ServerConfig = Field(default_factory=ServerConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)
    health: HealthConfig = Field(default_factory=HealthConfig)
    lifecycle: LifecycleConfig = Field(default_factory=LifecycleConfig)
    slo: SLOConfig = Field(default_factory=SLOConfig)
    status: StatusConfig = Field(default_factory=StatusConfig)
    breaker: BreakerSettings = Field(default_factory=BreakerSettings)
    retry: RetrySettings = Field(default_factory=RetrySettings)
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig)
    degraded: DegradedConfig = Field(default_factory=DegradedConfig)
    batcher: BatcherConfig = Field(default_factory=BatcherConfig)
    forecast: ForecastConfig = Field(default_factory=ForecastConfig)
    calibration: CalibrationConfig = Field(default_factory=CalibrationConfig)
    proxy: ProxyConfig = Field(default_factory=ProxyConfig)
    thermal: ThermalConfig = Field(default_factory=ThermalConfig)
    power_domains: list[PowerDomainConfig] = Field(default_factory=list)
    backends: list[BackendConfig] = Field(default_factory=list)
    coordination: CoordinationConfig = Field(default_factory=CoordinationConfig)
    discovery: DiscoveryConfig = Field(default_factory=DiscoveryConfig)
    spot: SpotConfig = Field(default_factory=SpotConfig)
    autoscale: AutoscaleConfig = Field(default_factory=AutoscaleConfig)
    reload: ReloadConfig = Field(default_factory=ReloadConfig)
    rollouts: list[RolloutConfig] = Field(
        default_factory=list,
        description="canary rollouts of a model's new version (gateway.config_rollouts); "
        "live: a new entry starts one, a removed one stops it",
    )

    @model_validator(mode="after")
    def _unique_ids(self) -> GatewayConfig:
        seen: set[str] = set()
        for i, b in enumerate(self.backends):
            if b.id in seen:
                raise ValueError(f"backends.{i}.id: backend id {b.id!r} appears twice")
            seen.add(b.id)
        domains = [d.name for d in self.power_domains]
        if len(domains) != len(set(domains)):
            raise ValueError("power_domains: names must be unique")
        for i, b in enumerate(self.backends):
            if b.power_domain is not None and b.power_domain not in domains:
                raise ValueError(
                    f"backends.{i}.power_domain: backend {b.id!r}: power_domain "
                    f"{b.power_domain!r} is not in power_domains"
                )
        tpd = self.discovery.template.power_domain
        if self.discovery.dynamic and tpd is not None and tpd not in domains:
            raise ValueError(
                f"discovery.template: power_domain {tpd!r} is not in power_domains"
            )
        names = [k.name for k in self.auth.client_keys]
        if len(names) != len(set(names)):
            raise ValueError("auth.client_keys: names must be unique")
        if not self.discovery.dynamic:  # discovered backends are checked when started
            check_versions(self.rollouts, self.backends)
        for i, r in enumerate(self.rollouts):
            problem = key_problem(r, names)
            if problem is not None:
                raise ValueError(f"rollouts.{i}.{problem}")
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # env beats the file (passed as init kwargs), the file beats defaults.
        return (env_settings, init_settings)


SECRET_NAME_PARTS = frozenset({"key", "secret", "token", "password", "passwd"})
"""Words that mark a config field as secret when one of the ``_``-separated parts of a name
on its path is one of them (``admin_key``, ``api_key_file``, ``client_secret``,
``password``; not ``client_keys`` or ``max_tokens``): a validation error never shows such a
field's value (:func:`_format_errors`)."""

# a URL's user info (``scheme://user:password@``, ``scheme://token@``), hidden in messages
_URL_USERINFO = re.compile(r"(://)[^/@\s]*@")


def is_secret_field(loc: tuple[int | str, ...]) -> bool:
    """Whether the config field at ``loc`` (pydantic's error location: names and indexes)
    holds a secret (:data:`SECRET_NAME_PARTS`)."""
    return any(part in SECRET_NAME_PARTS
               for name in loc if isinstance(name, str) for part in name.lower().split("_"))


def hide_userinfo(text: str) -> str:
    """``text`` with the user info of every URL in it shown as ``***``
    (``http://u:pw@host`` -> ``http://***@host``)."""
    return _URL_USERINFO.sub(r"\1***@", text)


_NAMED_PROBLEM = re.compile(r"^Value error, ([A-Za-z_]\w*(?:\.[\w\[\]-]+)*): (.*)$", re.DOTALL)
"""A whole-config check's ``ValueError`` (:class:`GatewayConfig`'s model validator) whose
message begins with the field at fault, a section and its dotted path (``rollouts.0.canary:
...``, ``power_domains: ...``): :func:`_format_errors` reports it at that field."""


def _format_errors(source: str, err: ValidationError) -> str:
    lines = [f"invalid configuration in {source}:"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        msg = e["msg"]
        named = _NAMED_PROBLEM.match(msg) if not loc else None
        if named is not None and named.group(1).split(".")[0] in GatewayConfig.model_fields:
            loc, msg = named.group(1), named.group(2)
        loc = loc or "(top level)"
        value = e.get("input")
        # never echo a misspelled field's value (it may be a key under a wrong name), nor a
        # secret field's, in the message or after it
        hidden = e["type"] == "extra_forbidden" or is_secret_field(tuple(e["loc"]))
        if e["type"] == "extra_forbidden":
            msg = "unknown field (check the spelling)"
        elif hidden and isinstance(value, str) and value and value in msg:
            msg = msg.replace(value, "***")
        shown = "" if isinstance(value, dict | list) or value is None or hidden else (
            f" (got {value!r})")
        # a URL's user info (e.g. a bad redis://:secret@host:x) never shows
        lines.append(hide_userinfo(f"  {loc}: {msg}{shown}"))
    return "\n".join(lines)


def load_config(path: str | Path | None = None, **overrides: Any) -> GatewayConfig:
    """Load and validate a config file (YAML), then apply ``LLM_GATEWAY_*`` env overrides.

    ``path`` None means defaults plus env only. ``overrides`` are top-level sections given
    as dicts (used by tests and the CLI), applied over the file before validation.

    Raises:
        ConfigError: unreadable file, bad YAML, or a field that fails validation; the
            message names the file, the dotted field path and the problem.
    """
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        source = str(path)
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ConfigError(f"cannot read config file {path}: {e.strerror or e}") from e
        data = parse_config_text(text, source)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return config_from_mapping(data, source)


def parse_config_text(text: str, source: str) -> dict[str, Any]:
    """The mapping of a config's YAML (or JSON, a subset of YAML) ``text``; ``source``
    names it in errors. Raises :class:`ConfigError` for bad YAML, a repeated key or a top
    level that is not a mapping."""
    try:
        loaded = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader subclass
    except yaml.YAMLError as e:
        raise ConfigError(f"invalid YAML in {source}: {_yaml_problem(e)}") from None
    if loaded is None:
        loaded = {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections")
    return loaded


def _yaml_problem(e: yaml.YAMLError) -> str:
    """A YAML error's problem and place, without the text around it (PyYAML quotes the
    offending line, which may hold a key)."""
    problem = getattr(e, "problem", None) or getattr(e, "context", None)
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    if problem is None:
        return type(e).__name__
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{problem}{where}"


def config_from_mapping(data: Mapping[str, Any], source: str) -> GatewayConfig:
    """A validated config from ``data`` (sections) with the ``LLM_GATEWAY_*`` env overrides
    applied (as :func:`load_config`). Raises :class:`ConfigError` naming ``source``, the
    dotted field path and the problem."""
    check_env_names()
    try:
        return GatewayConfig(**data)
    except ValidationError as e:
        raise ConfigError(_format_errors(f"{source} (and {ENV_PREFIX}* variables)", e)) from None
    except SettingsError as e:
        raise ConfigError(f"invalid {ENV_PREFIX}* environment variable: {e}") from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key repeated in one mapping (YAML would keep the
    last one silently: a second ``backends:`` block would drop the first)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping",
                    node.start_mark,
                    f"found duplicate key {key!r}",
                    key_node.start_mark,
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def check_env_names(environ: Mapping[str, str] | None = None) -> None:
    """Refuse ``LLM_GATEWAY_<SECTION>__<FIELD>`` variables whose section does not exist (a
    typo such as ``LLM_GATEWAY_SERVR__PORT`` would otherwise be silently ignored). Names
    without ``__`` are either a whole section (``LLM_GATEWAY_BACKENDS``) or belong to other
    tools (``LLM_GATEWAY_VLLM_VENV``, read by the test suite) and are left alone. Raises
    :class:`ConfigError` naming the variable."""
    env = os.environ if environ is None else environ
    sections = set(GatewayConfig.model_fields)
    for name in env:
        if not name.upper().startswith(ENV_PREFIX) or "__" not in name:
            continue
        section = name[len(ENV_PREFIX) :].split("__", 1)[0].lower()
        if section not in sections:
            raise ConfigError(
                f"environment variable {name}: no config section {section!r} "
                f"(sections: {', '.join(sorted(sections))})"
            )


def with_server_overrides(cfg: GatewayConfig, **server: Any) -> GatewayConfig:
    """``cfg`` with command-line ``server`` settings (host, port), which beat the file and the
    environment. Raises :class:`ConfigError` for invalid values."""
    if not server:
        return cfg
    try:
        new = ServerConfig(**{**cfg.server.model_dump(), **server})
    except ValidationError as e:
        raise ConfigError(_format_errors("the command line", e)) from None
    return cfg.model_copy(update={"server": new})


def check_secrets(cfg: GatewayConfig, discovery_credentials: bool = True) -> None:
    """Resolve every credential the config points at once, so that a missing one fails at
    start (``check-config`` and ``serve``, exit status 2) instead of at first use: the
    client keys, the admin key, the backends' keys, the discovery template's
    ``api_key_env`` (every discovered backend would be left out without it), and the
    Kubernetes credentials of discovery and of the ``delete_pod`` restart hook
    (:func:`kube_credentials_problem`; discovery's only with ``discovery_credentials``,
    False when a test runs the gateway with a stand-in source). Raises
    :class:`ConfigError` naming it."""
    seen: dict[str, str] = {}
    for k in cfg.auth.client_keys:
        secret = k.resolve()
        if secret in seen:
            raise ConfigError(f"auth.client_keys: {seen[secret]!r} and {k.name!r} have the "
                              "same key: the limits and priority of one would silently apply")
        seen[secret] = k.name
    cfg.auth.resolved_admin_key()
    for b in cfg.backends:
        b.resolved_api_key()
    d = cfg.discovery
    if d.dynamic:
        read_secret("discovery.template.api_key", None, d.template.api_key_env,
                    d.template.api_key_file)
    kube: list[tuple[str, str | None]] = []
    if discovery_credentials and d.source == "kubernetes" and d.kubernetes is not None:
        kube.append(("discovery.kubernetes.kubeconfig", d.kubernetes.kubeconfig))
    hook = cfg.lifecycle.restart_hook
    if hook is not None and hook.delete_pod:
        kube.append(("lifecycle.restart_hook.kubeconfig", hook.kubeconfig))
    for where, path in kube:
        problem = kube_credentials_problem(path)
        if problem is not None:
            raise ConfigError(f"{where}: {problem}")


def kube_credentials_problem(
    kubeconfig: str | None, environ: Mapping[str, str] | None = None
) -> str | None:
    """Why the Kubernetes API cannot be reached with these credentials, or None when they
    are there: a named ``kubeconfig`` file must exist; without one, the pod's service
    account (``KUBERNETES_SERVICE_HOST`` set) or ``$KUBECONFIG`` / ``~/.kube/config``, the
    order ``gateway.fleet.kube_client.api_client`` tries them in. Only presence is
    checked: a file that does not parse, or a token the API refuses, is an outage said at
    run time."""
    env = os.environ if environ is None else environ
    if kubeconfig is not None:
        path = Path(kubeconfig).expanduser()
        if not path.is_file():
            return f"{kubeconfig}: no such file (a kubeconfig file; null: in-cluster config)"
        return None
    if env.get("KUBERNETES_SERVICE_HOST"):
        return None
    named = [p for p in env.get("KUBECONFIG", "").split(os.pathsep) if p]
    files = [Path(p).expanduser() for p in named] or [Path("~/.kube/config").expanduser()]
    if any(f.is_file() for f in files):
        return None
    return (
        "no Kubernetes credentials: not in a cluster (KUBERNETES_SERVICE_HOST is not set) "
        f"and no kubeconfig at {', '.join(str(f) for f in files)}; name one with 'kubeconfig:'"
    )


def require_backends(cfg: GatewayConfig) -> None:
    """A gateway with no backend and no discovery serves nothing: refuse to start
    (``ConfigError``). With ``discovery.source`` dns or kubernetes an empty list is fine."""
    if not cfg.backends and not cfg.discovery.dynamic:
        raise ConfigError(
            "no backends configured: list at least one under 'backends:' "
            f"(or set {ENV_PREFIX}BACKENDS)"
        )
