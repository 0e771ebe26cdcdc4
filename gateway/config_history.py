"""The last applied configurations (issue 18's snapshots): what ``GET /admin/config/history``
lists and ``POST /admin/config/rollback`` returns to, kept in memory and, with
``reload.state_dir``, on disk so that a restart starts from the last applied one.

Each :class:`Snapshot` is one applied config: a version number (1, 2, ... for the life of
the state directory), when (Unix seconds), how (``start``, ``file``, ``sighup``, ``watch``,
``admin``, ``rollback``; ``fleet``: another replica's, in fleet mode, numbered with the
fleet's version), the config itself (``model_dump(mode="json")``), the digest of
that config (sha256 of its canonical JSON), the digest of the config *file* the gateway
was started from (the rule for a restart, :meth:`ConfigHistory.resume`), and what the
change did (:meth:`gateway.config_diff.ReloadPlan.summary`), and the state needed to return
to it (calibration baselines, holds, rollouts: :mod:`gateway.reload_state`), refreshed while
it runs (:meth:`ConfigHistory.keep_state`).

On disk: ``<state_dir>/config-history/<version>.json``, written atomically (a temporary
file, fsync, rename) with mode 0600 (a config may hold inline keys), the oldest deleted
beyond ``keep`` (at each new snapshot, and at start when more are there: a lowered
``keep``). A damaged file (one that cannot be read, is not JSON, has not a snapshot's
fields and types, or is not named after its version) never stops a start and is never
counted among the ``keep`` kept: it is renamed ``<name>.damaged`` (kept for the operator to
inspect, never deleted), logged once (the start that moved it), and listed by
:meth:`ConfigHistory.damaged_view` (``GET /admin/config/history``'s ``damaged``); its
number is not given again. :func:`redact` is the view for the admin API.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

log = logging.getLogger("gateway.config")

SUBDIR = "config-history"
SECRET_FIELDS = frozenset({"api_key", "admin_key", "key"})
"""Fields whose values :func:`redact` hides (inline keys: a backend's, the admin key, a
client key)."""
_URL_PASSWORD = re.compile(r"(://[^:/@\s]*:)[^@\s]*@")


def digest(obj: Any) -> str:
    """sha256 (hex) of ``obj``'s canonical JSON (sorted keys, no spaces), or of a string's
    UTF-8 bytes as they are."""
    data = obj.encode() if isinstance(obj, str) else json.dumps(
        obj, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(data).hexdigest()


def redact(obj: Any) -> Any:
    """``obj`` (a config's JSON) with every inline secret replaced by ``"***"`` (the fields
    of :data:`SECRET_FIELDS` that hold a value; the password of a URL such as a
    ``redis_url``). A new object; ``obj`` is not changed."""
    if isinstance(obj, Mapping):
        return {k: (REDACTED if k in SECRET_FIELDS and v not in (None, "") else redact(v))
                for k, v in obj.items()}
    if isinstance(obj, list):
        return [redact(v) for v in obj]
    if isinstance(obj, str):
        return _URL_PASSWORD.sub(r"\1***@", obj)
    return obj


REDACTED = "***"


def unredact(posted: Any, running: Any) -> Any:
    """``posted`` (a config's JSON sent back, e.g. ``GET /admin/config``'s edited) with each
    :data:`REDACTED` value that stands where ``running`` holds a secret replaced by that
    secret: a key field of :data:`SECRET_FIELDS` (list items matched by their ``id`` or
    ``name``, else by position), a URL whose password :func:`redact` hid. Other values,
    and a ``***`` with no running secret at its place, are left as they are (the caller
    refuses a key that is still ``***``). A new object."""
    if isinstance(posted, Mapping) and isinstance(running, Mapping):
        out: dict[str, Any] = {}
        for k, v in posted.items():
            have = running.get(k)
            if k in SECRET_FIELDS and v == REDACTED and isinstance(have, str) and have:
                out[k] = have
            else:
                out[k] = unredact(v, have)
        return out
    if isinstance(posted, list) and isinstance(running, list):
        by_key = {_item_key(r): r for r in running if _item_key(r) is not None}
        return [unredact(v, by_key.get(_item_key(v)) if _item_key(v) is not None
                         else (running[i] if i < len(running) else None))
                for i, v in enumerate(posted)]
    if (isinstance(posted, str) and isinstance(running, str) and REDACTED in posted
            and redact(running) == posted):
        return running
    return posted


def _item_key(item: Any) -> Any:
    """A list item's identity for :func:`unredact`: its ``id``, else its ``name``."""
    if isinstance(item, Mapping):
        return item.get("id", item.get("name"))
    return None


