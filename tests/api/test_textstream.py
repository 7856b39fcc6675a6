"""Stop sequences on streamed text: whatever the chunking, the output is the text up to where
a stop sequence first completes, and no part of a stop sequence is ever emitted."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshd.api.textstream import StopScanner, TextStream
from meshd.model.builtin import builtin_model_dir
from meshd.model.tokenizer import Tokenizer

ALPHABET = "ab\nc"


def expected_cut(text: str, stops: list[str]) -> tuple[str, bool]:
    """Character by character: cut where a stop first completes (the longest one there)."""
    for end in range(1, len(text) + 1):
        ending = [len(s) for s in stops if text[:end].endswith(s)]
        if ending:
            return text[: end - max(ending)], True
    return text, False


@given(
    text=st.text(ALPHABET, max_size=40),
    stops=st.lists(st.text(ALPHABET, min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 40), max_size=12),
)
def test_any_chunking_gives_the_text_before_the_first_stop(
    text: str, stops: list[str], cuts: list[int]
) -> None:
    scanner = StopScanner(stops)
    bounds = sorted({0, len(text), *(min(c, len(text)) for c in cuts)})
    out = "".join(scanner.feed(text[a:b]) for a, b in itertools.pairwise(bounds))
    out += scanner.finish()
    assert (out, scanner.stopped) == expected_cut(text, stops)


def test_partial_stop_is_held_back_then_released() -> None:
    scanner = StopScanner(["END"])
    assert scanner.feed("abcE") == "abc"
    assert scanner.feed("N") == ""
    assert scanner.feed("x") == "ENx"  # it was not a stop after all
    assert scanner.feed("xEND tail") == "x" and scanner.stopped
    assert scanner.feed("more") == "" and scanner.finish() == ""


def test_empty_stop_is_refused() -> None:
    with pytest.raises(ValueError):
        StopScanner(["ok", ""])


def test_text_stream_counts_tokens_up_to_the_stop() -> None:
    tokenizer = Tokenizer.open(builtin_model_dir())
    ids = tokenizer.encode("def add(a, b):\n    return a + b\n")
    text = tokenizer.decode(ids)
    stream = TextStream(tokenizer, ["return"])
    out = "".join(stream.push([t]) for t in ids) + stream.finish()
    assert out == text[: text.index("return")]
    assert stream.stopped
    # The token that completed "return" is the last one counted.
    assert "return" in tokenizer.decode(ids[: stream.tokens_used])
    assert "return" not in tokenizer.decode(ids[: stream.tokens_used - 1])
    plain = TextStream(tokenizer)
    assert plain.push(ids) + plain.finish() == text and plain.tokens_used == len(ids)
