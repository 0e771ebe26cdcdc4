"""``llm-gateway demo``: simulated vLLM backends plus the gateway, on localhost.

Every backend of the config with a ``sim`` block (a :class:`gateway.sim.config.SimConfig`)
gets a simulator on its URL's host and port; then the gateway serves the config. No GPU
and no other service is needed. Ctrl-C (or SIGTERM) stops everything cleanly.
"""

from __future__ import annotations

import contextlib
from urllib.parse import urlsplit

from gateway.app import create_app
from gateway.config import ConfigError, GatewayConfig


def banner(cfg: GatewayConfig, model: str) -> str:
    host = "127.0.0.1" if cfg.server.host in ("0.0.0.0", "::") else cfg.server.host
    base = f"http://{host}:{cfg.server.port}"
    return f"""\
llm-gateway demo: {len([b for b in cfg.backends if b.sim])} simulated vLLM backends behind {base}

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
    """Start the simulators, then serve the gateway until a signal arrives."""
    from gateway.serving import serve
    from gateway.sim.config import SimConfig
    from gateway.sim.runner import run_sim_server

    sims = [(b, SimConfig(**b.sim)) for b in cfg.backends if b.sim is not None]
    if not sims:
        raise ConfigError("demo: no backend has a 'sim' block to simulate")
    async with contextlib.AsyncExitStack() as stack:
        for b, sc in sims:
            u = urlsplit(b.base_url)
            await stack.enter_async_context(
                run_sim_server(sc, host=u.hostname or "127.0.0.1", port=u.port or 80)
            )
        await serve(create_app(cfg), cfg, lambda: print(banner(cfg, sims[0][1].model), flush=True))


def run_demo(cfg: GatewayConfig, fast_cycles: bool = False) -> int:
    """Blocking entry point of ``llm-gateway demo``; returns the exit status."""
    from gateway.serving import run

    if fast_cycles:
        cfg = with_fast_cycles(cfg)
    run(lambda: serve_demo(cfg), cfg)
    return 0
