"""What the draft model costs `auto` (meshd/speculative/auto.py), measured or before it was.

Three prices: a drafting pass (the seconds per drafted token the policy weighs), a
teacher-forced scoring pass over new commits, and the draft's start, the log its cache lacks
written before its first proposal. Each is this request's measure, else the book's (other
requests'), else a prior from the two models' sizes and the target's measured pass (never a
flat figure: a real draft is not free before it has drafted).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshd.speculative.acceptance_book import AcceptanceBook
from meshd.speculative.policy import LinkModel

if TYPE_CHECKING:
    from meshd.speculative.draft import DraftProposer


def pass_prior_s(book: AcceptanceBook, link: LinkModel) -> float:
    """A drafting pass's seconds before one was timed: the target's plain pass (summed over
    its stages) times the draft's share of the weights a pass reads."""
    ratio = book.draft_size_ratio
    if ratio is None:
        ratio = book.tuning.draft_cost_prior_ratio
    return ratio * link.compute_s(0)


def token_s(draft: DraftProposer | None, book: AcceptanceBook, link: LinkModel) -> float:
    """Seconds per drafted token: this request's measure, else the book's, else what a
    teacher-forced pass cost, else the prior (0 without a draft)."""
    if draft is None:
        return 0.0
    if draft.draft_cost_s > 0:
        return draft.draft_cost_s
    if book.draft_token_s is not None:
        return book.draft_token_s
    return score_s(book, link)


def score_s(book: AcceptanceBook, link: LinkModel) -> float:
    """A teacher-forced pass over a few new commits: as timed, else a drafting pass's prior."""
    if book.draft_score_s is not None:
        return book.draft_score_s
    return pass_prior_s(book, link)


def write_token_s(draft: DraftProposer, book: AcceptanceBook, link: LinkModel) -> float:
    """Seconds per token of a long pass (a prefill): as this request or the book timed it,
    else `draft_write_prior` of a drafting pass."""
    timed = draft.write_token_s or book.draft_write_token_s
    if timed is not None:
        return timed
    return book.tuning.draft_write_prior * token_s(draft, book, link)


def start_s(draft: DraftProposer | None, book: AcceptanceBook, link: LinkModel) -> float:
    """The price of the draft's next proposal beyond its pass: writing the log tokens its
    cache lacks (the prompt at a request's start; ~0 while it drafts or is scored)."""
    if draft is None:
        return 0.0
    return draft.unwritten() * write_token_s(draft, book, link)
