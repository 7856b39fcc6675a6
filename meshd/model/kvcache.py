"""Positional KV cache: one preallocated tensor per session per stage, written by position.

A window at `base_pos` writes keys/values at `base_pos .. base_pos+T-1` and attends over
`0 .. base_pos+T-1`. Whatever a rejected speculative window wrote beyond that is never read and
is overwritten by the next window at a lower `base_pos`, so rollback needs no call. The only
rule enforced is that a window may not leave a gap: `base_pos` must not exceed the number of
positions already written (`valid_len`).

A session holds one *group* for the stage's decoder layers and, on the last stage, one group
per MTP depth (each depth has its own sequence of positions).

Prefix cache: when a session closes, the coordinator may ask to keep the KV of its first n
positions (the decoder layers' group only) as an *entry*, named by an id the coordinator
chose. A later session may open from an entry: its first p <= n positions are copied in and
its windows start at p. Entries live within `cache_limit_bytes` and within the stage's KV
budget together with the sessions; sessions always win: an open that needs room evicts
entries, least recently used first, and an entry that does not fit is not kept. Nothing ever
waits for the cache or fails because of it: an entry that is gone is a miss, and the session
opens empty. An entry remembers the nodes it depends on (`peers`): the coordinator that asked for
it, whose index alone names it, and the stages next to this one on the route it was kept on.
When one of them is lost, the coordinator went with it or forgets the route's index, so the
entry would never be hit again, and it is dropped (`drop_entries_of`; were it still named, the
open would be a miss, which is always safe). A coordinator whose index stops naming an entry
(evicted, replaced, or its route forgotten) tells the stages, which drop it (`drop_entries`:
only the entry's own coordinator may), so no stage holds KV no index can name.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from meshd.model.errors import KVBudgetExceeded, SessionError
from meshd.model.llama import LayerCache


@dataclass(eq=False)
class KVGroup:
    """Keys and values of `n` layers over `max_positions` positions, plus how far they are valid.

    One tensor `[n, max_positions, 2 * kv_heads, head_dim]`: at each position a layer's keys
    then its values, the order in which a q/k/v row carries them (one copy writes both).
    """

    kv: torch.Tensor
    valid_len: int = 0
    layers: list[LayerCache] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.layers = [LayerCache.over(self.kv[i : i + 1]) for i in range(len(self.kv))]

    @property
    def k(self) -> torch.Tensor:
        """The keys, `[n, max_positions, kv_heads, head_dim]` (a view)."""
        return self.kv[:, :, : self.kv.shape[2] // 2]

    @property
    def v(self) -> torch.Tensor:
        """The values, `[n, max_positions, kv_heads, head_dim]` (a view)."""
        return self.kv[:, :, self.kv.shape[2] // 2 :]

    @property
    def max_positions(self) -> int:
        """How many positions this group can hold."""
        return int(self.kv.shape[1])

    def check_window(self, session_id: str, base_pos: int, length: int, what: str) -> None:
        """Raise `SessionError` unless a window at `base_pos` of `length` fits with no gap."""
        if length < 1:
            raise SessionError(f"session {session_id!r}: empty window for {what}")
        if base_pos < 0 or base_pos > self.valid_len:
            raise SessionError(
                f"session {session_id!r}: {what} window at position {base_pos} would leave a gap "
                f"(positions 0..{self.valid_len - 1} are written)"
            )
        if base_pos + length > self.max_positions:
            raise SessionError(
                f"session {session_id!r}: {what} window ends at position {base_pos + length}, "
                f"beyond the session's max_positions {self.max_positions}"
            )


@dataclass(eq=False)
class SessionKV:
    """Every cache group of one session on one stage."""

    main: KVGroup
    mtp: list[KVGroup]
    nbytes: int


@dataclass(frozen=True)
class KVLayout:
    """What a stage caches per position: layer count, MTP depths, heads, element type."""

    n_layers: int
    n_mtp: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        """Bytes of K and V per position for all layers and MTP depths of the stage."""
        itemsize = torch.empty(0, dtype=self.dtype).element_size()
        return 2 * (self.n_layers + self.n_mtp) * self.kv_heads * self.head_dim * itemsize


@dataclass(eq=False)
class PrefixEntry:
    """A kept prefix: the decoder layers' KV of positions [0, positions)."""

    kv: torch.Tensor  # [n_layers, positions, 2 * kv_heads, head_dim]
    peers: frozenset[bytes] = frozenset()  # its coordinator and neighbouring stages
    coordinator: bytes = b""  # the node that asked for it: the only one that may drop it

    @property
    def positions(self) -> int:
        """Positions held."""
        return int(self.kv.shape[1])

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        return self.kv.numel() * self.kv.element_size()


