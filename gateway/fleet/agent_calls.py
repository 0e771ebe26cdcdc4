"""The gateway's calls to an agent's GPU control endpoint (issue 21; the protocol is
:mod:`gateway.core.gpu_control`): read its GPUs, set or clear one setting on each of them.
Used by :class:`gateway.fleet.clock_driver.ClockDriver`; HTTP only, no decisions."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx


@dataclass(frozen=True, slots=True)
class AgentGpus:
    """What ``GET /control`` says of a backend's GPUs (those of ``gpu_indices``): their
    indices, the SM clock range all accept (MHz), the power-limit range all accept (W), and the
    caps the endpoint reports as set (the lowest locked top clock, MHz; the lowest power
    limit it set, W; None: none)."""

    indices: tuple[int, ...]
    min_mhz: float
    max_mhz: float
    min_w: float
    max_w: float
    locked_mhz: float | None
    limit_w: float | None


async def read_gpus(
    client: httpx.AsyncClient,
    base_url: str,
    headers: dict[str, str],
    timeout_s: float,
    wanted: Sequence[int] | None,
) -> AgentGpus:
    """``GET {base_url}/control`` (also the contact that keeps the agent from reverting).
    Raises ``httpx.HTTPError``, or ``ValueError`` for an answer that is not the protocol's
    (no GPU of ``wanted`` included)."""
    r = await client.get(f"{base_url}/control", headers=headers, timeout=timeout_s)
    r.raise_for_status()
    try:
        mine = [g for g in r.json()["gpus"] if wanted is None or g["index"] in wanted]
        if not mine:
            raise ValueError("none of the backend's GPUs is on this agent")
        lo_w = max(float(g["power_limit_range_w"][0]) for g in mine)
        hi_w = min(float(g["power_limit_range_w"][1]) for g in mine)
        locks = [float(g["locked_clocks_mhz"][1]) for g in mine if g.get("locked_clocks_mhz")]
        limits = [float(g["power_limit_w"]) for g in mine if g.get("power_limit_set")]
        hi_mhz = min(float(g["supported_clocks_mhz"][1]) for g in mine)
        return AgentGpus(
            tuple(int(g["index"]) for g in mine),
            min(hi_mhz, max(float(g["supported_clocks_mhz"][0]) for g in mine)),
            hi_mhz,
            lo_w,
            max(lo_w, hi_w),
            min(locks) if locks else None,
            min(limits) if limits else None,
        )
    except (KeyError, TypeError, IndexError) as e:
        raise ValueError(f"not a GPU control answer: {type(e).__name__}: {e}") from e


async def set_each(
    client: httpx.AsyncClient,
    base_url: str,
    headers: dict[str, str],
    gpus: Sequence[int],
    what: str,
    body: dict[str, Any] | None,
) -> None:
    """``POST`` ``body`` to (None: ``DELETE``) ``{base_url}/control/gpus/{i}/{what}`` for
    every GPU ``i`` (``what``: ``clocks`` or ``power-limit``). Raises ``httpx.HTTPError``
    (``HTTPStatusError`` for an answer that is not 2xx)."""
    for i in gpus:
        url = f"{base_url}/control/gpus/{i}/{what}"
        if body is None:
            r = await client.delete(url, headers=headers)
        else:
            r = await client.post(url, json=body, headers=headers)
        r.raise_for_status()
