"""Window width and pipeline depth from a cost model of the route and measured acceptance.

Notation (all times in seconds, compute summed over the route's stages):

    C(k)  = a + b·(k+1)                  one pass over a window of k drafts (+1 context token);
                                         C(0) is the measured one-token pass where known
    L     = sessions sharing the stages; a pass waits behind the others: C_L(k) = L·C(k)
    D     = the coordinator's draft model's seconds per drafted token (0 for other drafts)
    T(k)  = R + C_L(k) + D·k             one verify round trip (R: Σ hop RTT + protocol cost);
                                         a draft model drafts before the window leaves
    P_i   = α_1·…·α_i  (P_0 = 1)         chance that the first i drafts are all accepted
    E(k)  = Σ_{i=0..k} P_i               tokens committed per window (= (1−α^{k+1})/(1−α))
    p(k)  = P_{k+1}                      window fully accepted and the next window's assumed
                                         bonus token right: only then is a pipelined window used

Depth 1 spends T(k) per window. With d windows in flight the replies of a chain of fully
accepted windows come Δ = max(T/d, C_L/S, D·(k+1)) apart (S stages; the slowest stage bounds
the rate; a pipelined window's draft model guesses the bonus token before its k drafts); a
reject restarts the chain: T plus one stale pass still in progress per stage (C_L/S),
and, when other sessions share the stages, half of each of the d−1 stale windows' compute is
stolen from them. The expected time per window is then

    τ(k, d) = p·Δ + (1−p)·(T + C_L/S + (d−1)·C(k)/2·(L−1)/L)     (d > 1),   τ(k, 1) = T(k)

and the plan minimises τ/E over k in [window_min, window_max] and d in [1, max_depth] (d = 1
where a draft model drafts on the route's one node: nothing there overlaps its passes),
against the baseline τ(0, 1)/1 = T(0). It speculates only when that beats the baseline by
`min_speedup`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from meshd.speculative.config import SpecConfig

# Acceptance is kept below 1 so E and p stay finite-sample honest.
_ALPHA_CAP = 0.999


@dataclass(frozen=True, slots=True)
class LinkModel:
    """Measured costs of one verify window on the current route.

    `rtt_s` is the fixed cost per window (Σ hop round trips + protocol cost); one pass over
    w positions costs `pass_fixed_s + pass_per_token_s·w` of compute summed over all stages.
    `concurrent_sessions` counts the sessions sharing these stages, this one included.
    `mtp_s` is what the last stage's MTP heads cost per window (measured when `mtp_measured`);
    `draft_overhead_s` is the extra compute every speculative window pays and plain decoding
    does not — `mtp_s` for a strategy that drafts with the MTP heads, 0 otherwise.
    `plain_pass_s`, when measured, is the compute of a one-token pass (plain decoding), which
    need not lie on the line of the wider windows: a stage may have a one-token fast path.
    """

    rtt_s: float
    pass_fixed_s: float
    pass_per_token_s: float
    stages: int = 1
    concurrent_sessions: int = 1
    mtp_s: float = 0.0
    mtp_measured: bool = False
    draft_overhead_s: float = 0.0
    plain_pass_s: float | None = None
    # The coordinator's draft model: seconds per drafted token (measured), 0 for other drafts.
    draft_per_token_s: float = 0.0

    def compute_s(self, width: int) -> float:
        """Compute of one pass over a window of `width` drafts, summed over the stages."""
        if width <= 0 and self.plain_pass_s is not None:
            return self.plain_pass_s
        extra = self.draft_overhead_s if width > 0 else 0.0
        return self.pass_fixed_s + self.pass_per_token_s * (width + 1) + extra

    def with_mtp_drafts(self) -> LinkModel:
        """This link as a strategy drafting with the MTP heads sees it."""
        return replace(self, draft_overhead_s=self.mtp_s)

    def with_draft_cost(self, per_token_s: float) -> LinkModel:
        """This link as a strategy drafting with the coordinator's draft model sees it."""
        return replace(self, draft_per_token_s=max(0.0, per_token_s))

    def drafting_s(self, width: int) -> float:
        """The coordinator's time to draft `width` tokens before it can send the window."""
        return self.draft_per_token_s * max(0, width)

    def moved_to(self, new: LinkModel, fraction: float) -> bool:
        """Whether the route changed shape (stages, load, MTP cost first measured) or one of
        its costs moved by more than `fraction` on the way to `new`."""
        shape = (self.stages, self.concurrent_sessions, self.mtp_measured)
        if shape != (new.stages, new.concurrent_sessions, new.mtp_measured):
            return True
        pairs = (
            (self.rtt_s, new.rtt_s),
            (self.pass_fixed_s, new.pass_fixed_s),
            (self.pass_per_token_s, new.pass_per_token_s),
            (self.mtp_s, new.mtp_s),
            (self.compute_s(0), new.compute_s(0)),
        )
        return any(abs(b - a) > fraction * max(abs(a), 1e-6) for a, b in pairs)


# Used by `auto` until the coordinator has measured the route: a two-stage LAN.
DEFAULT_LINK = LinkModel(rtt_s=0.004, pass_fixed_s=0.010, pass_per_token_s=0.001, stages=2)


