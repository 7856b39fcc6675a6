"""n-gram proposers over the session's own history (prompt + committed tokens).

`ngram-simple` is prompt lookup: the longest suffix of the history (n from ngram_max down to
ngram_min) that occurred before, continued by the tokens that followed it. Unlike
transformers' prompt lookup, which takes the leftmost occurrence, it takes the MOST RECENT
earlier occurrence: in chat, code edits and agent loops the newest copy of a phrase is the one
the model is currently re-using (a renamed variable, the latest version of a function), and an
index that keeps only the newest occurrence per n-gram is updated in O(ngram_max) per token
and answered in O(ngram_max) per proposal, however long the history.

`ngram-cache` keeps counts of the continuations of every context of length n and proposes the
most frequent continuation (ties: the most recent), chained token by token, while its count
reaches `ngram_cache_min_hits`. Its statistics are per request: `reset` clears them (another
request's text misleads them; docs/speculative.md).

Both copy drafts LZ77-style: a continuation that runs into the end of the history continues
with the drafts themselves, so a repeating loop is proposed for the whole window.
"""

from __future__ import annotations

from collections.abc import Sequence

from meshd.speculative.config import SpecConfig
from meshd.speculative.proposer import AccountedProposer


class _History(AccountedProposer):
    """The session's token log and the n-gram range, shared by both n-gram strategies."""

    def __init__(self, config: SpecConfig) -> None:
        super().__init__(config)
        self.n_min = config.ngram_min
        self.n_max = config.ngram_max
        self.tokens: list[int] = []
        self._clear_index()

    def reset(self, prompt: Sequence[int]) -> None:
        """Start a new request: forget everything, then index `prompt`."""
        self._clear_stats()
        self.tokens = []
        self._clear_index()
        self.observe(prompt)

    def observe(self, committed: Sequence[int]) -> None:
        """Append committed tokens and index them."""
        for token in committed:
            self.tokens.append(int(token))
            self._index_last()

    def propose(self, max_tokens: int, mtp_draft: Sequence[int] = ()) -> list[int]:
        """Drafts after the history (`mtp_draft` is ignored)."""
        return self.propose_after((), max_tokens)

    def propose_after(self, assumed: Sequence[int], max_tokens: int) -> list[int]:
        """Drafts after the history followed by `assumed` (occurrences inside `assumed` are not
        indexed; its tail is matched against the history)."""
        raise NotImplementedError

    def _tail(self, assumed: Sequence[int]) -> list[int]:
        """The last `n_max` tokens of history + assumed."""
        return [*self.tokens[-self.n_max :], *(int(t) for t in assumed)][-self.n_max :]

    def _clear_index(self) -> None:
        raise NotImplementedError

    def _index_last(self) -> None:
        raise NotImplementedError


class NgramSimple(_History):
    """Prompt lookup: continue the most recent earlier occurrence of the longest suffix."""

    name = "ngram-simple"

    def _clear_index(self) -> None:
        # n → {n-gram: index of the token that followed its most recent occurrence}
        self._next: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(self.n_min, self.n_max + 1)
        }

    def _index_last(self) -> None:
        tokens = self.tokens
        i = len(tokens) - 1  # the new token is the continuation of the n-grams ending before it
        for n in range(self.n_min, min(self.n_max, i) + 1):
            self._next[n][tuple(tokens[i - n : i])] = i

    def propose_after(self, assumed: Sequence[int], max_tokens: int) -> list[int]:
        """Drafts continuing the longest matching suffix of history + `assumed`."""
        if max_tokens <= 0:
            return []
        tail = self._tail(assumed)
        for n in range(min(self.n_max, len(tail)), self.n_min - 1, -1):
            start = self._next[n].get(tuple(tail[-n:]))
            if start is not None:
                return self._copy(start, [int(t) for t in assumed], max_tokens)
        return []

    def _copy(self, start: int, assumed: list[int], count: int) -> list[int]:
        history = self.tokens
        known = len(history) + len(assumed)
        out: list[int] = []
        for i in range(count):
            at = start + i
            if at < len(history):
                out.append(history[at])
            elif at < known:
                out.append(assumed[at - len(history)])
            else:
                out.append(out[at - known])  # overlapping copy: the loop repeats itself
        return out


class NgramCache(_History):
    """Most frequent continuation chains from per-request n-gram counts."""

    name = "ngram-cache"

    def __init__(self, config: SpecConfig) -> None:
        self.min_hits = config.ngram_cache_min_hits
        super().__init__(config)

    def _clear_index(self) -> None:
        # n → {context: {next token: count}} and n → {context: most frequent next token}
        self._counts: dict[int, dict[tuple[int, ...], dict[int, int]]] = {
            n: {} for n in range(self.n_min, self.n_max + 1)
        }
        self._best: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(self.n_min, self.n_max + 1)
        }

    def _index_last(self) -> None:
        tokens = self.tokens
        i = len(tokens) - 1
        token = tokens[i]
        for n in range(self.n_min, min(self.n_max, i) + 1):
            context = tuple(tokens[i - n : i])
            counts = self._counts[n].setdefault(context, {})
            counts[token] = counts.get(token, 0) + 1
            best = self._best[n].get(context)
            # `>=`: among equally frequent continuations the most recent wins.
            if best is None or counts[token] >= counts[best]:
                self._best[n][context] = token

    def count(self, context: Sequence[int], token: int) -> int:
        """How often `token` followed `context` in this request (0 when never)."""
        n = len(context)
        if n not in self._counts:
            return 0
        return self._counts[n].get(tuple(int(t) for t in context), {}).get(int(token), 0)

    def propose_after(self, assumed: Sequence[int], max_tokens: int) -> list[int]:
        """Chain the most frequent continuation of the longest context seen often enough."""
        tail = self._tail(assumed)
        out: list[int] = []
        while len(out) < max_tokens:
            token = self._next_token(tail)
            if token is None:
                break
            out.append(token)
            tail = [*tail[1 - self.n_max :], token] if self.n_max > 1 else [token]
        return out

    def _next_token(self, tail: list[int]) -> int | None:
        for n in range(min(self.n_max, len(tail)), self.n_min - 1, -1):
            context = tuple(tail[-n:])
            best = self._best[n].get(context)
            if best is not None and self._counts[n][context][best] >= self.min_hits:
                return best
        return None
