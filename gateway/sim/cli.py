"""``llm-gateway sim``: argument parsing and a blocking runner for one simulated vLLM.

The main CLI wires it as::

    sub = subparsers.add_parser("sim", help="run a simulated vLLM server")
    add_sim_arguments(sub)
    ...
    run_sim_from_args(args)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys

from pydantic import ValidationError

from gateway.config import ConfigError
from gateway.core.listening import CannotListen
from gateway.sim.config import LoraAdapter, SimConfig
from gateway.sim.engine import EngineParams

log = logging.getLogger(__name__)


def add_sim_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the simulator's flags to ``parser`` (times in seconds, sizes in tokens)."""
    g = parser.add_argument_group("simulated vLLM server")
    g.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free)")
    g.add_argument("--model", default="demo-model", help="served model name")
    g.add_argument(
        "--served-lora",
        action="append",
        default=[],
        metavar="NAME[=PARENT]",
        help="extra served model id, a LoRA adapter on PARENT (default: --model); repeatable",
    )
    g.add_argument("--seed", type=int, default=0, help="seed of generated text and faults")
    g.add_argument("--max-num-seqs", type=int, default=16, help="max running requests")
    g.add_argument("--max-model-len", type=int, default=4096, help="context length, tokens")
    g.add_argument("--kv-cache-tokens", type=int, default=32768, help="KV-cache size, tokens")
    g.add_argument("--speed", type=float, default=1.0, help="speed multiplier (2 = twice as fast)")
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1")
    g.add_argument(
        "--error-rate",
        type=float,
        default=0.0,
        help="share of 5xx answers (0-1; a bad release's higher error rate)",
    )
    g.add_argument("--error-status", type=int, default=500, help="status of injected errors")
    g.add_argument("--rate-limit-rate", type=float, default=0.0, help="share of 429s (0-1)")
    g.add_argument("--retry-after", type=float, default=1.0, help="Retry-After of 429s, s")
    g.add_argument("--added-latency", type=float, default=0.0, help="delay before answering, s")
    g.add_argument("--hang", action="store_true", help="accept requests and never answer")
    g.add_argument(
        "--drop-after-chunks",
        type=int,
        default=None,
        help="cut streams after N SSE events (non-stream: no answer)",
    )
    g.add_argument(
        "--drop-after-tokens",
        type=int,
        default=None,
        help="cut streams right after generated token N (non-stream: no answer)",
    )
    g.add_argument("--unhealthy", action="store_true", help="GET /health answers 503")
    g.add_argument("--gpu", choices=["h100", "a100"], default="h100", help="simulated GPU model")
    g.add_argument("--gpus", type=int, default=1, help="GPUs per server (tensor parallel)")
    g.add_argument("--ambient", type=float, default=25.0, help="rack inlet temperature, °C")
    g.add_argument(
        "--r-th", type=float, default=0.075, help="GPU thermal resistance, K/W (cooling quality)"
    )
    g.add_argument(
        "--cooling-failure", action="store_true", help="start with failed cooling (R_th x2.5)"
    )
    g.add_argument(
        "--control-token-env",
        default=None,
        metavar="NAME",
        help="serve the agent's GPU control endpoint (/control) to the bearer token in "
        "environment variable NAME, e.g. LLM_GATEWAY_AGENT_TOKEN (default: no endpoint)",
    )
    g.add_argument(
        "--revert-after",
        type=float,
        default=60.0,
        metavar="S",
        help="the control endpoint reverts every GPU cap after S seconds without contact "
        "(default 60)",
    )
    r = parser.add_argument_group(
        "the build played (a bad release for canary drills; default: the good one)"
    )
    r.add_argument(
        "--ttft-factor",
        type=float,
        metavar="F",
        default=1.0,
        help="prefill steps take this many times as long: a lone request's TTFT x F (default 1)",
    )
    r.add_argument(
        "--itl-factor",
        type=float,
        metavar="F",
        default=1.0,
        help="decode steps take this many times as long: a lone stream's ITL x F (default 1)",
    )
    r.add_argument(
        "--drift",
        type=float,
        metavar="D",
        default=0.0,
        help="share of generated tokens replaced by other words, greedy requests included, "
        "the same on every repeat (0-1; default 0: the default build's text)",
    )
    r.add_argument(
        "--drift-seed",
        type=int,
        default=1,
        metavar="N",
        help="which tokens drift, and to what (default 1)",
    )
    g.add_argument("--log-level", default="info", help="uvicorn log level")
    g.add_argument(
        "--request-overhead",
        type=float,
        default=0.0,
        help="API-server seconds per embeddings request, one at a time (default 0: off)",
    )
    g.add_argument(
        "--input-overhead",
        type=float,
        default=0.0,
        help="API-server seconds per input of an embeddings request, added to "
        "--request-overhead (default 0: off)",
    )