@dataclass
class PrefixCacheStats:
    """What the prefix cache did on this stage (for status, metrics and tests)."""

    hits: int = 0  # sessions opened from an entry
    misses: int = 0  # sessions that asked for an entry this stage no longer had
    reused_tokens: int = 0  # positions copied from entries instead of computed
    kept: int = 0  # entries kept at a session's close
    not_kept: int = 0  # entries asked for that did not fit (or had too few positions)
    evictions: int = 0  # entries evicted to make room (least recently used first)
    dropped: int = 0  # entries freed because their coordinator's index no longer names them


class KVCache:
    """Sessions' positional caches on one stage, within an optional memory budget, and the
    prefix-cache entries kept from closed sessions (see the module docstring)."""

    def __init__(
        self,
        layout: KVLayout,
        device: torch.device,
        budget_bytes: int | None,
        cache_limit_bytes: int = 0,
    ) -> None:
        """`cache_limit_bytes`: bytes prefix-cache entries may hold at most (0: keep none)."""
        self.layout = layout
        self.device = device
        self.budget_bytes = budget_bytes
        self.cache_limit_bytes = cache_limit_bytes
        self._sessions: dict[str, SessionKV] = {}
        self.used_bytes = 0
        # Least recently used first.
        self._entries: OrderedDict[int, PrefixEntry] = OrderedDict()
        self.cache_bytes = 0
        self.cache_stats = PrefixCacheStats()

    @property
    def entries(self) -> int:
        """Prefix-cache entries held."""
        return len(self._entries)

    def entry_positions(self, entry_id: int) -> int:
        """Positions entry `entry_id` holds (0: not held)."""
        entry = self._entries.get(entry_id)
        return 0 if entry is None else entry.positions

    def open(
        self, session_id: str, max_positions: int, *, prefix: tuple[int, int] | None = None
    ) -> int:
        """Allocate a session's cache for up to `max_positions` positions.

        `prefix` = (entry id, p): start with the entry's first p positions. Returns the
        positions taken from the entry: p on a hit, 0 without a prefix or on a miss (the
        entry is gone or shorter, or memory for the session needs its bytes).
        """
        if session_id in self._sessions:
            raise SessionError(f"session {session_id!r} is already open")
        if max_positions < 1:
            raise SessionError(f"session {session_id!r}: max_positions must be >= 1")
        nbytes = self.layout.bytes_per_token * max_positions
        source: PrefixEntry | None = None
        if prefix is not None:
            found = self._entries.get(prefix[0])
            if found is not None and 0 < prefix[1] <= min(found.positions, max_positions):
                source = found
        self._make_room(nbytes, spare=source)
        if source is not None and not self._fits(nbytes):
            self._make_room(nbytes, spare=None)  # the session comes first: the entry goes too
            source = source if prefix is not None and prefix[0] in self._entries else None
        if not self._fits(nbytes):
            raise KVBudgetExceeded(
                f"session {session_id!r} needs {nbytes} bytes of KV cache for {max_positions} "
                f"positions; {self.used_bytes} of {self.budget_bytes} bytes are in use"
            )
        try:
            main, mtp = self._allocate(max_positions)
        except (torch.OutOfMemoryError, RuntimeError) as exc:
            if not self._entries:
                # With no budget set, the device itself is the budget.
                raise KVBudgetExceeded(
                    f"session {session_id!r}: cannot allocate {nbytes} bytes of KV cache on "
                    f"{self.device} ({str(exc).splitlines()[0]})"
                ) from None
            self.clear_entries()  # the device is full: the cache gives way to the session
            if prefix is not None:
                self.cache_stats.misses += 1
            return self.open(session_id, max_positions)
        reused = 0
        if source is not None and prefix is not None:
            reused = prefix[1]
            main.kv[:, :reused].copy_(source.kv[:, :reused])
            main.valid_len = reused
            self._entries.move_to_end(prefix[0])
            self.cache_stats.hits += 1
            self.cache_stats.reused_tokens += reused
        elif prefix is not None:
            self.cache_stats.misses += 1
        self._sessions[session_id] = SessionKV(main, mtp, nbytes)
        self.used_bytes += nbytes
        return reused

    def _allocate(self, max_positions: int) -> tuple[KVGroup, list[KVGroup]]:
        lay = self.layout
        main = self._group(lay.n_layers, max_positions)
        return main, [self._group(1, max_positions) for _ in range(lay.n_mtp)]

    def _fits(self, nbytes: int, *, freeing: int = 0) -> bool:
        if self.budget_bytes is None:
            return True
        return self.used_bytes - freeing + self.cache_bytes + nbytes <= self.budget_bytes

    def _make_room(self, nbytes: int, spare: PrefixEntry | None, *, freeing: int = 0) -> None:
        """Evict entries, least recently used first (never `spare`), until `nbytes` fit."""
        for entry_id, entry in list(self._entries.items()):
            if self._fits(nbytes, freeing=freeing):
                return
            if entry is not spare:
                self._drop(entry_id)
                self.cache_stats.evictions += 1

    def keep(
        self,
        session_id: str,
        entry_id: int,
        positions: int,
        *,
        peers: frozenset[bytes] = frozenset(),
        coordinator: bytes = b"",
    ) -> bool:
        """Keep the open session's first `positions` positions as entry `entry_id`, depending on
        `peers` and owned by `coordinator` (its KV is about to be freed: its bytes count as
        free). False when it holds fewer positions or the entry does not fit the cache's limit
        and the budget beside the live sessions."""
        session = self.get(session_id)
        main = session.main
        per_position = main.kv[:, :1].numel() * main.kv.element_size()
        nbytes = per_position * positions
        if (
            entry_id <= 0
            or not 0 < positions <= main.valid_len
            or nbytes > self.cache_limit_bytes
            or not self._fits(nbytes, freeing=session.nbytes + self.cache_bytes)
        ):
            self.cache_stats.not_kept += 1
            return False
        if entry_id in self._entries:
            self._drop(entry_id)
        for old_id in list(self._entries):
            if self.cache_bytes + nbytes <= self.cache_limit_bytes:
                break
            self._drop(old_id)
            self.cache_stats.evictions += 1
        self._make_room(nbytes, spare=None, freeing=session.nbytes)
        entry = PrefixEntry(main.kv[:, :positions].clone(), peers, coordinator)
        self._entries[entry_id] = entry
        self.cache_bytes += nbytes
        self.cache_stats.kept += 1
        return True

    def drop_entries(self, entry_ids: Iterable[int], coordinator: bytes) -> int:
        """Free those of `entry_ids` that `coordinator` asked for (its index no longer names
        them); how many. Ids not held, or held for another coordinator, are skipped: a node
        may only drop what it made."""
        count = 0
        for entry_id in entry_ids:
            entry = self._entries.get(entry_id)
            if entry is not None and entry.coordinator == coordinator:
                self._drop(entry_id)
                count += 1
        self.cache_stats.dropped += count
        return count

    def drop_entries_of(self, peer: bytes) -> int:
        """Free every entry that depends on `peer` (it is gone: nothing will name them again);
        how many there were. Not evictions: no room was needed."""
        mine = [entry_id for entry_id, entry in self._entries.items() if peer in entry.peers]
        for entry_id in mine:
            self._drop(entry_id)
        return len(mine)

    def _drop(self, entry_id: int) -> None:
        entry = self._entries.pop(entry_id)
        self.cache_bytes -= entry.nbytes

    def clear_entries(self) -> int:
        """Free every entry (counted as evictions); how many there were."""
        count = len(self._entries)
        for entry_id in list(self._entries):
            self._drop(entry_id)
        self.cache_stats.evictions += count
        return count

    def _group(self, n: int, max_positions: int) -> KVGroup:
        lay = self.layout
        shape = (n, max_positions, 2 * lay.kv_heads, lay.head_dim)
        # Zeroed so that a bug reading unwritten positions shows up as wrong numbers, not NaNs.
        return KVGroup(torch.zeros(shape, dtype=lay.dtype, device=self.device))

    def close(self, session_id: str) -> bool:
        """Free a session's cache; False if it was not open (closing twice is harmless)."""
        session = self._sessions.pop(session_id, None)
        if session is None:
            return False
        self.used_bytes -= session.nbytes
        return True

    def get(self, session_id: str) -> SessionKV:
        """The open session `session_id`, or `SessionError`."""
        try:
            return self._sessions[session_id]
        except KeyError:
            raise SessionError(f"session {session_id!r} is not open on this stage") from None

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._sessions

    def __len__(self) -> int:
        return len(self._sessions)
