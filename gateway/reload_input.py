"""What a live reload reads (issue 18), before :mod:`gateway.reloading` applies it: a new
config from text (``POST /admin/config``, the file), checked the same way as at start, and
the digest that says whether a restart may resume the last applied config.

* :func:`read_config`: YAML or JSON text to a validated :class:`GatewayConfig`: an empty
  text is refused (not "all defaults"); ``***`` where ``GET /admin/config`` showed a key is
  that key (:func:`gateway.config_history.unredact`), a ``***`` with no running key at its
  place is refused; the ``LLM_GATEWAY_*`` environment and the command line's
  ``--host`` / ``--port`` apply over it as they do over the file at start; a static fleet
  with no backend is refused as ``serve`` refuses it (:func:`gateway.config.require_backends`).
  Raises :class:`InvalidConfig` (message, the first field named). :func:`read_view` also
  takes ``GET /admin/config``'s body posted back (``{"version": N, "config": {...}}``).
* :func:`source_digest`: the config file's text, the ``LLM_GATEWAY_*`` environment and the
  command line's server settings together: a restart resumes the last applied config only
  while all three are as they were (:meth:`gateway.config_history.ConfigHistory.resume`).
* :func:`resume_config`: the config a start uses and the one line that says whether it
  resumed a kept version or why not; a kept config that no longer validates never stops a
  start (a warning, then the file's config).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from gateway.config import (
    ENV_PREFIX,
    ConfigError,
    GatewayConfig,
    config_from_mapping,
    parse_config_text,
    require_backends,
    with_server_overrides,
)
from gateway.config_history import (
    SUBDIR,
    ConfigHistory,
    Snapshot,
    digest,
    redacted_keys,
    unredact,
)

_FIELD = re.compile(r"^[A-Za-z_][\w.\[\]-]*$")


class InvalidConfig(Exception):
    """A config text that is not a valid config: ``problem``, and ``param`` the first field
    it names (None when none)."""

    def __init__(self, problem: str, param: str | None = None) -> None:
        super().__init__(problem)
        self.problem = problem
        self.param = param


def first_field(message: str) -> str | None:
    """The first dotted field path of a :class:`ConfigError` message
    (``gateway.config._format_errors``'s lines ``  path: problem``), or None."""
    for line in message.splitlines()[1:]:
        head = line.strip().split(":", 1)[0]
        if _FIELD.match(head):
            return head
    return None


def read_config(text: str, source: str, running: GatewayConfig,
                server_overrides: Mapping[str, object]) -> GatewayConfig:
    """The validated config of ``text`` (module docstring); ``running``: the config it
    replaces (its keys stand for ``***``). Raises :class:`InvalidConfig`."""
    return _validate(_parse(text, source), source, running, server_overrides)


VIEW_KEYS = frozenset({"version", "config"})
"""The top-level keys of ``GET /admin/config``'s body (:mod:`gateway.api.config_admin`)."""


def read_view(text: str, source: str, running: GatewayConfig,
              server_overrides: Mapping[str, object]) -> tuple[GatewayConfig, int | None]:
    """:func:`read_config` of a ``POST /admin/config`` body, which is either a config or
    ``GET /admin/config``'s body posted back: a mapping whose keys are ``config`` and
    optionally ``version`` (:data:`VIEW_KEYS`), read as its ``config``. Returns the config
    and the ``version`` the view was of (None: a bare config, or a view without one).
    Raises :class:`InvalidConfig` (a ``version`` that is not a whole number included)."""
    data = _parse(text, source)
    seen: int | None = None
    if isinstance(data, Mapping) and "config" in data and set(data) <= VIEW_KEYS:
        seen = data.get("version")
        if seen is not None and (not isinstance(seen, int) or isinstance(seen, bool)):
            raise InvalidConfig(f"version: {seen!r} is not a version (a whole number, as "
                                "GET /admin/config gives it) or null", "version")
        data = data["config"]
        if not isinstance(data, Mapping):
            raise InvalidConfig("config: the config (a mapping of sections), as "
                                "GET /admin/config gives it", "config")
    return _validate(data, source, running, server_overrides), seen


def _parse(text: str, source: str) -> Any:
    if not text.strip():
        raise InvalidConfig(f"{source} is empty: give the whole config (GET /admin/config "
                            "shows the running one); an empty one is not 'all defaults'")
    try:
        return parse_config_text(text, source)
    except ConfigError as e:
        raise InvalidConfig(str(e)) from None


def _validate(data: Any, source: str, running: GatewayConfig,
              server_overrides: Mapping[str, object]) -> GatewayConfig:
    data = unredact(data, running.model_dump(mode="json"))
    left = redacted_keys(data)
    if left:
        raise InvalidConfig(
            f"{left[0]} is '***', how /admin/config shows a key: give the key itself (a "
            "'***' kept where the running config has a key stands for that key)", left[0])
    try:
        cfg = with_server_overrides(config_from_mapping(data, source), **server_overrides)
        require_backends(cfg)
    except ConfigError as e:
        raise InvalidConfig(str(e), first_field(str(e)) or named_field(str(e))) from None
    return cfg


def named_field(message: str) -> str | None:
    """A field named at the start of a one-line :class:`ConfigError` (``auth.admin_key_env:
    ADMIN is not set``, ``backends[c].api_key_env: ...``: :func:`gateway.config
    .check_secrets`' form), or None."""
    head = message.split(":", 1)[0].strip()
    return head if _FIELD.match(head) and "." in head else None


def source_digest(path: str | Path | None, server_overrides: Mapping[str, object],
                  environ: Mapping[str, str] | None = None) -> str | None:
    """The digest of what a start reads besides the state directory: the config file's text
    (None: no file, or unreadable), the ``LLM_GATEWAY_*`` variables and the command line's
    server settings."""
    if path is None:
        return None
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    env = os.environ if environ is None else environ
    return digest({"file": text, "cli": {k: str(v) for k, v in server_overrides.items()},
                   "env": {k: v for k, v in env.items() if k.upper().startswith(ENV_PREFIX)}})


def text_digest(path: str | Path | None) -> str | None:
    """The digest of the config file's text alone (the file watch's), or None (no file, or
    unreadable)."""
    if path is None:
        return None
    try:
        return digest(Path(path).read_text())
    except OSError:
        return None


class StartFrom(NamedTuple):
    """What :func:`resume_config` chose: ``config`` to start with, ``resumed`` the kept
    snapshot it is (None: the file's), ``says`` the one line for the operator (None without
    ``reload.state_dir``) at ``level`` (``logging`` level: WARNING when a kept config could
    not be resumed)."""

    config: GatewayConfig
    resumed: Snapshot | None
    says: str | None
    level: int = logging.INFO


def resume_config(
    cfg: GatewayConfig, path: str | Path | None, server_overrides: Mapping[str, object]
) -> StartFrom:
    """The config a start uses: with ``reload.state_dir``, the last applied one kept there
    when the file, the environment and the command line are what it was started from
    (:func:`source_digest`, :meth:`ConfigHistory.resume`), with this start's ``server``
    section (a process's own: it never changes live); else ``cfg`` (the file's). Returns
    a :class:`StartFrom`: it, the snapshot resumed (None: the file's) and the one line that
    says which and why (None without ``reload.state_dir``): resumed version N; started from
    the file because the file, the ``LLM_GATEWAY_*`` environment or the command line changed
    since version N was applied, because version N is the file's own start, because nothing
    is kept, or because version N's config is no longer valid (a value edited by hand, a field an
    upgrade renamed: that line names the version, its file and the problem, and the start
    goes on from the file). Raises ``OSError`` when the state directory cannot be made."""
    if cfg.reload.state_dir is None:
        return StartFrom(cfg, None, None)
    history = ConfigHistory(cfg.reload.state_dir, cfg.reload.keep)
    last = history.last
    if last is None:
        return StartFrom(cfg, None, f"config: starting from the config file: no config "
                         f"version kept in {history.dir}")
    snap = history.resume(source_digest(path, server_overrides))
    if snap is None:
        if last.source == "start" and last.file_digest == source_digest(path, server_overrides):
            return StartFrom(cfg, None, f"config: starting from the config file, as "
                             f"version {last.version} (start) did: unchanged since")
        return StartFrom(cfg, None, (
            f"config: starting from the config file, not resuming version {last.version} "
            f"({last.source}): the config file, the {ENV_PREFIX}* environment or the "
            f"command line changed since version {last.version} was applied"))
    where = Path(cfg.reload.state_dir) / SUBDIR / f"{snap.version:08d}.json"
    try:
        data = {**snap.config, "server": cfg.server.model_dump(mode="json")}
        resumed = config_from_mapping(data, f"config version {snap.version} kept in {where}")
        require_backends(resumed)
    except Exception as e:  # a kept config never stops a start: any problem, said
        problem = str(e) if isinstance(e, ConfigError) else f"{where}: {type(e).__name__}: {e}"
        return StartFrom(cfg, None, (
            f"config: warning: starting from the config file, not resuming version "
            f"{snap.version} ({snap.source}): its kept config is no longer valid (an upgrade "
            f"or a hand edit?): {' '.join(problem.split())}"), logging.WARNING)
    return StartFrom(resumed, snap, (
        f"config: resuming version {snap.version} ({snap.source}), the last applied, kept "
        f"in {history.dir} (the config file, the {ENV_PREFIX}* environment and the command "
        "line are unchanged since)"))