@dataclass(frozen=True, slots=True)
class PolicyInputs:
    """A route's costs and the per-position acceptance α_j (j = 1, 2, …; the last repeats)."""

    link: LinkModel
    acceptance: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class WindowPlan:
    """The chosen width (drafts per window, 0 = no speculation) and depth, and why."""

    width: int
    depth: int
    expected_tokens: float
    expected_s_per_token: float
    baseline_s_per_token: float
    reason: str


def _prefix_products(acceptance: Sequence[float], count: int) -> list[float]:
    """P_0..P_count, with α clamped to [0, cap] and its last value repeated."""
    alphas = [min(max(float(a), 0.0), _ALPHA_CAP) for a in acceptance] or [0.0]
    products = [1.0]
    for i in range(count):
        products.append(products[-1] * alphas[min(i, len(alphas) - 1)])
    return products


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


@dataclass(frozen=True, slots=True)
class Search:
    """What `choose` found before it words a plan: for weighing many candidates (`auto`)."""

    inputs: PolicyInputs
    best: tuple[float, int, int, float]  # seconds per token, width, depth, expected tokens
    baseline: float
    products: list[float]

    def s_per_token(self, config: SpecConfig) -> tuple[float, int]:
        """The plan's expected seconds per token and width (0: it would not speculate)."""
        per_token, k, _, _ = self.best
        if k > 0 and per_token * config.min_speedup > self.baseline:
            return self.baseline, 0
        return per_token, k


def with_copy_rate(found: Search, rate: float) -> Search:
    """A prompt lookup's search (`found`, over its acceptance per copy) as the strategy runs:
    a copy window at a share `rate` of window starts, a plain one (`baseline` a token) where
    it has nothing to copy. Seconds per token and tokens per window are the mixture's."""
    per_token, k, depth, expected = found.best
    if k == 0:
        return found
    rate = min(1.0, max(0.0, rate))
    tokens = rate * expected + (1.0 - rate)
    seconds = rate * per_token * expected + (1.0 - rate) * found.baseline
    return Search(
        found.inputs, (seconds / tokens, k, depth, tokens), found.baseline, found.products
    )


def choose(inputs: PolicyInputs, config: SpecConfig) -> WindowPlan:
    """The (width, depth) minimising expected seconds per committed token; pure and cheap."""
    return plan_of(search(inputs, config), config)


def plan_of(found: Search, config: SpecConfig) -> WindowPlan:
    """The `WindowPlan` (with its reason) of a `search`."""
    link = found.inputs.link
    best, baseline, products = found.best, found.baseline, found.products
    k_max = config.window_max_tokens
    rtt = max(0.0, link.rtt_s)
    load = max(1, link.concurrent_sessions)
    per_token, k, depth, expected = best
    alpha1 = products[1]
    if k > 0 and per_token * config.min_speedup > baseline:
        return WindowPlan(0, 1, 1.0, baseline, baseline, _no_gain(link, alpha1, best, baseline))
    if k == 0:
        why = (
            "window_max_tokens is 0"
            if k_max == 0 or config.window_min_tokens > k_max
            else f"no width beats {_ms(baseline)}/token without speculation"
        )
        reason = (
            f"no speculation: {why} (rtt {_ms(rtt)}, compute {_ms(load * link.compute_s(0))}"
            f"{_load_words(link)}, α₁={alpha1:.2f})"
        )
        return WindowPlan(0, 1, 1.0, baseline, baseline, reason)
    return WindowPlan(
        k, depth, expected, per_token, baseline, _why(link, alpha1, best, baseline, products)
    )


def search(inputs: PolicyInputs, config: SpecConfig) -> Search:
    """Every (width, depth) of the config against the baseline; the best one."""
    link = inputs.link
    load = max(1, link.concurrent_sessions)
    stages = max(1, link.stages)
    rtt = max(0.0, link.rtt_s)
    k_max = config.window_max_tokens
    products = _prefix_products(inputs.acceptance, k_max + 1)
    baseline = rtt + load * link.compute_s(0)
    best = (baseline, 0, 1, 1.0)
    stolen = (load - 1) / load / 2.0
    # A draft model on one node drafts on the cores that verify, and its passes hold the
    # coordinator's loop, so no window can be verified while the next is drafted there.
    depths = 1 if link.draft_per_token_s > 0 and stages == 1 else config.max_pipeline_depth
    expected = 1.0
    for k in range(1, k_max + 1):
        expected += products[k]
        if k < config.window_min_tokens:
            continue
        compute = link.compute_s(k)
        loaded = load * compute
        drafting = link.drafting_s(k)
        round_trip = rtt + loaded + drafting
        full = products[k + 1]
        for depth in range(1, depths + 1):
            if depth == 1:
                per_window = round_trip
            else:
                # The coordinator drafts one window at a time, and a pipelined window's
                # drafter guesses the bonus token before its k drafts: no faster than
                # D·(k+1) apart.
                spacing = max(round_trip / depth, loaded / stages, link.drafting_s(k + 1))
                restart = round_trip + loaded / stages + (depth - 1) * compute * stolen
                per_window = full * spacing + (1.0 - full) * restart
            per_token = per_window / expected
            if per_token < best[0] * (1.0 - 1e-9):
                best = (per_token, k, depth, expected)
    return Search(inputs, best, baseline, products)


