"""`ThreadGovernor`: a stage's choice between its threads and one, made from measured passes."""

from __future__ import annotations

import collections
import logging
import statistics
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


# Passes a choice keeps its recent times for (their median is what is compared).
GOVERNOR_SAMPLES = 5
# Passes run with the other choice each time it is probed.
GOVERNOR_PROBE_PASSES = 3
# Passes between probes: the first gap, multiplied by GOVERNOR_BACKOFF each time a probe
# confirms the choice (up to the last), back to the first after a switch: probes stay a small
# share of an answer's time, and a stage that starts on busy cores leaves them early.
GOVERNOR_GAPS = (8, 1024)
GOVERNOR_BACKOFF = 4
# The other choice must be this much faster to be switched to (noise is not a reason).
GOVERNOR_MARGIN = 0.05
# A probe stops after a pass this many times slower than the current choice's median: on
# busy cores spinning workers wait for descheduled partners, and further such passes cost
# more than the probing saves (figures: docs/model-runtime.md, "Threads").
GOVERNOR_ABORT = 3.0


def _bucket(rows: int) -> int:
    """Passes are compared with passes of like size: one row (decode), a window, a prefill."""
    return 1 if rows == 1 else 16 if rows <= 16 else 17


@dataclass
class _Bucket:
    current: int
    gap: int = GOVERNOR_GAPS[0]
    since_probe: int = 0
    probing: int = 0
    times: dict[int, collections.deque[float]] = field(default_factory=dict)


class ThreadGovernor:
    """Picks, for each pass, `threads` or 1 intra-op thread, whichever its passes run faster.

    More threads pay only while the other cores are free: OpenMP workers that spin briefly
    between parallel regions (`GOMP_SPINCOUNT`, set by `meshd/__init__.py`) speed decode on a
    quiet machine and slow it on a busy one (docs/model-runtime.md, "Threads"). Which case
    holds changes while a daemon runs, so the stage measures: it keeps its current choice,
    every so often runs a few passes with the other, and switches when the other's median is
    clearly faster. Probes back off (growing gaps) while they confirm the choice.

    Sans-IO: `choose(rows)` says how many threads the next pass of `rows` rows should use and
    `record(rows, threads, seconds)` reports what it took; the stage does the timing.
    """

    def __init__(self, threads: int) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.threads = threads
        self._buckets: dict[int, _Bucket] = {}

    def choose(self, rows: int) -> int:
        """Threads for the next pass of `rows` rows."""
        if self.threads == 1:
            return 1
        bucket = self._buckets.setdefault(_bucket(rows), _Bucket(self.threads))
        return self._other(bucket.current) if bucket.probing else bucket.current

    def record(self, rows: int, threads: int, seconds: float) -> None:
        """A pass of `rows` rows ran on `threads` threads in `seconds`."""
        if self.threads == 1:
            return
        bucket = self._buckets.setdefault(_bucket(rows), _Bucket(self.threads))
        # A prefill's time grows with its rows; decode and window passes stream the weights
        # once whatever their rows, so their time per pass is what compares.
        cost = seconds / rows if rows > 16 else seconds
        times = bucket.times.setdefault(threads, collections.deque(maxlen=GOVERNOR_SAMPLES))
        times.append(cost)
        if bucket.probing:
            bucket.probing -= 1
            mine = bucket.times.get(bucket.current)
            if mine and cost > GOVERNOR_ABORT * statistics.median(mine):
                bucket.probing = 0  # far slower: no more passes on it this time
            if not bucket.probing:
                self._decide(bucket)
            return
        bucket.since_probe += 1
        if bucket.since_probe >= bucket.gap:
            bucket.since_probe = 0
            bucket.probing = GOVERNOR_PROBE_PASSES

    def current(self, rows: int = 1) -> int:
        """The choice passes of `rows` rows run with outside probes (for reports)."""
        bucket = self._buckets.get(_bucket(rows))
        return self.threads if bucket is None else bucket.current

    def _other(self, threads: int) -> int:
        return 1 if threads == self.threads else self.threads

    def _decide(self, bucket: _Bucket) -> None:
        other = self._other(bucket.current)
        mine, theirs = bucket.times.get(bucket.current), bucket.times.get(other)
        if not mine or not theirs:
            return
        if statistics.median(theirs) < statistics.median(mine) * (1 - GOVERNOR_MARGIN):
            log.debug("threads: %d -> %d (pass medians)", bucket.current, other)
            bucket.current, bucket.gap = other, GOVERNOR_GAPS[0]
        else:
            bucket.gap = min(bucket.gap * GOVERNOR_BACKOFF, GOVERNOR_GAPS[1])
