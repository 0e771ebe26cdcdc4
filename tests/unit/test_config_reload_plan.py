"""What a live reload may change (``gateway.config_diff``) and the kept configs
(``gateway.config_history``), pure and on a temporary directory."""

from __future__ import annotations

import json
import os
import stat
from typing import Any

from gateway.config import GatewayConfig
from gateway.config_diff import differences, plan_reload
from gateway.config_history import ConfigHistory, digest, redact


def cfg(backends: list[dict[str, Any]], **sections: Any) -> GatewayConfig:
    return GatewayConfig(backends=backends, **sections)


A = {"id": "a", "url": "http://10.0.0.1:8000"}
B = {"id": "b", "url": "http://10.0.0.2:8000"}
C = {"id": "c", "url": "http://10.0.0.3:8000"}


def test_differences_name_dotted_paths() -> None:
    assert differences({"x": {"y": 1, "z": [1, 2]}}, {"x": {"y": 2, "z": [1, 3]}}) == [
        "x.y", "x.z.1"]
    assert differences({"l": [1]}, {"l": [1, 2]}) == ["l"]
    assert differences({"a": 1}, {"a": 1, "b": 2}) == ["b"]
    assert differences({"a": 1}, {"a": 1}) == []


def test_backends_added_removed_changed_in_place_or_refused() -> None:
    old = cfg([A, {**B, "max_num_seqs": 8}])
    new = cfg([A, {**B, "max_num_seqs": 16, "role": "standby"}, C])
    p = plan_reload(old, new)
    assert p.ok and (p.added, p.removed, p.changed_backends) == (["c"], [], ["b"])
    moved = plan_reload(old, cfg([A, {**B, "url": "http://10.0.0.9:8000"}]))
    assert not moved.ok
    assert [r.path for r in moved.refused] == ["backends[b].url"]
    assert "new id" in str(moved.refused[0])
    gone = plan_reload(old, cfg([A]))
    assert gone.ok and gone.removed == ["b"] and not gone.empty


def test_sections_read_at_build_are_refused_with_their_paths_and_auth_is_live() -> None:
    old = cfg([A])
    p = plan_reload(old, cfg([A], proxy={"idle_timeout_s": 5}, slo={"ttft_s": 1}))
    assert [r.path for r in p.refused] == ["proxy.idle_timeout_s", "slo.ttft_s"]
    assert all("restart" in r.problem for r in p.refused)
    keys = plan_reload(old, cfg([A], auth={"client_keys": [{"name": "t", "key": "k"}]}))
    assert keys.ok and keys.auth
    same = plan_reload(old, cfg([A]))
    assert same.ok and same.empty


def test_history_keeps_the_last_three_on_disk_and_resumes_only_an_unchanged_file(
        tmp_path) -> None:
    h = ConfigHistory(tmp_path, keep=3)
    assert h.last is None and h.resume("f1") is None
    for i in range(5):
        h.record({"n": i, "auth": {"admin_key": "s3cret"}}, "admin" if i else "start", "f1",
                 {"changed": [str(i)]}, now=1000.0 + i)
    assert [s.version for s in h.snapshots] == [3, 4, 5]
    files = sorted((tmp_path / "config-history").glob("*.json"))
    assert [json.loads(f.read_text())["version"] for f in files] == [3, 4, 5]
    assert all(stat.S_IMODE(os.stat(f).st_mode) == 0o600 for f in files)
    again = ConfigHistory(tmp_path, keep=3)  # a restart reads them back
    assert [s.version for s in again.snapshots] == [3, 4, 5]
    assert again.resume("f1") is not None and again.resume("f1").version == 5  # type: ignore[union-attr]
    assert again.resume("edited") is None  # an edited file wins
    assert again.get(4) is not None and again.get(1) is None
    assert again.last is not None and again.last.digest == digest({"n": 4, "auth": {
        "admin_key": "s3cret"}})
    (tmp_path / "config-history" / "00000009.json").write_text("{not json")
    assert [s.version for s in ConfigHistory(tmp_path).snapshots] == [3, 4, 5]  # skipped


