"""Typed, versioned telemetry of speculative decoding for one request.

One acceptance definition everywhere: accepted draft tokens / drafted tokens (the bonus token
each window commits is neither). Fields are only ever added; a change of meaning bumps
`version`. Rates are None when their denominator is zero, never a made-up 0.
"""

from __future__ import annotations

import msgspec

from meshd.speculative.policy import WindowPlan

TELEMETRY_VERSION = 1


class ProposerCounts(msgspec.Struct, frozen=True, kw_only=True):
    """Drafts of one strategy in this request: `acceptance` = accepted / drafted."""

    drafted: int
    accepted: int
    acceptance: float | None


class SpecTelemetry(msgspec.Struct, frozen=True, kw_only=True):
    """A snapshot of one request's speculation (times in seconds, rates per second)."""

    version: int = TELEMETRY_VERSION
    strategy: str
    active_strategy: str
    proposers: dict[str, ProposerCounts]
    drafted_tokens: int
    accepted_tokens: int
    acceptance: float | None
    windows_sent: int
    windows_stale: int
    verify_round_trips: int
    tokens_committed: int
    tokens_per_round_trip: float | None
    network_s: float
    compute_s: float
    prompt_tokens: int
    prompt_s: float
    prompt_tok_per_s: float | None
    decode_tokens: int
    decode_s: float
    decode_tok_per_s: float | None
    policy_decisions: int
    last_width: int
    last_depth: int
    last_policy_reason: str
    last_strategy_reason: str
    # The coordinator's draft model (`draft`, `draft-ngram`, `auto` choosing it): seconds spent
    # drafting the windows sent, the tokens drafted there, and seconds per drafted token.
    # Its acceptance is `proposers["draft"]` (or "draft-ngram").
    draft_s: float = 0.0
    draft_model_tokens: int = 0
    draft_s_per_token: float | None = None
    # Of those tokens, the ones recalled from passes run while the previous window was out
    # (`spec.draft_ahead_tokens`): no window waited for them.
    draft_recalled_tokens: int = 0


def _rate(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator > 0 else None


class Recorder:
    """Cheap counters the coordinator bumps as a request runs; `snapshot()` freezes them.

    Call `window_sent` for every verify window sent, `window_stale` for each one dropped
    because an earlier window was rejected, and `verdict` for each reply used (decode windows;
    the prefill is reported with `prefill`).
    """

    def __init__(self, strategy: str) -> None:
        self.strategy = strategy
        self.active_strategy = strategy
        self._per_proposer: dict[str, list[int]] = {}
        self.windows_sent = 0
        self.windows_stale = 0
        self.verify_round_trips = 0
        self.tokens_committed = 0
        self.network_s = 0.0
        self.compute_s = 0.0
        self.prompt_tokens = 0
        self.prompt_s = 0.0
        self.decode_s = 0.0
        self.policy_decisions = 0
        self.last_width = 0
        self.last_depth = 1
        self.last_policy_reason = ""
        self.last_strategy_reason = ""
        self.draft_s = 0.0
        self.draft_model_tokens = 0
        self.draft_recalled_tokens = 0

    def draft(self, seconds: float, tokens: int, recalled: int = 0) -> None:
        """The draft model spent `seconds` drafting `tokens` tokens for a window, `recalled`
        of them from passes run ahead."""
        self.draft_s += seconds
        self.draft_model_tokens += tokens
        self.draft_recalled_tokens += recalled

    def window_sent(self, count: int = 1) -> None:
        """`count` verify windows left the coordinator."""
        self.windows_sent += count

    def window_stale(self, count: int = 1) -> None:
        """`count` windows were dropped: sent on an assumption a reject disproved."""
        self.windows_stale += count

    def verdict(
        self,
        proposer: str,
        drafted: int,
        accepted: int,
        committed: int,
        *,
        network_s: float = 0.0,
        compute_s: float = 0.0,
    ) -> None:
        """One verify reply used: `accepted` of `drafted` drafts by `proposer`, `committed`
        tokens added to the log, and the reply's network and compute time."""
        if not 0 <= accepted <= drafted:
            raise ValueError(f"need 0 <= accepted <= drafted, got {accepted}/{drafted}")
        counts = self._per_proposer.get(proposer)
        if counts is None:
            counts = self._per_proposer[proposer] = [0, 0]
        counts[0] += drafted
        counts[1] += accepted
        self.verify_round_trips += 1
        self.tokens_committed += committed
        self.network_s += network_s
        self.compute_s += compute_s

    def prefill(self, tokens: int, seconds: float) -> None:
        """A prompt chunk of `tokens` was prefilled in `seconds` (wall time)."""
        self.prompt_tokens += tokens
        self.prompt_s += seconds

    def decode_elapsed(self, seconds: float) -> None:
        """Wall time of the decode phase so far (first window sent → latest commit)."""
        self.decode_s = seconds

    def policy(
        self, plan: WindowPlan, active_strategy: str = "", strategy_reason: str = ""
    ) -> None:
        """A window plan was chosen (and, under `auto`, which strategy and why)."""
        self.policy_decisions += 1
        self.last_width = plan.width
        self.last_depth = plan.depth
        self.last_policy_reason = plan.reason
        if active_strategy:
            self.active_strategy = active_strategy
        if strategy_reason:
            self.last_strategy_reason = strategy_reason

    def snapshot(self) -> SpecTelemetry:
        """The figures so far, with the derived rates."""
        proposers = {
            name: ProposerCounts(drafted=d, accepted=a, acceptance=_rate(a, d))
            for name, (d, a) in sorted(self._per_proposer.items())
        }
        drafted = sum(c.drafted for c in proposers.values())
        accepted = sum(c.accepted for c in proposers.values())
        return SpecTelemetry(
            strategy=self.strategy,
            active_strategy=self.active_strategy,
            proposers=proposers,
            drafted_tokens=drafted,
            accepted_tokens=accepted,
            acceptance=_rate(accepted, drafted),
            windows_sent=self.windows_sent,
            windows_stale=self.windows_stale,
            verify_round_trips=self.verify_round_trips,
            tokens_committed=self.tokens_committed,
            tokens_per_round_trip=_rate(self.tokens_committed, self.verify_round_trips),
            network_s=self.network_s,
            compute_s=self.compute_s,
            prompt_tokens=self.prompt_tokens,
            prompt_s=self.prompt_s,
            prompt_tok_per_s=_rate(self.prompt_tokens, self.prompt_s),
            decode_tokens=self.tokens_committed,
            decode_s=self.decode_s,
            decode_tok_per_s=_rate(self.tokens_committed, self.decode_s),
            policy_decisions=self.policy_decisions,
            last_width=self.last_width,
            last_depth=self.last_depth,
            last_policy_reason=self.last_policy_reason,
            last_strategy_reason=self.last_strategy_reason,
            draft_s=self.draft_s,
            draft_model_tokens=self.draft_model_tokens,
            draft_s_per_token=_rate(self.draft_s, self.draft_model_tokens),
            draft_recalled_tokens=self.draft_recalled_tokens,
        )
