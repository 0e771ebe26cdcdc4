"""CLI glue: flags -> SimConfig."""

from __future__ import annotations

import argparse

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