def _load_words(link: LinkModel) -> str:
    n = link.concurrent_sessions
    return f" ({n} sessions share the stages)" if n > 1 else ""


def _why(
    link: LinkModel,
    alpha1: float,
    best: tuple[float, int, int, float],
    baseline: float,
    products: list[float],
) -> str:
    per_token, k, depth, expected = best
    rtt, compute = link.rtt_s, link.concurrent_sessions * link.compute_s(k)
    compute_words = f"compute {_ms(compute)}{_load_words(link)}"
    if rtt >= compute:
        balance = f"rtt {_ms(rtt)} dominates {compute_words}"
    else:
        balance = f"{compute_words} dominates rtt {_ms(rtt)}"
    chain = f", whole-window accept {products[k + 1]:.2f}" if depth > 1 else ""
    return (
        f"{balance}; α₁={alpha1:.2f} → k={k} commits {expected:.2f} "
        f"tok/window, depth {depth}{chain}; {_ms(per_token)}/token vs {_ms(baseline)} without"
    )


def _no_gain(
    link: LinkModel, alpha1: float, best: tuple[float, int, int, float], baseline: float
) -> str:
    per_token, k, depth, _ = best
    return (
        f"no speculation: best k={k} depth {depth} gives {_ms(per_token)}/token vs "
        f"{_ms(baseline)} without, below the min_speedup margin (rtt {_ms(link.rtt_s)}, "
        f"compute {_ms(link.concurrent_sessions * link.compute_s(k))}{_load_words(link)}, "
        f"α₁={alpha1:.2f})"
    )


class AcceptanceTracker:
    """EWMA of the acceptance at each draft position, from verdicts (or shadow scoring).

    α_j estimates P(draft j accepted | drafts 1..j−1 accepted). A verdict that accepted `a` of
    `n` drafts is a success at positions 1..a and, when a < n, a failure at position a+1;
    deeper positions were not tested and keep their estimate.
    """

    def __init__(self, positions: int, ewma_alpha: float, prior: float) -> None:
        if positions < 1:
            raise ValueError(f"positions must be >= 1, got {positions}")
        self.ewma_alpha = ewma_alpha
        self._alpha = [prior] * positions
        self.samples = 0
        # While fewer than this many windows were folded in since `copy`, the newest weighs
        # 1/(folded + 2) where that is more than `ewma_alpha`: the estimate copied counts as
        # one window, not as the EWMA's whole memory.
        self._warm_left = 0
        self._warm_seen = 0

    def update(self, drafted: int, accepted: int) -> None:
        """Fold in one window: `accepted` of `drafted` drafts were accepted."""
        if not 0 <= accepted <= drafted:
            raise ValueError(f"need 0 <= accepted <= drafted, got {accepted}/{drafted}")
        if drafted:
            self.fold(self.open_window(), accepted, rejected=accepted < drafted)

    def open_window(self) -> float:
        """Count one more window and return the weight its verdict folds in with (`fold`):
        `ewma_alpha`, or more for the first windows after a warm `copy`."""
        w = self.ewma_alpha
        if self._warm_left > 0:
            w = max(w, 1.0 / (self._warm_seen + 2))
            self._warm_seen += 1
            self._warm_left -= 1
        self.samples += 1
        return w

    def fold(self, weight: float, accepted: int, *, rejected: bool, since: int = 0) -> None:
        """Fold in (part of) one window's verdict at `weight` (from `open_window`): drafts
        `since`+1..`accepted` accepted, and draft `accepted`+1 rejected when `rejected`.
        A window whose first drafts are known right before the rest is judged (a shadow draft
        while the log grows) folds in its positions as they become known, `since` being those
        folded already; each position is folded once, so the result is the whole verdict's."""
        alphas = self._alpha
        for j in range(since, min(accepted, len(alphas))):
            alphas[j] += weight * (1.0 - alphas[j])
        if rejected and accepted < len(alphas):
            alphas[accepted] -= weight * alphas[accepted]

    def per_position(self) -> tuple[float, ...]:
        """(α_1, α_2, …) for `PolicyInputs.acceptance`."""
        return tuple(self._alpha)

    def copy(self, ewma_alpha: float | None = None, *, warm: bool = False) -> AcceptanceTracker:
        """An independent tracker starting from this one's estimates (and weight, unless
        `ewma_alpha` is given). `warm`: its first windows weigh 1/2, 1/3, … while that is
        more than the weight, so its own evidence outweighs the copied estimate quickly."""
        weight = self.ewma_alpha if ewma_alpha is None else ewma_alpha
        twin = AcceptanceTracker(len(self._alpha), weight, 0.0)
        twin._alpha = list(self._alpha)
        twin.samples = self.samples
        if warm and weight > 0:
            twin._warm_left = max(0, math.ceil(1.0 / weight) - 2)
        return twin
