"""MTP-based proposers: the last stage's multi-token-prediction draft, alone or extended.

The last stage sends, with each reply, up to `mtp_depth` tokens its MTP heads predict after
the token it just committed. `mtp` proposes exactly that draft. `mtp-simple` and `mtp-cache`
propose the MTP draft followed by an n-gram tail of up to `extension_tokens` tokens, looked up
after history + MTP tokens by ngram-simple or ngram-cache.

Where the n-gram's own continuation starts with the MTP draft's first token, the model is
copying what the n-gram follows, and the hybrids propose that copy (up to the same length)
instead: past its first token an MTP draft is a guess, and a confirmed copy is right more
often (figures: docs/speculative.md).
"""

from __future__ import annotations

from collections.abc import Sequence

from meshd.speculative.config import SpecConfig
from meshd.speculative.ngram import NgramCache, NgramSimple
from meshd.speculative.proposer import AccountedProposer


class MtpProposer(AccountedProposer):
    """The latest MTP draft, kept aligned with the log as tokens commit."""

    name = "mtp"

    def __init__(self, config: SpecConfig) -> None:
        super().__init__(config)
        self.depth = config.mtp_depth
        self._draft: list[int] = []

    def reset(self, prompt: Sequence[int]) -> None:
        """New request: forget the draft."""
        self._clear_stats()
        self._draft = []

    def observe(self, committed: Sequence[int]) -> None:
        """Drop the committed prefix of the draft; a draft the log contradicts is discarded."""
        done = [int(t) for t in committed]
        if self._draft[: len(done)] == done:
            self._draft = self._draft[len(done) :]
        else:
            self._draft = []

    def propose(self, max_tokens: int, mtp_draft: Sequence[int] = ()) -> list[int]:
        """The newest MTP draft (`mtp_draft` when given, else what is left of the last one)."""
        if mtp_draft:
            self._draft = [int(t) for t in mtp_draft[: self.depth]]
        return self._draft[: max(0, max_tokens)]

    def propose_after(self, assumed: Sequence[int], max_tokens: int) -> list[int]:
        """The rest of the MTP draft when `assumed` is its prefix, else nothing."""
        lead = [int(t) for t in assumed]
        if len(lead) > len(self._draft) or self._draft[: len(lead)] != lead:
            return []
        return self._draft[len(lead) :][: max(0, max_tokens)]


class MtpHybrid(AccountedProposer):
    """MTP prefix + n-gram tail (`mtp-simple` over NgramSimple, `mtp-cache` over NgramCache).

    With `owns_parts=False` the parts are shared with someone else (the `auto` proposer) who
    resets and feeds them; this object then only composes their proposals.
    """

    def __init__(
        self,
        name: str,
        config: SpecConfig,
        mtp: MtpProposer,
        tail: NgramSimple | NgramCache,
        *,
        owns_parts: bool = True,
    ) -> None:
        super().__init__(config)
        self.name = name
        self.mtp = mtp
        self.tail = tail
        self.extension_tokens = config.extension_tokens
        self._owns_parts = owns_parts

    def reset(self, prompt: Sequence[int]) -> None:
        """New request."""
        self._clear_stats()
        if self._owns_parts:
            self.mtp.reset(prompt)
            self.tail.reset(prompt)

    def observe(self, committed: Sequence[int]) -> None:
        """Feed the committed tokens to both parts."""
        if self._owns_parts:
            self.mtp.observe(committed)
            self.tail.observe(committed)

    def propose(self, max_tokens: int, mtp_draft: Sequence[int] = ()) -> list[int]:
        """MTP draft, then n-gram tokens after it (or the n-gram's copy, where it agrees)."""
        return self._compose((), self.mtp.propose(max_tokens, mtp_draft), max_tokens)

    def propose_after(self, assumed: Sequence[int], max_tokens: int) -> list[int]:
        """The MTP draft's rest after `assumed`, then n-gram tokens after both."""
        return self._compose(assumed, self.mtp.propose_after(assumed, max_tokens), max_tokens)

    def _compose(self, assumed: Sequence[int], head: list[int], max_tokens: int) -> list[int]:
        if head:
            copy = self.tail.propose_after(
                assumed, min(max_tokens, len(head) + self.extension_tokens)
            )
            if len(copy) >= len(head) and copy[0] == head[0]:
                return copy  # (a shorter copy, say a sparse ngram-cache chain, would drop drafts)
        room = min(self.extension_tokens, max_tokens - len(head))
        return head + (self.tail.propose_after([*assumed, *head], room) if room > 0 else [])
