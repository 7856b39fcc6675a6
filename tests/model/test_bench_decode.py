"""`meshd bench decode` runs end to end and reports comparable figures."""

from __future__ import annotations

import json
import pathlib

import pytest

from meshd.cli.main import main
from tests.model.tiny import make_checkpoint


def test_bench_decode_json_on_a_random_checkpoint(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["bench", "decode", "--random-config", "tiny", "--quick", "--json", "--tokens", "8"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"] == "random-tiny" and report["tokens"] == 8 and report["rounds"] == 3
    assert report["meshd_tok_s"] > 0 and report["transformers_tok_s"] > 0
    assert report["ratio"] == pytest.approx(
        report["meshd_tok_s"] / report["transformers_tok_s"], rel=0.01
    )
    assert report["same_tokens"] is True  # both sides decoded the same greedy text
    assert 0 < report["matmul_floor_cpu_ms_per_tok"] < report["meshd_cpu_ms_per_tok"]
    assert len(report["meshd_runs_tok_s"]) == len(report["transformers_runs_tok_s"]) == 3


def test_bench_decode_text_report_for_a_given_model(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make_checkpoint(tmp_path, "qwen2", num_hidden_layers=2)
    assert (
        main(["bench", "decode", "--model", str(tmp_path), "--tokens", "4", "--rounds", "1"]) == 0
    )
    out = capsys.readouterr().out
    assert str(tmp_path) in out and "ratio" in out and "same greedy tokens: True" in out
