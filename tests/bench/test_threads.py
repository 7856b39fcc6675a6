"""`meshd bench threads` runs end to end: one thread, N, and the stage's governor, side by side."""

from __future__ import annotations

import json

import pytest
import torch

from meshd.cli.main import main


def test_bench_threads_reports_each_setting_and_the_governors_choice(
    capsys: pytest.CaptureFixture[str],
) -> None:
    previous = torch.get_num_threads()
    args = ["bench", "threads", "--random-config", "tiny", "--tokens", "8", "--rounds", "2"]
    assert main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["tok_s"]) == {"1", "2", "governed"}
    assert all(len(runs) == 2 for runs in report["runs_tok_s"].values())
    assert all(v > 0 for v in report["tok_s"].values())
    best = max(report["tok_s"]["1"], report["tok_s"]["2"])
    assert report["ratio_governed_vs_best_fixed"] == pytest.approx(
        report["tok_s"]["governed"] / best, abs=0.002
    )
    assert report["governor_decode_threads"] in (1, 2)
    assert torch.get_num_threads() == previous  # the bench leaves torch as it found it
    with pytest.raises(SystemExit, match="at least 2"):
        main([*args, "--threads", "1"])
