# ruff: noqa: E501  (exporter lines are quoted verbatim)
"""Parsing dcgm-exporter's Prometheus text into per-GPU readings and one backend sample."""

from __future__ import annotations

from gateway.core.samples import GpuSample
from gateway.fleet.telemetry import parse_dcgm

# As dcgm-exporter writes it (labels and order from its default counters), two GPUs.
EXPORTER = """\
# HELP DCGM_FI_DEV_SM_CLOCK SM clock frequency (in MHz).
# TYPE DCGM_FI_DEV_SM_CLOCK gauge
DCGM_FI_DEV_SM_CLOCK{gpu="0",UUID="GPU-ef6e",pci_bus_id="00000000:02:00.0",device="nvidia0",modelName="NVIDIA H100 80GB HBM3",Hostname="node-1"} 1980
DCGM_FI_DEV_SM_CLOCK{gpu="1",UUID="GPU-a1b2",pci_bus_id="00000000:03:00.0",device="nvidia1",modelName="NVIDIA H100 80GB HBM3",Hostname="node-1"} 1410
# HELP DCGM_FI_DEV_GPU_TEMP GPU temperature (in C).
# TYPE DCGM_FI_DEV_GPU_TEMP gauge
DCGM_FI_DEV_GPU_TEMP{gpu="0",UUID="GPU-ef6e",pci_bus_id="00000000:02:00.0",device="nvidia0",modelName="NVIDIA H100 80GB HBM3",Hostname="node-1"} 64
DCGM_FI_DEV_GPU_TEMP{gpu="1",UUID="GPU-a1b2",pci_bus_id="00000000:03:00.0",device="nvidia1",modelName="NVIDIA H100 80GB HBM3",Hostname="node-1"} 86
# HELP DCGM_FI_DEV_POWER_USAGE Power draw (in W).
# TYPE DCGM_FI_DEV_POWER_USAGE gauge
DCGM_FI_DEV_POWER_USAGE{gpu="0",UUID="GPU-ef6e",pci_bus_id="00000000:02:00.0",device="nvidia0",modelName="NVIDIA H100 80GB HBM3",Hostname="node-1"} 412.5
DCGM_FI_DEV_POWER_USAGE{gpu="1",UUID="GPU-a1b2",pci_bus_id="00000000:03:00.0",device="nvidia1",modelName="NVIDIA H100 80GB HBM3",Hostname="node-1"} 655.25
# HELP DCGM_FI_DEV_POWER_MGMT_LIMIT Power management limit (in W).
# TYPE DCGM_FI_DEV_POWER_MGMT_LIMIT gauge
DCGM_FI_DEV_POWER_MGMT_LIMIT{gpu="0",UUID="GPU-ef6e",device="nvidia0"} 700
DCGM_FI_DEV_POWER_MGMT_LIMIT{gpu="1",UUID="GPU-a1b2",device="nvidia1"} 700
DCGM_FI_DEV_POWER_MGMT_LIMIT_MIN{gpu="0",UUID="GPU-ef6e",device="nvidia0"} 200
# HELP DCGM_FI_DEV_XID_ERRORS Value of the last XID error encountered.
# TYPE DCGM_FI_DEV_XID_ERRORS gauge
DCGM_FI_DEV_XID_ERRORS{gpu="0",UUID="GPU-ef6e",device="nvidia0",err_code="0",err_msg="No Error"} 0
DCGM_FI_DEV_XID_ERRORS{gpu="1",UUID="GPU-a1b2",device="nvidia1",err_code="79",err_msg="GPU has fallen off the bus"} 79
# HELP DCGM_FI_DEV_ECC_DBE_VOL_TOTAL Total number of double-bit volatile ECC errors.
# TYPE DCGM_FI_DEV_ECC_DBE_VOL_TOTAL counter
DCGM_FI_DEV_ECC_DBE_VOL_TOTAL{gpu="0",UUID="GPU-ef6e",device="nvidia0"} 0
DCGM_FI_DEV_ECC_DBE_VOL_TOTAL{gpu="1",UUID="GPU-a1b2",device="nvidia1"} 2
"""


def test_two_gpus_parsed_and_reduced_to_the_hottest() -> None:
    gpus = parse_dcgm(EXPORTER)
    assert [g.temp_c for g in gpus] == [64.0, 86.0]
    assert gpus[1].power_w == 655.25 and gpus[1].power_limit_w == 700.0
    assert [g.xid for g in gpus] == [0, 79] and [g.ecc_dbe for g in gpus] == [0.0, 2.0]
    s = GpuSample.from_gpus(10.0, gpus)
    assert s.temp_c == 86.0 and s.power_w == 1067.75 and s.power_limit_w == 1400.0
    assert s.sm_clock_mhz == 1410.0 and s.ecc_dbe_total == 2.0 and s.xid_last == (0, 79)


def test_gpu_indices_keep_only_this_backends_gpus() -> None:
    gpus = parse_dcgm(EXPORTER, gpu_indices=[0])
    assert len(gpus) == 1 and gpus[0].temp_c == 64.0
    assert parse_dcgm(EXPORTER, gpu_indices=[5]) == []


def test_a_limit_only_as_enforced_limit_is_used() -> None:
    text = (
        'DCGM_FI_DEV_GPU_TEMP{gpu="0"} 50\n'
        'DCGM_FI_DEV_POWER_USAGE{gpu="0"} 300\n'
        'DCGM_FI_DEV_ENFORCED_POWER_LIMIT{gpu="0"} 600\n'
    )
    (g,) = parse_dcgm(text)
    assert g.power_limit_w == 600.0 and g.sm_clock_mhz is None and g.ecc_dbe is None


def test_without_labels_a_single_gpu_is_gpu_zero() -> None:
    (g,) = parse_dcgm("DCGM_FI_DEV_GPU_TEMP 70\nDCGM_FI_DEV_POWER_USAGE 250.5\n")
    assert (g.temp_c, g.power_w) == (70.0, 250.5)


def test_no_temperature_means_no_reading() -> None:
    assert parse_dcgm("vllm:num_requests_running 3\n") == []
    assert parse_dcgm('DCGM_FI_DEV_POWER_USAGE{gpu="0"} 300\n') == []
    assert parse_dcgm('DCGM_FI_DEV_GPU_TEMP{gpu="0"} NaN\n') == []
    assert parse_dcgm("") == []


def test_gpu_label_is_not_confused_with_a_longer_label_name() -> None:
    text = 'DCGM_FI_DEV_GPU_TEMP{vgpu="7",gpu="2"} 61\nDCGM_FI_DEV_GPU_TEMP{gpu="10"} 62\n'
    gpus = parse_dcgm(text)
    assert [g.temp_c for g in gpus] == [61.0, 62.0]  # ordered by gpu index: 2, 10
