"""`meshd bench plot`: draw the benchmarks' saved JSON as PNG figures for docs/benchmarks.md.

    meshd bench concurrency --json > docs/bench/concurrency.json    # ... one file per bench
    meshd bench plot [--in docs/bench] [--out docs/img] [--only concurrency spec]

Reads `<bench>.json` for every benchmark it knows (the output of `meshd bench NAME --json`) and
writes `<bench>.png` next to the others in `--out`. A file may also hold several reports, one
JSON object per line (`>>` appends runs): the decode figure draws each of them (one per
checkpoint); the others draw the last. A missing file is skipped with the command that would
make it; a file that does not parse or lacks a field the figure needs is reported and skipped
(exit status 1). matplotlib (the `plots` extra) is imported only here, with the Agg backend,
so `meshd` itself starts without it.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

# The benches with a figure, in the order docs/benchmarks.md shows them.
PLOTTED = ("lanes", "decode", "spec", "pipeline", "concurrency", "scale", "load")
DEFAULT_IN = "docs/bench"
DEFAULT_OUT = "docs/img"


class ReportError(ValueError):
    """A saved report that cannot be drawn: not JSON, or missing what the figure needs."""


@dataclass(frozen=True)
class Outcome:
    """What happened to one bench's file."""

    bench: str
    status: str  # "wrote", "missing" or "failed"
    path: pathlib.Path  # the PNG written, or the JSON looked for
    detail: str = ""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `meshd bench plot`."""
    parser.add_argument(
        "--in",
        dest="input_dir",
        default=DEFAULT_IN,
        help=f"folder of <bench>.json files (default {DEFAULT_IN})",
    )
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"PNG folder (default {DEFAULT_OUT})")
    parser.add_argument(
        "--only", nargs="+", choices=PLOTTED, default=None, help="draw only these benches"
    )
    parser.add_argument("--dpi", type=int, default=100, help="PNG resolution (default 100)")


def run(args: argparse.Namespace) -> int:
    """Draw every saved report found; 0 unless a file failed or none was found."""
    try:
        outcomes = plot_all(
            pathlib.Path(args.input_dir), pathlib.Path(args.out), args.only or PLOTTED, args.dpi
        )
    except ImportError as exc:
        print(f"meshd bench plot needs matplotlib (pip install 'meshd[plots]'): {exc}")
        return 1
    for o in outcomes:
        if o.status == "wrote":
            print(f"{o.bench}: wrote {o.path} ({o.path.stat().st_size / 1024:.0f} kB)")
        elif o.status == "missing":
            print(f"{o.bench}: skipped, no {o.path} (meshd bench {o.bench} --json > {o.path})")
        else:
            print(f"{o.bench}: FAILED, {o.path}: {o.detail}", file=sys.stderr)
    failed = any(o.status == "failed" for o in outcomes)
    wrote = any(o.status == "wrote" for o in outcomes)
    return 1 if failed or not wrote else 0


def plot_all(
    input_dir: pathlib.Path, out_dir: pathlib.Path, benches: Sequence[str], dpi: int = 100
) -> list[Outcome]:
    """Draw `<bench>.json` from `input_dir` as `<bench>.png` in `out_dir`, for each bench."""
    from meshd.bench import plot_figures as figures

    draw: dict[str, Callable[[list[dict[str, Any]]], Any]] = {
        "lanes": figures.lanes,
        "decode": figures.decode,
        "spec": figures.spec,
        "pipeline": figures.pipeline,
        "concurrency": figures.concurrency,
        "scale": figures.scale,
        "load": figures.load,
    }
    outcomes = []
    for bench in benches:
        source = input_dir / f"{bench}.json"
        if not source.is_file():
            outcomes.append(Outcome(bench, "missing", source))
            continue
        target = out_dir / f"{bench}.png"
        try:
            figure = draw[bench](load_reports(source))
        except (ReportError, LookupError, TypeError, ValueError) as exc:
            # A report from another version of the bench, or a hand-edited one.
            outcomes.append(Outcome(bench, "failed", source, f"{type(exc).__name__}: {exc}"))
            continue
        out_dir.mkdir(parents=True, exist_ok=True)
        figures.save(figure, target, dpi)
        outcomes.append(Outcome(bench, "wrote", target))
    return outcomes


def load_reports(path: pathlib.Path) -> list[dict[str, Any]]:
    """The JSON objects in `path`: one document, a list of them, or one per line."""
    text = path.read_text()
    try:
        whole = json.loads(text)
        reports = whole if isinstance(whole, list) else [whole]
    except json.JSONDecodeError:
        try:
            reports = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as exc:
            raise ReportError(f"not JSON: {exc}") from None
    if not reports or not all(isinstance(r, dict) for r in reports):
        raise ReportError("expected a JSON object (or one per line) as `--json` prints it")
    return reports
