"""Committed tokens → text deltas, cut at the first stop sequence.

Stop sequences are matched on the detokenized text, so one may span several tokens (or start
in the middle of one); the first one to complete ends the text. Text that could still become
the start of a stop sequence is held back until it either completes one (then it is dropped,
with everything after it) or cannot (then it is released). Nothing of a stop sequence ever
reaches the client.
"""

from __future__ import annotations

from collections.abc import Sequence

from meshd.model.tokenizer import Tokenizer


class StopScanner:
    """Finds the first stop sequence in a stream of text pieces."""

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not s for s in stops):
            raise ValueError("stop sequences must not be empty")
        self.stops = tuple(stops)
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """Add `text`; return what is safe to emit now (sets `stopped` on a match)."""
        if self.stopped:
            return ""
        buffer = self._held + text
        # The stop that completes first wins (generation would have ended there), and of
        # those ending at the same place, the longest: independent of how text is chunked.
        hits = [(i + len(s), i) for s in self.stops if (i := buffer.find(s)) >= 0]
        if hits:
            self.stopped = True
            self._held = ""
            return buffer[: min(hits)[1]]
        hold = self._longest_partial(buffer)
        self._held = buffer[len(buffer) - hold :]
        return buffer[: len(buffer) - hold]

    def finish(self) -> str:
        """The held-back text at the end of generation (no stop sequence completed)."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _longest_partial(self, buffer: str) -> int:
        """Length of the longest suffix of `buffer` that is a proper prefix of a stop."""
        best = 0
        for stop in self.stops:
            for length in range(min(len(stop) - 1, len(buffer)), best, -1):
                if buffer.endswith(stop[:length]):
                    best = length
                    break
        return best


class TextStream:
    """Detokenizes one generation and applies its stop sequences.

    `tokens_used` counts the tokens that went into the text: all of them, or those up to and
    including the one that completed a stop sequence (what the client is billed for).
    """

    def __init__(
        self, tokenizer: Tokenizer, stops: Sequence[str] = (), *, skip_special_tokens: bool = True
    ) -> None:
        self._decoder = tokenizer.stream(skip_special_tokens=skip_special_tokens)
        self._stops = StopScanner(stops)
        self.tokens_used = 0

    @property
    def stopped(self) -> bool:
        """True once a stop sequence matched (later tokens are ignored)."""
        return self._stops.stopped

    def push(self, tokens: Sequence[int]) -> str:
        """Add committed tokens; return the text they release."""
        out: list[str] = []
        for token in tokens:
            if self._stops.stopped:
                break
            self.tokens_used += 1
            out.append(self._stops.feed(self._decoder.push(token)))
        return "".join(out)

    def finish(self) -> str:
        """The text still held back at the end of generation."""
        if self._stops.stopped:
            return ""
        tail = self._stops.feed(self._decoder.flush())
        return tail + self._stops.finish()
