"""``llm-gateway sim --control-token-env NAME --revert-after S`` serves the agent's GPU
control endpoint (issue 21), as a user starts it: a real process, called over HTTP."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
MAIN = "import sys; from gateway.cli import main; sys.exit(main())"


def _sim(env: dict[str, str], *flags: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", MAIN, "sim", "--port", "0", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), **env},
    )


def test_sim_serves_the_control_endpoint_to_the_token_in_the_named_variable() -> None:
    proc = _sim({"SIM_TOKEN": "tok"}, "--control-token-env", "SIM_TOKEN", "--revert-after", "7")
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "GPU control at" in line and "reverted 7 s" in line, line
        url = re.search(r"at (http://\S+?);", line)
        assert url is not None, line
        base = url.group(1)
        assert httpx.get(base + "/control", timeout=5).status_code == 401
        r = httpx.get(base + "/control", headers={"Authorization": "Bearer tok"}, timeout=5)
        assert r.status_code == 200 and r.json()["revert_after_s"] == 7.0
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)


def test_sim_without_the_named_variable_says_which_and_exits_2() -> None:
    env = {k: v for k, v in os.environ.items() if k != "SIM_TOKEN_UNSET"}
    proc = _sim(env, "--control-token-env", "SIM_TOKEN_UNSET")
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert "SIM_TOKEN_UNSET" in err and "not set" in err, err


def test_sim_without_the_flag_serves_no_control_endpoint() -> None:
    proc = _sim({})
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "GPU control" not in line
        base = re.search(r"at (http://\S+)", line)
        assert base is not None, line
        r = httpx.get(base.group(1) + "/control", headers={"Authorization": "Bearer x"})
        assert r.status_code == 404
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)