def test_a_hand_edited_snapshot_of_the_wrong_shape_is_skipped_not_fatal(tmp_path) -> None:
    h = ConfigHistory(tmp_path, keep=3)
    h.record({"n": 1}, "start", "f1", {"changed": []}, now=1000.0)
    h.record({"n": 2}, "admin", "f1", {"changed": ["n"]}, now=1001.0)
    path = tmp_path / "config-history" / "00000002.json"
    snap = json.loads(path.read_text())
    path.write_text(json.dumps({**snap, "version": "2"}))  # a string: sorting would raise
    assert [s.version for s in ConfigHistory(tmp_path).snapshots] == [1]
    path.write_text(json.dumps({**snap, "config": ["not", "a", "mapping"]}))
    again = ConfigHistory(tmp_path)
    assert [s.version for s in again.snapshots] == [1]
    assert again.record({"n": 3}, "start", "f1", {}, now=1002.0).version == 3  # not reused


def test_redact_hides_inline_secrets_and_url_passwords() -> None:
    data = {"auth": {"admin_key": "x", "client_keys": [{"name": "t", "key": "k",
                                                         "key_env": None}]},
            "backends": [{"id": "a", "api_key": None, "api_key_env": "K"}],
            "coordination": {"redis_url": "redis://:pw@host:6379/0"}}
    out = redact(data)
    assert out["auth"]["admin_key"] == "***"
    assert out["auth"]["client_keys"][0] == {"name": "t", "key": "***", "key_env": None}
    assert out["backends"][0]["api_key"] is None and out["backends"][0]["api_key_env"] == "K"
    assert out["coordination"]["redis_url"] == "redis://:***@host:6379/0"
    assert data["auth"]["admin_key"] == "x"  # not changed in place


def test_damaged_snapshots_are_moved_aside_once_and_the_rotation_keeps_the_valid(
        tmp_path, caplog) -> None:
    """A file of the history directory that is not a snapshot (truncated JSON, the wrong
    shape, a name that is not its version's) is renamed ``*.damaged`` (kept for the operator,
    listed in ``damaged``, logged once), never counted among the ``keep`` kept: the
    directory holds the last ``keep`` valid snapshots; a valid one beyond ``keep`` (a
    lowered ``reload.keep``) is rotated out at start."""
    h = ConfigHistory(tmp_path, keep=5)
    for i in range(4):
        h.record({"n": i}, "admin", "f1", {"changed": []}, now=1000.0 + i)
    d = tmp_path / "config-history"
    (d / "00000005.json").write_text('{"version": 5, "config": {"n"')  # truncated
    (d / "00000006.json").write_text(json.dumps({"version": 6}))  # the wrong shape
    snap = json.loads((d / "00000004.json").read_text())
    (d / "00000007.json").write_text(json.dumps({**snap, "version": 3}))  # not its name's
    caplog.set_level("WARNING", logger="gateway.config")
    h = ConfigHistory(tmp_path, keep=3)
    assert [s.version for s in h.snapshots] == [2, 3, 4]
    assert sorted(p.name for p in d.glob("*.json")) == [
        "00000002.json", "00000003.json", "00000004.json"]  # 1 rotated out
    assert sorted(p.name for p in d.glob("*.damaged")) == [
        "00000005.json.damaged", "00000006.json.damaged", "00000007.json.damaged"]
    assert [x["file"] for x in h.damaged_view()] == [
        "00000005.json.damaged", "00000006.json.damaged", "00000007.json.damaged"]
    problems = [x["problem"] for x in h.damaged_view()]
    assert "not JSON" in problems[0] and "not a snapshot" in problems[1], problems
    assert "version 3" in problems[2], problems
    moved = [r for r in caplog.records if "damaged" in r.getMessage()]
    assert len(moved) == 3, [r.getMessage() for r in caplog.records]
    caplog.clear()
    again = ConfigHistory(tmp_path, keep=3)  # the next start: listed, not logged again
    assert [s.version for s in again.snapshots] == [2, 3, 4]
    assert [x["file"] for x in again.damaged_view()] == [
        x["file"] for x in h.damaged_view()]
    assert not [r for r in caplog.records if "damaged" in r.getMessage()]
    assert again.record({"n": 9}, "admin", "f1", {}, now=2000.0).version == 8  # not reused
    assert sorted(p.name for p in d.glob("*.json")) == [
        "00000003.json", "00000004.json", "00000008.json"]
