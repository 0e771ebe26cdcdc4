"""The ended rollouts' rules (issue 18, :mod:`gateway.flow.rollout_ledger`): which record
blocks which identity, how the operator lifts it, and what is kept."""

from __future__ import annotations

from gateway.flow.rollout_ledger import KEEP, Ended, Ledger, identity_of


def ended(rid: str, canary: str = "v2", status: str = "rolled_back", blocks: bool = True,
          at: float = 100.0, model: str = "m1") -> Ended:
    return Ended(rid, model, "v1", canary, "config", 3, status, "why", "errors", 0, at - 10,
                 at, blocks)


def test_a_failure_blocks_its_identity_whatever_the_settings_and_only_it() -> None:
    led = Ledger()
    led.add(ended("r1"))
    assert led.blocking(identity_of("m1", "v1", "v2")) is not None
    assert led.blocking(identity_of("m1", "v1", "v3")) is None  # another canary
    assert led.blocking(identity_of("m2", "v1", "v2")) is None  # another model
    assert led.blocking(identity_of("m1", "v0", "v2")) is None  # another baseline
    led.add(ended("r2", canary="v3", status="promoted", blocks=False))
    led.add(ended("r3", canary="v4", blocks=False))  # stopped by its config entry
    assert led.blocking(identity_of("m1", "v1", "v3")) is None
    assert led.blocking(identity_of("m1", "v1", "v4")) is None
    assert led.blocks_run("r1") and not led.blocks_run("r3")


def test_the_operator_lifts_a_block_and_the_record_stays_visible() -> None:
    led = Ledger()
    led.add(ended("r1"))
    led.add(ended("r2", canary="v3"))
    assert led.clear(200.0, "POST /admin/rollouts", "m1", identity_of("m1", "v1", "v3")) \
        == ["r2"]
    assert led.blocking(identity_of("m1", "v1", "v2")) is not None  # only that identity
    assert led.clear(300.0, "DELETE /admin/rollouts", "m1") == ["r1"]
    assert led.blocking(identity_of("m1", "v1", "v2")) is None
    view = led.view()
    assert [(v["id"], v["blocking"], v["cleared_unix"]) for v in view] == [
        ("r2", False, 200.0), ("r1", False, 300.0)]  # newest first, kept


def test_old_records_drop_non_blocking_first_and_a_saved_ledger_is_taken_up() -> None:
    led = Ledger()
    led.add(ended("bad", at=1.0))
    for i in range(KEEP + 5):
        led.add(ended(f"p{i}", status="promoted", blocks=False, at=10.0 + i))
    assert len(led.records) == KEEP
    assert led.blocks_run("bad")  # the oldest, yet kept: it blocks
    again = Ledger()
    assert again.load([*led.state(), {"id": "x", "junk": 1}]) == KEEP  # junk skipped
    assert again.load(led.state()) == 0  # known ids not taken twice
    assert again.blocking(identity_of("m1", "v1", "v2")) is not None
