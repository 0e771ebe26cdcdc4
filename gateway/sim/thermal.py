"""A simulated GPU's power and temperature: a lumped RC thermal model (pure, time injected).

One :class:`GpuThermal` per simulated GPU. Nothing here reads a clock or does I/O: the
caller passes the time (seconds, any monotonic origin) and the GPU's utilisation over the
interval since its last call, so the same code runs in real time (``/gpu/metrics`` of the
simulated vLLM server) and in simulated time (:mod:`gateway.sim.fleet`).

Power (W), from batch occupancy
-------------------------------
``P = P_idle + (P_max - P_idle) * u * clock``, with the utilisation ``u`` (0-1) from
:func:`utilisation`: ``u = busy * (floor + (1 - floor) * occupancy)`` where ``busy`` is the
share of the interval the engine was stepping and ``occupancy`` the running batch over
``max_num_seqs``. A busy step with one sequence still streams the weights through the SMs and
draws ``floor`` (35%) of the dynamic range; a full batch draws all of it. ``clock`` (0-1) is
the SM clock over its maximum: dynamic power falls with the clock (linear here, a
conservative choice: ``P ~ f V^2`` falls faster). Constants of :data:`H100_SXM` /
:data:`A100_SXM`: TDP (power limit) 700 W / 400 W and boost SM clock 1980 / 1410 MHz from
NVIDIA's H100 and A100 datasheets; idle draw about 70 W / 55 W, as ``nvidia-smi`` shows on an
idle data-centre GPU with a model loaded; the 35% floor is an assumption in line with
Splitwise (Patel et al., ISCA 2024), which measures decode-phase draw well below TDP.

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
:attr:`GpuThermal.power_limit_w`). A slower clock slows the engine's steps: see
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

    Watts, °C, MHz, J/K. ``clock_bound_share`` is the share of an engine step's time that
    scales with the SM clock (the rest is bound by HBM bandwidth, which the SM clock does
    not change); an assumption, since LLM decode is largely memory-bound.
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
    clock_bound_share: float = 0.6
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
        if not 0 <= self.busy_floor <= 1 or not 0 <= self.clock_bound_share <= 1:
            raise ValueError("busy_floor and clock_bound_share must be in [0, 1]")


H100_SXM = GpuSpec()
"""NVIDIA H100 SXM5 80 GB: 700 W TDP, 1980 MHz boost (datasheet)."""

A100_SXM = GpuSpec(
    name="NVIDIA A100-SXM4-80GB",
    tdp_w=400.0,
    idle_w=55.0,
    max_sm_clock_mhz=1410.0,
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
        clock = s.throttle_clock if self.throttling else 1.0
        dyn = (s.tdp_w - s.idle_w) * util
        capped = False
        if dyn > 0 and s.idle_w + dyn * clock > self.power_limit_w:
            clock = max(0.05, (self.power_limit_w - s.idle_w) / dyn)
            capped = True
        return clock, capped

    def demand_w(self, util: float, clock: float) -> float:
        """Draw (W) at utilisation ``util`` and clock share ``clock``."""
        s = self.spec
        return s.idle_w + (s.tdp_w - s.idle_w) * min(1.0, max(0.0, util)) * clock

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
