"""Grammar masks for structured output, with llguidance, exact under speculative decoding.

A `Constraint` is one request's grammar matcher. The coordinator keeps it at the state of the
committed tokens: for each verify window it walks the window's tokens (and, for a pipelined
window, the tokens assumed before it), takes the mask of allowed tokens after each, and rolls
back at once. The masks travel in the window (`VerifyWindow.mask`); the last stage applies row
i's mask to the logits row that chooses the token after window token i, before sampling or
verifying (`sampling.verify`). So every committed token is the one non-speculative decoding
would choose from the same masked row with the same keyed noise: drafts only decide how many
of those tokens a window commits, and a draft the grammar forbids is cut before it is sent
(it could never be accepted).

Why llguidance rather than xgrammar: docs/api.md. Its one-off cost, the tokenizer set-up, is
paid once per tokenizer in a worker thread.
"""

from __future__ import annotations

import functools
import json
import threading
import zlib
from collections.abc import Mapping, Sequence
from typing import Any, cast

import llguidance

from meshd.model.tokenizer import Tokenizer

# JSON layout the grammars allow: one space after `,` and `:`, no other whitespace between
# tokens. A flexible layout would let a weak model spend its whole budget on whitespace; this
# one is the layout models write anyway, so it costs them little likelihood.
JSON_LAYOUT: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


class GrammarError(ValueError):
    """A schema or grammar the engine cannot enforce (the message says why)."""


