"""Command line: ``llm-gateway serve | demo | sim | sim-fleet | agent | check-config``.

Starting it is cheap: this module imports only the config schema, and each subcommand
imports what it needs when it runs (the app and its web stack for ``serve``, the simulator
for ``demo``, ``sim`` and ``sim-fleet``). The simulator's flags are added to their
subparsers only when that subcommand is chosen (:class:`_Subcommand`), so
``llm-gateway --help`` and ``check-config`` never load the simulator.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gateway.config import (
    ConfigError,
    GatewayConfig,
    check_secrets,
    load_config,
    require_backends,
    with_server_overrides,
)

DEFAULT_CONFIG = Path("config/gateway.yaml")
_REPO_CONFIG = Path(__file__).resolve().parent.parent / "config" / "gateway.yaml"


def find_default_config() -> Path:
    """``config/gateway.yaml`` in the current directory, else the one beside the sources."""
    if DEFAULT_CONFIG.exists():
        return DEFAULT_CONFIG
    return _REPO_CONFIG


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # httpx logs every control-plane request (probes, scrapes) at INFO: too chatty.
    logging.getLogger("httpx").setLevel(logging.WARNING)


def _load(args: argparse.Namespace) -> GatewayConfig:
    """The config file (default: config/gateway.yaml), env overrides, then the command
    line's --host/--port, which win over both. Refuses a fleet with no backends."""
    path = Path(args.config) if args.config else find_default_config()
    server: dict[str, object] = {}
    if getattr(args, "host", None):
        server["host"] = args.host
    if getattr(args, "port", None) is not None:
        server["port"] = args.port
    cfg = with_server_overrides(load_config(path), **server)
    require_backends(cfg)
    return cfg


def cmd_serve(args: argparse.Namespace) -> int:
    from gateway.app import create_app
    from gateway.serving import run, serve

    cfg = _load(args)
    setup_logging(cfg.server.log_level)
    app = create_app(cfg)
    run(lambda: serve(app, cfg), cfg)
    return 0


def cmd_check_config(args: argparse.Namespace) -> int:
    cfg = _load(args)
    check_secrets(cfg)
    print(f"ok: {len(cfg.backends)} backends, listening on {cfg.server.host}:{cfg.server.port}")
    for b in cfg.backends:
        models = ", ".join(b.models) if b.models else "(discovered from /v1/models)"
        print(f"  {b.id:<16} {b.base_url:<32} {b.role.value:<8} {models}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from gateway.demo import run_demo

    cfg = _load(args)
    setup_logging(cfg.server.log_level)
    return run_demo(cfg, fast_cycles=getattr(args, "fast_cycles", False))


def cmd_sim(args: argparse.Namespace) -> int:
    from gateway.sim.cli import run_sim_from_args

    setup_logging("info")
    run_sim_from_args(args)
    return 0


def cmd_sim_fleet(args: argparse.Namespace) -> int:
    from gateway.sim.fleet_cli import run_fleet_from_args

    return run_fleet_from_args(args)


def cmd_agent(args: argparse.Namespace) -> int:
    from gateway.agent import run_agent

    setup_logging("info")
    return run_agent(args.host, args.port)


class _Subcommand(argparse.ArgumentParser):
    """A subcommand's parser whose flags may be added late: ``arguments(parser)`` runs the
    first time this parser parses or formats its help, so a subcommand whose flags live
    with heavy code (the simulator's) costs nothing until it is chosen."""

    def __init__(
        self,
        *args: Any,
        arguments: Callable[[argparse.ArgumentParser], None] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._arguments = arguments

    def _complete(self) -> None:
        if self._arguments is not None:
            add, self._arguments = self._arguments, None
            add(self)

    def parse_known_args(  # type: ignore[override]  # same signature, typeshed overloads it
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        self._complete()
        return super().parse_known_args(args, namespace)

    def format_help(self) -> str:
        self._complete()
        return super().format_help()

    def format_usage(self) -> str:
        self._complete()
        return super().format_usage()


def _sim_arguments(parser: argparse.ArgumentParser) -> None:
    from gateway.sim.cli import add_sim_arguments

    add_sim_arguments(parser)


def _fleet_arguments(parser: argparse.ArgumentParser) -> None:
    from gateway.sim.fleet_cli import add_fleet_arguments

    add_fleet_arguments(parser)


def build_parser() -> argparse.ArgumentParser:
    """The ``llm-gateway`` parser; each subcommand sets ``func`` (``args -> exit status``).
    Imports nothing beyond this module: the simulator's flags load when ``sim`` or
    ``sim-fleet`` is parsed."""
    p = argparse.ArgumentParser(
        prog="llm-gateway",
        description="OpenAI-compatible gateway for a fleet of vLLM servers.",
    )
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Subcommand)

    def with_config(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--config", "-c", help="YAML config (default: config/gateway.yaml)")
        sp.add_argument("--host", help="listen address (overrides server.host)")
        sp.add_argument("--port", type=int, help="listen port (overrides server.port)")

    sp = sub.add_parser("serve", help="run the gateway")
    with_config(sp)
    sp.set_defaults(func=cmd_serve)

    sp = sub.add_parser("demo", help="start simulated backends and the gateway (no GPU needed)")
    with_config(sp)
    sp.add_argument(
        "--fast-cycles",
        action="store_true",
        help="run the maintenance cycles in seconds, to watch a backend drain, rest, "
        "recalibrate and return in /admin/backends",
    )
    sp.set_defaults(func=cmd_demo)

    sp = sub.add_parser("check-config", help="validate a config file and print the fleet")
    with_config(sp)
    sp.set_defaults(func=cmd_check_config)

    sp = sub.add_parser(
        "agent",
        help="serve this GPU host's NVML readings under DCGM exporter names (/metrics)",
    )
    sp.add_argument("--host", default="0.0.0.0", help="listen address (default 0.0.0.0)")
    sp.add_argument("--port", type=int, default=9400, help="listen port (default 9400)")
    sp.set_defaults(func=cmd_agent)

    sp = sub.add_parser("sim", help="run one simulated vLLM server", arguments=_sim_arguments)
    sp.set_defaults(func=cmd_sim)

    sp = sub.add_parser(
        "sim-fleet",
        help="simulate a GPU fleet in simulated time and compare routing policies "
        "(temperature, power, goodput)",
        arguments=_fleet_arguments,
    )
    sp.set_defaults(func=cmd_sim_fleet)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the command ``argv`` (default: ``sys.argv[1:]``); returns the exit status (2: bad
    config, 3: an OS error such as a port in use, 130: interrupted)."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ConfigError as e:
        print(f"llm-gateway: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # e.g. a port already in use
        print(
            f"llm-gateway: {e.strerror or e}"
            + (f" ({e.filename})" if getattr(e, "filename", None) else ""),
            file=sys.stderr,
        )
        return 3
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
