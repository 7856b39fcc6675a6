"""The coordinator's index of prompt prefixes its route's stages keep (sans-IO: `now` passed in).

Stages after the first never see token ids, so the coordinator names what they keep: when a
request ends, it asks every stage of the route to keep the session's KV of positions [0, n) as
entry E (`CloseSession.keep_entry`) and records here which tokens E holds. A later request over
the same route looks up its prompt, and opens "from E, first p positions"
(`OpenSession.prefix_entry`); its prefill sends only positions p.. .

Every way an entry leaves the index reports its id (`record`'s eviction and replacement,
`forget`, `clear`), so the coordinator can tell the stages to free its KV (`DropEntries`).

Lookup walks a hash chain of token blocks: block k's key is the hash of (key of block k-1,
tokens of block k), and each key maps to the entries whose tokens start with those blocks. The
deepest key the prompt reaches names the entries sharing the most whole blocks with it; their
exact common prefix is then compared token by token (which also rules out hash collisions).

Which positions may be reused (`exact`):
- Exact (the default): a prefill chunk runs layer by layer, where a row's bits depend on the
  rows computed with it (MKL's fp32 sums, batched attention), so the KV of a position equals a
  cold run's only if the same window computed it. The prefill cuts prompts at multiples of
  `chunk_tokens` from position 0, so a whole chunk of an earlier prompt is the window a cold
  run of any prompt sharing it computes. Only positions inside whole prompt chunks computed
  that way (`_Entry.exact`) are reused, in whole chunks: greedy output with a hit equals a cold
  run's bit for bit. Decoded tokens and a prompt's last partial chunk are computed again, once,
  by the next request's prefill, after which they are exact too.
- Not exact: every position an entry holds is reused (decoded tokens included). A position's
  KV may then differ from a cold run's in the last bits, and a greedy token at a near-tie may
  differ.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from meshd.stage.host_config import PREFIX_CACHE_ENTRIES

# Tokens per block of the hash chain: prefixes shorter than this are never looked up.
BLOCK_TOKENS = 16


@dataclass(frozen=True)
class PrefixHit:
    """Open the session from `entry`'s first `positions` positions; `exact` of them were
    computed as a cold run computes them."""

    entry: int
    positions: int
    exact: int


@dataclass(frozen=True)
class KeepPlan:
    """What to keep when a session ends: `tokens` (positions [0, len)) as a new entry, of which
    the first `exact` were computed as a cold run computes them; `replaces`: an entry it covers."""

    tokens: tuple[int, ...]
    exact: int
    replaces: int = 0


@dataclass
class PrefixCounters:
    """What the coordinator's prefix cache did, over all routes (status and metrics)."""

    lookups: int = 0  # requests that looked for a prefix
    hits: int = 0  # requests that opened from an entry
    reused_tokens: int = 0  # prompt positions not prefilled thanks to a hit
    misses: int = 0  # hits a stage could not serve: prefilled in full instead
    prompt_tokens: int = 0  # prompt tokens of the requests that looked
    kept: int = 0  # entries asked of the stages


@dataclass
class _Entry:
    tokens: tuple[int, ...]
    exact: int
    keys: list[int]  # chain keys of its whole blocks


