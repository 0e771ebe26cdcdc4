"""CLI glue: flags -> SimConfig."""

from __future__ import annotations

import argparse

import pytest

from gateway.config import ConfigError, GatewayConfig
from gateway.sim import ReleaseConfig, SimConfig
from gateway.sim.cli import add_sim_arguments, sim_config_from_args


def test_flags_build_the_config() -> None:
    parser = argparse.ArgumentParser()
    add_sim_arguments(parser)
    args = parser.parse_args(
        [
            "--model", "m", "--served-lora", "a", "--served-lora", "b=other", "--seed", "3",
            "--max-num-seqs", "4", "--speed", "2", "--api-key", "k", "--error-rate", "0.5",
            "--rate-limit-rate", "0.1", "--retry-after", "3", "--added-latency", "0.2",
            "--hang", "--drop-after-chunks", "2", "--port", "0",
        ]
    )  # fmt: skip
    cfg = sim_config_from_args(args)
    assert cfg.served_ids == ["m", "a", "b"]
    assert cfg.lora_adapters[1].parent == "other"
    assert (cfg.engine.max_num_seqs, cfg.engine.speed, cfg.api_key) == (4, 2.0, "k")
    f = cfg.faults
    assert (f.error_rate, f.rate_limit_rate, f.retry_after_s, f.added_latency_s) == (
        0.5, 0.1, 3.0, 0.2,
    )  # fmt: skip
    assert f.hang and f.drop_after_chunks == 2 and f.seed == 3
    assert args.port == 0


def test_release_flags_build_the_config() -> None:
    parser = argparse.ArgumentParser()
    add_sim_arguments(parser)
    args = parser.parse_args(
        ["--ttft-factor", "1.5", "--itl-factor", "1.25", "--drift", "0.1", "--drift-seed", "4",
         "--error-rate", "0.05"]
    )  # fmt: skip
    cfg = sim_config_from_args(args)
    r = cfg.release
    assert (r.ttft_factor, r.itl_factor, r.drift, r.drift_seed) == (1.5, 1.25, 0.1, 4)
    assert cfg.faults.error_rate == 0.05  # a bad release's error rate: the fault's
    assert sim_config_from_args(parser.parse_args([])).release == ReleaseConfig()


@pytest.mark.parametrize(
    ("flags", "field"),
    [
        (["--ttft-factor", "0"], "release.ttft_factor"),
        (["--itl-factor", "-1"], "release.itl_factor"),
        (["--drift", "1.5"], "release.drift"),
        (["--error-rate", "2"], "faults.error_rate"),
    ],
)
def test_bad_release_flags_name_the_field(flags: list[str], field: str) -> None:
    parser = argparse.ArgumentParser()
    add_sim_arguments(parser)
    with pytest.raises(ConfigError, match=f"invalid simulator flags: {field}: "):
        sim_config_from_args(parser.parse_args(flags))


def test_a_demo_backends_sim_block_takes_a_release() -> None:
    """``llm-gateway demo`` builds each simulator from its backend's ``sim`` block."""
    cfg = GatewayConfig(
        backends=[{"id": "canary", "url": "http://127.0.0.1:8104",
                   "sim": {"model": "demo-model", "release": {"ttft_factor": 1.5, "drift": 0.1}}}]
    )  # fmt: skip
    sim = cfg.backends[0].sim
    assert sim is not None
    release = SimConfig(**sim).release
    assert (release.ttft_factor, release.itl_factor, release.drift) == (1.5, 1.0, 0.1)
