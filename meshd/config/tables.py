"""The tables of `NodeConfig` that have no home in a component: NAT dialing and the daemon's
own planner defaults.

Every table of the tree is a msgspec Struct validated one way: `__post_init__` raises a
ValueError whose message starts with the field's name, and the loader
(`meshd.config.sources`) adds the table and where the value was set.
"""

from __future__ import annotations

import math

import msgspec

from meshd.plan.inputs import PlannerConfig


class NatDialConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How the daemon falls back to NAT traversal when a direct dial fails (the `[nat]`
    table; the punch and relay limits are `[punch]`)."""

    # After a peer needed an introduction, skip dialing its advertised address this long.
    direct_retry_s: float = 60.0
    # The larger-keyed side of a pair waits this long for the other's lane before punching.
    yield_s: float = 2.0
    # Introducers tried per dial (each costs up to a punch plus a handshake when it fails).
    max_introducers: int = 3

    def __post_init__(self) -> None:
        if not 0 < self.direct_retry_s < math.inf:
            raise ValueError("direct_retry_s must be a positive number of seconds")
        if not 0 <= self.yield_s < math.inf:
            raise ValueError("yield_s must be >= 0 seconds")
        if self.max_introducers < 1:
            raise ValueError("max_introducers must be >= 1")


# The daemon's planner differs from `PlannerConfig`'s defaults (which simulations and
# benchmarks use) in two rules:
# - a pair not measured yet is assumed 10 ms apart (the first plan is made before any pair is
#   measured);
# - plans are sticky (reuse tolerance infinite): a membership change moves only the stages it
#   took away. Predictions of a small model on a busy machine swing by more than 80 % with
#   round-trip noise, and every move reloads a stage and fails the sessions on it.
DAEMON_PLANNER = PlannerConfig(unknown_rtt_s=0.01, reuse_tolerance_fraction=math.inf)