def redacted_keys(obj: Any, path: str = "") -> list[str]:
    """Dotted paths of key fields (:data:`SECRET_FIELDS`) whose value is still
    :data:`REDACTED` in ``obj``."""
    out: list[str] = []
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            p = f"{path}.{k}" if path else str(k)
            if k in SECRET_FIELDS and v == REDACTED:
                out.append(p)
            else:
                out.extend(redacted_keys(v, p))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out.extend(redacted_keys(v, f"{path}.{i}"))
    return out


@dataclass(frozen=True)
class Snapshot:
    """One applied config (module docstring). ``applied_at``: Unix seconds."""

    version: int
    applied_at: float
    source: str
    digest: str
    file_digest: str | None
    config: dict[str, Any]
    summary: dict[str, Any]
    state: dict[str, Any] = field(default_factory=dict)

    def view(self, with_config: bool = False) -> dict[str, Any]:
        """JSON for the admin API: everything but the config and the state (of which a
        count per part: calibration baselines, holds, rollouts by model with status and
        step), or with both (the config redacted)."""
        out = {k: v for k, v in asdict(self).items() if k not in ("config", "state")}
        st = self.state
        rollouts = st.get("rollouts") or {}
        out["state"] = {
            "calibration_baselines": len(st.get("calibration") or {}),
            "holds": {b: h.get("kind") for b, h in (st.get("holds") or {}).items()
                      if isinstance(h, Mapping)},
            "rollouts": {m: {"status": r.get("machine", {}).get("status"),
                             "step": r.get("machine", {}).get("step")}
                         for m, r in rollouts.items() if isinstance(r, Mapping)},
        }
        if with_config:
            out["config"] = redact(self.config)
            out["state"]["kept"] = st
        return out


DAMAGED = ".damaged"
"""The suffix a damaged file of the history directory is renamed with (module docstring)."""
_NUMBERED = re.compile(r"^(\d+)\.json")