def sim_config_from_args(args: argparse.Namespace) -> SimConfig:
    """Build the ``SimConfig`` described by parsed ``add_sim_arguments`` flags.

    Raises :class:`gateway.config.ConfigError` naming the field and the problem when a
    flag's value is out of range (e.g. ``release.ttft_factor: Input should be greater
    than 0``)."""
    try:
        return _sim_config(args)
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']} (got {err['input']!r})"
            for err in e.errors()
        )
        raise ConfigError(f"invalid simulator flags: {problems}") from None
    except ValueError as e:  # EngineParams' own checks
        raise ConfigError(f"invalid simulator flags: engine: {e}") from None


def _sim_config(args: argparse.Namespace) -> SimConfig:
    loras = []
    for spec in args.served_lora:
        name, _, parent = spec.partition("=")
        loras.append(LoraAdapter(name=name, parent=parent or None))
    engine = EngineParams(
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        kv_cache_tokens=args.kv_cache_tokens,
        speed=args.speed,
    )
    # validated as one document, so that a bad value is named by its path (faults.error_rate)
    return SimConfig.model_validate(
        {
            "model": args.model,
            "lora_adapters": loras,
            "seed": args.seed,
            "api_key": args.api_key,
            "request_overhead_s": args.request_overhead,
            "input_overhead_s": args.input_overhead,
            "engine": engine,
            "faults": {
                "error_rate": args.error_rate,
                "error_status": args.error_status,
                "rate_limit_rate": args.rate_limit_rate,
                "retry_after_s": args.retry_after,
                "added_latency_s": args.added_latency,
                "hang": args.hang,
                "drop_after_chunks": args.drop_after_chunks,
                "drop_after_tokens": args.drop_after_tokens,
                "unhealthy": args.unhealthy,
                "seed": args.seed,
                "cooling_failure": args.cooling_failure,
            },
            "release": {
                "ttft_factor": args.ttft_factor,
                "itl_factor": args.itl_factor,
                "drift": args.drift,
                "drift_seed": args.drift_seed,
            },
            "gpu": {
                "model": args.gpu,
                "count": args.gpus,
                "ambient_c": args.ambient,
                "r_th_k_per_w": args.r_th,
                "control_token": control_token(args.control_token_env),
                "revert_after_s": args.revert_after,
            },
        }
    )


def control_token(env: str | None) -> str | None:
    """The control endpoint's token, read from environment variable ``env`` (never from the
    command line, where other users of the host could read it); None without ``env``. Raises
    :class:`gateway.config.ConfigError` when ``env`` is named but unset or empty."""
    if env is None:
        return None
    token = os.environ.get(env, "")
    if not token:
        raise ConfigError(f"--control-token-env {env}: environment variable {env} is not set")
    return token


async def _serve(config: SimConfig, host: str, port: int, log_level: str) -> None:
    from gateway.sim.runner import run_sim_server

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    async with run_sim_server(config, host=host, port=port, log_level=log_level) as url:
        gpu = config.gpu
        control = (
            f"; GPU control at {url}/control (reverted {gpu.revert_after_s:g} s after the "
            "last contact)"
            if gpu.control_token
            else ""
        )
        print(f"vLLM simulator serving {config.served_ids} at {url}{control}", flush=True)
        await stop.wait()
    print("vLLM simulator stopped", flush=True)


def run_sim_from_args(args: argparse.Namespace) -> None:
    """Serve until SIGINT/SIGTERM (blocking); Ctrl-C ends open streams and exits cleanly.
    Raises :class:`gateway.core.listening.CannotListen` when ``--host``/``--port`` cannot be
    bound."""
    config = sim_config_from_args(args)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(config, args.host, args.port, args.log_level))


def main(argv: list[str] | None = None) -> None:
    """Stand-alone entry point: ``python -m gateway.sim.cli --port 8001``."""
    parser = argparse.ArgumentParser(description="Simulated vLLM OpenAI server")
    add_sim_arguments(parser)
    try:
        run_sim_from_args(parser.parse_args(argv))
    except (CannotListen, ConfigError) as e:
        sys.exit(f"vLLM simulator: {e}")


if __name__ == "__main__":
    main()
