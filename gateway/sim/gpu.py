"""The simulated server's GPUs: configuration, a real-time tick, and DCGM-exporter metrics.

:class:`SimGpus` holds one :class:`gateway.sim.thermal.GpuThermal` per GPU of the backend
(``count`` > 1: tensor parallel, every GPU sees the same batch). :meth:`SimGpus.tick` reads
the engine's busy time and mean batch (tokens per step) since the last tick, advances the
thermal model to ``now``, applies the GPU faults of :class:`gateway.sim.faults.FaultConfig`
(cooling failure, Xid, double-bit ECC) and slows the engine's steps while a GPU is
throttled (the slowest GPU of a tensor-parallel group sets the pace).
:func:`render_dcgm` writes the Prometheus text dcgm-exporter serves, with its metric
names and labels (``gpu``, ``UUID``, ``device``, ``modelName``, ``Hostname``; NVIDIA
dcgm-exporter ``etc/default-counters.csv``):

* ``DCGM_FI_DEV_GPU_TEMP`` (°C, whole degrees as DCGM reports), ``DCGM_FI_DEV_POWER_USAGE``
  (W), ``DCGM_FI_DEV_POWER_MGMT_LIMIT`` (W), ``DCGM_FI_DEV_SM_CLOCK`` (MHz) - gauges;
* ``DCGM_FI_DEV_XID_ERRORS`` - gauge, the code of the last Xid error (0: none), as DCGM;
* ``DCGM_FI_DEV_ECC_DBE_VOL_TOTAL`` - counter of volatile double-bit ECC errors;
* ``DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION`` - counter, mJ since start;
* ``DCGM_FI_DEV_GPU_UTIL`` - gauge, % of the last tick's interval the engine was busy
  (DCGM: the share of time a kernel ran);
* ``DCGM_FI_DEV_FB_USED`` / ``DCGM_FI_DEV_FB_FREE`` - gauges, MiB: vLLM allocates
  ``gpu_memory_utilization`` (:data:`VLLM_MEMORY_SHARE`, its default 0.9) of the card at
  start (weights, activations, KV cache) and holds it, so used memory does not move with load.

:class:`GpuTicker` runs ``tick`` on the asyncio loop every ``tick_s`` (the server's lifespan
starts and stops it). Everything but the ticker is pure: time comes in as arguments.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import uuid
from collections.abc import Callable

from gateway.config import GpuConfig as GpuConfig  # declared with the config schema
from gateway.core.gpu_control import ControlService, GpuLimits
from gateway.sim.engine import Engine
from gateway.sim.faults import FaultConfig
from gateway.sim.thermal import (
    GPU_SPECS,
    Cooling,
    GpuThermal,
    prefill_time_factor,
    step_time_factor,
    utilisation,
)

log = logging.getLogger(__name__)

VLLM_MEMORY_SHARE = 0.9
"""vLLM's ``--gpu-memory-utilization`` default: the share of a GPU's memory it takes."""


class SimGpus:
    """The GPUs of one simulated server (see the module docstring). Not thread-safe: call
    from the server's event loop."""

    def __init__(self, cfg: GpuConfig, engine: Engine, now: float = 0.0, seed: int = 0) -> None:
        self.cfg = cfg
        self.engine = engine
        spec = GPU_SPECS[cfg.model]
        if cfg.thermal_mass_j_per_k is not None:
            spec = dataclasses.replace(spec, c_th_j_per_k=cfg.thermal_mass_j_per_k)
        cooling = Cooling(cfg.ambient_c, cfg.r_th_k_per_w)
        self.gpus = [GpuThermal(spec, cooling, now, cfg.temp_c) for _ in range(cfg.count)]
        self.uuids = [
            str(uuid.UUID(int=(seed * 131 + i + 1) * 0x9E3779B97F4A7C15 % 2**128))
            for i in range(cfg.count)
        ]
        self._t = now
        stats = engine.stats()
        self._busy = engine.busy_time_until(now)
        self._steps = stats.steps_total
        self._tokens = stats.generation_tokens_total
        self._xid_seen = 0
        self._ecc_seen = 0
        self.busy = 0.0  # share of the last tick's interval the engine was busy (0-1)

    def apply_faults(self, faults: FaultConfig) -> None:
        """Bring the GPUs in line with ``faults``: cooling failure on/off, and any Xid or
        ECC errors above those already injected (new ones count from now)."""
        factor = faults.cooling_failure_factor if faults.cooling_failure else 1.0
        for g in self.gpus:
            g.set_cooling_failure(factor)
        target = self.gpus[min(faults.fault_gpu, len(self.gpus) - 1)]
        if faults.xid_errors > self._xid_seen:
            target.inject_xid(faults.xid_code, faults.xid_errors - self._xid_seen)
        self._xid_seen = faults.xid_errors
        if faults.ecc_dbe_errors > self._ecc_seen:
            target.inject_ecc_dbe(faults.ecc_dbe_errors - self._ecc_seen)
        self._ecc_seen = faults.ecc_dbe_errors

    def tick(self, now: float, faults: FaultConfig | None = None) -> None:
        """Advance every GPU to ``now`` (seconds) with the utilisation the engine showed since
        the last tick, then set the engine's step slowdown from the slowest GPU's clock."""
        if faults is not None:
            self.apply_faults(faults)
        dt = now - self._t
        stats = self.engine.stats()
        if dt >= self.cfg.tick_s / 2:  # shorter intervals would make the busy share noisy
            # Busy time up to now, the elapsed part of a step still running included: a
            # slow step (a low clock) spans several ticks, each of which it kept busy.
            busy_s = self.engine.busy_time_until(now)
            busy = min(1.0, max(0.0, (busy_s - self._busy) / dt))
            self.busy = busy
            # Mean batch over the interval: tokens generated per engine step ended in it;
            # no step ended (one long step spans the tick): the batch of the step running.
            steps = stats.steps_total - self._steps
            tokens = stats.generation_tokens_total - self._tokens
            batch = tokens / max(1, steps) if tokens else float(self.engine.step_batch())
            occ = batch / self.engine.params.max_num_seqs
            self._busy = busy_s
            self._steps = stats.steps_total
            self._tokens = stats.generation_tokens_total
            self._t = now
            for g in self.gpus:
                g.advance(now, utilisation(busy, occ, g.spec.busy_floor))
        slowest = min(self.gpus, key=lambda g: g.clock)
        self.engine.slowdown = step_time_factor(slowest.clock, slowest.spec.clock_bound_share)
        self.engine.prefill_slowdown = prefill_time_factor(slowest.clock, slowest.spec)