class PrefixIndex:
    """The entries one route's stages were asked to keep, newest use last (bounded)."""

    def __init__(
        self, *, chunk_tokens: int, exact: bool = True, max_entries: int = PREFIX_CACHE_ENTRIES
    ) -> None:
        if chunk_tokens < 1 or max_entries < 1:
            raise ValueError("chunk_tokens and max_entries must be >= 1")
        self.chunk_tokens = chunk_tokens
        self.exact = exact
        self.max_entries = max_entries
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._by_key: dict[int, set[int]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, entry_id: object) -> bool:
        return entry_id in self._entries

    def lookup(self, prompt: Sequence[int]) -> PrefixHit | None:
        """The entry that saves `prompt` the most positions, or None. At least one prompt
        token is always left to compute (its logits give the first new token)."""
        prompt = tuple(prompt)
        candidates: set[int] = set()
        for key in _chain(prompt):
            found = self._by_key.get(key)
            if not found:
                break
            candidates = found
        best: PrefixHit | None = None
        for entry_id in candidates:
            entry = self._entries[entry_id]
            common = _common_prefix(entry.tokens, prompt)
            positions, exact = self._reusable(entry, common, len(prompt))
            if positions > 0 and (best is None or positions > best.positions):
                best = PrefixHit(entry_id, positions, exact)
        if best is not None:
            self._entries.move_to_end(best.entry)
        return best

    def _reusable(self, entry: _Entry, common: int, prompt_len: int) -> tuple[int, int]:
        """(positions to reuse, how many of them are exact) for a prompt sharing `common`."""
        limit = min(common, prompt_len - 1)
        if self.exact:
            chunk = self.chunk_tokens
            positions = min(limit, entry.exact) // chunk * chunk
            return positions, positions
        positions = min(limit, len(entry.tokens))
        return positions, min(positions, entry.exact)

    def plan_keep(
        self, kv_tokens: Sequence[int], prompt_len: int, hit: PrefixHit | None
    ) -> KeepPlan | None:
        """What a session that ended normally should leave behind (None: nothing worth it).

        `kv_tokens` are the tokens whose KV every stage holds at positions [0, len): the
        prompt's `prompt_len`, then the committed ones run so far. With exact reuse only the
        exact positions are kept (no other position would ever be reused). `hit` is the prefix it
        opened from (None when it prefilled in full). Positions before the hit's exact ones,
        and whole prompt chunks after an exact, chunk-aligned hit, were computed as a cold run
        computes them.
        """
        tokens = tuple(kv_tokens)
        chunk = self.chunk_tokens
        if hit is None or (hit.exact == hit.positions and hit.positions % chunk == 0):
            exact = prompt_len // chunk * chunk
        else:
            exact = hit.exact // chunk * chunk
        exact = min(exact, len(tokens))
        if self.exact:
            tokens = tokens[:exact]  # the rest would never be reused
        if len(tokens) < (chunk if self.exact else BLOCK_TOKENS):
            return None
        replaces = 0
        if hit is not None:
            old = self._entries.get(hit.entry)
            covered = old is not None and tokens[: len(old.tokens)] == old.tokens
            if old is not None and covered and exact >= old.exact:
                replaces = hit.entry
        return KeepPlan(tokens, exact, replaces)

    def record(self, entry_id: int, plan: KeepPlan) -> list[int]:
        """The stages were asked to keep `plan` as `entry_id`; returns the entries this index
        dropped (the one it replaces, and the least recently used past `max_entries`)."""
        dropped: list[int] = []
        if plan.replaces and self.forget(plan.replaces):
            dropped.append(plan.replaces)
        keys = list(_chain(plan.tokens))
        self._entries[entry_id] = _Entry(plan.tokens, plan.exact, keys)
        for key in keys:
            self._by_key.setdefault(key, set()).add(entry_id)
        while len(self._entries) > self.max_entries:
            oldest = next(iter(self._entries))
            self.forget(oldest)
            dropped.append(oldest)
        return dropped

    def clear(self) -> list[int]:
        """Drop every entry (the route's stages may no longer hold them); returns their ids."""
        dropped = list(self._entries)
        self._entries.clear()
        self._by_key.clear()
        return dropped

    def forget(self, entry_id: int) -> bool:
        """Drop an entry (a stage no longer holds it); False if it was not here."""
        entry = self._entries.pop(entry_id, None)
        if entry is None:
            return False
        for key in entry.keys:
            holders = self._by_key.get(key)
            if holders is not None:
                holders.discard(entry_id)
                if not holders:
                    del self._by_key[key]
        return True


def _chain(tokens: tuple[int, ...]) -> list[int]:
    """Chain keys of the whole blocks of `tokens`."""
    keys: list[int] = []
    key = 0
    for lo in range(0, len(tokens) - BLOCK_TOKENS + 1, BLOCK_TOKENS):
        key = hash((key, tokens[lo : lo + BLOCK_TOKENS]))
        keys.append(key)
    return keys


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Length of the longest common prefix (slice comparisons run in C)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
