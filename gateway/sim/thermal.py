"""A simulated GPU's power and temperature: a lumped RC thermal model (pure, time injected).

One :class:`GpuThermal` per simulated GPU. Nothing here reads a clock or does I/O: the
caller passes the time (seconds, any monotonic origin) and the GPU's utilisation over the
interval since its last call, so the same code runs in real time (``/gpu/metrics`` of the
simulated vLLM server) and in simulated time (:mod:`gateway.sim.fleet`).

Power (W), from batch occupancy and the SM clock (DVFS)
-------------------------------------------------------
``P = P_idle + (P_max - P_idle) * u * d(f)``, with the utilisation ``u`` (0-1) from
:func:`utilisation`: ``u = busy * (floor + (1 - floor) * occupancy)`` where ``busy`` is the
share of the interval the engine was stepping and ``occupancy`` the running batch over
``max_num_seqs``. A busy step with one sequence still streams the weights through the SMs and
draws ``floor`` (35%) of the dynamic range; a full batch draws all of it. ``f`` (0-1) is the
SM clock over its maximum and ``d(f)`` (:func:`dynamic_share`, 1 at full clock) the DVFS law:
``d(f) = m + (1 - m) f v(f)^2`` -- CMOS switching power ``C V^2 f`` (Weste & Harris, *CMOS
VLSI Design*, ch. 5) with the voltage ``v(f) = max(v_floor, f)`` (share of its maximum)
falling linearly with the clock over the DVFS range, so the SM share falls as ``f^3`` at the
top and as ``f`` once the voltage sits at its floor ``v_floor`` (0.7: GPUs' V-f curves span
about 0.7-1.05 V), and ``m`` (``uncore_share``, 1/3) the share that does not follow the SM
clock (HBM, memory controllers, NVLink). ``m`` is calibrated to Maliakel et al.,
"Characterizing LLM Inference Energy-Performance Tradeoffs across Workloads and GPU Scaling"
(arXiv:2501.08219): lowering the GPU clock saves about 42% of inference energy for a 1-6%
longer latency; with the decode step's clock share ``clock_bound_share`` = 6% (the top of
their range) at our floor of half the clock (a 6% slower decode), ``m = 1/3`` gives that 42%
for a full batch. DynamoLLM (Stojkovic et al., HPCA 2025) and GreenLLM (Liu et al.,
arXiv:2508.16449) measure the same asymmetry: decode barely slows with the clock, prefill
slows as ``1/f``. Constants of :data:`H100_SXM` / :data:`A100_SXM`: TDP (power limit)
700 W / 400 W, boost SM clock 1980 / 1410 MHz and the lowest power limit ``nvidia-smi -q``
shows (200 W / 100 W) from NVIDIA's datasheets; idle draw about 70 W / 55 W, as ``nvidia-smi``
shows on an idle data-centre GPU with a model loaded; the 35% floor is an assumption in line
with Splitwise (Patel et al., ISCA 2024), which measures decode-phase draw well below TDP.

Clock control (what NVML's ``nvmlDeviceSetGpuLockedClocks`` and
``nvmlDeviceSetPowerManagementLimit`` do): :meth:`GpuThermal.lock_clocks` bounds the SM
clock to ``[min, max]`` MHz within ``[min_sm_clock_mhz, max_sm_clock_mhz]``; the clock runs
at the lock's top unless throttling or the power limit pull it lower.
:meth:`GpuThermal.set_power_limit` sets the limit within ``[min_power_limit_w, tdp_w]``.

Temperature (°C), first-order RC
--------------------------------
``C_th dT/dt = P - (T - T_ambient) / R_th``: heat in is the draw ``P``; heat out through the
heat sink and air is ``(T - T_amb) / R_th``. ``R_th`` (K/W) is the cooling quality of the
slot (rack inlet air, airflow, fan curve), ``T_amb`` its inlet temperature; the steady state
is ``T_ss = T_amb + P R_th`` and the time constant ``tau = R_th C_th``. Power is held
constant over each interval, so the update is the exact solution
``T(t+dt) = T_ss + (T(t) - T_ss) exp(-dt / tau)``: stable and accurate for any step size
(the fleet simulator steps once a second). Defaults: ``R_th = 0.075 K/W`` puts an H100 at
full power (700 W) with 25 °C inlet at 77.5 °C, the upper 70s °C that air-cooled HGX H100
systems report under sustained load; ``C_th = 800 J/K`` (about 1.5 kg of copper/aluminium
heat sink at 400-900 J/(kg K)) gives ``tau = 60 s``, the minute-scale warm-up GPUs show
when a load starts.

Thermal throttling
------------------
At ``throttle_c`` (87 °C, the "GPU Max Operating Temp" ``nvidia-smi -q`` reports on H100
SXM) the driver lowers the SM clock to ``throttle_clock`` (60%) of its maximum until the GPU
reads below ``throttle_release_c`` (84 °C; hardware hysteresis, 3 K here). Every entry
counts as one throttling event. The clock also drops when the demanded power exceeds the
power limit (the GPU's own power capping; a facility may lower that limit:
:attr:`GpuThermal.power_limit_w`), but never below the GPU's lowest supported SM clock
(``min_sm_clock_mhz``, :func:`min_clock`): a limit under what that clock draws at the load
(NVML accepts any limit in ``[min_power_limit_w, tdp_w]``; a fully loaded simulated H100 at
210 MHz draws about 300 W) leaves the GPU at its minimum clock, drawing over the limit by
what that clock needs, as a real GPU does. A slower clock slows the engine's steps: see
:func:`step_time_factor`.

Faults: a cooling failure multiplies ``R_th`` (a failed fan or a CRAC unit: the GPU heats to
a higher steady state, faster); Xid errors and double-bit ECC errors are counters the
caller raises (:meth:`GpuThermal.inject_xid`, :meth:`GpuThermal.inject_ecc_dbe`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

_EPS = 1e-9


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """Electrical and thermal constants of one GPU model (see the module docstring).

    Watts, °C, MHz, J/K. ``clock_bound_share`` is the share of a decode step's time that
    scales with the SM clock (the rest is bound by HBM bandwidth, which the SM clock does
    not change; 6%, Maliakel et al. arXiv:2501.08219), ``prefill_clock_share`` the same for
    prefill (1: compute-bound, time ``1/f``). ``uncore_share`` and ``v_floor``: the DVFS law
    :func:`dynamic_share`. ``min_sm_clock_mhz``: the lowest lockable SM clock (the bottom of
    ``nvmlDeviceGetSupportedGraphicsClocks``); ``min_power_limit_w``: the bottom of
    ``nvmlDeviceGetPowerManagementLimitConstraints``.
    """

    name: str = "NVIDIA H100 80GB HBM3"
    tdp_w: float = 700.0
    idle_w: float = 70.0
    busy_floor: float = 0.35
    max_sm_clock_mhz: float = 1980.0
    throttle_c: float = 87.0
    throttle_release_c: float = 84.0
    throttle_clock: float = 0.6
    c_th_j_per_k: float = 800.0
    clock_bound_share: float = 0.06
    prefill_clock_share: float = 1.0
    uncore_share: float = 1.0 / 3.0
    v_floor: float = 0.7
    min_sm_clock_mhz: float = 210.0
    min_power_limit_w: float = 200.0
    # framebuffer memory as nvidia-smi / DCGM report it (MiB; an 80 GB card shows 81559)
    memory_mib: float = 81559.0

    def __post_init__(self) -> None:
        if not 0 <= self.idle_w < self.tdp_w:
            raise ValueError("idle_w must be in [0, tdp_w)")
        if not 0 < self.throttle_clock <= 1:
            raise ValueError("throttle_clock must be in (0, 1]")
        if not self.throttle_release_c < self.throttle_c:
            raise ValueError("throttle_release_c must be below throttle_c")
        if self.c_th_j_per_k <= 0:
            raise ValueError("c_th_j_per_k must be > 0")
        shares = (self.busy_floor, self.clock_bound_share, self.prefill_clock_share)
        if not all(0 <= x <= 1 for x in (*shares, self.uncore_share)):
            raise ValueError("busy_floor and the clock and uncore shares must be in [0, 1]")
        if not 0 < self.v_floor <= 1:
            raise ValueError("v_floor must be in (0, 1]")
        if not 0 < self.min_sm_clock_mhz <= self.max_sm_clock_mhz:
            raise ValueError("min_sm_clock_mhz must be in (0, max_sm_clock_mhz]")
        if not 0 < self.min_power_limit_w <= self.tdp_w:
            raise ValueError("min_power_limit_w must be in (0, tdp_w]")


H100_SXM = GpuSpec()
"""NVIDIA H100 SXM5 80 GB: 700 W TDP, 1980 MHz boost (datasheet)."""

A100_SXM = GpuSpec(
    name="NVIDIA A100-SXM4-80GB",
    tdp_w=400.0,
    idle_w=55.0,
    max_sm_clock_mhz=1410.0,
    min_power_limit_w=100.0,
    c_th_j_per_k=1000.0,
)
"""NVIDIA A100 SXM4 80 GB: 400 W TDP, 1410 MHz boost (datasheet)."""

GPU_SPECS: dict[str, GpuSpec] = {"h100": H100_SXM, "a100": A100_SXM}


@dataclass(frozen=True, slots=True)
class Cooling:
    """Where a GPU sits: rack inlet air ``ambient_c`` (°C) and thermal resistance
    ``r_th_k_per_w`` (K/W) from the GPU die to that air (heat sink + airflow)."""

    ambient_c: float = 25.0
    r_th_k_per_w: float = 0.075

    def __post_init__(self) -> None:
        if self.r_th_k_per_w <= 0:
            raise ValueError("r_th_k_per_w must be > 0")


def utilisation(busy: float, occupancy: float, floor: float) -> float:
    """Power utilisation 0-1 from the busy share of an interval and the mean batch
    occupancy (running / max_num_seqs) while busy; ``floor`` is :attr:`GpuSpec.busy_floor`."""
    busy = min(1.0, max(0.0, busy))
    occupancy = min(1.0, max(0.0, occupancy))
    return busy * (floor + (1.0 - floor) * occupancy)


def dynamic_share(clock: float, spec: GpuSpec) -> float:
    """Share (0-1) of the dynamic power a busy GPU draws at SM clock share ``clock``: the
    DVFS law ``m + (1 - m) f max(v_floor, f)^2`` of the module docstring (1 at full clock)."""
    f = min(1.0, max(0.0, clock))
    v = max(spec.v_floor, f)
    return spec.uncore_share + (1.0 - spec.uncore_share) * f * v * v


def clock_for_share(share: float, spec: GpuSpec) -> float:
    """The SM clock share at which :func:`dynamic_share` equals ``share`` (the inverse), never
    below :func:`min_clock` (the GPU's lowest supported SM clock: a share the DVFS range
    cannot reach gives that minimum, and the GPU then draws what it draws there)."""
    m = spec.uncore_share
    if share >= 1.0:
        return 1.0
    sm = (share - m) / (1.0 - m) if m < 1.0 else 1.0  # f v(f)^2
    vf = spec.v_floor
    f = sm ** (1.0 / 3.0) if sm >= vf**3 else sm / (vf * vf)
    return min(1.0, max(min_clock(spec), f))


def min_clock(spec: GpuSpec) -> float:
    """The lowest SM clock share the GPU runs at: ``min_sm_clock_mhz / max_sm_clock_mhz``
    (the bottom of ``nvmlDeviceGetSupportedGraphicsClocks``; H100 SXM: 210 / 1980 MHz).
    Neither a power limit nor a clock lock takes a real GPU below it."""
    return spec.min_sm_clock_mhz / spec.max_sm_clock_mhz


def prefill_time_factor(clock: float, spec: GpuSpec) -> float:
    """How much longer a prefill takes at SM clock share ``clock``: compute-bound, so
    ``(1 - s) + s / f`` with ``s = prefill_clock_share`` (1: ``1/f``)."""
    return step_time_factor(clock, spec.prefill_clock_share)


def step_time_factor(clock: float, clock_bound_share: float) -> float:
    """How much longer an engine step takes at SM clock ``clock`` (share of the maximum):
    ``(1 - s) + s / clock`` with ``s`` the clock-bound share of the step (1 at full clock)."""
    clock = max(clock, 0.05)
    return (1.0 - clock_bound_share) + clock_bound_share / clock


def steady_state_c(power_w: float, cooling: Cooling) -> float:
    """Temperature (°C) a GPU settles at when drawing ``power_w`` W: ``T_amb + P R_th``."""
    return cooling.ambient_c + power_w * cooling.r_th_k_per_w


def _crossing(t0: float, tss: float, thr: float, tau: float) -> float | None:
    """Seconds until ``T`` (from ``t0`` towards ``tss``, time constant ``tau``) reaches
    ``thr``; None if it never does."""
    if (t0 - thr) * (tss - thr) >= 0:  # same side: never crosses (or starts on it)
        return None
    return -tau * math.log((thr - tss) / (t0 - tss))


class GpuThermal:
    """One simulated GPU: temperature, draw, clock, throttling, error counters.

    Drive it with :meth:`advance` (time in seconds, never backwards). Read ``temp_c``,
    ``power_w``, ``clock`` (0-1), ``sm_clock_mhz``, ``throttling``, and the cumulative
    ``throttle_events``, ``throttle_time_s``, ``time_above_s`` (above ``hot_c``), ``energy_j``.
    """

    def __init__(
        self,
        spec: GpuSpec = H100_SXM,
        cooling: Cooling | None = None,
        now: float = 0.0,
        temp_c: float | None = None,
        hot_c: float = 85.0,
    ) -> None:
        self.spec = spec
        self.cooling = cooling or Cooling()
        self.cooling_factor = 1.0  # R_th multiplier; > 1 during a cooling failure
        self.power_limit_w = spec.tdp_w
        self.locked_min_mhz: float | None = None  # SM clock lock (MHz); None: not locked
        self.locked_max_mhz: float | None = None
        self.hot_c = hot_c
        self.util = 0.0
        self.throttling = False
        self.power_capped = False
        self.clock = 1.0
        self.temp_c = steady_state_c(spec.idle_w, self.cooling) if temp_c is None else temp_c
        self.power_w = spec.idle_w
        self.throttle_events = 0
        self.throttle_time_s = 0.0
        self.time_above_s = 0.0
        self.energy_j = 0.0
        self.xid_errors = 0
        self.last_xid = 0
        self.ecc_dbe = 0
        self._t = now

    # ---------------------------------------------------------------- configuration
    @property
    def r_th(self) -> float:
        """Effective thermal resistance now (K/W), cooling failure included."""
        return self.cooling.r_th_k_per_w * self.cooling_factor

    @property
    def tau_s(self) -> float:
        """Thermal time constant now (s): ``R_th C_th``."""
        return self.r_th * self.spec.c_th_j_per_k

    @property
    def sm_clock_mhz(self) -> float:
        """SM clock now (MHz), as ``DCGM_FI_DEV_SM_CLOCK``."""
        return self.spec.max_sm_clock_mhz * self.clock

    @property
    def clock_ceiling(self) -> float:
        """The highest SM clock share the lock allows (1 when not locked)."""
        if self.locked_max_mhz is None:
            return 1.0
        return self.locked_max_mhz / self.spec.max_sm_clock_mhz

    def lock_clocks(self, min_mhz: float, max_mhz: float) -> tuple[float, float]:
        """Lock the SM clock to ``[min_mhz, max_mhz]`` (MHz), clamped to the GPU's range
        ``[min_sm_clock_mhz, max_sm_clock_mhz]`` (as ``nvmlDeviceSetGpuLockedClocks``); returns
        the range set. Takes effect at the next :meth:`advance`."""
        s = self.spec
        if min_mhz > max_mhz:
            raise ValueError("min_mhz must not exceed max_mhz")
        lo = min(s.max_sm_clock_mhz, max(s.min_sm_clock_mhz, min_mhz))
        hi = min(s.max_sm_clock_mhz, max(s.min_sm_clock_mhz, max_mhz))
        self.locked_min_mhz, self.locked_max_mhz = lo, hi
        return lo, hi

    def reset_clocks(self) -> None:
        """Clear the clock lock (``nvmlDeviceResetGpuLockedClocks``)."""
        self.locked_min_mhz = self.locked_max_mhz = None

    def set_power_limit(self, watts: float | None) -> float:
        """Set the power limit (W) within ``[min_power_limit_w, tdp_w]``; None restores the
        default (TDP). Returns the limit set."""
        s = self.spec
        w = s.tdp_w if watts is None else min(s.tdp_w, max(s.min_power_limit_w, watts))
        self.power_limit_w = w
        return w

    def set_cooling_failure(self, factor: float) -> None:
        """Multiply ``R_th`` by ``factor`` from now on (1 = cooling restored)."""
        if factor <= 0:
            raise ValueError("cooling factor must be > 0")
        self.cooling_factor = factor

    def set_cooling(self, cooling: Cooling) -> None:
        """Move the GPU to other cooling (ambient and R_th) from now on."""
        self.cooling = cooling

    def inject_xid(self, code: int, count: int = 1) -> None:
        """Record ``count`` Xid errors of ``code`` (e.g. 79: fallen off the bus, 48: DBE)."""
        self.xid_errors += count
        self.last_xid = code

    def inject_ecc_dbe(self, count: int = 1) -> None:
        """Record ``count`` volatile double-bit ECC errors."""
        self.ecc_dbe += count

    # ------------------------------------------------------------------- physics
    def _clock_for(self, util: float) -> tuple[float, bool]:
        """SM clock share and whether the power limit binds, for ``util`` now."""
        s = self.spec
        clock = min(self.clock_ceiling, s.throttle_clock if self.throttling else 1.0)
        dyn = (s.tdp_w - s.idle_w) * util
        capped = False
        if dyn > 0 and s.idle_w + dyn * dynamic_share(clock, s) > self.power_limit_w:
            # the firmware lowers the clock until the draw meets the limit, but never below
            # the GPU's minimum clock: a limit under what that clock draws at this load
            # leaves the GPU at its minimum, drawing over the limit (NVML clamps the limit
            # to [min_power_limit_w, tdp_w]; the model can load a GPU past it there)
            clock = min(clock, clock_for_share((self.power_limit_w - s.idle_w) / dyn, s))
            capped = True
        return max(min_clock(s), clock), capped

    def demand_w(self, util: float, clock: float) -> float:
        """Draw (W) at utilisation ``util`` and clock share ``clock`` (:func:`dynamic_share`)."""
        s = self.spec
        u = min(1.0, max(0.0, util))
        return s.idle_w + (s.tdp_w - s.idle_w) * u * dynamic_share(clock, s)

    def advance(self, now: float, util: float) -> None:
        """Integrate from the last call to ``now`` with utilisation ``util`` (0-1) held.

        Throttling starts and ends exactly where the temperature crosses its thresholds
        inside the interval, so coarse steps give the same events as fine ones.
        """
        self.util = util
        dt = now - self._t
        if dt <= 0:
            self.clock, self.power_capped = self._clock_for(util)
            self.power_w = self.demand_w(util, self.clock)
            return
        self._t = now
        s = self.spec
        for _ in range(100_000):  # bounded: each pass ends at a crossing or at `now`
            if not self.throttling and self.temp_c >= s.throttle_c - _EPS:
                self.throttling = True
                self.throttle_events += 1
            elif self.throttling and self.temp_c <= s.throttle_release_c + _EPS:
                self.throttling = False
            if dt <= _EPS:
                break
            clock, _ = self._clock_for(util)
            p = self.demand_w(util, clock)
            tau = self.tau_s
            tss = self.cooling.ambient_c + p * self.r_th
            t0 = self.temp_c
            thr = s.throttle_release_c if self.throttling else s.throttle_c
            cross = _crossing(t0, tss, thr, tau)
            if cross is not None and cross < dt:
                step, t1 = cross, thr
            else:
                step, t1 = dt, tss + (t0 - tss) * math.exp(-dt / tau)
            self._account(t0, t1, tss, tau, step, p)
            self.temp_c = t1
            dt -= step
        self.clock, self.power_capped = self._clock_for(util)
        self.power_w = self.demand_w(util, self.clock)

    def _account(self, t0: float, t1: float, tss: float, tau: float, dt: float, p: float) -> None:
        self.energy_j += p * dt
        if self.throttling:
            self.throttle_time_s += dt
        hot = self.hot_c
        if t0 >= hot and t1 >= hot:
            self.time_above_s += dt
        elif t0 >= hot or t1 >= hot:
            c = _crossing(t0, tss, hot, tau)
            if c is not None:
                self.time_above_s += (dt - c) if t1 >= hot else c
