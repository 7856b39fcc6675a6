"""`AutoTuning`: every threshold of `auto`'s rules (meshd/speculative/auto.py), in one place.

Each field is one rule's number and the comment states the rule. How each value was set, and
what it cost before, is in docs/speculative.md ("`auto`'s tuning").
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class AutoTuning:
    """The numbers `auto` decides by; one instance per model (`AcceptanceBook.tuning`)."""

    # -- the MTP heads (stopping them is final for a request) --
    # Scored windows of an MTP strategy, in the book and in the request, before they may stop.
    mtp_min_samples: int = 8
    # Choosing plain decoding, a request keeps heads the book says pay for this many windows...
    mtp_grace_samples: int = 24
    # ...but only where the heads cost at most this fraction of a plain window.
    mtp_grace_fraction: float = 0.2
    # Choosing an n-gram strategy, it keeps them while they cost at most this share of a window.
    mtp_cheap_fraction: float = 0.1
    # `draft` stops the heads only when it beats every MTP strategy by this share of a token...
    draft_over_heads_margin: float = 0.05
    # ...judged by the request's own estimates once both have this many of its windows.
    draft_own_samples: int = 16
    # Switching between draft-model and MTP strategies needs this gain in time per token.
    model_switch_margin: float = 0.1

    # -- the draft model's cost gate (meshd/speculative/draft_gate.py) --
    # The draft competes only where one window at a time (round trip + verify pass + its
    # drafting, nothing overlapped) beats plain decoding by this factor, at its acceptance.
    draft_min_gain: float = 1.1
    # A cold draft session's first scoring pass (the prompt's prefill) is forced by the
    # floor only where the rest of the request, decoded this much faster, would pay it back.
    draft_score_start_gain: float = 1.5
    # Until the route measured a window wider than one token, each draft in a window adds
    # this fraction of a one-token pass to the verify pass (a CPU pass is not free per token).
    verify_token_prior: float = 0.4

    # -- when to decide --
    # Committed tokens between decisions at first and after a change of choice...
    decide_every_tokens: int = 4
    # ...doubling while the choice holds, up to this many.
    decide_every_max_tokens: int = 32
    # One decision's cost (weighing every candidate's widths and depths)...
    decide_cost_s: float = 200e-6
    # ...may be at most this share of the plain decoding time of the tokens it spans.
    decide_share: float = 0.005
    # A route cost that moved by more than this fraction since the last decision re-decides now.
    link_change_fraction: float = 0.5

    # -- estimates --
    # The per-model book adapts at this fraction of a request's EWMA weight.
    book_ewma_fraction: float = 0.25
    # Unresolved shadow drafts kept per candidate (pipelined proposals overlap).
    pending_per_candidate: int = 8

    # -- scoring the draft model teacher-forced while it is not the choice --
    # Its pass over the new commits may cost this share of their plain decoding time...
    draft_score_share: float = 0.015
    # ...and this share while auto decodes plainly and the book says the draft pays.
    draft_score_share_eager: float = 0.05
    # Declined by the cost gate (neither the request's nor the book's estimate says it pays):
    # only a probe, at most this share of the commits' network wait (their round trips), so
    # none on one node, where nothing waits and a pass would slow every token. A probe, not
    # nothing: a later text the draft predicts well must be able to bring it back.
    draft_probe_share: float = 0.03
    # At least one pass per this many commits unless the draft is declined.
    draft_sync_max_commits: int = 32
    # The gate's "no" declines the draft (probes only) once the book has scored this many of
    # its windows: by the prior alone it would never be scored, and never let in, on one node.
    draft_judged_samples: int = 8
    # The newest timed pass's EWMA weight.
    cost_ewma: float = 0.2

    # -- the draft model's cost before it was timed, and the price of its start --
    # Until a pass of the draft was timed, a pass costs the target's plain pass times the
    # ratio of the weights each one-token pass reads (`AcceptanceBook.draft_size_ratio`),
    # or times this where the sizes are not known.
    draft_cost_prior_ratio: float = 1 / 3
    # Until a long pass of the draft was timed, a token it writes in one (its prefill)
    # costs this fraction of one of its drafting passes (a CPU prefill is bound by compute,
    # not by reading the weights, so a written token is not nearly free).
    draft_write_prior: float = 0.2
    # Before it drafts, the draft must write the log its cache lacks (a request's prompt):
    # it competes only where the rest of the request saves this many times that price.
    draft_start_payback: float = 1.0
    # Starts waiting for the draft's choices (beyond these the oldest are dropped).
    draft_pending: int = 64

    def tokens_for(self, cost_s: float, budget_per_token_s: float) -> int:
        """The fewest tokens (or commits) over which `cost_s` stays within
        `budget_per_token_s` apiece (`decide_every_max_tokens` where nothing is budgeted)."""
        if budget_per_token_s <= 0:
            return self.decide_every_max_tokens
        return max(1, math.ceil(cost_s / budget_per_token_s))