_HELP: tuple[tuple[str, str, str], ...] = (
    ("DCGM_FI_DEV_SM_CLOCK", "gauge", "SM clock frequency (in MHz)."),
    ("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C)."),
    ("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W)."),
    ("DCGM_FI_DEV_POWER_MGMT_LIMIT", "gauge", "Power management limit (in W)."),
    (
        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
        "counter",
        "Total energy consumption since boot (in mJ).",
    ),
    ("DCGM_FI_DEV_XID_ERRORS", "gauge", "Value of the last XID error encountered."),
    ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "counter", "Total number of double-bit volatile ECC errors."),
    ("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %)."),
    ("DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (in MiB)."),
    ("DCGM_FI_DEV_FB_FREE", "gauge", "Framebuffer memory free (in MiB)."),
)


def render_dcgm(gpus: SimGpus) -> str:
    """Prometheus text exposition of ``gpus`` with dcgm-exporter's names and labels."""
    values: dict[str, Callable[[GpuThermal], str]] = {
        "DCGM_FI_DEV_SM_CLOCK": lambda g: f"{round(g.sm_clock_mhz)}",
        "DCGM_FI_DEV_GPU_TEMP": lambda g: f"{round(g.temp_c)}",
        "DCGM_FI_DEV_POWER_USAGE": lambda g: f"{g.power_w:.3f}",
        "DCGM_FI_DEV_POWER_MGMT_LIMIT": lambda g: f"{g.power_limit_w:.1f}",
        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": lambda g: f"{round(g.energy_j * 1000)}",
        "DCGM_FI_DEV_XID_ERRORS": lambda g: f"{g.last_xid}",
        "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": lambda g: f"{g.ecc_dbe}",
        "DCGM_FI_DEV_GPU_UTIL": lambda g: f"{round(gpus.busy * 100)}",
        "DCGM_FI_DEV_FB_USED": lambda g: f"{round(g.spec.memory_mib * VLLM_MEMORY_SHARE)}",
        "DCGM_FI_DEV_FB_FREE": lambda g: (
            f"{round(g.spec.memory_mib) - round(g.spec.memory_mib * VLLM_MEMORY_SHARE)}"
        ),
    }
    lines: list[str] = []
    host = gpus.cfg.hostname
    for name, kind, help_text in _HELP:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        for i, (g, u) in enumerate(zip(gpus.gpus, gpus.uuids, strict=True)):
            labels = (
                f'gpu="{i}",UUID="GPU-{u}",device="nvidia{i}",'
                f'modelName="{g.spec.name}",Hostname="{host}"'
            )
            lines.append(f"{name}{{{labels}}} {values[name](g)}")
    return "\n".join(lines) + "\n"


