"""`AcceptanceBook`: one model's acceptance estimates by strategy, shared by its sessions.

`auto` (meshd/speculative/auto.py) starts each request from the book and adapts with the
request's own EWMA; the book adapts slower (`AutoTuning.book_ewma_fraction`), so it
averages over many requests' texts. It also keeps what the draft model costs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from meshd.speculative.auto_tuning import AutoTuning
from meshd.speculative.config import SpecConfig
from meshd.speculative.policy import AcceptanceTracker


@dataclass
class AcceptanceBook:
    """Per-model acceptance estimates by strategy, shared by that model's sessions."""

    config: SpecConfig
    trackers: dict[str, AcceptanceTracker] = field(default_factory=dict)
    has_mtp: bool = False
    tuning: AutoTuning = field(default_factory=AutoTuning)
    # Seconds of one teacher-forced pass of the draft model over a commit's new tokens (EWMA;
    # None until one was timed).
    draft_score_s: float | None = None
    # The draft model's seconds per drafted token, as the latest request that drafted left it.
    draft_token_s: float | None = None
    # Seconds per token of a long pass of the draft (a prefill), as the latest request left it.
    draft_write_token_s: float | None = None
    # The weights a one-token pass of the draft reads ÷ the target's (`pass_weights`), where
    # whoever made the book knows both models; None: `tuning.draft_cost_prior_ratio`.
    draft_size_ratio: float | None = None
    # Per prompt-lookup strategy: the share of window starts (commits) where it found something
    # to copy (EWMA at the book's weight; 1 until seen). Its tracker is per copy, this says how
    # often.
    copy_rates: dict[str, float] = field(default_factory=dict)

    def tracker(self, strategy: str) -> AcceptanceTracker:
        """The model-level tracker of `strategy` (created at the prior on first use)."""
        found = self.trackers.get(strategy)
        if found is None:
            found = AcceptanceTracker(
                max(1, self.config.window_max_tokens),
                self.config.ewma_alpha * self.tuning.book_ewma_fraction,
                self.config.prior_acceptance,
            )
            self.trackers[strategy] = found
        return found

    def fold_copy(self, strategy: str, found: bool, request: dict[str, float]) -> None:
        """One window start where `strategy` found (or did not find) something to copy, into
        a request's copy rates (at the request's weight, from the book's) and the book's."""
        weight = self.config.ewma_alpha
        for rates in (request, self.copy_rates):
            old = rates.get(strategy, 1.0)
            rates[strategy] = old + weight * (float(found) - old)
            weight *= self.tuning.book_ewma_fraction

    def time_score(self, seconds: float) -> None:
        """Fold one timed teacher-forced pass into `draft_score_s` (at `tuning.cost_ewma`)."""
        old = self.draft_score_s
        self.draft_score_s = (
            seconds if old is None else old + self.tuning.cost_ewma * (seconds - old)
        )
