"""MTP drafts on the last stage, kept exact under positional rollback.

After a window is verified, the last stage runs the model's MTP depths from the hidden state of
the last accepted position, so the next draft costs no extra round trip. Each depth k has its
own positional KV cache, and its input at position i needs `t[i+k]` — a token that may still be
a draft (the tip of the chain) when the depth runs. The rule that keeps every depth exact:

- a window at `base_pos = b` re-runs depth k over positions `b-k .. end`, so every position
  that earlier ran on a draft token (at most k-1 of them, all at or after `b-k+1`) is recomputed
  now that its token is known, and overwrites its KV entry;
- the one input row before a depth's run (depth k-1's hidden at `b-k`) comes from a small
  position-keyed ring of recent hidden rows per depth.

A row whose input is unchanged need not run again, and most do not: depth k's row at `b-k+j`
ran on `t[b+j]`, which the previous window usually knew already (depth 1's rows always), or
drafted right. So each depth records, per position, the token its row ran on, and a window
re-runs depth k only from the first row in `b-k .. b-1` whose recorded token differs from the
one now known (or that depth k-1 ran again, or that is not recorded as consistent with depth
k-1's rows): the depths mostly run one row each instead of k+1, and the vocabulary head only
for the row that drafts (figures: docs/speculative.md, "MTP heads").

Rows before `b-k` are never touched, and the records say exactly what each held row ran on,
so a rollback window (lower `b`) after a stale, wrongly-assumed window just works, like the
main model's positional KV.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from meshd.model.errors import SessionError
from meshd.model.kernels.blocks import argmax_rows
from meshd.model.stage import StageModel


class MtpStateLost(Exception):
    """A needed earlier hidden row has left the ring (windows ran too far ahead)."""


@dataclass
class _Ring:
    """Hidden rows of recent positions for one depth, tagged with their positions."""

    rows: torch.Tensor  # [R, hidden]
    tags: list[int]  # [R] positions, -1 where empty (a list: read and written per row)

    def put(self, start: int, rows: torch.Tensor) -> None:
        size = len(self.tags)
        n = rows.shape[0]
        if n > size:
            rows, start, n = rows[-size:], start + n - size, size
        first = start % size
        head = min(n, size - first)  # rows up to the ring's end, then the rest from slot 0
        self.rows[first : first + head] = rows[:head]
        self.rows[: n - head] = rows[head:]
        for j in range(n):
            self.tags[(start + j) % size] = start + j

    def get(self, position: int) -> torch.Tensor:
        slot = position % len(self.tags)
        if self.tags[slot] != position:
            raise MtpStateLost(f"hidden row for position {position} is no longer held")
        return self.rows[slot : slot + 1]


@dataclass
class _Inputs:
    """Per depth: the token each held row ran on, position-keyed, and how far they are sound.

    `clean` bounds the rows known to match depth k-1's rows as they are now: a row at or after
    it runs again whatever its token.
    """

    tokens: list[int]
    tags: list[int]
    clean: int = 0

    def put(self, start: int, ids: Sequence[int]) -> None:
        size = len(self.tags)
        for j, token in enumerate(ids):
            slot = (start + j) % size
            self.tokens[slot] = token
            self.tags[slot] = start + j

    def same(self, position: int, token: int) -> bool:
        slot = position % len(self.tags)
        return self.tags[slot] == position and self.tokens[slot] == token


class MtpDrafter:
    """Runs the MTP depths of a last stage after each window and returns greedy drafts."""

    def __init__(
        self, stage: StageModel, ring_positions: int = 512, *, reuse_rows: bool = True
    ) -> None:
        """`reuse_rows=False` re-runs every row from `b-k` with logits for all of them: the
        baseline `meshd bench mtp` times."""
        if not stage.is_last:
            raise ValueError("MTP drafts run on the last stage")
        self.stage = stage
        self.reuse_rows = reuse_rows
        self.depth = len(stage.mtp)
        self.ring_positions = ring_positions
        self._rings: dict[str, list[_Ring]] = {}
        self._inputs: dict[str, list[_Inputs]] = {}

    def open(self, session_id: str) -> None:
        """Start tracking a session (its KV is opened by the stage)."""
        h = self.stage.config.hidden_size
        self._rings[session_id] = [
            _Ring(
                torch.zeros(self.ring_positions, h, dtype=self.stage.dtype),
                [-1] * self.ring_positions,
            )
            for _ in range(self.depth)
        ]
        size = self.ring_positions
        self._inputs[session_id] = [_Inputs([0] * size, [-1] * size) for _ in range(self.depth)]

    def close(self, session_id: str) -> None:
        """Forget a session."""
        self._rings.pop(session_id, None)
        self._inputs.pop(session_id, None)

    @torch.inference_mode()
    def after_window(
        self,
        session_id: str,
        base_pos: int,
        known_tokens: Sequence[int],
        main_hidden: torch.Tensor,
        next_token: int | None,
        want: int,
    ) -> list[int]:
        """Update every depth after a window and return up to `want` greedy MTP drafts.

        `known_tokens` are the window's tokens that are now known to be right (its context
        tokens plus the accepted drafts) at positions `base_pos ..`; `main_hidden` holds the
        main model's residual rows for at least those positions. `next_token` is the sampled
        token after them (None for a prefill chunk that sampled nothing). The drafts predict
        the tokens after `next_token`.
        """
        if session_id not in self._rings or self.depth == 0:
            return []
        try:
            return self._run(session_id, base_pos, known_tokens, main_hidden, next_token, want)
        except (SessionError, MtpStateLost):
            # Only a stale window (assumed past a reject) can leave a gap before its drafts:
            # its output is discarded by the coordinator anyway, so it simply gets no draft.
            # It may have stopped between depths: no row it could have reached counts as sound.
            # The session may also have been closed meanwhile (by the event loop's thread).
            for inputs in self._inputs.get(session_id, ()):
                inputs.clean = min(inputs.clean, max(0, base_pos - self.depth))
            return []

    def _run(
        self,
        session_id: str,
        base_pos: int,
        known_tokens: Sequence[int],
        main_hidden: torch.Tensor,
        next_token: int | None,
        want: int,
    ) -> list[int]:
        rings, records = self._rings.get(session_id), self._inputs.get(session_id)
        if rings is None or records is None:  # closed since the window began
            raise SessionError(f"session {session_id!r} closed during its window")
        b = base_pos
        n_known = len(known_tokens)
        # t(p): the token at position p for p > b, as far as this window knows it.
        tokens = list(known_tokens) + ([next_token] if next_token is not None else [])
        tip = b + len(tokens) - 1  # last position whose token is known
        drafts: list[int] = []
        prev_rows = main_hidden[:n_known]  # depth 0 output at positions b .. b+n_known-1
        prev_start = b
        # Every depth runs even when fewer drafts are wanted: a skipped depth's KV would fall
        # behind and leave a gap for the next window.
        for k in range(1, self.depth + 1):
            ring_prev = rings[k - 1]
            # Depth k runs where depth k-1's output exists and t[i+k] is known or drafted.
            lo = max(0, b - k)
            end = tip - 1 if next_token is not None else tip - k
            # Keep depth k-1's rows for later windows (they need the row at their b-k).
            ring_prev.put(prev_start, prev_rows)
            if end < lo:
                # Depth k-1's rows from prev_start changed under rows of depth k and deeper.
                for deeper in records[k - 1 :]:
                    deeper.clean = min(deeper.clean, prev_start)
                break
            chain = tokens + drafts
            record = records[k - 1]
            # Skip the leading rows that would run on the same input again.
            start = lo
            limit = min(prev_start, b, end + 1, record.clean) if self.reuse_rows else lo
            while start < limit and record.same(start, chain[start + k - b]):
                start += 1
            if start > end:  # nothing of depth k changed (a prefill chunk's tail)
                prev_rows, prev_start = prev_rows[:0], end + 1
                continue
            prev = self._rows(ring_prev, start, prev_start, prev_rows, end)
            ids = [chain[i + k - b] for i in range(start, end + 1)]
            # A draft is wanted from this depth, or feeds the next depth's last row.
            drafting = next_token is not None and (
                k <= want or k < self.depth or not self.reuse_rows
            )
            out = self.stage.mtp_forward(
                session_id,
                k,
                start,
                prev,
                torch.tensor(ids, dtype=torch.int64),
                logits_last_n=(1 if drafting else 0) if self.reuse_rows else None,
            )
            record.put(start, ids)
            record.clean = end + 1
            if drafting:
                drafts.append(argmax_rows(out.logits[-1])[0])
            prev_rows, prev_start = out.hidden, start
        return drafts[:want]

    def _rows(
        self, ring: _Ring, start: int, fresh_start: int, fresh: torch.Tensor, end: int
    ) -> torch.Tensor:
        """Depth k-1's rows for positions start..end: from the ring before `fresh_start`."""
        before = [ring.get(p) for p in range(start, min(fresh_start, end + 1))]
        offset = max(start, fresh_start) - fresh_start
        tail = fresh[offset : offset + end + 1 - max(start, fresh_start)]
        return torch.cat([*before, tail]) if before else tail
