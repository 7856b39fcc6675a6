"""The grammar matcher's windows: masks per choosing row, drafts cut where the grammar
refuses them, the committed state restored after every window, and a trigger token before
which nothing is constrained."""

from __future__ import annotations

import pytest

from meshd.model.builtin import builtin_model_dir
from meshd.model.tokenizer import Tokenizer
from meshd.speculative.grammar import (
    Constraint,
    GrammarError,
    grammar_tokenizer,
    json_schema_grammar,
    pack_masks,
)
from meshd.speculative.sampling import unpack_masks

TOKENIZER = Tokenizer.open(builtin_model_dir())
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}


def ids(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


def constraint(trigger: int | None = None) -> Constraint:
    return Constraint(grammar_tokenizer(TOKENIZER), json_schema_grammar(SCHEMA), trigger=trigger)


def allowed(packed: bytes, rows: int) -> list[set[int]]:
    mask = unpack_masks(packed, rows, TOKENIZER.vocab_size)
    return [set(row.nonzero().squeeze(-1).tolist()) for row in mask]


def test_each_row_allows_what_follows_and_refused_drafts_are_cut() -> None:
    c = constraint()
    answer = ids('{"ok": true}')
    kept, packed = c.window_masks([], [], [*answer[:2], 7])  # 7 cannot follow
    assert kept == 2
    rows = allowed(packed, 3)
    assert answer[0] in rows[0] and answer[1] in rows[1] and answer[2] in rows[2]
    # The matcher is back at the committed state: the full answer still commits, and
    # completes the grammar (generation ends there).
    c.commit(answer[:-1])
    assert not c.stopped
    c.commit(answer[-1:])
    assert c.stopped


def test_a_pipelined_window_assumes_the_tokens_in_flight() -> None:
    c = constraint()
    answer = ids('{"ok": true}')
    kept, packed = c.window_masks(answer[:1], answer[1:2], answer[2:3])
    assert kept == 1
    assert answer[2] in allowed(packed, 2)[0]
    assert c.window_masks([], ids("nope"), []) is None  # a head the grammar refuses
    c.commit(answer)  # nothing of the above stuck


def test_nothing_is_masked_before_the_trigger() -> None:
    marker = TOKENIZER.eos_ids[-1]
    c = constraint(trigger=marker)
    assert c.window_masks([], [], ids("hello there")) == (len(ids("hello there")), b"")
    kept, packed = c.window_masks([], [], [*ids("hi"), marker, *ids('{"')])
    rows = allowed(packed, kept + 1)
    assert len(rows[0]) == TOKENIZER.vocab_size  # before the trigger: every token
    assert rows[-1] != rows[0]
    c.commit([*ids("prose"), marker])
    assert c.active
    with pytest.raises(GrammarError):
        c.commit(ids("not json"))


def test_masks_round_trip_and_garbage_is_refused() -> None:
    rows = [bytes([0b101, 0, 0, 0]) + bytes(4)]
    mask = unpack_masks(pack_masks(rows), 1, 40)
    assert mask[0].nonzero().squeeze(-1).tolist() == [0, 2]
    with pytest.raises(ValueError):
        unpack_masks(b"not zlib", 1, 40)
    with pytest.raises(ValueError):
        unpack_masks(pack_masks([bytes(3)]), 1, 40)
