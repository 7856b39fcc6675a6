"""The vocabulary a draft model scores: its first ids and the request's own (`DraftVocab`).

A draft pass ends in the head, one row of weights per vocabulary id: on a small draft with a
large vocabulary it is about a third of the bytes a pass reads (docs/speculative.md).
A draft's token only has to be the target's likely choice, and verification accepts only the
target's own, so the draft may score fewer ids without changing any output: a token it cannot
propose is one the window loses, never a changed token (frequency-ranked drafting, FR-Spec,
narrows a draft's head by corpus frequency for the same reason). Here the
ids scored are the first `first` of the tokenizer's (byte-pair vocabularies number their
pieces in merge order, the common ones first), the end-of-sequence ids and every id the
request's log holds (its prompt and what it committed: code and chat repeat their own rare
tokens). Only a head of one block-format tensor is narrowed (a GGUF file's or one quantized
at load), by a view of its first rows and a copy of the request's other rows; any other head
scores the whole vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from meshd.model.gguf_matrix import GgufMatrix, Matrix
from meshd.model.kernels.blocks import BlockMatrix


class DraftVocab:
    """The ids one request's draft passes score, and the head matrix over exactly those.

    Column j of the narrowed head is id `ids[j]`: the first ids in order, then the others
    ascending, so an argmax over the columns breaks ties toward the lowest id, as one over
    the whole vocabulary does.
    """

    def __init__(self, head: GgufMatrix, first: int, always: Iterable[int] = ()) -> None:
        (self._table,) = head.parts
        self.vocab_size = head.out_features
        self.first = min(first, self.vocab_size)
        self._extra: set[int] = set()
        self._matrix: GgufMatrix | None = None
        self._ids = torch.arange(self.first)
        self.see(always)

    @classmethod
    def narrowing(
        cls, head: Matrix | None, first: int, always: Iterable[int] = ()
    ) -> DraftVocab | None:
        """A `DraftVocab` over `head`, or None where it would score the whole vocabulary
        anyway (`first` 0 or past the vocabulary) or cannot be narrowed (a plain tensor, a
        fused or reordered operand)."""
        if not isinstance(head, GgufMatrix) or len(head.parts) != 1 or head.perms[0] is not None:
            return None
        if first <= 0 or first >= head.out_features:
            return None
        return cls(head, first, always)

    def see(self, tokens: Iterable[int]) -> None:
        """Score these ids from now on too (the log's new tokens; ids past the vocabulary,
        the target's added tokens, are fed as id 0 and never proposed)."""
        new = {t for t in tokens if self.first <= t < self.vocab_size} - self._extra
        if new:
            self._extra |= new
            self._matrix = None

    def matrix(self) -> GgufMatrix:
        """The head's rows for `ids`, side by side (rebuilt after `see` added ids)."""
        if self._matrix is None:
            table = self._table
            rows = table.data.reshape(table.out_features, table.row_bytes)
            parts = [self._rows(rows[: self.first], self.first)]
            extra = sorted(self._extra)
            if extra:
                parts.append(self._rows(np.ascontiguousarray(rows[extra]), len(extra)))
            self._matrix = GgufMatrix(parts)
            self._ids = torch.cat([torch.arange(self.first), torch.tensor(extra, dtype=torch.long)])
        return self._matrix

    @property
    def ids(self) -> torch.Tensor:
        """The id of each column of `matrix()`'s product, `[columns]` int64."""
        self.matrix()
        return self._ids

    def _rows(self, rows: np.ndarray, count: int) -> BlockMatrix:
        table = self._table
        return BlockMatrix(
            rows.reshape(-1), table.ggml_type, table.in_features, count, path=table.kernel
        )
