"""`auto`: pick the strategy with the best expected time per token, per model and request.

Every candidate is scored in the shadow at no network cost: whenever a window is proposed, each
candidate drafts `window_max_tokens` tokens from the same state, and when the log grows those
drafts are compared with what was committed. Verification is lossless and position-keyed, so the
committed tokens are exactly what the target would have chosen, and a candidate's draft would
have been accepted up to its first difference from them: the shadow score IS the acceptance that
candidate would have measured (a draft shorter than the window counts as a reject at its end).
Prompt lookup is scored per copy, beside how often it finds one: a window start with nothing to
copy is no window of its (`with_copy_rate`). Each candidate's per-position acceptance feeds
`policy.choose` with the current link model; the candidate with the lowest expected seconds per
token wins, and `disabled` wins when no candidate beats plain decoding. The reason is kept in
`reason`.

Per model: an `AcceptanceBook` shared by the sessions of one model carries the estimates
across requests; each request starts from the book and adapts with its own EWMA.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from meshd.speculative import draft_price
from meshd.speculative.acceptance_book import AcceptanceBook
from meshd.speculative.auto_decision import Decision
from meshd.speculative.config import DRAFT_STRATEGIES, MTP_STRATEGIES, SpecConfig
from meshd.speculative.draft_gate import gate, plain_s
from meshd.speculative.draft_scoring import DraftScorer, Shadow
from meshd.speculative.mtp import MtpHybrid, MtpProposer
from meshd.speculative.ngram import NgramCache, NgramSimple
from meshd.speculative.policy import (
    DEFAULT_LINK,
    AcceptanceTracker,
    LinkModel,
    PolicyInputs,
    Search,
    WindowPlan,
    plan_of,
    search,
    with_copy_rate,
)
from meshd.speculative.proposer import AccountedProposer, Proposer

if TYPE_CHECKING:
    from meshd.speculative.draft import DraftModel, DraftProposer
    from meshd.speculative.sampling import SamplingParams

# The draft model's candidate: `draft-ngram` (the draft's tokens, or prompt lookup's copy where
# it starts with the draft's first token): it keeps the copies inside a window, which
# switching to ngram-simple by stretches does not.
_DRAFT_CANDIDATE = "draft-ngram"
_NGRAM = ("ngram-simple", "ngram-cache")


class AutoProposer(AccountedProposer):
    """Chooses among disabled, n-gram and (when the model sends MTP drafts) MTP strategies."""

    name = "auto"

    def __init__(
        self,
        config: SpecConfig,
        book: AcceptanceBook | None = None,
        link: LinkModel = DEFAULT_LINK,
        *,
        draft: DraftModel | None = None,
        sampling: SamplingParams | None = None,
    ) -> None:
        super().__init__(config)
        self.book = book if book is not None else AcceptanceBook(config)
        self.tuning = self.book.tuning
        self.link = link
        self._decided_link = link  # the costs the current choice was made with
        self._width = max(1, config.window_max_tokens)
        simple, cache, mtp = NgramSimple(config), NgramCache(config), MtpProposer(config)
        self._mtp = mtp
        self._parts: tuple[NgramSimple | NgramCache | MtpProposer, ...] = (simple, cache, mtp)
        self._candidates: dict[str, Proposer] = {
            "ngram-simple": simple,
            "ngram-cache": cache,
            "mtp": mtp,
            "mtp-simple": MtpHybrid("mtp-simple", config, mtp, simple, owns_parts=False),
            "mtp-cache": MtpHybrid("mtp-cache", config, mtp, cache, owns_parts=False),
        }
        # The node's draft model, where one is configured: one more candidate (and part).
        self._draft: DraftProposer | None = None
        self._scorer: DraftScorer | None = None
        if draft is not None:
            from meshd.speculative.draft import DraftNgram

            self._draft = DraftNgram(config, draft, sampling)
            self._candidates[_DRAFT_CANDIDATE] = self._draft
            self._scorer = DraftScorer(
                self._draft, _DRAFT_CANDIDATE, self._width, self.tuning.draft_pending
            )
        self._draft_pays = True  # by its or the book's estimate at the last decision
        self._book_says_draft_pays = True  # by the book's estimate at the last decision
        self._mtp_live = True  # the stages run the MTP heads for this request
        self._next_decision = 0  # log length at which `observe` decides again
        self._decide_every = self.tuning.decide_every_tokens
        self._tokens: list[int] = []
        self._budget: int | None = None  # log length the request may reach (`expect_tokens`)
        self._pending: list[Shadow] = []
        self._trackers: dict[str, AcceptanceTracker] = {}
        self._copy_rates: dict[str, float] = {}  # per lookup: window starts with a copy (EWMA)
        self._first_samples: dict[str, int] = {}
        self._decided_at = -1  # log length at the last decision
        self._book_favours_mtp: bool | None = None
        self._drafts: dict[str, list[int]] = {}
        self.decisions = 0  # times every candidate was weighed (each costs a search apiece)
        self.trace: Callable[[Decision], None] | None = None  # told each decision, if set
        self.choice = "disabled"
        self._ranked: list[str] = []  # candidates that pay by the last decision, best first
        self._reason = "nothing measured yet"
        self.plan: WindowPlan | None = None
        self.reset(())

    @property
    def active(self) -> str:
        """The strategy drafting now: the choice, or where the choice is prompt lookup and it
        has nothing to copy at this log, the best other candidate that pays and has a draft
        (`_fallback`)."""
        if self.choice in _NGRAM and not self._drafts.get(self.choice):
            return self._fallback()
        return self.choice

    def _fallback(self) -> str:
        """The best candidate by the last decision that drafts at this log and is no n-gram
        lookup, or "disabled" (a plain window) when there is none. Prompt lookup wins on a
        copied stretch and has nothing between copies, where a draft still pays."""
        mtp = self._mtp_live and self.book.has_mtp
        usable = (n for n in self._ranked if n not in _NGRAM and (mtp or n not in MTP_STRATEGIES))
        return next(usable, "disabled")

    @property
    def reason(self) -> str:
        """Why the current choice won (or why none speculates)."""
        return self._reason

    @property
    def uses_mtp(self) -> bool:
        """Yes: sessions open with the MTP heads, so the MTP strategies can be weighed."""
        return True

    def set_link(self, link: LinkModel) -> None:
        """Update the measured route costs used to compare strategies (re-decides at once only
        on a large change; otherwise at the next scheduled decision)."""
        moved = self._decided_link.moved_to(link, self.tuning.link_change_fraction)
        self.link = link
        if moved:
            self._decide()

    @property
    def wants_mtp(self) -> bool:
        """Whether this request should keep the stages' MTP heads running.

        Yes while an MTP strategy is the choice, while the route's MTP cost is unmeasured, or
        while the book has too few scored windows of an MTP strategy to judge. Then, where the
        book's estimates say the heads do not pay on this route, no (at once: one node need
        not pay for them in every request). Where the book says they pay but this request's
        choice moved away, only once this request has scored enough windows of its own: the
        first few windows of a request are a small sample, and stopping the heads is final
        for the request (without drafts nothing scores them again); and while its choice is
        plain decoding, only after `mtp_grace_samples` windows (at once where the heads cost
        more than `mtp_grace_fraction` of a plain window); while it is an n-gram strategy, only
        once the heads cost more than `mtp_cheap_fraction` of a window.
        """
        if not self._mtp_live:
            return False
        if self.choice in MTP_STRATEGIES or not self.link.mtp_measured:
            return True
        if not self.book.has_mtp:
            return True
        if any(self.book.tracker(m).samples < self.tuning.mtp_min_samples for m in MTP_STRATEGIES):
            return True
        if self._book_favours_mtp is None:
            # Whether the heads pay on this route at all (an MTP strategy beats plain decoding
            # by the book), not whether they beat the book's n-gram strategies: n-gram
            # acceptance belongs to a request's text (the book's is high after an editing
            # request and says nothing of the prose that follows), MTP acceptance to the model.
            # Comparing with the book's n-gram would stop the heads at once in every prose
            # request after an editing one, where they pay.
            best = self._best(self.book.tracker, MTP_STRATEGIES)[0]
            self._book_favours_mtp = best in MTP_STRATEGIES
        if not self._book_favours_mtp:
            return False
        own = min(self._trackers[m].samples - self._first_samples[m] for m in MTP_STRATEGIES)
        if own < self.tuning.mtp_min_samples:
            return True
        if self._decided_at != len(self._tokens):
            self._decide()  # stopping is final: on today's estimates, not a spaced-out decision's
        if self.choice == "disabled":
            return own < self.tuning.mtp_grace_samples and self._heads_cheap(
                self.tuning.mtp_grace_fraction, 0
            )
        if self.choice in MTP_STRATEGIES:
            return True
        if self.choice in DRAFT_STRATEGIES:
            return not self._draft_beats_heads()
        width = self.plan.width if self.plan is not None else self._width
        return self._heads_cheap(self.tuning.mtp_cheap_fraction, width)

    def _draft_beats_heads(self) -> bool:
        """Whether `draft` has scored enough windows of this request and beats the best MTP
        strategy by `draft_over_heads_margin`, by the book or by this request's own
        estimates once both families have `draft_own_samples` of its windows. A request's
        estimates of both dip together on a hard stretch, where their order is noise, hence
        the margin and the samples; the book alone mixes the requests' texts."""
        own = self._trackers[_DRAFT_CANDIDATE].samples - self._first_samples[_DRAFT_CANDIDATE]
        if own < self.tuning.mtp_min_samples:
            return False
        judges: list[Callable[[str], AcceptanceTracker]] = []
        if self.book.tracker(_DRAFT_CANDIDATE).samples >= self.tuning.mtp_min_samples:
            judges.append(self.book.tracker)
        heads = min(self._trackers[m].samples - self._first_samples[m] for m in MTP_STRATEGIES)
        if min(own, heads) >= self.tuning.draft_own_samples:
            judges.append(lambda name: self._trackers[name])
        for tracker in judges:
            best, mtp_s, _ = self._best(tracker, MTP_STRATEGIES)
            if best == "disabled":
                return True  # no MTP strategy pays at all
            _, draft_s, _ = self._best(tracker, DRAFT_STRATEGIES, heads_off=True)
            if 0 < draft_s <= (1 - self.tuning.draft_over_heads_margin) * mtp_s:
                return True
        return False

    def _heads_cheap(self, fraction: float, width: int) -> bool:
        """Whether the MTP heads cost at most `fraction` of a window of `width` drafts."""
        window_s = self.link.rtt_s + self.link.compute_s(width)
        return self.link.mtp_s <= fraction * window_s

    def stop_mtp(self) -> None:
        """The MTP heads are off for the rest of this request: choose among the others."""
        self._mtp_live = False
        self._decide()

    def reset(self, prompt: Sequence[int]) -> None:
        """New request: reset every part and start each estimate from the model's book."""
        self._mtp_live = True
        self._decide_every = self.tuning.decide_every_tokens
        self._clear_stats()
        for part in self._parts:
            part.reset(prompt)
        if self._draft is not None:
            self._draft.reset(prompt)
        if self._scorer is not None:
            self._scorer.reset()
        self.last_draft_s = 0.0
        self._tokens = [int(t) for t in prompt]
        self._budget = None
        self._pending = []
        alpha = self.config.ewma_alpha
        # Warm: a request's first windows outweigh the book quickly (the book mixes the other
        # requests' texts, and a copy-heavy one must not decide the next one's start).
        self._trackers = {n: self.book.tracker(n).copy(alpha, warm=True) for n in self._candidates}
        self._copy_rates = {n: self.book.copy_rates.get(n, 1.0) for n in _NGRAM}
        self._first_samples = {n: t.samples for n, t in self._trackers.items()}
        self._book_favours_mtp = None  # judged once per request, when needed
        self._drafts = self._shadow(())
        self._decide()

    def observe(self, committed: Sequence[int]) -> None:
        """Feed every part, score the shadow drafts the new tokens settle, draft again, decide.

        Scoring and deciding here, not only in `propose`, keeps `auto` learning while it is
        disabled and the coordinator asks it for no drafts at all.
        """
        self.last_observe_s = 0.0
        for part in self._parts:
            part.observe(committed)
        if self._draft is not None:
            self._draft.observe(committed)
        self._tokens.extend(int(t) for t in committed)
        self._score()
        self._drafts = self._shadow(())
        self._score_draft()
        if len(self._tokens) >= self._next_decision:
            self._decide()

    def propose(self, max_tokens: int, mtp_draft: Sequence[int] = ()) -> list[int]:
        """The active strategy's drafts (shadow-drafting again when a new MTP draft came)."""
        if mtp_draft and self.config.mtp_depth > 0:
            first_mtp = not self.book.has_mtp
            self.book.has_mtp = True
            self._drafts = self._shadow(mtp_draft, reuse=not first_mtp)
            if first_mtp:
                self._decide()
        self.last_draft_s, self.last_recalled = 0.0, 0
        active = self.active
        if active == "disabled":
            return []
        if active in DRAFT_STRATEGIES:
            return self._propose_draft(max_tokens)
        # .get: another session of the model may have just made the MTP strategies available.
        return self._drafts.get(active, [])[: max(0, max_tokens)]

    def _propose_draft(self, max_tokens: int) -> list[int]:
        """The draft model's proposal, which is also its shadow (scored over its width)."""
        width = max(0, min(max_tokens, self._width))
        start = len(self._tokens)
        shadow = next(
            (s for s in self._pending if s.strategy == _DRAFT_CANDIDATE and s.start == start), None
        )
        if shadow is not None and len(shadow.drafts) >= width:
            return shadow.drafts[:width]  # drafted in the shadow at this very log
        assert self._draft is not None
        drafts = self._draft.propose(width)
        self.last_draft_s, self.last_recalled = self._draft.last_draft_s, self._draft.last_recalled
        if self._draft.draft_cost_s > 0:
            self.book.draft_token_s = self._draft.draft_cost_s
        self.book.draft_write_token_s = self._draft.write_token_s or self.book.draft_write_token_s
        if width > 0:
            self._pending = [
                s
                for s in self._pending
                if not (s.strategy == _DRAFT_CANDIDATE and s.start == start)
            ]
            self._pending.append(Shadow(_DRAFT_CANDIDATE, start, drafts, width))
            # Drafting for the n-gram choice (`_fallback`), this start was also left for a
            # teacher-forced pass to score: it is scored once, as this proposal.
            if self._scorer is not None:
                self._scorer.forget(start)
        return drafts

    def propose_after(self, assumed: Sequence[int], max_tokens: int) -> list[int]:
        """The active strategy's drafts after log + `assumed`."""
        self.last_draft_s, self.last_recalled = 0.0, 0
        active = self.active
        if active == "disabled":
            return []
        chosen = self._candidates[active]
        drafts = chosen.propose_after(assumed, max_tokens)
        self.last_draft_s, self.last_recalled = chosen.last_draft_s, chosen.last_recalled
        return drafts

    def think_ahead(self, assumed: Sequence[int], max_tokens: int) -> bool:
        """The draft model's passes ahead, while it drafts."""
        draft = self._draft if self.active in DRAFT_STRATEGIES else None
        return draft is not None and draft.think_ahead(assumed, max_tokens)

    @property
    def runs_a_model(self) -> bool:
        return self._draft is not None

    @property
    def draft_cost_s(self) -> float:
        """The draft model's seconds per token while it drafts (else 0)."""
        if self._draft is not None and self.active in DRAFT_STRATEGIES:
            # Until it drafted, as the book or a prior has it (not 0: it is not free).
            return draft_price.token_s(self._draft, self.book, self.link)
        return 0.0

    def expect_tokens(self, max_tokens: int) -> None:
        """The request may commit up to `max_tokens`: what the draft's start is weighed
        against (`draft_gate.start_pays`)."""
        self._budget = len(self._tokens) + max(0, max_tokens)
        self._decide()

    def close(self) -> None:
        """The request ended: free the draft model's session."""
        if self._draft is not None:
            self._draft.close()

    def record(self, drafted: int, accepted: int) -> None:
        """Count real windows (the estimates come from shadow scoring, which covers them)."""
        if drafted > 0:
            self.stats.drafted += drafted
            self.stats.accepted += accepted
            self.stats.windows += 1

    def acceptance(self) -> tuple[float, ...]:
        """The active strategy's per-position estimate ((0.0,) while disabled)."""
        active = self.active
        if active == "disabled":
            return (0.0,)
        return self._trackers[active].per_position()

    def estimate(self, strategy: str) -> tuple[float, ...]:
        """This request's per-position acceptance estimate for a candidate strategy."""
        return self._trackers[strategy].per_position()

    def _available(self) -> list[str]:
        names = ["ngram-simple", "ngram-cache"]
        if self.book.has_mtp and self.config.mtp_depth > 0 and self._mtp_live:
            names.extend(MTP_STRATEGIES)
        if self._draft is not None:
            names.append(_DRAFT_CANDIDATE)
        return names

    def _shadow(self, mtp_draft: Sequence[int], reuse: bool = False) -> dict[str, list[int]]:
        """Every available candidate drafts `window_max_tokens` from the current log; the
        drafts wait in `_pending` until the log shows how many would have been accepted.

        `reuse`: the log has not grown since the last call, so the n-gram candidates' drafts
        (which do not depend on the MTP draft) are kept, not looked up again.
        """
        start = len(self._tokens)
        drafts: dict[str, list[int]] = {}
        fresh_mtp = bool(mtp_draft) or bool(self._mtp.propose(self._width))
        for name in self._available():
            if name in DRAFT_STRATEGIES:
                # Scored teacher-forced (`_score_draft`) while not the choice; while it is,
                # its proposal is drafted in `propose`.
                if not reuse and self.choice != name and self._scorer is not None:
                    self._scorer.leave(start, drafts.get("ngram-simple") or [])
                continue
            if reuse and name not in MTP_STRATEGIES and name in self._drafts:
                drafts[name] = self._drafts[name]
                continue  # its shadow for this start is already pending
            drafts[name] = self._candidates[name].propose(self._width, mtp_draft)
            if name in MTP_STRATEGIES and not fresh_mtp:
                continue  # no MTP draft to judge: neither credit nor blame the MTP strategies
            if name in _NGRAM:
                # Chosen where it has nothing to copy, the window is another candidate's or a
                # plain one (`active`): its tracker scores copies only, and how often it finds
                # one is its copy rate (`with_copy_rate` prices the two together).
                self.book.fold_copy(name, bool(drafts[name]), self._copy_rates)
                if not drafts[name]:
                    continue
            self._pending = [
                s for s in self._pending if not (s.strategy == name and s.start == start)
            ]
            self._pending.append(Shadow(name, start, drafts[name]))
        del self._pending[: -self.tuning.pending_per_candidate * len(self._candidates)]
        return drafts

    def _score(self) -> None:
        """Fold in what the log has shown of each shadow draft: its leading drafts as soon as
        the log confirms them, its first wrong draft (or its end, when shorter than the
        window) once the log reaches it: while auto decodes plainly (a commit a window), a
        candidate that became right is seen at once, not a window's worth of commits late."""
        log = self._tokens
        waiting: list[Shadow] = []
        for shadow in self._pending:
            seen = len(log) - shadow.start
            matched = 0
            settled = False
            for j, token in enumerate(shadow.drafts[:seen]):
                if log[shadow.start + j] != token:
                    settled = True
                    break
                matched += 1
            width = shadow.width or self._width
            if settled or (matched == len(shadow.drafts) and not shadow.open):
                self._fold(shadow, matched, rejected=matched < width)
                # News that may change the choice: decide at once, whatever the spacing.
                # (An empty draft, a reject at its first position, is no news.)
                if (shadow.strategy != self.choice and matched == self._width) or (
                    shadow.strategy == self.choice and matched == 0 and shadow.drafts
                ):
                    self._next_decision = len(log)
            else:
                if matched > shadow.credited:
                    self._fold(shadow, matched, rejected=False)
                waiting.append(shadow)
        self._pending = waiting

    def _fold(self, shadow: Shadow, matched: int, *, rejected: bool) -> None:
        """Fold `shadow`'s drafts up to `matched` (and a reject after them) into the request's
        and the book's estimates, as one window however many calls it takes."""
        mine, book = self._trackers[shadow.strategy], self.book.tracker(shadow.strategy)
        if shadow.weights is None:
            shadow.weights = (mine.open_window(), book.open_window())
        since = shadow.credited
        mine.fold(shadow.weights[0], matched, rejected=rejected, since=since)
        book.fold(shadow.weights[1], matched, rejected=rejected, since=since)
        shadow.credited = matched

    def _score_draft(self) -> None:
        """Turn the starts waiting for the draft's choices into shadows once those choices
        settle them, running the draft over the log's new tokens when a pass is due
        (`DraftScorer.due`: only a rare probe while the cost gate declines the draft)."""
        scorer = self._scorer
        if scorer is None:
            return
        if self.choice in DRAFT_STRATEGIES:
            # It proposes for itself now; chains no pass will extend are dropped (what the log
            # confirmed of them stays credited).
            scorer.waiting.clear()
            self._pending = [s for s in self._pending if not s.open]
            return
        chains = [s for s in self._pending if s.open]
        if not scorer.waiting and not chains:
            return
        scorer.commits += 1
        scorer.idle_s += max(0.0, self.link.rtt_s)
        assert self._draft is not None
        if not scorer.due(
            self.tuning,
            declined=not self._draft_pays
            and self.book.tracker(_DRAFT_CANDIDATE).samples >= self.tuning.draft_judged_samples,
            eager=self.choice == "disabled" and self._book_says_draft_pays,
            pass_s=draft_price.score_s(self.book, self.link),
            write_token_s=self._draft.write_token_s or self.book.draft_write_token_s,
            plain_s=plain_s(self.link),
            start_s=draft_price.start_s(self._draft, self.book, self.link),
            remaining=None if self._budget is None else self._budget - len(self._tokens),
        ):
            return
        started = self._draft.clock()
        spent = scorer.run(self._tokens, chains, self._pending)
        self.last_observe_s += self._draft.clock() - started
        if spent is not None:
            self.book.time_score(spent)
        self.book.draft_write_token_s = self._draft.write_token_s or self.book.draft_write_token_s
        self._score()

    def _decide(self) -> None:
        self._decided_link = self.link
        self._decided_at = len(self._tokens)
        self.decisions += 1
        best_name, best_s, found = self._best(lambda name: self._trackers[name])
        if _DRAFT_CANDIDATE in found:
            # By the book too: on a hard stretch of text the request's estimate says no, and
            # that is when the draft must be scored often to see it pay again; where the book
            # says no as well, the route makes it too dear.
            self._book_says_draft_pays = (
                self._best(self.book.tracker, (_DRAFT_CANDIDATE,))[0] == _DRAFT_CANDIDATE
            )
            self._draft_pays = (
                found[_DRAFT_CANDIDATE].s_per_token(self.config)[1] > 0
                or self._book_says_draft_pays
            )
        plans = {name: f.s_per_token(self.config) for name, f in found.items()}
        self._ranked = sorted((n for n, (_, w) in plans.items() if w > 0), key=lambda n: plans[n])
        models = (*MTP_STRATEGIES, *DRAFT_STRATEGIES)
        if (
            self.choice in found
            and best_name in models
            and self.choice in models
            and (best_name in DRAFT_STRATEGIES) != (self.choice in DRAFT_STRATEGIES)
        ):
            held_s, width = found[self.choice].s_per_token(self.config)
            if width > 0 and best_s > (1 - self.tuning.model_switch_margin) * held_s:
                best_name = self.choice  # not clearly better: keep the one drafting now
        cap = min(
            self.tuning.decide_every_max_tokens,
            self.tuning.tokens_for(
                self.tuning.decide_cost_s, self.tuning.decide_share * plain_s(self.link)
            ),
        )
        if best_name == self.choice:
            self._decide_every = min(2 * self._decide_every, cap)
        else:
            self._decide_every = min(self.tuning.decide_every_tokens, cap)
        self._next_decision = len(self._tokens) + self._decide_every
        first = next(iter(found.values()), None)
        fallback = plan_of(first, self.config) if first is not None else None
        best_plan = None if best_name == "disabled" else plan_of(found[best_name], self.config)
        alphas = ", ".join(
            f"{name} α₁={self._trackers[name].per_position()[0]:.2f}"
            + (f" copies {self._copy_rates[name]:.2f}" if name in _NGRAM else "")
            for name in self._available()
        )
        if best_plan is None:
            self.choice, self.plan = "disabled", fallback
            tail = fallback.reason if fallback is not None else ""
            self._reason = f"disabled: no strategy pays ({alphas}); {tail}"
        else:
            self.choice, self.plan = best_name, best_plan
            self._reason = f"{best_name} ({alphas}): {best_plan.reason}"
        if self.trace is not None:
            self.trace(Decision(len(self._tokens), self.choice, self._reason, plans))

    def _best(
        self,
        tracker: Callable[[str], AcceptanceTracker],
        among: Sequence[str] | None = None,
        *,
        heads_off: bool = False,
    ) -> tuple[str, float, dict[str, Search]]:
        """The available candidate (of `among`, default all) with the least expected time per
        token by `tracker`'s estimates ("disabled" when none speculates), its time, and every
        weighed candidate's search. Weighs each cheaply; only the winner's plan gets worded.
        `heads_off`: the draft strategies as they would be with the MTP heads stopped."""
        best_name, best_s = "disabled", 0.0
        found: dict[str, Search] = {}
        for name in self._available():
            if among is not None and name not in among:
                continue
            heads = name in MTP_STRATEGIES or (
                name in DRAFT_STRATEGIES and self._mtp_live and self.book.has_mtp and not heads_off
            )
            link = self.link.with_mtp_drafts() if heads else self.link
            if name in DRAFT_STRATEGIES:
                link = link.with_draft_cost(draft_price.token_s(self._draft, self.book, link))
            found[name] = search(PolicyInputs(link, tracker(name).per_position()), self.config)
            if name in _NGRAM:
                found[name] = with_copy_rate(found[name], self._copy_rates[name])
            if name in DRAFT_STRATEGIES:  # and only where it pays, its start included
                start_s = draft_price.start_s(self._draft, self.book, self.link)
                left = None if self._budget is None else self._budget - len(self._tokens)
                found[name] = gate(
                    found[name], self.config, self.tuning, start_s=start_s, remaining=left
                )
            per_token, width = found[name].s_per_token(self.config)
            if width > 0 and (best_name == "disabled" or per_token < best_s):
                best_name, best_s = name, per_token
        return best_name, best_s, found
