"""Positional KV cache: one preallocated tensor per session per stage, written by position.

A window at `base_pos` writes keys/values at `base_pos .. base_pos+T-1` and attends over
`0 .. base_pos+T-1`. Whatever a rejected speculative window wrote beyond that is never read and
is overwritten by the next window at a lower `base_pos`, so rollback needs no call. The only
rule enforced is that a window may not leave a gap: `base_pos` must not exceed the number of
positions already written (`valid_len`).

A session holds one *group* for the stage's decoder layers and, on the last stage, one group
per MTP depth (each depth has its own sequence of positions).
"""

from __future__ import annotations

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


class KVCache:
    """Sessions' positional caches on one stage, within an optional memory budget."""

    def __init__(self, layout: KVLayout, device: torch.device, budget_bytes: int | None) -> None:
        self.layout = layout
        self.device = device
        self.budget_bytes = budget_bytes
        self._sessions: dict[str, SessionKV] = {}
        self.used_bytes = 0

    def open(self, session_id: str, max_positions: int) -> None:
        """Allocate a session's cache for up to `max_positions` positions."""
        if session_id in self._sessions:
            raise SessionError(f"session {session_id!r} is already open")
        if max_positions < 1:
            raise SessionError(f"session {session_id!r}: max_positions must be >= 1")
        nbytes = self.layout.bytes_per_token * max_positions
        if self.budget_bytes is not None and self.used_bytes + nbytes > self.budget_bytes:
            raise KVBudgetExceeded(
                f"session {session_id!r} needs {nbytes} bytes of KV cache for {max_positions} "
                f"positions; {self.used_bytes} of {self.budget_bytes} bytes are in use"
            )
        lay = self.layout
        try:
            main = self._group(lay.n_layers, max_positions)
            mtp = [self._group(1, max_positions) for _ in range(lay.n_mtp)]
        except (torch.OutOfMemoryError, RuntimeError) as exc:
            # With no budget set, the device itself is the budget.
            raise KVBudgetExceeded(
                f"session {session_id!r}: cannot allocate {nbytes} bytes of KV cache on "
                f"{self.device} ({str(exc).splitlines()[0]})"
            ) from None
        self._sessions[session_id] = SessionKV(main, mtp, nbytes)
        self.used_bytes += nbytes

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
