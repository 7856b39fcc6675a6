"""`meshd bench plot`: saved `--json` reports in, one PNG per bench out.

The reports are built with the benches' own report code where it runs without a model
(pipeline, spec, load; scale runs for real at 10 nodes); concurrency, decode and lanes build
their JSON inline in `run`, so they are written here with the keys those modules print.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
from typing import Any

import pytest

from meshd.bench import pipeline as bench_pipeline
from meshd.bench import plot_figures as figures
from meshd.bench import spec as bench_spec
from meshd.bench.load import summarize
from meshd.bench.load_requests import Job, LoadConfig, Record
from meshd.bench.pipeline import Cell, RunResult
from meshd.bench.plot import PLOTTED
from meshd.cli.main import main

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
REPO = pathlib.Path(__file__).resolve().parents[2]


def pipeline_report() -> dict[str, Any]:
    """Two stage counts × two RTTs, plain and one speculative candidate."""
    cells = [Cell(s, r) for s in (1, 2) for r in (0.0, 20.0)]
    runs = {}
    for cell in cells:
        network = cell.stages * (cell.rtt_ms / 2 + 0.5) if cell.stages > 1 else 0.0
        for strategy, e in (("disabled", 1.0), ("ngram-simple", 3.0)):
            ms = (10.3 + network) / e
            runs[(cell, strategy)] = [
                RunResult([1, 2, 3], ms, 10.0, network, e, 0, strategy) for _ in range(2)
            ]
    report = bench_pipeline._report(cells, ["ngram-simple"], runs)
    report["conditions"] = {
        "date": "2026-12-02",
        "prompt": "heapq",
        "prompt_tokens": 98,
        "tokens": 16,
        "repeats": 2,
        "candidates": ["ngram-simple"],
        "cpus": 2,
        "load_average_before": 10.37,
        "load_average_after": 11.81,
        "wall_s": 12.0,
    }
    return report


def spec_report() -> dict[str, Any]:
    runs = []
    for rtt in (0.0, 20.0):
        for workload in ("edit", "prose"):
            for strategy, ratio in (("disabled", 1.0), ("ngram-simple", 2.0), ("auto", 2.5)):
                runs.append(
                    {
                        "stages": 2,
                        "rtt_ms": rtt,
                        "workload": workload,
                        "prompt": "p",
                        "strategy": strategy,
                        "decode_tok_s": 30.0 * ratio,
                        "ratio_vs_disabled": ratio,
                        "acceptance": None if strategy == "disabled" else 0.8,
                        "drafted": 10,
                        "accepted": 8,
                        "tokens_per_round_trip": ratio,
                        "windows_stale": 0,
                        "identical_to_disabled": True,
                    }
                )
    return {"rows": bench_spec._aggregate(runs), "runs": runs, "samples": {}, "tokens": 48}


def load_report() -> dict[str, Any]:
    sizes = ("short", "medium", "long")
    jobs = [Job(i, "chat", i % 2 == 0, sizes[i % 3], "hi", 8, 16, 0.0, i) for i in range(12)]
    records = [
        Record(i, i % 2, 200, "", 0, 0.5 + 0.1 * i, 0.05 if i % 2 == 0 else None, 16)
        for i in range(12)
    ]
    report = summarize(jobs, records, 4.0, LoadConfig(requests=12, concurrency=4))
    return report | {"leaked": False, "target": {"kind": "local", "stages": 2}}


def concurrency_report() -> dict[str, Any]:
    rows = []
    for n in (1, 2, 4):
        for batching in (False, True):
            tok_s = 100.0 * (n**0.8 if batching else 1.0)
            rows.append(
                {
                    "streams": n,
                    "batching": batching,
                    "decode_tok_s": tok_s,
                    "p50_token_ms": 1e3 * n / tok_s,
                    "p99_token_ms": 1.5e3 * n / tok_s,
                    "largest_batch": n if batching else 1,
                    "identical_to_unbatched": True,
                    "ratio_vs_1_stream": tok_s / 100.0,
                    "ratio_vs_unbatched": tok_s / 100.0,
                }
            )
    return {
        "rows": rows,
        "tokens_per_stream": 32,
        "repeats": 1,
        "rtt_ms": 0.0,
        "strategy": "disabled",
        "stages": 2,
    }


def decode_report(model: str, meshd_tok_s: float) -> dict[str, Any]:
    return {
        "meshd_tok_s": meshd_tok_s,
        "transformers_tok_s": meshd_tok_s / 1.4,
        "ratio": 1.4,
        "meshd_cpu_ms_per_tok": 5.0,
        "transformers_cpu_ms_per_tok": 7.0,
        "cpu_ratio": 1.4,
        "same_tokens": True,
        "tokens": 32,
        "rounds": 3,
        "prompt_tokens": 9,
        "params": 5_500_000,
        "dtype": "float32",
        "device": "cpu",
        "threads": 1,
        "matmul_floor_cpu_ms_per_tok": 2.5,
        "max_cpu_ratio": 2.0,
        "model": model,
    }


def lanes_report() -> dict[str, Any]:
    return {
        "udp_rtt_us": 40.0,
        "udp_task_hop_rtt_us": 64.0,
        "lane_mb_s": 249.0,
        "lane_rtt_us": 152.0,
        "aioquic_mb_s": 13.7,
        "aioquic_rtt_us": 317.0,
        "aioquic_max_datagram_mb_s": 99.7,
        "throughput_ratio_vs_aioquic": 18.2,
        "throughput_ratio_vs_aioquic_max_datagram": 2.5,
        "rtt_ratio_vs_udp": 3.8,
        "rtt_ratio_vs_aioquic": 0.48,
        "message_bytes": 65536,
        "messages": 200,
        "pings": 300,
        "rounds": 2,
    }


def scale_json(capsys: pytest.CaptureFixture[str]) -> str:
    """A real `meshd bench scale` run at 10 nodes (about a second)."""
    args = ["bench", "scale", "--sizes", "10", "--quick", "--kills", "1", "--coordinators", "1"]
    assert main([*args, "--random-plans", "20", "--window-s", "5", "--json"]) == 0
    return capsys.readouterr().out


def write(folder: pathlib.Path, name: str, report: dict[str, Any]) -> None:
    (folder / f"{name}.json").write_text(json.dumps(report))


def plot(folder: pathlib.Path, out: pathlib.Path, *extra: str) -> int:
    return main(["bench", "plot", "--in", str(folder), "--out", str(out), *extra])


def assert_png(path: pathlib.Path) -> None:
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE), path
    assert 10_000 < len(data) <= 150_000, (path, len(data))  # a drawn figure, small for git


def test_every_bench_report_becomes_a_png(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "bench"
    data.mkdir()
    (data / "scale.json").write_text(scale_json(capsys))
    write(data, "pipeline", pipeline_report())
    write(data, "spec", spec_report())
    write(data, "load", load_report())
    write(data, "concurrency", concurrency_report())
    write(data, "lanes", lanes_report())
    # Appended runs, one per line, as `meshd bench decode --json >> decode.json` leaves them.
    lines = [decode_report("random-tiny", 2400.0), decode_report("random-large", 9.8)]
    (data / "decode.json").write_text("".join(json.dumps(r) + "\n" for r in lines))

    assert plot(data, tmp_path / "img") == 0
    out = capsys.readouterr().out
    for name in PLOTTED:
        assert_png(tmp_path / "img" / f"{name}.png")
        assert f"{name}: wrote" in out


def test_missing_inputs_are_skipped_with_the_command_that_makes_them(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write(tmp_path, "concurrency", concurrency_report())
    assert plot(tmp_path, tmp_path / "img") == 0
    out = capsys.readouterr().out
    assert_png(tmp_path / "img" / "concurrency.png")
    assert f"pipeline: skipped, no {tmp_path / 'pipeline.json'}" in out
    assert "meshd bench load --json >" in out
    assert sorted(p.name for p in (tmp_path / "img").iterdir()) == ["concurrency.png"]

    # Nothing to draw at all is an error status, still without a traceback.
    empty = tmp_path / "empty"
    empty.mkdir()
    assert plot(empty, tmp_path / "none") == 1
    assert "skipped" in capsys.readouterr().out
    assert not (tmp_path / "none").exists()


def test_a_broken_report_is_named_and_the_others_still_draw(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "spec.json").write_text("{not json")
    write(tmp_path, "pipeline", {"rows": []})  # another bench's shape, or a truncated run
    write(tmp_path, "load", {"errors": 1, "leaked": True, "failure": "daemons did not start"})
    write(tmp_path, "lanes", lanes_report())
    assert plot(tmp_path, tmp_path / "img") == 1
    captured = capsys.readouterr()
    for name in ("spec", "pipeline", "load"):
        assert f"{name}: FAILED, {tmp_path / (name + '.json')}" in captured.err
        assert not (tmp_path / "img" / f"{name}.png").exists()
    assert "did not run: daemons did not start" in captured.err
    assert_png(tmp_path / "img" / "lanes.png")


def test_only_draws_the_benches_named(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write(tmp_path, "lanes", lanes_report())
    write(tmp_path, "concurrency", concurrency_report())
    assert plot(tmp_path, tmp_path / "img", "--only", "lanes") == 0
    assert [p.name for p in (tmp_path / "img").iterdir()] == ["lanes.png"]
    assert "concurrency" not in capsys.readouterr().out


def test_titles_carry_the_runs_date_and_load_when_the_report_has_them() -> None:
    figure = figures.pipeline([pipeline_report()])
    title = figure.get_suptitle()
    assert "2026-12-02, load 10.37 → 11.81 on 2 CPUs" in title
    assert figures.conditions(concurrency_report()) == ""


def test_decode_draws_every_checkpoint_in_the_file() -> None:
    figure = figures.decode(
        [decode_report("random-tiny", 2400.0), decode_report("random-large", 9.8)]
    )
    labels = [t.get_text() for t in figure.axes[0].get_xticklabels()]
    assert [label.split("\n")[0] for label in labels] == ["random-tiny", "random-large"]
    assert figure.axes[0].get_yscale() == "log"  # 2400 vs 7 tok/s: bars stay readable


def test_load_with_per_request_latencies_adds_a_cdf() -> None:
    report = load_report()
    assert len(figures.load([report]).axes) == 2
    report["latencies_s"] = [0.5, 1.0, 2.0, 4.0]
    report["ttfts_s"] = [0.05, 0.1]
    assert len(figures.load([report]).axes) == 3


def test_spec_bars_use_two_stages_at_20_ms_when_measured() -> None:
    figure = figures.spec([spec_report()])
    assert figure.axes[0].get_title().startswith("2 stage(s), RTT 20 ms")
    assert len(figure.axes) == 2  # and the by-RTT panel, since two RTTs were measured


# Benches whose saved report docs/bench may lack, and a small real run that makes one.
SMALL_RUNS = {
    "lanes": ["bench", "lanes", "--messages", "20", "--pings", "20", "--rounds", "1", "--json"],
    "decode": [
        "bench", "decode", "--random-config", "tiny", "--tokens", "4", "--rounds", "1", "--json",
    ],
}  # fmt: skip


def test_the_committed_docs_data_draws(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every plotted bench draws from a real report: the committed one in docs/bench, or, for
    a bench with none committed, a small run of the bench itself (never a hand-written one)."""
    saved = REPO / "docs" / "bench"
    committed = sorted(p.stem for p in saved.glob("*.json"))
    # The docs' figures are drawn from these files: they must be there, and only plotted ones.
    assert committed, f"no {saved}/*.json: the docs' figures have no data"
    assert set(committed) <= set(PLOTTED)
    data = tmp_path / "bench"
    data.mkdir()
    for name in PLOTTED:
        if name in committed:
            (data / f"{name}.json").write_bytes((saved / f"{name}.json").read_bytes())
            continue
        assert name in SMALL_RUNS, f"no {saved}/{name}.json and no small run to make one"
        capsys.readouterr()
        assert main(SMALL_RUNS[name]) == 0
        (data / f"{name}.json").write_text(capsys.readouterr().out)
    assert plot(data, tmp_path / "img") == 0
    assert sorted(p.stem for p in (tmp_path / "img").iterdir()) == sorted(PLOTTED)
    for name in PLOTTED:
        assert_png(tmp_path / "img" / f"{name}.png")


def test_meshd_starts_without_importing_matplotlib() -> None:
    code = (
        "import sys, meshd.cli.main, meshd.bench.plot; "
        "meshd.cli.main.build_parser(); "
        "assert 'matplotlib' not in sys.modules, 'matplotlib imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
