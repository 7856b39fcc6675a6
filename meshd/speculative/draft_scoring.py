"""Scoring a draft model's candidate in `auto`'s shadow without drafting with it.

A draft model's shadow would cost a pass per drafted token (an n-gram's is a lookup). While
the draft is not `auto`'s choice it is scored teacher-forced instead: every commit leaves a
start to score, and one pass over the log's new tokens gives the draft's own choice at each
of their positions, which settles every start at once (a chain that has been right drafts
from the log itself). `auto` decides when a pass is due; `DraftScorer` keeps the starts and
the choices and turns them into `Shadow`s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshd.speculative.auto_tuning import AutoTuning
from meshd.speculative.draft_gate import pays_back

if TYPE_CHECKING:
    from meshd.speculative.draft import DraftProposer


@dataclass
class Shadow:
    """One candidate's draft at one log position, waiting for the log to score it."""

    strategy: str
    start: int  # log length when drafted: drafts[i] predicts log[start + i]
    drafts: list[int]
    width: int = 0  # positions it is scored over (0: the window's); a shorter draft rejects
    # The draft model's chain, known only as far as its teacher-forced passes have reached:
    # more drafts may follow (its chain is right so far), so reaching its end settles nothing.
    open: bool = False
    credited: int = 0  # leading drafts already folded in as accepted (the log confirmed them)
    weights: tuple[float, float] | None = None  # its weight in the request's and book's EWMA