class SimActuator:
    """The agent's control endpoint over the simulated GPUs
    (:class:`gateway.core.gpu_control.GpuActuator`): locked clocks and power limits as NVML
    would set them (:meth:`GpuThermal.lock_clocks`, :meth:`GpuThermal.set_power_limit`)."""

    def __init__(self, gpus: SimGpus) -> None:
        self.gpus = gpus.gpus

    @property
    def count(self) -> int:
        return len(self.gpus)

    def limits(self, index: int) -> GpuLimits:
        s = self.gpus[index].spec
        return GpuLimits(
            s.min_sm_clock_mhz, s.max_sm_clock_mhz, s.min_power_limit_w, s.tdp_w, s.tdp_w
        )

    def lock_clocks(self, index: int, min_mhz: float, max_mhz: float) -> None:
        self.gpus[index].lock_clocks(min_mhz, max_mhz)

    def reset_clocks(self, index: int) -> None:
        self.gpus[index].reset_clocks()

    def set_power_limit(self, index: int, watts: float) -> None:
        self.gpus[index].set_power_limit(watts)

    def power_limit_w(self, index: int) -> float:
        return self.gpus[index].power_limit_w


class GpuTicker:
    """Runs :meth:`SimGpus.tick` every ``cfg.tick_s`` seconds on the running loop; with
    ``cfg.control_token`` it holds the control endpoint's service (``control``) and reverts
    its caps after ``cfg.revert_after_s`` without contact, as the agent does."""

    def __init__(
        self, gpus: SimGpus, faults: Callable[[], FaultConfig], clock: Callable[[], float]
    ) -> None:
        self.gpus = gpus
        self._faults = faults
        self._clock = clock
        self._task: asyncio.Task[None] | None = None
        cfg = gpus.cfg
        # contact is first set by the first request (nothing is capped before it)
        self.control = (
            ControlService(SimActuator(gpus), cfg.control_token, 0.0, cfg.revert_after_s)
            if cfg.control_token
            else None
        )

    def tick(self) -> None:
        """One tick now (also called before serving ``/gpu/metrics``)."""
        now = self._clock()
        if self.control is not None and self.control.tick(now):
            log.warning(
                "sim: no contact for %.0f s: GPU caps reverted", self.gpus.cfg.revert_after_s
            )
        self.gpus.tick(now, self._faults())

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="sim-gpu-ticker")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        while True:
            try:
                self.tick()
            except Exception:  # the GPU model must never stop the server
                log.exception("sim: GPU tick failed")
            await asyncio.sleep(self.gpus.cfg.tick_s)
