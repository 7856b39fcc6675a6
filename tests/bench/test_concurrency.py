"""`meshd bench concurrency`: every cell is reported, and batching never changes the text."""

from __future__ import annotations

import trio

from meshd.bench.concurrency import _matrix
from meshd.model.builtin import builtin_model_dir


async def test_bench_concurrency_reports_every_cell_with_identical_text() -> None:
    with trio.fail_after(60):
        report = await _matrix(str(builtin_model_dir()), [1, 2], 4, 1, 0.0, "disabled")
    cells = [(row["streams"], row["batching"]) for row in report["rows"]]
    assert cells == [(1, False), (1, True), (2, False), (2, True)]
    assert all(row["identical_to_unbatched"] for row in report["rows"])
    assert all(row["decode_tok_s"] > 0 and row["p99_token_ms"] > 0 for row in report["rows"])
    # Unbatched passes hold one window; batched ones at most one per stream (two streams on
    # two stages may also settle into alternating passes, so 1 is allowed).
    assert [
        row["largest_batch"] <= (row["streams"] if row["batching"] else 1) for row in report["rows"]
    ] == [True] * 4