@functools.lru_cache(maxsize=4)
def grammar_tokenizer(tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    """The engine's view of a tokenizer (built once; seconds for a large vocabulary)."""
    return llguidance.LLTokenizer(
        tokenizer.to_json(),
        n_vocab=tokenizer.vocab_size,
        eos_token=list(tokenizer.eos_ids) or None,
    )


@functools.lru_cache(maxsize=4)
def special_tokens(tokenizer: llguidance.LLTokenizer) -> tuple[int, ...]:
    """The engine's special tokens (end-of-sequence, chat markers: a few dozen)."""
    return tuple(i for i in range(tokenizer.vocab_size) if tokenizer.is_special_token(i))


def json_schema_grammar(schema: Mapping[str, Any] | None, *, strict: bool = True) -> str:
    """The grammar of JSON text valid for `schema` (None: any JSON object).

    `strict` refuses schema keywords the engine cannot enforce; otherwise they are ignored
    (OpenAI's non-strict mode makes no promise either).
    """
    layout = JSON_LAYOUT | ({} if strict else {"lenient": True})
    target = {"type": "object"} if schema is None else dict(schema)
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(target, overrides=cast(Any, layout))
    except ValueError as exc:
        raise GrammarError(str(exc)) from None
    return check_grammar(grammar)


def check_grammar(grammar: str) -> str:
    """`grammar` if the engine accepts it, else GrammarError with its reason."""
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise GrammarError(error)
    return grammar


def lark_json_rule(schema: Mapping[str, Any]) -> str:
    """A Lark rule body matching JSON valid for `schema` (with the layout above), for use
    inside a larger Lark grammar (tool calls wrapped in a model's own markers)."""
    return "%json " + json.dumps(dict(schema) | {"x-guidance": JSON_LAYOUT})


class Constraint:
    """One request's matcher, kept at the committed tokens' state (see the module docstring).

    A single request's window loop uses it, one call at a time; the lock only guards against a
    recovery's attempts overlapping (they do not: each starts after the last has failed).
    """

    def __init__(
        self, tokenizer: llguidance.LLTokenizer, grammar: str, *, trigger: int | None = None
    ) -> None:
        """`trigger`: a token id before which nothing is constrained (a tool call's opening
        marker when the model may also answer in prose); the grammar then describes what
        follows it. None: the grammar holds from the first token."""
        self._matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if self._matcher.is_error():
            raise GrammarError(self._matcher.get_error())
        self._trigger = trigger
        self._special = special_tokens(tokenizer)
        self._active = trigger is None
        # The mask of a row the grammar does not constrain (yet): every token allowed.
        self._free = b"\xff" * len(self._matcher.compute_bitmask())
        self._lock = threading.Lock()

    @property
    def active(self) -> bool:
        """The grammar constrains the next token (its trigger, if any, has been committed)."""
        return self._active

    @property
    def stopped(self) -> bool:
        """The grammar is complete (nothing but end-of-sequence may follow) or its
        end-of-sequence token was consumed: generation must end."""
        return self._active and bool(self._matcher.is_stopped())

    def commit(self, tokens: Sequence[int]) -> None:
        """Advance over committed tokens (each one was chosen from a masked row)."""
        with self._lock:
            for token in tokens:
                if not self._active:
                    self._active = int(token) == self._trigger
                    continue
                if self._matcher.is_stopped():
                    return  # past the end: nothing further is constrained
                if not self._matcher.consume_token(int(token)):
                    raise GrammarError(
                        f"committed token {token} breaks the grammar: {self._matcher.get_error()}"
                    )

    def window_masks(
        self, assumed: Sequence[int], head: Sequence[int], drafts: Sequence[int]
    ) -> tuple[int, bytes] | None:
        """Masks for a window whose rows choose the tokens after `head` and each draft.

        `assumed` are tokens of windows still in flight, taken as committed (a pipelined
        window); `head` the window's context tokens not yet committed (its first token, when
        pipelined; empty otherwise). Returns how many of `drafts` the grammar allows in a row
        (the window keeps only those) and the packed masks of `kept + 1` rows (empty when the
        trigger is not reached, so no row is constrained); None when the
        assumed tokens or the head break the grammar (that window cannot be right: send none).
        The matcher is back at the committed state on return.
        """
        with self._lock:
            m = self._matcher
            active = self._active
            consumed = 0

            def step(token: int) -> bool:
                nonlocal active, consumed
                if not active:
                    active = int(token) == self._trigger
                    return True
                if not self._allows(token):
                    return False
                m.consume_token(int(token))
                consumed += 1
                return True

            try:
                for token in (*assumed, *head):
                    if not step(token):
                        return None
                if active and m.is_stopped():
                    return None
                rows = [self._row() if active else self._free]
                kept = 0
                for draft in drafts:
                    before = consumed
                    if not step(draft):
                        break
                    if active and m.is_stopped():
                        # An end-of-sequence draft: the target chooses that token itself, as
                        # the window's next token; no row can follow it.
                        m.rollback(consumed - before)
                        consumed = before
                        break
                    kept += 1
                    rows.append(self._row() if active else self._free)
                if active:
                    return kept, pack_masks(rows)
                return kept, b""  # no row constrained (before the trigger): no masks at all
            finally:
                if consumed:
                    m.rollback(consumed)

    def _row(self) -> bytes:
        # llguidance's mask may allow a special token whose text the grammar expects as
        # plain bytes (Qwen2.5's `</tool_call>`), which it then refuses to consume: such bits
        # are cleared, so a mask never allows a token the matcher would refuse.
        row = bytearray(self._matcher.compute_bitmask())
        for token in self._special:
            byte, bit = divmod(token, 8)
            if row[byte] >> bit & 1 and self._matcher.validate_tokens([token]) != 1:
                row[byte] &= ~(1 << bit) & 0xFF
        return bytes(row)

    def _allows(self, token: int) -> bool:
        # Checked before consuming: a refused token would leave the matcher in its error
        # state, which it never leaves.
        m = self._matcher
        return not m.is_stopped() and m.validate_tokens([int(token)]) == 1


def pack_masks(rows: Sequence[bytes]) -> bytes:
    """Rows of 32-bit little-endian mask words (bit i of word j allows token 32·j + i), one
    after the other, compressed: a JSON state allows either few tokens or nearly all."""
    return zlib.compress(b"".join(rows), 1)
