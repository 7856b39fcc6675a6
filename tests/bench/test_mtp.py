"""`meshd bench mtp` on the built-in model: row reuse leaves every draft as it was."""

from __future__ import annotations

from meshd.bench import mtp as bench_mtp
from meshd.model.builtin import builtin_model_dir


def test_reused_rows_give_the_same_drafts_as_running_every_row_again() -> None:
    report = bench_mtp.measure(str(builtin_model_dir()), bench_mtp.DEFAULT_PROMPT, 24, 4, None)
    assert report["tokens"] == 24 and report["want"] == report["mtp_depths"] == 2
    assert report["same_drafts"] is True
    # The built-in heads guess the next greedy token far more often than chance (1/4096).
    assert report["depth1_hit_rate"] > 0.2
    assert report["pass_ms"] > 0 and report["mtp_reuse_ms"] > 0
