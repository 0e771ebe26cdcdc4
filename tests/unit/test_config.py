"""Config loading: the shipped files are valid, env overrides apply, bad files fail clearly."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["gateway.yaml", "vllm-example.yaml"])
def test_shipped_configs_are_valid(name):
    cfg = load_config(ROOT / "config" / name)
    assert cfg.backends


def test_demo_fleet_has_three_simulated_backends():
    cfg = load_config(ROOT / "config" / "gateway.yaml")
    assert [b.id for b in cfg.backends] == ["sim-1", "sim-2", "sim-3"]
    assert all(b.sim is not None for b in cfg.backends)


def test_production_timeouts_have_no_wall_clock_cap():
    p = load_config(None).proxy
    assert p.ttfb_timeout_s >= 600 and p.idle_timeout_s >= 60
    assert not hasattr(p, "total_timeout_s")


def test_env_overrides_file(tmp_path, monkeypatch):
    f = tmp_path / "c.yaml"
    f.write_text("server: {port: 8001}\nproxy: {idle_timeout_s: 50}\n"
                 "backends: [{id: a, url: 'http://10.0.0.1:8000'}]\n")
    monkeypatch.setenv("LLM_GATEWAY_SERVER__PORT", "9100")
    monkeypatch.setenv("LLM_GATEWAY_BACKENDS", '[{"id": "z", "url": "http://10.0.0.9:8000"}]')
    cfg = load_config(f)
    assert cfg.server.port == 9100
    assert cfg.proxy.idle_timeout_s == 50  # untouched by env
    assert [b.id for b in cfg.backends] == ["z"]


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("proxy: {idle_timout_s: 5}\n", "proxy.idle_timout_s: unknown field"),
        ("server: {port: 70000}\n", "server.port: Input should be less than or equal to 65535"),
        ("backends: [{id: a, url: 'not a url'}]\n", "backends.0.url:"),
        ("backends: [{id: a, url: 'http://h:1/v1'}]\n", "give the server root"),
        ("backends: [{id: a, url: 'http://h:1'}, {id: a, url: 'http://h:2'}]\n", "appears twice"),
        ("auth: {client_keys: [{name: k}]}\n", "exactly one of 'key' or 'key_env'"),
        ("server: [1, 2\n", "invalid YAML"),
        ("- just\n- a list\n", "top level must be a mapping"),
        ("backends: []\nbackends: [{id: a, url: 'http://h:1'}]\n", "duplicate key 'backends'"),
        ("admission: {shed_levels: [1, 2, 3]}\n", "must not increase"),
        ("breaker: {open_base_s: 100, open_max_s: 10}\n", "open_base_s must not exceed"),
        ("retry: {backoff_base_s: 5, backoff_max_s: 1}\n", "backoff_base_s must not exceed"),
        ("auth: {client_keys: [{name: a, key: k1}, {name: b, key: k1}]}\n", "same key"),
        ("auth: {client_keys: [{name: a, key: k1}, {name: a, key: k2}]}\n", "used twice"),
        ("auth: {admin_key: ''}\n", "admin_key is empty"),
        ("auth: {client_keys: [{name: a, key: ' '}]}\n", "'key' is empty"),
        ("backends: [{id: a, url: 'http://h:1', sim: {modle: x}}]\n", "sim.modle"),
    ],
)
def test_bad_file_names_field_and_problem(tmp_path, text, needle):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(f)
    assert needle in str(e.value)
    assert str(f) in str(e.value)


def test_missing_file():
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config("/nonexistent/gw.yaml")


def test_cli_reports_bad_config_and_exits_2(tmp_path, capsys):
    from gateway.cli import main

    f = tmp_path / "bad.yaml"
    f.write_text("health: {fail_threshold: 0}\n")
    assert main(["check-config", "-c", str(f)]) == 2
    err = capsys.readouterr().err
    assert "health.fail_threshold" in err and "greater than or equal to 1" in err


def test_demo_sim_blocks_are_valid_simulator_configs():
    from gateway.sim.config import SimConfig

    for b in load_config(ROOT / "config" / "gateway.yaml").backends:
        assert b.sim is not None
        SimConfig(**b.sim)


def test_env_typo_in_a_section_name_fails_but_other_tools_variables_pass(monkeypatch):
    """``LLM_GATEWAY_SERVR__PORT`` (a typo) is refused, naming the variable; a variable
    without ``__`` that is no section (``LLM_GATEWAY_VLLM_VENV``, the test suite's) is left
    alone."""
    monkeypatch.setenv("LLM_GATEWAY_VLLM_VENV", "/somewhere")
    assert load_config(None).server.port == 8000
    monkeypatch.setenv("LLM_GATEWAY_SERVR__PORT", "9100")
    with pytest.raises(ConfigError, match="LLM_GATEWAY_SERVR__PORT"):
        load_config(None)


def test_client_keep_alive_outlasts_load_balancers_and_client_pools():
    """uvicorn's own default (5 s) equals httpx's pool keep-alive, so a client could reuse
    a connection just as the gateway closed it; the gateway keeps idle connections longer
    than an AWS ALB (60 s), and the setting reaches uvicorn."""
    from gateway.serving import uvicorn_config

    cfg = load_config(None)
    assert cfg.server.keep_alive_s > 60
    assert uvicorn_config(object(), cfg).timeout_keep_alive == cfg.server.keep_alive_s
    cfg = load_config(None, server={"keep_alive_s": 7})
    assert uvicorn_config(object(), cfg).timeout_keep_alive == 7


def test_one_field_of_a_cycle_can_be_set_alone(tmp_path, monkeypatch):
    """``lifecycle.medium.cooldown_s`` alone (file or env) keeps the cycle's other
    defaults (it failed with "every_s: Field required")."""
    f = tmp_path / "g.yaml"
    f.write_text("lifecycle: {medium: {cooldown_s: 60}, long: {every_s: 0}}\n")
    cfg = load_config(f)
    assert cfg.lifecycle.medium.cooldown_s == 60 and cfg.lifecycle.medium.every_s == 1800
    assert cfg.lifecycle.short.every_s == 300 and cfg.lifecycle.long.every_s == 0
    monkeypatch.setenv("LLM_GATEWAY_LIFECYCLE__SHORT__EVERY_S", "30")
    f.write_text("{}\n")
    cfg = load_config(f)
    assert cfg.lifecycle.short.every_s == 30 and cfg.lifecycle.medium.every_s == 1800


def test_check_config_warns_when_clocks_are_on_without_the_agent_token(
    tmp_path, capsys, monkeypatch
):
    from gateway.cli import main

    f = tmp_path / "clocks.yaml"
    f.write_text(
        "backends: [{id: a, url: 'http://127.0.0.1:9', gpu_control_url: 'http://127.0.0.1:9'}]\n"
        "thermal: {enabled: true, clocks: {enabled: true, agent_token_env: MY_AGENT_TOKEN}}\n"
    )
    monkeypatch.delenv("MY_AGENT_TOKEN", raising=False)
    assert main(["check-config", "-c", str(f)]) == 0
    out = capsys.readouterr()
    assert "warning" in out.err and "MY_AGENT_TOKEN" in out.err and "not set" in out.err
    monkeypatch.setenv("MY_AGENT_TOKEN", "t")
    assert main(["check-config", "-c", str(f)]) == 0
    assert "warning" not in capsys.readouterr().err


def test_check_config_prints_each_backends_model_version_and_the_rollouts(tmp_path, capsys):
    """A new user's trial: ``check-config`` did not say which version each backend carries."""
    from gateway.cli import main

    f = tmp_path / "versions.yaml"
    f.write_text(
        "backends:\n"
        "  - {id: a, url: 'http://127.0.0.1:9', models: [m1], model_version: v1}\n"
        "  - {id: b, url: 'http://127.0.0.1:8', models: [m1], model_version: v2}\n"
        "  - {id: c, url: 'http://127.0.0.1:7', models: [m2]}\n"
        "rollouts: [{model: m1, baseline: v1, canary: v2, steps: [0.1, 0.5, 1.0]}]\n"
    )
    assert main(["check-config", "-c", str(f)]) == 0
    lines = capsys.readouterr().out.splitlines()
    by_id = {ln.split()[0]: ln for ln in lines[1:] if ln.startswith("  ") and "rollout" not in ln}
    assert by_id["a"].endswith("model_version v1") and by_id["b"].endswith("model_version v2")
    assert "model_version" not in by_id["c"]
    assert "  rollout of m1: v1 -> v2, steps 0.1, 0.5, 1" in lines