class DraftScorer:
    """The starts waiting for the draft's teacher-forced choices, and those choices."""

    def __init__(self, draft: DraftProposer, strategy: str, width: int, keep: int) -> None:
        self.draft = draft
        self.strategy = strategy  # the name its shadows are scored under
        self.width = width
        self.keep = keep  # most starts waiting (the oldest are dropped)
        self.choices: dict[int, int] = {}  # the draft's choice by log position
        self.waiting: list[tuple[int, list[int]]] = []  # (start, prompt lookup's copy there)
        self.commits = 0  # commits since the last pass
        self.idle_s = 0.0  # the network wait of those commits (a declined draft's probe budget)

    def reset(self) -> None:
        """New request: nothing waits, nothing is known."""
        self.choices = {}
        self.waiting = []
        self.commits = 0
        self.idle_s = 0.0

    def due(
        self,
        tuning: AutoTuning,
        *,
        declined: bool,
        eager: bool,
        pass_s: float,
        write_token_s: float | None,
        plain_s: float,
        start_s: float = 0.0,
        remaining: int | None = None,
    ) -> bool:
        """Whether a pass is due after this commit (`commits`, `idle_s` counted).

        While the cost gate `declined` the draft (by the request's and the book's estimates),
        only as a probe: once its cost (a cold session's prefill included) is within
        `draft_probe_share` of the commits' network wait, so never on one node, where a pass
        would slow the tokens and nothing waits. Otherwise once a pass (`pass_s`) is within
        the share of those commits' plain decoding time (`plain_s` a token) the draft's
        prospects allow (`draft_score_share`, or `_eager` while auto decodes plainly and the
        book says the draft pays), and at least every `draft_sync_max_commits`. Where the
        draft's cache lacks more of the log than those commits (a cold session: the prompt it
        has not written, which no kept prefix holds) the pass is the draft's start
        (`start_s`): the floor applies only where the request's `remaining` tokens, decoded
        `AutoTuning.draft_score_start_gain` times faster, would pay it back; else the pass is
        due once its whole cost fits the share, as a short request must not pay a long
        prompt's prefill for a score."""
        if declined:
            return self.idle_s * tuning.draft_probe_share >= self.probe_cost_s(
                pass_s, write_token_s
            )
        share = tuning.draft_score_share_eager if eager else tuning.draft_score_share
        cold = self.draft.unwritten() - self.commits > tuning.draft_sync_max_commits
        gain = tuning.draft_score_start_gain
        if cold and not pays_back(plain_s, gain, start_s, remaining, tuning):
            cost = self.probe_cost_s(pass_s, write_token_s)
            return self.commits >= tuning.tokens_for(cost, share * plain_s)
        every = tuning.tokens_for(pass_s, share * plain_s)
        return self.commits >= min(every, tuning.draft_sync_max_commits)

    def probe_cost_s(self, pass_s: float, write_token_s: float | None) -> float:
        """What the next pass would cost: a pass over new commits (`pass_s`), or where the
        draft's cache lacks more of the log (a cold session: the prompt's prefill), the tokens
        it must write at `write_token_s` apiece (at `pass_s` apiece until that was timed)."""
        unwritten = self.draft.unwritten()
        per_token = write_token_s if write_token_s is not None else pass_s
        return max(pass_s, unwritten * per_token)

    def leave(self, start: int, copy: list[int]) -> None:
        """A start for a later pass to score (with prompt lookup's copy there)."""
        self.waiting.append((start, copy))
        del self.waiting[: -self.keep]

    def forget(self, start: int) -> None:
        """`start` is scored otherwise (the draft drafted there for real)."""
        self.waiting = [(at, copy) for at, copy in self.waiting if at != start]

    def run(self, log: Sequence[int], chains: list[Shadow], pending: list[Shadow]) -> float | None:
        """One pass of the draft over the log from the oldest start it must settle; extends
        the open `chains`, and appends a shadow to `pending` for every start it settles.
        Returns the pass's measured seconds (None when it was not timed)."""
        since = min(
            [start for start, _ in self.waiting] + [s.start + len(s.drafts) for s in chains]
        )
        while since in self.choices and since < len(log):
            since += 1
        first, choices = self.draft.predict_log(since)
        self.commits = 0
        self.idle_s = 0.0
        for j, token in enumerate(choices):
            self.choices[first + j] = token
        eos = self.draft.draft.eos_ids
        for shadow in chains:  # the pass reached further along these chains
            found = draft_ngram_shadow(self.choices, log, shadow.start, (), self.width, eos)
            if found is not None:
                shadow.drafts, shadow.open = found
        waiting: list[tuple[int, list[int]]] = []
        for start, copy in self.waiting:
            found = draft_ngram_shadow(self.choices, log, start, copy, self.width, eos)
            if found is None:
                waiting.append((start, copy))
            else:
                drafts, more = found
                pending.append(Shadow(self.strategy, start, drafts, open=more))
        self.waiting = waiting
        oldest = min(
            [start for start, _ in waiting] + [s.start for s in pending if s.open],
            default=len(log),
        )
        for position in [p for p in self.choices if p < oldest]:
            del self.choices[position]
        return self.draft.last_score_s


def draft_ngram_shadow(
    choices: dict[int, int],
    log: Sequence[int],
    start: int,
    copy: Sequence[int],
    width: int,
    eos: frozenset[int],
) -> tuple[list[int], bool] | None:
    """What `draft-ngram` would have proposed at `start`, as far as scoring it needs, from the
    draft's teacher-forced `choices` by position, and whether more of it may follow; None
    while its first token is not known.

    Prompt lookup's `copy` where it starts with the draft's first token; else the draft's
    chain up to its first token that differs from the log (the chain drafts from the log
    while it agrees with it), an EOS, or `width` tokens. A chain right as far as the choices
    (or the log) reach is open: the next passes continue it.
    """
    first = choices.get(start)
    if first is None:
        return None
    if copy and copy[0] == first:
        return list(copy), False
    chain: list[int] = []
    position = start
    while len(chain) < width:
        token = choices.get(position)
        if token is None:
            return chain, True  # no pass has reached this position yet
        chain.append(token)
        if token in eos:
            return chain, False
        if position >= len(log):
            return chain, True  # the log does not reach this token yet
        if log[position] != token:
            return chain, False
        position += 1
    return chain, False