def _load(p: Path, name: str) -> Snapshot:
    """The snapshot in file ``p`` (``name``: the file's ``<version>.json`` name, which its
    version must give). Raises ``OSError`` (unreadable), ``ValueError`` (not JSON, or not
    its name's version) or ``TypeError`` (not a snapshot's fields, or of the wrong types:
    a hand-edited file), each saying what is wrong."""
    try:
        data = json.loads(p.read_text())
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 text: {e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON (truncated or edited?): {e}") from None
    if not isinstance(data, dict):
        raise TypeError(f"not a snapshot: a JSON {type(data).__name__}, not an object")
    try:
        snap = Snapshot(**data)
    except TypeError as e:
        raise TypeError(f"not a snapshot: {str(e).removeprefix('Snapshot.')}") from None
    if (not isinstance(snap.version, int) or isinstance(snap.version, bool)
            or not isinstance(snap.config, dict) or not isinstance(snap.state, dict)
            or not isinstance(snap.summary, dict)
            or not isinstance(snap.applied_at, int | float)):
        raise TypeError("not a snapshot: version, applied_at, config, summary or state of "
                        "the wrong type")
    if name != f"{snap.version:08d}.json":
        raise ValueError(f"it holds version {snap.version}, which is not its name's "
                         f"({name})")
    return snap


@dataclass(frozen=True)
class Damaged:
    """A damaged file of the history directory (module docstring): ``file``, its name now
    (``<name>.damaged`` once moved aside), ``problem``, and whether it was ``moved`` aside
    (False: it could not be renamed, and stays where it is, skipped at each start)."""

    file: str
    problem: str
    moved: bool = True


class ConfigHistory:
    """The last ``keep`` snapshots, oldest first, mirrored in ``state_dir`` when given
    (created if missing). Raises ``OSError`` when the directory cannot be created or a
    snapshot cannot be written (the caller refuses the change then)."""

    def __init__(self, state_dir: str | Path | None, keep: int = 3) -> None:
        self.dir = Path(state_dir) / SUBDIR if state_dir is not None else None
        self.keep = keep
        self.snapshots: list[Snapshot] = []
        self._highest = 0  # the highest version number ever given here (files included)
        self.damaged: list[Damaged] = []
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            valid = self._read()
            self.snapshots = valid[-keep:]
            for old in valid[:-keep]:  # a lowered keep: rotated out as record would
                self._delete(old.version)

    def _read(self) -> list[Snapshot]:
        """The valid snapshots of the directory, oldest first; each damaged file moved aside
        (and logged) or, when moved by an earlier start, listed (module docstring)."""
        assert self.dir is not None
        out: list[Snapshot] = []
        moved: dict[str, Damaged] = {}
        for p in sorted(self.dir.glob("*.json")):
            self._number(p.name)
            try:
                out.append(_load(p, p.name))
            except (OSError, ValueError, TypeError) as e:
                d = self._set_aside(p, str(e))
                moved[d.file] = d
        for p in sorted(self.dir.glob(f"*{DAMAGED}")):
            self._number(p.name)  # a damaged file's number is not given again
            if p.name not in moved:  # moved aside by an earlier start: listed, not logged
                try:
                    _load(p, re.sub(r"\.\d+$", "", p.name.removesuffix(DAMAGED)))
                    problem = "moved aside by an earlier start"
                except (OSError, ValueError, TypeError) as e:
                    problem = str(e)
                moved[p.name] = Damaged(p.name, problem)
        self.damaged = sorted(moved.values(), key=lambda d: d.file)
        return sorted(out, key=lambda s: s.version)

    def _number(self, name: str) -> None:
        m = _NUMBERED.match(name)
        if m is not None:
            self._highest = max(self._highest, int(m.group(1)))

    def _set_aside(self, p: Path, problem: str) -> Damaged:
        """Rename the damaged file ``p`` to ``<name>.damaged`` (``.1.damaged``, ... when
        that name is taken), logged once."""
        target = next(t for n in range(1000) if not (t := p.with_name(
            p.name + (f".{n}" if n else "") + DAMAGED)).exists())
        try:
            p.rename(target)
        except OSError as e:
            log.warning("config history: %s is not a snapshot (%s), skipped; it cannot be "
                        "moved aside (%s): it stays, skipped at each start", p, problem, e)
            return Damaged(p.name, problem, moved=False)
        log.warning("config history: %s is not a snapshot (%s); moved aside as %s for "
                    "inspection, not counted among the %d kept", p, problem, target.name,
                    self.keep)
        return Damaged(target.name, problem)

    def damaged_view(self) -> list[dict[str, Any]]:
        """The damaged files found in the directory (module docstring), as JSON: ``file``,
        ``problem``, ``moved``."""
        return [asdict(d) for d in self.damaged]

    @property
    def last(self) -> Snapshot | None:
        """The snapshot of the running config (the last applied), if any."""
        return self.snapshots[-1] if self.snapshots else None

    def get(self, version: int) -> Snapshot | None:
        """The kept snapshot ``version``, or None."""
        return next((s for s in self.snapshots if s.version == version), None)

    def resume(self, file_digest: str | None) -> Snapshot | None:
        """The snapshot a restart starts from: the last applied one, when the config file
        is the one it was started from (``file_digest``: the file's content digest now;
        None: no file). An edited file (or none kept) gives None: start from the file."""
        last = self.last
        if last is None or last.source == "start" or last.file_digest != file_digest:
            return None
        return last

    def keep_state(self, version: int, state: dict[str, Any]) -> bool:
        """Make ``state`` the kept state of snapshot ``version`` (rewritten on disk when it
        changed). Returns whether anything changed. Raises ``OSError`` when it cannot be
        written (the snapshot keeps its former state then)."""
        old = self.get(version)
        if old is None or old.state == state:
            return False
        snap = replace(old, state=state)
        if self.dir is not None:
            self._write(snap)
        self.snapshots = [snap if s.version == version else s for s in self.snapshots]
        return True

    def record(self, config: dict[str, Any], source: str, file_digest: str | None,
               summary: dict[str, Any], now: float, version: int | None = None,
               state: dict[str, Any] | None = None) -> Snapshot:
        """Keep ``config`` as the newest snapshot (``now``: Unix seconds); the oldest beyond
        ``keep`` is dropped (and its file deleted); ``state``: the state it starts from
        (:mod:`gateway.reload_state`). ``version``: the number to give it (fleet
        mode: the fleet's, allocated by the shared store, :mod:`gateway.coord.config_sync`);
        default the last one's + 1. Kept snapshots numbered ``version`` or above (a history
        from before this replica joined the fleet's sequence) are dropped first, so the
        newest is always the running one. Raises ``OSError`` when it cannot be written
        (nothing changes then)."""
        if version is None:
            version = max(self.last.version if self.last else 0, self._highest) + 1
        snap = Snapshot(version, now, source, digest(config), file_digest, config, summary,
                        state or {})
        if self.dir is not None:
            self._write(snap)
        self._highest = max(self._highest, version)
        stale = [s for s in self.snapshots if s.version >= version]
        self.snapshots = [s for s in self.snapshots if s.version < version]
        self.snapshots.append(snap)
        for old in [*stale, *self.snapshots[: -self.keep]]:
            if old.version != version:  # else its file is the new snapshot's now
                self._delete(old.version)
        self.snapshots = self.snapshots[-self.keep:]
        return snap

    def _delete(self, version: int) -> None:
        """Delete snapshot ``version``'s file (rotated out); a failure is logged."""
        if self.dir is not None:
            try:
                (self.dir / f"{version:08d}.json").unlink(missing_ok=True)
            except OSError as e:
                log.warning("config history: cannot delete snapshot %d: %s", version, e)

    def _write(self, snap: Snapshot) -> None:
        assert self.dir is not None
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".snapshot-", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(asdict(snap), f, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o600)
            os.replace(tmp, self.dir / f"{snap.version:08d}.json")
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
