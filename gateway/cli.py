"""Command line: ``llm-gateway serve | demo | sim | sim-fleet | agent | check-config``.

Starting it is cheap: this module imports only the config schema, and each subcommand
imports what it needs when it runs (the app and its web stack for ``serve``, the simulator
for ``demo``, ``sim`` and ``sim-fleet``). The simulator's flags are added to their
subparsers only when that subcommand is chosen (:class:`_Subcommand`), so
``llm-gateway --help`` and ``check-config`` never load the simulator.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from gateway.config import (
    ConfigError,
    GatewayConfig,
    check_secrets,
    load_config,
    require_backends,
    with_server_overrides,
)
from gateway.core.listening import CannotListen
from gateway.core.urls import redacted_url
from gateway.core.wording import plural
from gateway.logs import current_format, say, setup_logging

CONFIG_ENV = "LLM_GATEWAY_CONFIG"
"""Environment variable naming the config file when ``--config`` is not given."""
DEFAULT_CONFIGS = (Path("config/gateway.yaml"), Path("gateway.yaml"))
"""Looked for in the current directory, in this order, when neither ``--config`` nor
``LLM_GATEWAY_CONFIG`` names a file."""


def find_config(
    explicit: str | None, environ: Mapping[str, str] | None = None, cwd: Path | None = None
) -> Path | None:
    """The config file a command reads: ``explicit`` (``--config``), else the file named by
    ``$LLM_GATEWAY_CONFIG``, else the first of :data:`DEFAULT_CONFIGS` that exists in
    ``cwd`` (default: the current directory); None when none of these applies. A named
    file is returned even when missing (loading it then says it cannot be read). Never
    looks beside the installed sources: a file is read only where the user points or works.
    """
    if explicit:
        return Path(explicit)
    named = (os.environ if environ is None else environ).get(CONFIG_ENV, "").strip()
    if named:
        return Path(named)
    here = Path.cwd() if cwd is None else cwd
    for candidate in DEFAULT_CONFIGS:
        if (here / candidate).is_file():
            return here / candidate
    return None


def no_config_error() -> ConfigError:
    """What ``serve`` and ``check-config`` say when :func:`find_config` found nothing."""
    looked = " or ".join(f"./{p}" for p in DEFAULT_CONFIGS)
    return ConfigError(
        f"no config file: pass --config PATH or set {CONFIG_ENV}=PATH (no {looked} in "
        f"{Path.cwd()}); config/vllm-example.yaml in the repository is a start, and "
        "'llm-gateway demo' needs none"
    )


def observe(cfg: GatewayConfig) -> None:
    """This process's log lines (``server.log_level``, ``server.log_format``:
    :func:`gateway.logs.setup_logging`) and spans (``server.otel``:
    :func:`gateway.tracing.configure`); ``serve``, ``demo`` and each ``--workers``
    process call it once."""
    from gateway import tracing

    setup_logging(cfg.server.log_level, cfg.server.log_format)
    if tracing.configure(cfg.server.otel):
        atexit.register(tracing.shutdown)  # the spans still batched are exported


def _load(
    args: argparse.Namespace, builtin: Path | None = None, out: TextIO | None = None
) -> GatewayConfig:
    """The config file (:func:`find_config`; else ``builtin``, else :func:`no_config_error`),
    env overrides, then the command line's --host/--port, which win over both. Says which
    file it reads (``config: /abs/path.yaml``, links resolved, on ``out``, default stderr).
    Refuses a fleet with no backends."""
    path = find_config(args.config)
    note = ""
    if path is None:
        if builtin is None:
            raise no_config_error()
        path, note = builtin, " (built-in demo fleet: no --config, no ./config/gateway.yaml)"
    line = f"config: {path.resolve()}{note}"
    server: dict[str, object] = {}
    if getattr(args, "host", None):
        server["host"] = args.host
    if getattr(args, "port", None) is not None:
        server["port"] = args.port
    try:
        cfg = with_server_overrides(load_config(path), **server)
    except ConfigError:
        if out is None and declared_log_format(path) == "json":  # its error a JSON line too
            setup_logging("info", "json")
        say(line, out=out)
        raise
    if cfg.server.log_format == "json" and out is None:  # a JSON line like every other
        setup_logging(cfg.server.log_level, "json")
    say(line, out=out)
    require_backends(cfg)
    args.server_overrides = server  # a live reload applies them again (gateway.reloading)
    return cfg


def declared_log_format(path: Path, environ: Mapping[str, str] | None = None) -> str | None:
    """The ``server.log_format`` a config that failed to load asked for, so that the error
    is written in it: ``LLM_GATEWAY_SERVER__LOG_FORMAT`` when set, else the value under
    ``server:`` / ``log_format:`` in the file's YAML read as far as it parses (PyYAML's
    event stream: a syntax error after the ``server`` section still finds it); None when
    neither says (or the file cannot be read)."""
    env = os.environ if environ is None else environ
    named = env.get("LLM_GATEWAY_SERVER__LOG_FORMAT")
    if named:
        return named.strip().lower()
    import yaml

    try:
        text = path.read_text()
    except OSError:
        return None
    keys: list[object] = []  # per open mapping: its current key (None: a key is next)
    try:
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, yaml.MappingStartEvent | yaml.SequenceStartEvent):
                if keys and keys[-1] is not None:
                    keys[-1] = ("open", keys[-1])
                keys.append(None if isinstance(event, yaml.MappingStartEvent) else "[]")
            elif isinstance(event, yaml.MappingEndEvent | yaml.SequenceEndEvent):
                keys.pop()
                if keys and isinstance(keys[-1], tuple):
                    keys[-1] = None
            elif isinstance(event, yaml.ScalarEvent) and keys and keys[-1] != "[]":
                if keys[-1] is None:
                    keys[-1] = event.value
                    continue
                path_now = [k[1] for k in keys[:-1] if isinstance(k, tuple)] + [keys[-1]]
                if path_now == ["server", "log_format"]:
                    return event.value.strip().lower()
                keys[-1] = None
    except yaml.YAMLError:
        pass
    return None


def cmd_serve(args: argparse.Namespace) -> int:
    cfg = _load(args)
    if args.workers > 1:  # N processes on one port, each a replica (gateway/workers.py)
        from gateway.workers import serve_workers

        setup_logging(cfg.server.log_level, cfg.server.log_format)
        return serve_workers(cfg, args.workers, observe)
    observe(cfg)
    from gateway.app import create_app
    from gateway.reload_input import resume_config
    from gateway.serving import run, serve

    path = find_config(args.config)
    server = args.server_overrides
    start = resume_config(cfg, path, server)  # a kept config that is no longer valid: said
    cfg = start.config
    if start.says is not None:
        say(start.says, start.level)
    app = create_app(cfg, config_path=path, server_overrides=server)
    run(lambda: serve(app, cfg), cfg)
    return 0


def cmd_check_config(args: argparse.Namespace) -> int:
    cfg = _load(args, out=sys.stdout)
    check_secrets(cfg)
    fleet = plural(len(cfg.backends), "backend")
    print(f"ok: {fleet}, listening on {cfg.server.host}:{cfg.server.port}")
    d = cfg.discovery
    if d.dns is not None and d.source == "dns":
        print(f"  + discovered: dns {d.dns.name} port {d.dns.port}, every {d.dns.interval_s:g} s")
    elif d.kubernetes is not None and d.source == "kubernetes":
        k = d.kubernetes
        print(f"  + discovered: kubernetes EndpointSlices {k.label_selector!r} in "
              f"{k.namespace or 'its own namespace'}")
    for b in cfg.backends:
        models = ", ".join(b.models) if b.models else "(discovered from /v1/models)"
        version = f"  model_version {b.model_version}" if b.model_version else ""
        print(f"  {b.id:<16} {redacted_url(b.base_url):<32} {b.role.value:<8} {models}{version}")
    for r in cfg.rollouts:
        print(f"  rollout of {r.model}: {r.baseline} -> {r.canary}, steps "
              f"{', '.join(f'{x:g}' for x in r.steps)}")
    clocks = cfg.thermal.clocks  # the gateway would start, but cap no clocks: say so
    if cfg.thermal.enabled and clocks.enabled and not os.environ.get(clocks.agent_token_env):
        print(f"warning: thermal.clocks is enabled but {clocks.agent_token_env} "
              "(thermal.clocks.agent_token_env) is not set: no GPU clock caps or power limits "
              "(set it to the agents' control token)", file=sys.stderr)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from gateway.demo import BUILTIN_FLEET, run_demo

    cfg = _load(args, builtin=BUILTIN_FLEET)
    observe(cfg)
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
    token = args.control_token or os.environ.get("LLM_GATEWAY_AGENT_TOKEN") or None
    return run_agent(args.host, args.port, token, args.revert_after)


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


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"a whole number of processes >= 1, not {text!r}")
    return n


def build_parser() -> argparse.ArgumentParser:
    """The ``llm-gateway`` parser; each subcommand sets ``func`` (``args -> exit status``).
    Imports nothing beyond this module: the simulator's flags load when ``sim`` or
    ``sim-fleet`` is parsed."""
    p = argparse.ArgumentParser(
        prog="llm-gateway",
        description="OpenAI-compatible gateway for a fleet of vLLM servers.",
    )
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Subcommand)

    def with_config(sp: argparse.ArgumentParser, demo: bool = False) -> None:
        sp.add_argument(
            "--config",
            "-c",
            help=f"YAML config (default: ${CONFIG_ENV}, else ./config/gateway.yaml or "
            "./gateway.yaml in the current directory"
            + (", else the built-in demo fleet)" if demo else ")"),
        )
        sp.add_argument("--host", help="listen address (overrides server.host)")
        sp.add_argument("--port", type=int, help="listen port (overrides server.port)")

    sp = sub.add_parser("serve", help="run the gateway")
    with_config(sp)
    sp.add_argument(
        "--workers",
        type=_positive_int,
        default=1,
        help="processes serving the one port, each a fleet-mode replica (default 1; more "
        "than 1 needs coordination.redis_url)",
    )
    sp.set_defaults(func=cmd_serve)

    sp = sub.add_parser("demo", help="start simulated backends and the gateway (no GPU needed)")
    with_config(sp, demo=True)
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
    sp.add_argument(
        "--control-token",
        default=None,
        help="serve the GPU control endpoint (clock caps, power limits) to this bearer token "
        "(or LLM_GATEWAY_AGENT_TOKEN); without one there is none",
    )
    sp.add_argument(
        "--revert-after",
        type=float,
        default=60.0,
        help="seconds without contact from the gateway after which every cap is reverted (60)",
    )
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
    or no config, 3: an address it cannot listen on, or another OS error, 130:
    interrupted). Failures print one line on stderr."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ConfigError as e:
        say(f"llm-gateway: {e}", logging.CRITICAL)
        return 2
    except CannotListen as e:
        say(f"llm-gateway: {e}", logging.CRITICAL)
        return 3
    except OSError as e:  # e.g. a port already in use
        say(
            f"llm-gateway: {e.strerror or e}"
            + (f" ({e.filename})" if getattr(e, "filename", None) else ""),
            logging.CRITICAL,
        )
        return 3
    except KeyboardInterrupt:
        return 130
    except Exception:  # a start-up failure of another kind: its traceback, exit status 1
        if current_format() != "json":
            raise  # Python's own traceback on stderr, as always
        logging.getLogger("gateway.cli").critical("llm-gateway: failed", exc_info=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
