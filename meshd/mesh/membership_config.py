"""Membership tuning: every timer, fan-out and bound, with the formulas that scale them with n.

Defaults aim at two goals at once: a dead node known dead everywhere within a few seconds in
a home or lab mesh, and under 10 kB/s of gossip per node in a 1000-node mesh. See
docs/membership.md for the reasoning and the measured figures.
"""

from __future__ import annotations

import math

import msgspec


class MembershipConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Behaviour of the membership state machine (the daemon's `[membership]` table).

    Validated on construction: a ValueError whose message starts with the field.
    """

    # SWIM probing: one member per probe_interval_s; no Ack within probe_timeout_s → ask
    # indirect_probes others to probe it; still nothing by the end of the interval → suspect.
    probe_interval_s: float = 1.0
    probe_timeout_s: float = 0.4
    indirect_probes: int = 3
    # After a lane to a member dies, indirect probes get this long before it is declared dead.
    lane_dead_probe_s: float = 0.5
    # A member whose lane cannot be opened but whom relays reach is left to them (no direct
    # probes, gossip or lane attempts from this node) for this long.
    detour_hold_s: float = 30.0
    # Piggyback dissemination: every gossip_interval_s, when something changed, to
    # gossip_fanout random members; each change goes out retransmit_mult·⌈log10(n+1)⌉ times.
    gossip_interval_s: float = 0.2
    gossip_fanout: int = 3
    retransmit_mult: int = 4
    max_piggyback_updates: int = 16
    # Lifeguard suspicion: the timeout starts at suspicion_max_mult × base and falls to base as
    # up to suspicion_confirmations others independently suspect too, where
    # base = max(suspicion_min_s, suspicion_mult · log10(n+1) · probe_interval_s).
    suspicion_min_s: float = 1.0
    suspicion_mult: float = 1.0
    suspicion_max_mult: float = 3.0
    suspicion_confirmations: int = 3
    # Dead and left members stay in the view (so stale gossip cannot resurrect them) this long.
    dead_retention_s: float = 60.0
    # Push-pull anti-entropy with one random member, one page of the id space per exchange,
    # every max(sync_min_interval_s, sync_interval_per_member_s · n).
    sync_min_interval_s: float = 10.0
    sync_interval_per_member_s: float = 0.1
    sync_page_entries: int = 256
    # A join (or a sync with an unknown peer) pages through the whole view; an unanswered
    # page is resent after sync_retry_s, at most sync_retries times.
    sync_retry_s: float = 1.0
    sync_retries: int = 5
    # A record asked for with Want and not received is asked for again after this long.
    want_timeout_s: float = 1.0
    # The own capacity record is re-signed at most every
    # max(capacity_min_interval_s, capacity_interval_per_member_s · n), and only on change.
    capacity_min_interval_s: float = 1.0
    capacity_interval_per_member_s: float = 0.25
    # A measured RTT counts as changed (worth a new record) when it moved by more than this
    # fraction of the published value and by more than rtt_change_min_s.
    rtt_change_fraction: float = 0.25
    rtt_change_min_s: float = 0.002
    max_rtt_entries: int = 32
    max_members: int = 4096
    # Largest gossip message this node builds (the wire's hard limit is 64 KiB).
    max_message_bytes: int = 60_000

    def __post_init__(self) -> None:
        for name in self.__struct_fields__:
            value = getattr(self, name)
            if isinstance(value, float) and not (0.0 < value < math.inf):
                raise ValueError(f"{name} must be a positive finite number, got {value}")
            if isinstance(value, int) and value < 0:
                raise ValueError(f"{name} must not be negative, got {value}")
        if self.probe_timeout_s >= self.probe_interval_s:
            raise ValueError("probe_timeout_s must be below probe_interval_s")
        if self.suspicion_max_mult < 1.0:
            raise ValueError("suspicion_max_mult must be at least 1")
        for name in ("gossip_fanout", "retransmit_mult", "sync_page_entries", "max_members"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.sync_page_entries > 256:
            raise ValueError("sync_page_entries must be at most 256 (a Want's limit)")
        if not 4096 <= self.max_message_bytes <= 64 * 1024 - 1024:
            raise ValueError("max_message_bytes must be in 4096..64512")

    def retransmit_limit(self, n: int) -> int:
        """How many times one change is piggybacked, for a mesh of n members."""
        return self.retransmit_mult * max(1, math.ceil(math.log10(n + 1)))

    def suspicion_bounds_s(self, n: int) -> tuple[float, float]:
        """(shortest, longest) suspicion timeout for a mesh of n members."""
        base = max(
            self.suspicion_min_s, self.suspicion_mult * math.log10(n + 1) * self.probe_interval_s
        )
        return base, base * self.suspicion_max_mult

    def sync_interval_s(self, n: int) -> float:
        """Seconds between anti-entropy exchanges for a mesh of n members."""
        return max(self.sync_min_interval_s, self.sync_interval_per_member_s * n)

    def capacity_interval_s(self, n: int) -> float:
        """Least seconds between two versions of the own capacity record."""
        return max(self.capacity_min_interval_s, self.capacity_interval_per_member_s * n)
