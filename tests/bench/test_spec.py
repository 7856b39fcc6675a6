"""`meshd bench spec` over a real one-stage pipeline: rounds, settings, identical text."""

from __future__ import annotations

import argparse
import json

import pytest

from meshd.bench import spec as bench_spec
from meshd.model.builtin import builtin_draft_dir, builtin_model_dir
from meshd.sim.workloads import workloads
from meshd.speculative.config import SpecConfig


async def test_short_runs_repeat_in_rounds_and_every_run_matches_disabled() -> None:
    loads = [w for w in workloads(1) if w.kind == "edit"]
    report = await bench_spec._matrix(
        str(builtin_model_dir()),
        [1],
        [0.0],
        12,
        loads,
        ["disabled", "ngram-simple", "auto"],
        bench_spec.Rounds(min_seconds=600.0, max_rounds=3),  # never reached: 3 rounds
        SpecConfig(window_max_tokens=4),
    )
    runs = report["runs"]
    assert sorted((r["round"], r["strategy"]) for r in runs) == [
        (i, s) for i in range(3) for s in ("auto", "disabled", "ngram-simple")
    ]
    assert all(r["identical_to_disabled"] for r in runs)
    (row,) = [r for r in report["rows"] if r["strategy"] == "ngram-simple"]
    assert row["ratio_vs_disabled"] > 0
    # The row says how far its rounds spread, so a reader can tell a dip from noise.
    q1, q3 = row["ratio_quartiles"]
    assert row["ratio_samples"] == 3
    assert q1 <= row["ratio_vs_disabled"] <= q3
    # `auto` against the cell's best single strategy, paired within each round.
    (auto,) = [r for r in report["rows"] if r["strategy"] == "auto"]
    singles = [r for r in report["rows"] if r["strategy"] != "auto"]
    best = max(singles, key=lambda r: r["ratio_vs_disabled"])
    assert auto["best_single"] == best["strategy"]
    speed = {(r["strategy"], r["round"]): r["decode_tok_s"] for r in runs}
    paired = sorted(speed[("auto", i)] / speed[(best["strategy"], i)] for i in range(3))
    assert auto["paired_ratio_vs_best_single"] == pytest.approx(paired[1], abs=1e-3)
    assert auto["paired_ratio_vs_best_single_quartiles"][0] <= paired[1]
    assert auto["ratio_vs_best_single"] == pytest.approx(
        auto["ratio_vs_disabled"] / best["ratio_vs_disabled"], abs=1e-3
    )
    table = bench_spec.markdown(report, ["disabled", "ngram-simple", "auto"])
    assert "`auto` ÷ `disabled` per round, quartiles: edit " in table
    assert "(3 rounds)" in table
    assert "`auto` ÷ best single strategy, of the medians / paired per round" in table


def test_rounds_stop_once_disabled_has_decoded_long_enough() -> None:
    rounds = bench_spec.Rounds(min_seconds=2.0, max_rounds=5)
    assert rounds.more(1, 0.5)
    assert not rounds.more(1, 2.5)
    assert not rounds.more(5, 0.5)


def test_draft_strategies_run_with_the_shipped_draft_on_the_built_in_model(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = argparse.ArgumentParser()
    bench_spec.add_arguments(parser)
    args = parser.parse_args(
        ["--stages", "1", "--rtt-ms", "0", "--tokens", "8", "--prompts", "1", "--min-seconds",
         "0", "--strategies", "draft", "draft-ngram", "--no-transformers", "--json"]
    )  # fmt: skip
    assert bench_spec.run(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["draft_model"] == str(builtin_draft_dir())
    strategies = {r["strategy"] for r in report["runs"]}
    assert strategies == {"disabled", "draft", "draft-ngram"}
    assert all(r["identical_to_disabled"] for r in report["runs"])
    assert all(r["drafted"] > 0 for r in report["runs"] if r["strategy"] != "disabled")


def test_a_seeded_sampled_run_gives_every_strategy_the_same_text(
    capsys: pytest.CaptureFixture[str],
) -> None:
    texts = {}
    for seed in (7, 8):
        parser = argparse.ArgumentParser()
        bench_spec.add_arguments(parser)
        args = parser.parse_args(
            ["--stages", "1", "--rtt-ms", "0", "--tokens", "12", "--prompts", "1",
             "--workloads", "prose", "--min-seconds", "0",
             "--strategies", "disabled", "ngram-simple", "draft-ngram", "auto",
             "--temperature", "0.8", "--seed", str(seed), "--no-transformers", "--json"]
        )  # fmt: skip
        assert bench_spec.run(args) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["sampling"] == {"temperature": 0.8, "seed": seed}
        assert report["identical_texts"] is True
        runs = report["runs"]
        assert {r["strategy"] for r in runs} == {"disabled", "ngram-simple", "draft-ngram", "auto"}
        assert len(runs) == 4 and all(r["identical_to_disabled"] for r in runs)
        texts[seed] = report["samples"]["prose"]
    assert texts[7] != texts[8]  # the seed is honoured: these are samples, not greedy text
