"""Autoscale settings a gateway cannot run on are refused when the config loads, so
``check-config`` says so (exit status 2, the field named) instead of ``serve`` accepting
them and then failing: ``lead_s: 1e12`` made every decision walk the forecaster's
seasonal bins over the whole window (the event loop stuck, requests and SIGTERM unanswered),
``.inf`` made every decision fail (``/autoscale`` serving the first answer forever).

Also: the documented defaults (README's ``autoscale:`` block and ``config/gateway.yaml``'s,
both saying "these are the defaults") are the ones the gateway uses."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from gateway.cli import main
from gateway.config import AutoscaleConfig

ROOT = Path(__file__).resolve().parents[2]

CONFIG = """
server: {host: 127.0.0.1, port: 18999}
backends:
  - {id: a, url: "http://127.0.0.1:9", models: [m]}
autoscale:
  %s
"""


def check_config(tmp_path: Path, line: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(CONFIG % line)
    rc = main(["check-config", "-c", str(cfg)])
    out = capsys.readouterr()
    return rc, out.out + out.err


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ("lead_s: 1e12", "autoscale.lead_s"),
        ("lead_s: .inf", "autoscale.lead_s"),
        ("interval_s: .inf", "autoscale.interval_s"),
        ("cold_start_s: .inf", "autoscale.cold_start_s"),
        ("scale_down_cooldown_s: 1e9", "autoscale.scale_down_cooldown_s"),
        ("ttft_target_s: .inf", "autoscale.ttft_target_s"),
        ("ttft_window_s: .inf", "autoscale.ttft_window_s"),
    ],
)
def test_unrunnable_autoscale_values_are_refused_at_load(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], line: str, field: str
) -> None:
    rc, out = check_config(tmp_path, line, capsys)
    assert rc == 2, out
    assert field in out and "Traceback" not in out, out


@pytest.mark.parametrize(
    "line", ["lead_s: 86400", "interval_s: 300", "scale_down_cooldown_s: 3600", "lead_s: 0"]
)
def test_the_largest_runnable_values_are_accepted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], line: str
) -> None:
    rc, out = check_config(tmp_path, line, capsys)
    assert rc == 0, out


def _yaml_block_after(text: str, marker: str) -> dict[str, object]:
    """The ``autoscale:`` mapping of the YAML in ``text`` at the line matching ``marker``."""
    m = re.search(marker, text, re.M)
    assert m, marker
    start = m.start()
    lines = [text[start:].splitlines()[0]]
    for ln in text[start:].splitlines()[1:]:
        if not ln.startswith("  ") or ln.startswith("```"):
            break
        lines.append(ln)
    block = yaml.safe_load("\n".join(lines))["autoscale"]
    assert isinstance(block, dict)
    return block


def test_documented_defaults_are_the_defaults() -> None:
    defaults = AutoscaleConfig().model_dump()
    readme = (ROOT / "README.md").read_text()
    documented = {
        "README": _yaml_block_after(
            readme, r"^autoscale: +# gateway/config\.py AutoscaleConfig; these are the defaults"),
        "config/gateway.yaml": _yaml_block_after(
            (ROOT / "config" / "gateway.yaml").read_text(), r"^autoscale:"),
    }
    for where, block in documented.items():
        wrong = {k: (v, defaults[k]) for k, v in block.items() if defaults[k] != v}
        assert not wrong, f"{where} says (documented, actual): {wrong}"
