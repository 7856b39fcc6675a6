"""Numbers that tune the daemon's composition (timers, retries); units in the names.

The timers an operator may need (recovery, suspicion hold, drain, membership) are
`NodeConfig` keys instead (docs/configuration.md); these are the internal ones.
"""

from __future__ import annotations

import math

import msgspec

from meshd.node.lanes import NatDialConfig


class DaemonTuning(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How the daemon paces re-planning, bootstrap, retries and reporting."""

    # Membership changes arriving within this window cause one re-plan, not many.
    replan_debounce_s: float = 0.2
    # `--join` bootstrap: first retry after this long, doubling up to the maximum.
    join_retry_initial_s: float = 0.5
    join_retry_max_s: float = 8.0
    # Pause between attempts while the planned stages are not ready yet.
    retry_interval_s: float = 0.1
    # Single-token passes timed at start-up to measure compute per layer and token.
    warmup_passes: int = 6
    # Lane RTTs are fed to membership this often.
    rtt_report_interval_s: float = 1.0
    # Largest context (prompt + completion) the planner sizes KV for; 0 = the model's own.
    context_tokens: int = 0
    # The planner's guess for a pair not measured yet (the first plan is made before any pair
    # is measured).
    planner_unknown_rtt_s: float = 0.01
    # How much slower a plan that keeps the loaded stages may be before they move. Infinite:
    # plans are sticky, a membership change moves only the stages it took away. A finite
    # share lets predicted gains move stages, but predictions of a small model on a busy
    # machine swing by more than 80 % with round-trip noise (measured on the test mesh), and
    # every move reloads a stage and fails the sessions on it.
    planner_reuse_tolerance_fraction: float = math.inf
    # When a direct dial fails: introductions, hole punching and relaying (with their limits).
    nat: NatDialConfig = NatDialConfig()

    def __post_init__(self) -> None:
        for name in self.__struct_fields__:
            value = getattr(self, name)
            unbounded = name == "planner_reuse_tolerance_fraction" and value == math.inf
            if isinstance(value, float) and not (0.0 < value < math.inf or unbounded):
                raise ValueError(f"{name} must be a positive finite number, got {value}")
        if self.warmup_passes < 1 or self.context_tokens < 0:
            raise ValueError("warmup_passes must be >= 1, context_tokens >= 0")
