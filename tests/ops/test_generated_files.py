"""The committed dashboard and alert rules are the generator's output (gateway/ops), and
``--config`` bakes a fleet's own thresholds into them (Prometheus rules cannot read the
gateway's config)."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from gateway.ops.__main__ import DASHBOARD, RULES, main, outputs
from gateway.ops.alerts import alerts
from gateway.ops.dashboard import queries
from gateway.ops.limits import Limits

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def test_committed_files_are_the_generators_output() -> None:
    for rel, text in outputs(Limits.defaults()).items():
        assert (DEPLOY / rel).read_text() == text, (
            f"deploy/{rel} differs from the generator: run `python -m gateway.ops`")
    assert main(["--check", "--out-dir", str(DEPLOY)]) == 0


def test_check_names_a_stale_file(tmp_path: Path) -> None:
    assert main(["--out-dir", str(tmp_path)]) == 0
    (tmp_path / RULES).write_text("groups: []\n")
    assert main(["--check", "--out-dir", str(tmp_path)]) == 1


def test_dashboard_rows_and_every_query_marked() -> None:
    board = json.loads((DEPLOY / DASHBOARD).read_text())
    rows = [p["title"] for p in board["panels"] if p["type"] == "row"]
    assert rows == ["Traffic and SLOs", "Fleet health", "Thermal and power", "Cache",
                    "Admission and batching", "Cost"]
    in_json = {(p["title"], t["refId"]): t["expr"]
               for p in board["panels"] if p["type"] != "row" for t in p["targets"]}
    marked = {(q.panel, q.ref_id): q.expr for q in queries(Limits.defaults())}
    assert in_json == marked
    # percentiles, not means: no latency panel divides a histogram's _sum by its _count
    assert not any("_sum" in e for e in in_json.values())
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))


def test_config_thresholds_reach_the_rules(tmp_path: Path) -> None:
    cfg = tmp_path / "gateway.yaml"
    cfg.write_text(yaml.safe_dump({
        "backends": [{"id": "a", "url": "http://127.0.0.1:1", "models": ["m1"]}],
        "slo": {"ttft_s": 1.5, "itl_s": 0.05},
        "thermal": {"hot_c": 80, "warm_c": 70, "resume_c": 65},
        "calibration": {"threshold": 0.9},
        "status": {"now_s": 120, "min_samples": 10},
    }))
    assert main(["--config", str(cfg), "--out-dir", str(tmp_path)]) == 0
    text = (tmp_path / RULES).read_text()
    rules = {r["alert"]: r for r in yaml.safe_load(text)["groups"][0]["rules"]}
    # the status page's window and minimum sample: the page and the alerts judge alike
    enough = "and on (model) sum by (model) (increase(gateway_{}[2m])) >= 10"
    assert rules["GatewayTTFTP99OverSLO"]["expr"].endswith(
        "[2m]))) > 1.5 " + enough.format("ttft_seconds_count"))
    assert rules["GatewayITLP99OverSLO"]["expr"].endswith(
        "[2m]))) > 0.05 " + enough.format("itl_seconds_count"))
    assert rules["GatewayErrorRatioHigh"]["expr"].endswith(
        "[2m])) > 0.05 " + enough.format("requests_total"))
    assert rules["GatewayGpuHot"]["expr"].endswith(">= 80")
    assert rules["GatewayCalibrationDrift"]["expr"].endswith("< 0.9")
    assert f"from {cfg}" in text
    board = json.loads((tmp_path / DASHBOARD).read_text())
    ttft = next(p for p in board["panels"] if p["title"] == "TTFT P50 / P99 by model")
    assert [s["value"] for s in ttft["fieldConfig"]["defaults"]["thresholds"]["steps"]] \
        == [None, 1.5]


def test_every_alert_has_a_runbook_and_summary() -> None:
    rules = yaml.safe_load((DEPLOY / RULES).read_text())["groups"][0]["rules"]
    assert {r["alert"] for r in rules} == {a.name for a in alerts(Limits.defaults())}
    for r in rules:
        assert r["annotations"]["runbook"].strip() and r["annotations"]["summary"].strip()
        assert r["labels"]["severity"] in ("page", "ticket")
