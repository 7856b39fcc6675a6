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

This depends only on `b` — not on what ran before — so a rollback window (lower `b`) after a
stale, wrongly-assumed window just works, like the main model's positional KV.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from meshd.model.errors import SessionError
from meshd.model.stage import StageModel


class MtpStateLost(Exception):
    """A needed earlier hidden row has left the ring (windows ran too far ahead)."""


@dataclass
class _Ring:
    """Hidden rows of recent positions for one depth, tagged with their positions."""

    rows: torch.Tensor  # [R, hidden]
    tags: torch.Tensor  # [R] int64, -1 where empty

    def put(self, start: int, rows: torch.Tensor) -> None:
        size = self.rows.shape[0]
        rows = rows[-size:]
        start += max(0, rows.shape[0] - size)
        slots = torch.arange(start, start + rows.shape[0]) % size
        self.rows[slots] = rows.to(self.rows.dtype)
        self.tags[slots] = torch.arange(start, start + rows.shape[0])

    def get(self, position: int) -> torch.Tensor:
        slot = position % self.rows.shape[0]
        if int(self.tags[slot]) != position:
            raise MtpStateLost(f"hidden row for position {position} is no longer held")
        return self.rows[slot : slot + 1]


class MtpDrafter:
    """Runs the MTP depths of a last stage after each window and returns greedy drafts."""

    def __init__(self, stage: StageModel, ring_positions: int = 512) -> None:
        if not stage.is_last:
            raise ValueError("MTP drafts run on the last stage")
        self.stage = stage
        self.depth = len(stage.mtp)
        self.ring_positions = ring_positions
        self._rings: dict[str, list[_Ring]] = {}

    def open(self, session_id: str) -> None:
        """Start tracking a session (its KV is opened by the stage)."""
        h = self.stage.config.hidden_size
        self._rings[session_id] = [
            _Ring(
                torch.zeros(self.ring_positions, h, dtype=self.stage.dtype),
                torch.full((self.ring_positions,), -1, dtype=torch.int64),
            )
            for _ in range(self.depth)
        ]

    def close(self, session_id: str) -> None:
        """Forget a session."""
        self._rings.pop(session_id, None)

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
        rings = self._rings[session_id]
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
            start = max(0, b - k)
            end = tip - 1 if next_token is not None else tip - k
            # Keep depth k-1's rows for later windows (they need the row at their b-k).
            ring_prev.put(prev_start, prev_rows)
            if end < start:
                break
            prev = self._rows(ring_prev, start, prev_start, prev_rows, end)
            chain = tokens + drafts
            ids = [chain[i + k - b] for i in range(start, end + 1)]
            out = self.stage.mtp_forward(
                session_id, k, start, prev, torch.tensor(ids, dtype=torch.int64)
            )
            if next_token is not None:
                drafts.append(int(out.logits[-1].argmax()))
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
