"""Parsing vLLM's /metrics into load, on a real vLLM 0.32 scrape and edge cases."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.fleet.telemetry import parse_vllm_load

SAMPLE = Path(__file__).resolve().parents[3] / "shared" / "real-vllm" / "metrics_sample.txt"


@pytest.mark.skipif(not SAMPLE.exists(), reason=f"{SAMPLE} not present")
def test_real_vllm_scrape():
    assert parse_vllm_load(SAMPLE.read_text()) == (0.0, 0.0, 0.0)


def test_values_and_old_kv_name_and_engines_summed():
    text = "\n".join([
        "# HELP vllm:num_requests_running x",
        'vllm:num_requests_running{engine="0",model_name="m"} 3.0',
        'vllm:num_requests_running{engine="1",model_name="m"} 2.0',
        'vllm:num_requests_waiting{engine="0",model_name="m"} 4.0',
        'vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 99.0',
        'vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.25',
        'vllm:gpu_cache_usage_perc{engine="1",model_name="m"} 0.75',
    ])
    assert parse_vllm_load(text) == (4.0, 5.0, 0.75)


def test_not_vllm():
    assert parse_vllm_load("process_cpu_seconds_total 1.0\n") is None
    assert parse_vllm_load('vllm:num_requests_running{a="b c"} NaN') is None
