"""The command line starts light: ``--help`` and ``check-config`` load neither the web stack
nor the simulator (each subcommand imports what it needs when it runs)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("fastapi", "starlette", "uvicorn", "aiohttp", "httpx", "gateway.sim", "gateway.app")

_PROBE = """
import contextlib, io, json, sys
import gateway.cli as cli
out = io.StringIO()
with contextlib.redirect_stdout(out):
    try:
        status = cli.main(sys.argv[1:])
    except SystemExit as e:
        status = e.code
print(json.dumps({"status": status, "out": out.getvalue(), "modules": sorted(sys.modules)}))
"""


def _run(*argv: str) -> dict[str, object]:
    """Run ``llm-gateway argv`` in a fresh interpreter; its exit status, stdout and the
    modules it had imported by the end."""
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, *argv],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        check=True,
    )
    return json.loads(proc.stdout.splitlines()[-1])


def _heavy(modules: object) -> list[str]:
    assert isinstance(modules, list)
    return [m for m in modules if any(m == h or m.startswith(h + ".") for h in HEAVY)]


@pytest.mark.parametrize(
    "argv",
    [("--help",), ("check-config", "-c", "config/gateway.yaml")],
    ids=["help", "check-config"],
)
def test_light_commands_import_no_web_stack_or_simulator(argv: tuple[str, ...]) -> None:
    result = _run(*argv)
    assert result["status"] == 0, result["out"]
    assert result["out"], "the command printed nothing"
    assert _heavy(result["modules"]) == []


def test_probe_sees_heavy_imports() -> None:
    """The probe above can fail: parsing ``sim`` loads the simulator's flags, which import
    the simulator."""
    result = _run("sim", "--help")
    assert result["status"] == 0
    assert "--max-num-seqs" in str(result["out"])
    assert "gateway.sim" in _heavy(result["modules"])


def test_late_flags_parse() -> None:
    """The simulator's flags, added only when ``sim`` / ``sim-fleet`` is chosen, parse."""
    args = build_parser().parse_args(["sim", "--port", "8123", "--max-num-seqs", "4"])
    assert (args.command, args.port, args.max_num_seqs) == ("sim", 8123, 4)
    args = build_parser().parse_args(["sim-fleet", "--json"])
    assert args.command == "sim-fleet" and args.json is True
