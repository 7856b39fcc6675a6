"""What the coordinator measures about a route, as the window policy needs it.

Each reply carries every stage's compute time; the coordinator knows when it sent the window.
So per window: compute = Σ stage compute, network = (reply time − send time) − Σ compute −
Σ queueing. The coordinator's own time between a reply and the next window it sends (commit,
stream, propose, plan) is measured too when nothing else was in flight: every window pays it,
so the policy sees it as part of the fixed per-window cost.

Compute is kept per window size (an EWMA for each count of tokens a window carried), not as
one running line: a stage's one-token pass can take a path of its own (the CPU stages reuse
scratch buffers for it), so a two-token window may cost far more than a one-token one while
each further token adds little (figures and the script that measures them:
docs/speculative.md, "Where the costs come from"). So the plain-decoding baseline is the
measured one-token cost itself, and speculative windows come from a line fitted over the
sizes >= 2 seen (each size weighted by how often it was seen, at most `_BUCKET_WEIGHT_CAP`).
Sizes keep their estimate while a request decodes plainly: a fit that forgets old windows lets
a stretch of one-token windows drown what it knew of wider ones, then extrapolates a wrong
slope from the remnant, and speculation looks free or ruinous by what the last request did.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from meshd.speculative.policy import LinkModel

# Weight of the newest window in its size's compute estimate.
_BUCKET_EWMA = 0.2
# A size seen this often counts fully in the line fit; rarer sizes count by their count.
_BUCKET_WEIGHT_CAP = 8


@dataclass
class _Bucket:
    """Compute of windows of one size: EWMA seconds and how many were seen."""

    seconds: float
    count: int = 1


@dataclass
class RouteCosts:
    """Running estimates for one route (seconds)."""

    stages: int
    rtt_s: float | None = None
    # MTP heads' time per window (last stage), kept apart from the pass fit: plain decoding
    # does not pay it, speculation with MTP drafts does. None until a window measured it.
    mtp_s: float | None = None
    # The coordinator's time from a reply to the next window's send, with nothing in flight.
    local_s: float | None = None
    # Compute by window size (tokens carried: the context token plus the drafts).
    _sizes: dict[int, _Bucket] = field(default_factory=dict)

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
        bucket = self._sizes.get(tokens)
        if bucket is None:
            self._sizes[tokens] = _Bucket(compute_s)
        else:
            bucket.seconds += _BUCKET_EWMA * (compute_s - bucket.seconds)
            bucket.count += 1
        self.rtt_s = network if self.rtt_s is None else 0.8 * self.rtt_s + 0.2 * network

    def observe_local(self, seconds: float) -> None:
        """Record the coordinator's turnaround between a reply and the next window."""
        seconds = max(0.0, seconds)
        self.local_s = seconds if self.local_s is None else 0.8 * self.local_s + 0.2 * seconds

    def plain_pass_s(self) -> float | None:
        """Compute of a one-token window (plain decoding), once one was measured."""
        bucket = self._sizes.get(1)
        return bucket.seconds if bucket is not None else None

    def compute_fit(self) -> tuple[float, float]:
        """(fixed seconds per pass, seconds per token) of speculative windows, summed over the
        stages: a line over the window sizes ≥ 2 seen (over every size while fewer than two
        of those were seen; flat while only one size was)."""
        if not self._sizes:
            return 0.01, 0.001
        wide = {n: b for n, b in self._sizes.items() if n >= 2}
        points = wide if len(wide) >= 2 else self._sizes
        sw = sx = sy = sxx = sxy = 0.0
        for tokens, bucket in points.items():
            w = float(min(bucket.count, _BUCKET_WEIGHT_CAP))
            sw += w
            sx += w * tokens
            sy += w * bucket.seconds
            sxx += w * tokens * tokens
            sxy += w * tokens * bucket.seconds
        det = sw * sxx - sx * sx
        if len(points) < 2 or det <= 1e-12 * max(1.0, sw * sxx):
            return sy / sw, 0.0  # one size: all of it per pass
        slope = max(0.0, (sw * sxy - sx * sy) / det)
        intercept = max(0.0, (sy - slope * sx) / sw)
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
            plain_pass_s=self.plain_pass_s(),
        )
