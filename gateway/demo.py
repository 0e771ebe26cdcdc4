"""``llm-gateway demo``: simulated vLLM backends plus the gateway, on localhost.

Every backend of the config with a ``sim`` block (a :class:`gateway.sim.config.SimConfig`)
gets a simulator on its URL's host and port; then the gateway serves the config. No GPU
and no other service is needed. Ctrl-C (or SIGTERM) stops everything cleanly.

Without a config file the demo runs :data:`BUILTIN_FLEET`, shipped inside the package (the
same text as the repository's ``config/gateway.yaml``): three simulators on ports 8101 to
8103 behind the gateway on 127.0.0.1:8000.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from urllib.parse import urlsplit

from gateway.app import create_app
from gateway.config import ConfigError, GatewayConfig
from gateway.core.listening import CannotListen
from gateway.core.wording import plural

BUILTIN_FLEET = Path(__file__).resolve().parent / "demo_fleet.yaml"
"""The demo's own fleet, read when no config file is given or found (package data)."""


def banner(cfg: GatewayConfig, model: str) -> str:
    """What the demo prints once it serves: its address, a curl and an SDK line to try."""
    host = "127.0.0.1" if cfg.server.host in ("0.0.0.0", "::") else cfg.server.host
    base = f"http://{host}:{cfg.server.port}"
    sims = plural(len([b for b in cfg.backends if b.sim]), "simulated vLLM backend")
    return f"""\
llm-gateway demo: {sims} behind {base}

  curl {base}/v1/chat/completions -H 'content-type: application/json' \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello"}}], "stream": true}}'

  python -c "from openai import OpenAI; c = OpenAI(base_url='{base}/v1', api_key='none'); \\
[print(x.choices[0].delta.content or '', end='', flush=True) for x in \\
c.chat.completions.create(model='{model}', messages=[{{'role': 'user', 'content': 'Hello'}}], stream=True)]"

  backends: curl {base}/admin/backends     metrics: curl {base}/metrics
  GPUs (simulated, DCGM names at each backend's /gpu/metrics): the "gpu" field of each
  backend in /admin/backends, and gateway_gpu_temperature_celsius in /metrics
Ctrl-C stops everything.
"""


FAST_CYCLES = {
    "lifecycle": {
        "slow_start_s": 5.0,
        "drain_deadline_s": 10.0,
        "check_interval_s": 0.5,
        "short": {"every_s": 5.0},
        "medium": {"every_s": 20.0, "every_requests": 500, "cooldown_s": 4.0},
        "long": {"every_s": 120.0},
    }
}


def with_fast_cycles(cfg: GatewayConfig) -> GatewayConfig:
    """``cfg`` with the maintenance cycles sped up to seconds (``demo --fast-cycles``)."""
    data = cfg.model_dump()
    lc = data["lifecycle"]
    fast = FAST_CYCLES["lifecycle"]
    for key, value in fast.items():
        lc[key] = {**lc[key], **value} if isinstance(value, dict) else value
    return GatewayConfig(**data)


async def serve_demo(cfg: GatewayConfig) -> None:
    """Bind the gateway's address, start the simulators, then serve the gateway until a
    signal arrives. An address that cannot be bound raises
    :class:`gateway.core.listening.CannotListen` before anything started (the gateway's)
    or naming the simulated backend (a simulator's)."""
    from gateway.serving import listen_socket, serve
    from gateway.sim.config import SimConfig
    from gateway.sim.runner import run_sim_server

    sims = [(b, SimConfig(**b.sim)) for b in cfg.backends if b.sim is not None]
    if not sims:
        raise ConfigError("demo: no backend has a 'sim' block to simulate")
    sock = listen_socket(cfg.server.host, cfg.server.port)
    try:
        async with contextlib.AsyncExitStack() as stack:
            for b, sc in sims:
                u = urlsplit(b.base_url)
                try:
                    await stack.enter_async_context(
                        run_sim_server(sc, host=u.hostname or "127.0.0.1", port=u.port or 80)
                    )
                except CannotListen as e:
                    raise e.elsewhere(
                        subject=f"simulated backend {b.id}",
                        port_hint="stop it, or give the demo a --config whose backends' urls "
                        "use free ports",
                        host_hint="give the demo a --config whose backends' urls use this "
                        "machine's addresses",
                    ) from None
            await serve(
                create_app(cfg),
                cfg,
                lambda: print(banner(cfg, sims[0][1].model), flush=True),
                sock=sock,
            )
    finally:
        sock.close()


def run_demo(cfg: GatewayConfig, fast_cycles: bool = False) -> int:
    """Blocking entry point of ``llm-gateway demo``; returns the exit status."""
    from gateway.serving import run

    if fast_cycles:
        cfg = with_fast_cycles(cfg)
    run(lambda: serve_demo(cfg), cfg)
    return 0
