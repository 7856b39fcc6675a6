"""What the coordinator measures about a route, as the window policy needs it.

Each reply carries every stage's compute time; the coordinator knows when it sent the window.
So per window: compute = Σ stage compute, network = (reply time − send time) − Σ compute −
Σ queueing. The coordinator's own time between a reply and the next window it sends (commit,
stream, propose, plan) is measured too when nothing else was in flight: every window pays it,
so the policy sees it as part of the fixed per-window cost. Compute is fitted as `a + b·tokens` by exponentially-forgetting least squares over
windows of different widths (prefill chunks pin the slope, decode windows the intercept).
"""

from __future__ import annotations

from dataclasses import dataclass

from meshd.spec.policy import LinkModel


@dataclass
class RouteCosts:
    """Running estimates for one route (seconds)."""

    stages: int
    forget: float = 0.9
    rtt_s: float | None = None
    # MTP heads' time per window (last stage), kept apart from the pass fit: plain decoding
    # does not pay it, speculation with MTP drafts does. None until a window measured it.
    mtp_s: float | None = None
    # The coordinator's time from a reply to the next window's send, with nothing in flight.
    local_s: float | None = None
    # Sufficient statistics of the weighted least-squares fit compute ≈ a + b·tokens.
    _sw: float = 0.0
    _sx: float = 0.0
    _sy: float = 0.0
    _sxx: float = 0.0
    _sxy: float = 0.0

    def observe(
        self,
        tokens: int,
        round_trip_s: float,
        compute_s: float,
        queue_s: float,
        mtp_s: float = 0.0,
    ) -> None:
        """Record one window: its width, wall-clock round trip and the stages' timings.

        `compute_s` includes `mtp_s`, the MTP heads' share, which is tracked on its own.
        """
        if mtp_s > 0:
            self.mtp_s = mtp_s if self.mtp_s is None else 0.8 * self.mtp_s + 0.2 * mtp_s
        network = max(0.0, round_trip_s - compute_s - queue_s)
        compute_s = max(0.0, compute_s - mtp_s)
        f = self.forget
        self._sw = f * self._sw + 1.0
        self._sx = f * self._sx + tokens
        self._sy = f * self._sy + compute_s
        self._sxx = f * self._sxx + tokens * tokens
        self._sxy = f * self._sxy + tokens * compute_s
        self.rtt_s = network if self.rtt_s is None else 0.8 * self.rtt_s + 0.2 * network

    def observe_local(self, seconds: float) -> None:
        """Record the coordinator's turnaround between a reply and the next window."""
        seconds = max(0.0, seconds)
        self.local_s = seconds if self.local_s is None else 0.8 * self.local_s + 0.2 * seconds

    def compute_fit(self) -> tuple[float, float]:
        """(fixed seconds per pass, seconds per token), summed over the stages."""
        if self._sw == 0:
            return 0.01, 0.001
        det = self._sw * self._sxx - self._sx * self._sx
        if det <= 1e-12 * max(1.0, self._sw * self._sxx):
            # One width seen so far: attribute it all to the per-pass cost.
            return self._sy / self._sw, 0.0
        slope = (self._sw * self._sxy - self._sx * self._sy) / det
        slope = max(0.0, slope)
        intercept = max(0.0, (self._sy - slope * self._sx) / self._sw)
        return intercept, slope

    def link_model(self, concurrent_sessions: int = 1) -> LinkModel:
        """The policy's view of this route now."""
        fixed, per_token = self.compute_fit()
        rtt = self.rtt_s if self.rtt_s is not None else 0.002 * self.stages
        return LinkModel(
            rtt_s=rtt + (self.local_s or 0.0),
            pass_fixed_s=fixed,
            pass_per_token_s=per_token,
            stages=self.stages,
            concurrent_sessions=concurrent_sessions,
            mtp_s=self.mtp_s if self.mtp_s is not None else 0.0,
            mtp_measured=self.mtp_s is not None,
        )
