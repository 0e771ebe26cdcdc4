"""The pure parts of fleet-mode reload (issue 18): what a replica keeps as its own when it runs
the fleet's config (``gateway.coord.config_sync``), and a local history numbered with the
fleet's versions (``ConfigHistory.record(..., version)``)."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from gateway.config_history import ConfigHistory
from gateway.coord.config_sync import (
    FleetRecord,
    file_differs,
    shared_digest,
    shared_view,
    with_local,
)
from tests.support.servers import gateway_config


def config(rid: str, port: int, backends: dict[str, str], state_dir: str | None = None) -> dict:
    return gateway_config([{"id": k, "url": u} for k, u in backends.items()],
                          server={"port": port},
                          coordination={"redis_url": "redis://127.0.0.1:6379/0",
                                        "replica_id": rid},
                          reload={"state_dir": state_dir}).model_dump(mode="json")


def test_replicas_share_all_but_their_server_coordination_and_reload_sections() -> None:
    one = config("r1", 8001, {"a": "http://a:1"}, "/var/lib/r1")
    two = config("r2", 8002, {"a": "http://a:1"}, None)
    assert shared_digest(one) == shared_digest(two)
    assert "server" not in shared_view(one)
    assert "coordination" not in shared_view(one) and "reload" not in shared_view(one)
    assert one["server"]["port"] == 8001  # shared_view copies
    other = config("r2", 8002, {"a": "http://a:1", "b": "http://b:1"}, None)
    assert shared_digest(other) != shared_digest(two)

    mine = with_local(other, one)  # r1 running r2's published config
    assert mine["backends"] == other["backends"]
    assert mine["server"] == one["server"]
    assert mine["coordination"]["replica_id"] == "r1"
    assert mine["reload"]["state_dir"] == "/var/lib/r1"
    assert other["coordination"]["replica_id"] == "r2"  # not changed
    # a replica without a state dir does not take the publisher's
    assert with_local(one, two)["reload"]["state_dir"] is None


def test_a_record_that_cannot_be_read_is_none() -> None:
    assert FleetRecord.parse("not json") is None
    assert FleetRecord.parse(json.dumps({"version": 1})) is None
    rec = FleetRecord.parse(json.dumps({
        "version": 4, "applied_at": 1.5, "source": "admin", "digest": "d", "by": "r1",
        "summary_json": json.dumps({"changed": ["backends"]}),
        "config_json": json.dumps({"backends": []})}))
    assert rec is not None and rec.by == "r1"
    assert rec.snapshot.version == 4 and rec.snapshot.config == {"backends": []}
    assert rec.snapshot.summary == {"changed": ["backends"], "by": "r1"}


def test_history_numbered_by_the_fleet_keeps_the_running_one_last(tmp_path: Path) -> None:
    h = ConfigHistory(tmp_path, keep=3)
    for i in range(1, 6):  # a life before the fleet: versions 1..5, 3..5 kept
        h.record({"n": i}, "admin", None, {}, float(i))
    assert [s.version for s in h.snapshots] == [3, 4, 5]
    h.record({"n": 10}, "fleet", None, {}, 10.0, version=8)  # the fleet's version
    assert [s.version for s in h.snapshots] == [4, 5, 8]
    # the fleet's sequence below this replica's own (a store that lost its data): the
    # snapshots numbered at or above it are dropped, so the newest is the running one
    h.record({"n": 11}, "fleet", None, {}, 11.0, version=5)
    assert [s.version for s in h.snapshots] == [4, 5]
    assert h.last is not None and h.last.config == {"n": 11}
    on_disk = ConfigHistory(tmp_path, keep=3)
    assert [(s.version, s.config) for s in on_disk.snapshots] == [(4, {"n": 4}), (5, {"n": 11})]


def test_a_config_file_differs_from_the_fleets_config_unless_only_its_own_fields_do(
    tmp_path: Path,
) -> None:
    fleet = config("r1", 8001, {"a": "http://a:1"})
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(config("r2", 8002, {"a": "http://a:1"}, str(tmp_path))))
    assert file_differs(path, shared_digest(fleet)) is False
    path.write_text(yaml.safe_dump(config("r2", 8002, {"b": "http://b:1"})))
    assert file_differs(path, shared_digest(fleet)) is True
    path.write_text("backends: [")  # not a config: nothing said
    assert file_differs(path, shared_digest(fleet)) is None
    assert file_differs(None, shared_digest(fleet)) is None
