"""Session leases on a stage host (sans-IO: every call takes `now`, nothing sleeps).

A session's KV is held only while its coordinator shows it is alive: each window, rollback or
keep-alive for the session renews its lease to `now + lease_s`; a session whose lease lapses
is freed by the host, so a coordinator that crashed (or a lane that died without a word)
never leaves KV behind for longer than `lease_s`. The driver sleeps until `next_deadline()`
and frees what `expired(now)` returns.

Deadlines live in a dict: the host holds at most `max_sessions` (64) sessions, so scanning
them when the timer fires costs less than keeping a heap in step with every renewal.
"""

from __future__ import annotations

import math

# A stage frees a session after this long without a window or keep-alive from its coordinator
# (the daemon's `session_lease_s`; coordinators renew their sessions every third of it).
SESSION_LEASE_S = 30.0


class Leases:
    """Lease deadlines by session id."""

    def __init__(self, lease_s: float) -> None:
        if not 0 < lease_s < math.inf:
            raise ValueError(f"lease_s must be a positive number of seconds, got {lease_s}")
        self.lease_s = lease_s
        self._deadlines: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._deadlines)

    def __contains__(self, session: object) -> bool:
        return session in self._deadlines

    def touch(self, session: str, now: float) -> None:
        """Start or renew `session`'s lease: it lapses at `now + lease_s` unless renewed."""
        self._deadlines[session] = max(self._deadlines.get(session, -math.inf), now + self.lease_s)

    def drop(self, session: str) -> None:
        """Forget `session` (closed explicitly, or freed for another reason)."""
        self._deadlines.pop(session, None)

    def deadline(self, session: str) -> float | None:
        """When `session`'s lease lapses (None: no lease)."""
        return self._deadlines.get(session)

    def expired(self, now: float) -> list[str]:
        """Sessions whose lease lapsed by `now`, oldest deadline first; they are forgotten."""
        lapsed = sorted((d, s) for s, d in self._deadlines.items() if d <= now)
        for _, session in lapsed:
            del self._deadlines[session]
        return [session for _, session in lapsed]

    def next_deadline(self) -> float | None:
        """The earliest deadline (None: no session holds a lease)."""
        return min(self._deadlines.values(), default=None)
