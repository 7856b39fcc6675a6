"""Strategy names → proposers. See `proposer.py` for the interface and the acceptance definition.

| strategy       | drafts                                                             |
|----------------|--------------------------------------------------------------------|
| `disabled`     | none                                                               |
| `ngram-simple` | continuation of the most recent earlier occurrence of the suffix   |
| `ngram-cache`  | most frequent continuation chain from per-request n-gram counts    |
| `mtp`          | the MTP draft the last stage sent with the previous reply          |
| `mtp-simple`   | MTP draft + ngram-simple tail of up to `extension_tokens`          |
| `mtp-cache`    | MTP draft + ngram-cache tail of up to `extension_tokens`           |
| `draft`        | k tokens from the node's draft model (`spec.draft_model`)          |
| `draft-ngram`  | ngram-simple's copy where it starts with the draft's token, else it |
| `auto`         | whichever of the above the cost model expects to be fastest        |

(The hybrids propose the n-gram's copy instead where it starts with the MTP draft's token.)
"""

from __future__ import annotations

from meshd.speculative.acceptance_book import AcceptanceBook
from meshd.speculative.auto import AutoProposer
from meshd.speculative.config import DRAFT_STRATEGIES, STRATEGIES, SpecConfig
from meshd.speculative.draft import DraftModel, DraftNgram, DraftProposer
from meshd.speculative.mtp import MtpHybrid, MtpProposer
from meshd.speculative.ngram import NgramCache, NgramSimple
from meshd.speculative.policy import DEFAULT_LINK, LinkModel
from meshd.speculative.proposer import DisabledProposer, Proposer
from meshd.speculative.sampling import SamplingParams


class UnknownStrategyError(ValueError):
    """The strategy name is not one of `config.STRATEGIES`."""


def make_proposer(
    strategy: str,
    config: SpecConfig,
    *,
    book: AcceptanceBook | None = None,
    link: LinkModel = DEFAULT_LINK,
    draft: DraftModel | None = None,
    sampling: SamplingParams | None = None,
) -> Proposer:
    """A fresh proposer for `strategy` (call `reset(prompt)` before each request).

    `book` (per model) and `link` (measured route costs) are used by `auto` only; `draft` is
    the node's draft model (`draft`, `draft-ngram`, and `auto` where it is given) and
    `sampling` the request's (the draft drafts for it).
    """
    if strategy in DRAFT_STRATEGIES and draft is None:
        raise UnknownStrategyError(f"speculative strategy {strategy!r} needs a draft model")
    if strategy == "draft" and draft is not None:
        return DraftProposer(config, draft, sampling)
    if strategy == "draft-ngram" and draft is not None:
        return DraftNgram(config, draft, sampling)
    if strategy == "disabled":
        return DisabledProposer(config)
    if strategy == "ngram-simple":
        return NgramSimple(config)
    if strategy == "ngram-cache":
        return NgramCache(config)
    if strategy == "mtp":
        return MtpProposer(config)
    if strategy == "mtp-simple":
        return MtpHybrid(strategy, config, MtpProposer(config), NgramSimple(config))
    if strategy == "mtp-cache":
        return MtpHybrid(strategy, config, MtpProposer(config), NgramCache(config))
    if strategy == "auto":
        return AutoProposer(config, book, link, draft=draft, sampling=sampling)
    raise UnknownStrategyError(
        f"unknown speculative strategy {strategy!r}; allowed: {', '.join(STRATEGIES)}"
    )
