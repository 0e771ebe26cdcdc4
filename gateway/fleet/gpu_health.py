"""GPU health breaker: Xid and double-bit ECC errors (pure: times come with the samples).

Rules (issue 5, from seed 000): 3 or more *new* Xid errors within an hour, or any *new*
double-bit (uncorrectable) ECC error, make the backend ``unhealthy`` (reason ``gpu_xid`` /
``gpu_ecc``); the controller then runs the long cycle's restart hook.

"New" is judged between successive samples of one backend
(:class:`gateway.routing.thermal.GpuSample`):

* Xid: DCGM's ``DCGM_FI_DEV_XID_ERRORS`` is a gauge holding the code of the *last* Xid of a
  GPU, not a count. A GPU whose value changes to a non-zero code has had a new Xid. (Two
  Xids with the same code in a row on one GPU between two scrapes read as one, a limit of the
  gauge; an exporter that serves a rising count instead is counted once per change, so at
  least as often as it rises between scrapes.)
* ECC: ``DCGM_FI_DEV_ECC_DBE_VOL_TOTAL`` is a counter; any rise is a new error.

The first sample is the baseline (errors from before the gateway looked are not new), and
so is the first after the GPU count changes or a counter goes down (a reset, e.g. after a
restart). After a trip the Xid window starts empty.
"""

from __future__ import annotations

from collections import deque

from gateway.core.samples import GpuSample

GPU_XID = "gpu_xid"
GPU_ECC = "gpu_ecc"


class GpuHealth:
    """Counts new Xid and ECC DBE errors of one backend; :meth:`observe` says when to trip.

    ``xid_threshold`` new Xids within ``xid_window_s`` seconds trip it (3 in 3600 s).
    """

    def __init__(self, xid_threshold: int = 3, xid_window_s: float = 3600.0) -> None:
        self.xid_threshold = xid_threshold
        self.xid_window_s = xid_window_s
        self._prev: GpuSample | None = None
        self._xids: deque[float] = deque()
        self.total_xids = 0  # new Xids seen since start
        self.total_ecc = 0.0  # new DBE errors seen since start

    def recent_xids(self, now: float) -> int:
        """New Xids within the window ending at ``now`` (monotonic seconds)."""
        while self._xids and self._xids[0] <= now - self.xid_window_s:
            self._xids.popleft()
        return len(self._xids)

    def observe(self, sample: GpuSample) -> str | None:
        """Take one sample (in time order); return ``"gpu_ecc"`` or ``"gpu_xid"`` when the
        backend must be taken out now, else None."""
        prev, self._prev = self._prev, sample
        if prev is None:
            return None
        reason = None
        if (
            sample.ecc_dbe_total is not None
            and prev.ecc_dbe_total is not None
            and sample.ecc_dbe_total > prev.ecc_dbe_total
        ):
            self.total_ecc += sample.ecc_dbe_total - prev.ecc_dbe_total
            reason = GPU_ECC
        if len(sample.xid_last) == len(prev.xid_last):
            new = sum(
                1
                for code, before in zip(sample.xid_last, prev.xid_last, strict=True)
                if code != 0 and code != before
            )
            for _ in range(new):
                self._xids.append(sample.at)
            self.total_xids += new
            if reason is None and new and self.recent_xids(sample.at) >= self.xid_threshold:
                reason = GPU_XID
        if reason is not None:
            self._xids.clear()
        return reason
