"""The proposer interface, per-proposer accounting, and the `disabled` strategy.

Acceptance has exactly one definition everywhere in meshd: accepted draft tokens divided by
drafted tokens (tokens sent as drafts in verify windows). The bonus token a window always
commits is not a draft and counts in neither figure.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from meshd.speculative.config import MTP_STRATEGIES, SpecConfig
from meshd.speculative.policy import AcceptanceTracker, LinkModel


@dataclass
class ProposerStats:
    """Drafted and accepted token counts of one request, and the windows they came in."""

    drafted: int = 0
    accepted: int = 0
    windows: int = 0

    @property
    def acceptance(self) -> float | None:
        """accepted / drafted, or None before anything was drafted."""
        return self.accepted / self.drafted if self.drafted else None


class Proposer(ABC):
    """Drafts tokens for verify windows. One instance serves one session at a time.

    The coordinator's window loop talks to every strategy through these methods only; the
    ones with bodies are defaults that a strategy overrides where it needs them.
    """

    name: str = "abstract"
    stats: ProposerStats
    # Seconds the latest proposal took on the coordinator (a draft model's passes; ~0 for
    # lookups): the window loop takes it out of the round trip it measures.
    last_draft_s: float = 0.0
    # Of the latest proposal's tokens, those recalled from passes run ahead (`think_ahead`).
    last_recalled: int = 0
    # Seconds the latest `observe` spent on passes of a model of its own (`auto` scoring the
    # draft model teacher-forced): the window loop leaves them out of the coordinator's
    # turnaround, which every strategy's time per token includes (a one-off pass over a
    # prompt counted there would price all tokens as slow, and favour the widest windows).
    last_observe_s: float = 0.0

    @abstractmethod
    def reset(self, prompt: Sequence[int]) -> None:
        """Start a new request: clear per-request state and index `prompt`."""

    @abstractmethod
    def observe(self, committed: Sequence[int]) -> None:
        """Tokens just committed to the session's log, in order."""

    @abstractmethod
    def propose(self, max_tokens: int, mtp_draft: Sequence[int] = ()) -> list[int]:
        """Up to `max_tokens` drafts after the last committed token.

        `mtp_draft` is the MTP draft the last stage sent with the latest reply (tokens after
        the last committed one); strategies that do not use MTP ignore it.
        """

    @abstractmethod
    def propose_after(self, assumed: Sequence[int], max_tokens: int) -> list[int]:
        """Up to `max_tokens` drafts after the log plus `assumed` (tokens not yet verified,
        for a pipelined window sent before the previous reply)."""

    @abstractmethod
    def record(self, drafted: int, accepted: int) -> None:
        """A verdict on one window of this proposer's drafts: `accepted` of `drafted`."""

    @abstractmethod
    def acceptance(self) -> tuple[float, ...]:
        """Per-position acceptance estimate (α_1, α_2, …) for `policy.choose`."""

    @property
    def active(self) -> str:
        """The strategy that drafts now (differs from `name` only for `auto`)."""
        return self.name

    @property
    def reason(self) -> str:
        """Why the active strategy drafts (or why nothing does); "" when fixed."""
        return ""

    def set_link(self, link: LinkModel) -> None:
        """The route's measured costs now (a fixed strategy does not weigh them)."""
        return None

    def expect_tokens(self, max_tokens: int) -> None:
        """After `reset`: the request may commit up to `max_tokens` tokens (`auto` weighs a
        draft model's start against what they can save; a fixed strategy does not)."""
        return None

    def think_ahead(self, assumed: Sequence[int], max_tokens: int) -> bool:
        """Work toward the next proposal while a window is in flight, assuming it accepted
        (`assumed`: its drafts): at most one pass of a model. False when there is none to do
        (the default: lookups cost nothing to redo)."""
        return False

    @property
    def runs_a_model(self) -> bool:
        """Whether its calls may run passes of a model on the coordinator (a draft model's:
        seconds over a long prompt), so the driver makes them off its event loop."""
        return False

    @property
    def uses_mtp(self) -> bool:
        """Whether a session for this strategy opens with the last stage's MTP heads."""
        return self.name in MTP_STRATEGIES

    @property
    def wants_mtp(self) -> bool:
        """Whether the MTP heads should keep running for this request (read per window;
        once False the window loop stops them for the rest of the request)."""
        return self.uses_mtp

    def stop_mtp(self) -> None:
        """The MTP heads are off for the rest of this request."""
        return None

    @property
    def draft_cost_s(self) -> float:
        """Measured coordinator seconds per drafted token of the active strategy (a draft
        model's; 0 for lookups, whose cost is in the coordinator's turnaround)."""
        return 0.0

    def close(self) -> None:
        """The request ended: free what the proposer holds (a draft model's session)."""
        return None


class AccountedProposer(Proposer):
    """Shared bookkeeping: per-request stats and a per-position acceptance EWMA.

    The EWMA survives `reset` (what a model's text tends to repeat is knowledge worth keeping
    between requests of one session); the stats do not (they are per request).
    """

    def __init__(self, config: SpecConfig) -> None:
        self.config = config
        self.stats = ProposerStats()
        self.tracker = AcceptanceTracker(
            max(1, config.window_max_tokens), config.ewma_alpha, config.prior_acceptance
        )

    def record(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        self.tracker.update(drafted, accepted)  # validates first: raises on accepted > drafted
        self.stats.drafted += drafted
        self.stats.accepted += accepted
        self.stats.windows += 1

    def acceptance(self) -> tuple[float, ...]:
        return self.tracker.per_position()

    def _clear_stats(self) -> None:
        self.stats = ProposerStats()


class DisabledProposer(AccountedProposer):
    """Never drafts: every window is [last committed token] and commits exactly one token."""

    name = "disabled"

    def reset(self, prompt: Sequence[int]) -> None:
        """Start a new request."""
        self._clear_stats()

    def observe(self, committed: Sequence[int]) -> None:
        """Nothing to learn."""

    def propose(self, max_tokens: int, mtp_draft: Sequence[int] = ()) -> list[int]:
        """No drafts."""
        return []

    def propose_after(self, assumed: Sequence[int], max_tokens: int) -> list[int]:
        """No drafts."""
        return []

    def acceptance(self) -> tuple[float, ...]:
        """Nothing is ever accepted."""
        return (0.0,)
