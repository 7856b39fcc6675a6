"""`meshd bench pipeline`: time per token for 1/2/3 stages at emulated RTTs, next to the model.

Every cell (stages S × emulated RTT) is one in-process pipeline of real stage hosts over real
lanes on loopback (`open_local_pipeline`); all cells are open at once and run round-robin, plain
greedy decoding first and then each speculative candidate, so the shared machine's drift hits
every cell alike. One fixed prompt, greedy, a fixed token count (EOS ignored).

What "emulated RTT r" means here (read from `open_local_pipeline` and the endpoint): every
node's UDP endpoint delays everything it sends by r/2, so each link has round trip r. The
coordinator runs on stage 0's node and hands windows to stage 0 in-process (no lane, no delay).
A token at plain decoding therefore crosses, one way each: S−1 stage→stage links carrying
hidden states, and one link from the last stage back to the coordinator with the token id:

    H(S) = S one-way lane messages for S ≥ 2,   H(1) = 0.

The model's terms, in ms per token:
- C: time per token of the 1-stage pipeline at RTT 0 (stage compute, the coordinator's loop,
  one thread hand-off), measured in this run.
- P: cost of one lane message beyond the emulated delay (encode, encrypt, loopback UDP,
  decrypt, decode, trio wake-ups, the receiving stage's thread hand-off), fitted by least
  squares to the RTT-0 cells with S ≥ 2: TPOT(S, 0) − C = H(S)·P.
- corrected model: TPOT = C + H(S)·(RTT/2 + P).
- the issue's model: TPOT = C + (S−1)·(2·RTT + P'), with its own P' per stage boundary fitted
  the same way, TPOT(S, 0) − C = (S−1)·P'. It charges two round trips per boundary; the chain
  above pays RTT/2 per message, so at RTT > 0 it over-predicts (at S = 2: 2·RTT, really RTT).
Every cell other than (1, 0) and the RTT-0 cells with S ≥ 2 is predicted out of sample.

Speculation: a verify window that commits E tokens (measured tokens per round trip) pays the
per-window costs once, and verifying k drafts costs Δc more compute than one token (measured in
the same cell from the stages' timings):  TPOT ≈ (C + Δc + H(S)·(RTT/2 + P)) / E. Pipelined
windows (depth 2) overlap round trips, which this depth-1 formula does not credit.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

import trio

from meshd.coord.local import LocalPipeline, open_local_pipeline
from meshd.coord.pipeline import GenerationRequest
from meshd.coord.workloads import workloads
from meshd.model.builtin import builtin_model_dir
from meshd.model.tokenizer import Tokenizer
from meshd.spec.config import STRATEGIES, SpecConfig

TOLERANCE = 0.15  # the issue's goal: measured within 15 % of the model
P_GOAL_MS = 1.0  # the issue's goal: protocol cost per hop on loopback
PROMPT_KIND = "prose"  # the fixed prompt: the first prose workload (a stdlib docstring)
WARMUP_TOKENS = 8


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `meshd bench pipeline`."""
    parser.add_argument("--model", default=None, help="HF checkpoint dir (default: built-in)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--markdown", action="store_true", help="print Markdown tables")
    parser.add_argument(
        "--quick", action="store_true", help="RTT 0/20 ms, 24 tokens, 1 repeat, auto (< 60 s)"
    )
    parser.add_argument("--stages", type=int, nargs="*", default=None)
    parser.add_argument("--rtt-ms", type=float, nargs="*", default=None)
    parser.add_argument("--tokens", type=int, default=None, help="tokens generated per run")
    parser.add_argument("--repeats", type=int, default=None, help="round-robin passes (median)")
    parser.add_argument(
        "--strategies",
        nargs="*",
        default=None,
        help="speculative candidates (the fastest per cell is reported)",
    )


def run(args: argparse.Namespace) -> int:
    """Run every cell, fit the model, print the tables."""
    model_dir = args.model or str(builtin_model_dir())
    # The calibration cells (1 stage and RTT 0) are always measured.
    stages = sorted({1, *(args.stages or [1, 2, 3])})
    rtts = sorted({0.0, *(args.rtt_ms or ([0.0, 20.0] if args.quick else [0.0, 5.0, 20.0, 50.0]))})
    tokens = args.tokens or (24 if args.quick else 64)
    repeats = args.repeats or (1 if args.quick else 3)
    default = ["auto"] if args.quick else [s for s in STRATEGIES if s != "disabled"]
    candidates = [s for s in (args.strategies or default) if s != "disabled"]
    unknown = sorted(set(candidates) - set(STRATEGIES))
    if unknown:
        raise SystemExit(f"unknown strategies: {', '.join(unknown)}")
    cells = [Cell(s, r) for s in stages for r in rtts]
    report = trio.run(_measure, model_dir, cells, tokens, repeats, candidates)
    if args.json:
        print(json.dumps(report))
    elif args.markdown:
        print(markdown(report))
    else:
        _print(report)
    return 0


# -- the model ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Cell:
    """One pipeline configuration: stage count and emulated round trip per link."""

    stages: int
    rtt_ms: float


def hops(stages: int) -> int:
    """One-way lane messages on a token's critical path (S−1 forward, 1 back; none for S=1)."""
    return stages if stages > 1 else 0


@dataclass(frozen=True)
class PipelineModel:
    """The fitted model: C, P per lane message (corrected), P' per stage boundary (issue's)."""

    c_ms: float
    p_ms: float
    p_issue_ms: float

    def predict(
        self, stages: int, rtt_ms: float, extra_compute_ms: float = 0.0, tokens_per_rt: float = 1.0
    ) -> float:
        """Corrected model, ms per token: (C + Δc + H(S)·(RTT/2 + P)) / E."""
        window = self.c_ms + extra_compute_ms + hops(stages) * (rtt_ms / 2 + self.p_ms)
        return window / tokens_per_rt

    def predict_issue(
        self, stages: int, rtt_ms: float, extra_compute_ms: float = 0.0, tokens_per_rt: float = 1.0
    ) -> float:
        """The issue's model, ms per token: (C + Δc + (S−1)·(2·RTT + P')) / E."""
        window = self.c_ms + extra_compute_ms + (stages - 1) * (2 * rtt_ms + self.p_issue_ms)
        return window / tokens_per_rt


def fit_model(plain_ms: dict[Cell, float]) -> PipelineModel:
    """Fit C from the (1 stage, RTT 0) cell and P, P' by least squares on RTT-0 cells, S ≥ 2."""
    c = plain_ms[Cell(1, 0.0)]
    points = [(cell.stages, ms - c) for cell, ms in plain_ms.items() if cell.rtt_ms == 0.0]
    points = [(s, d) for s, d in points if s > 1]
    if not points:
        return PipelineModel(c, 0.0, 0.0)
    p = sum(hops(s) * d for s, d in points) / sum(hops(s) ** 2 for s, _ in points)
    p_issue = sum((s - 1) * d for s, d in points) / sum((s - 1) ** 2 for s, _ in points)
    return PipelineModel(c, p, p_issue)


def in_sample(cell: Cell) -> bool:
    """True for the cells the model is fitted on (its predictions there are not tests)."""
    return cell.rtt_ms == 0.0


# -- measurement ----------------------------------------------------------------------------
@dataclass(frozen=True)
class RunResult:
    """One generation: its tokens and timings (ms)."""

    tokens: list[int]
    ms_per_token: float  # wall: first commit (prefill's token) to last, over tokens − 1
    compute_ms_per_window: float  # Σ stage compute per verify window (stage timings)
    network_ms_per_window: float  # round trip − compute − queueing, per verify window
    tokens_per_rt: float
    windows_stale: int
    active_strategy: str


async def _measure(
    model_dir: str, cells: list[Cell], tokens: int, repeats: int, candidates: list[str]
) -> dict[str, Any]:
    tokenizer = Tokenizer.open(model_dir)
    load = next(w for w in workloads(1) if w.kind == PROMPT_KIND)
    prompt = tokenizer.encode(load.prompt)
    load_before = os.getloadavg()
    started = time.perf_counter()
    strategies = ["disabled", *candidates]
    runs: dict[tuple[Cell, str], list[RunResult]] = {}
    async with contextlib.AsyncExitStack() as stack:
        pipes: dict[Cell, LocalPipeline] = {}
        for cell in cells:
            pipes[cell] = await stack.enter_async_context(
                open_local_pipeline(
                    model_dir, cell.stages, rtt_s=cell.rtt_ms / 1000, wire_dtype="f16"
                )
            )
        mtp = next(iter(pipes.values())).checkpoint.config.num_mtp_layers
        for cell in cells:  # warm-up: lanes open, threads start, caches fill
            await _generate(pipes[cell], prompt, WARMUP_TOKENS, "disabled", mtp)
        for r in range(repeats):
            # Rotate the order each pass, so no cell always runs right after another.
            for cell in cells[r % len(cells) :] + cells[: r % len(cells)]:
                for strategy in strategies:  # interleaved within the cell too
                    result = await _generate(pipes[cell], prompt, tokens, strategy, mtp)
                    runs.setdefault((cell, strategy), []).append(result)
    report = _report(cells, candidates, runs)
    report["conditions"] = {
        "date": datetime.date.today().isoformat(),
        "prompt": load.name,
        "prompt_tokens": len(prompt),
        "tokens": tokens,
        "repeats": repeats,
        "candidates": candidates,
        "cpus": os.cpu_count(),
        "load_average_before": round(load_before[0], 2),
        "load_average_after": round(os.getloadavg()[0], 2),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    return report


async def _generate(
    pipe: LocalPipeline, prompt: list[int], n: int, strategy: str, mtp: int
) -> RunResult:
    stamps: list[float] = []
    out: list[int] = []

    async def on_tokens(new: list[int]) -> None:
        stamps.append(time.perf_counter())
        out.extend(new)

    request = GenerationRequest(
        prompt=prompt,
        max_tokens=n,
        spec=SpecConfig(strategy=strategy),
        mtp_depth=mtp,
        eos_ids=frozenset(),  # fixed length, so every run decodes the same count
    )
    result = await pipe.coordinator.generate(pipe.route, request, on_tokens)
    tel = result.telemetry
    windows = max(1, tel.verify_round_trips)
    return RunResult(
        tokens=result.tokens,
        ms_per_token=1e3 * (stamps[-1] - stamps[0]) / max(1, len(out) - 1),
        compute_ms_per_window=1e3 * tel.compute_s / windows,
        network_ms_per_window=1e3 * tel.network_s / windows,
        tokens_per_rt=tel.tokens_per_round_trip or 1.0,
        windows_stale=tel.windows_stale,
        active_strategy=tel.active_strategy,
    )


# -- the report -----------------------------------------------------------------------------
def _median(runs: list[RunResult], attr: str) -> float:
    return float(statistics.median(getattr(r, attr) for r in runs))


def _rel(measured: float, predicted: float) -> float:
    return (measured - predicted) / predicted


def _report(
    cells: list[Cell], candidates: list[str], runs: dict[tuple[Cell, str], list[RunResult]]
) -> dict[str, Any]:
    plain = {cell: _median(runs[(cell, "disabled")], "ms_per_token") for cell in cells}
    model = fit_model(plain)
    rows = [_plain_row(cell, runs[(cell, "disabled")], model) for cell in cells]
    every = [
        _spec_row(cell, s, runs[(cell, s)], runs[(cell, "disabled")], model)
        for cell in cells
        for s in candidates
    ]
    best = []
    for cell in cells:
        mine = [r for r in every if (r["stages"], r["rtt_ms"]) == (cell.stages, cell.rtt_ms)]
        if mine:
            best.append(min(mine, key=lambda r: r["measured_ms_per_token"]))
    return {
        "rows": rows + best,
        "candidates": every,
        "model": {
            "C_ms": round(model.c_ms, 3),
            "P_ms": round(model.p_ms, 3),
            "P_issue_ms": round(model.p_issue_ms, 3),
            "corrected": "C + H(S)*(RTT/2 + P), H(S) = S one-way messages for S >= 2, 0 for S = 1",
            "issue": "C + (S-1)*(2*RTT + P')",
        },
    }


def _common(cell: Cell, model: PipelineModel) -> dict[str, Any]:
    return {
        "stages": cell.stages,
        "rtt_ms": cell.rtt_ms,
        "hops": hops(cell.stages),
        "C_ms": round(model.c_ms, 3),
        "P_ms": round(model.p_ms, 3),
        "P_issue_ms": round(model.p_issue_ms, 3),
        "in_sample": in_sample(cell),
    }


def _direct_p(cell: Cell, runs: list[RunResult]) -> float | None:
    """Lane cost per message from the coordinator's own timestamps (round trip − stage time)."""
    if cell.stages == 1:
        return None
    network = _median(runs, "network_ms_per_window")
    return (network - hops(cell.stages) * cell.rtt_ms / 2) / hops(cell.stages)


def _plain_row(cell: Cell, runs: list[RunResult], model: PipelineModel) -> dict[str, Any]:
    measured = _median(runs, "ms_per_token")
    predicted = model.predict(cell.stages, cell.rtt_ms)
    issue = model.predict_issue(cell.stages, cell.rtt_ms)
    direct = _direct_p(cell, runs)
    return {
        **_common(cell, model),
        "table": "plain",
        "strategy": "disabled",
        "measured_ms_per_token": round(measured, 3),
        "predicted_ms_per_token": round(predicted, 3),
        "rel_error": round(_rel(measured, predicted), 4),
        "within_tolerance": abs(_rel(measured, predicted)) <= TOLERANCE,
        "predicted_issue_ms_per_token": round(issue, 3),
        "rel_error_issue": round(_rel(measured, issue), 4),
        "compute_ms_per_token": round(_median(runs, "compute_ms_per_window"), 3),
        "P_direct_ms": None if direct is None else round(direct, 3),
        "tokens_per_round_trip": 1.0,
        "runs_ms_per_token": [round(r.ms_per_token, 3) for r in runs],
    }


def _spec_row(
    cell: Cell,
    strategy: str,
    runs: list[RunResult],
    plain_runs: list[RunResult],
    model: PipelineModel,
) -> dict[str, Any]:
    measured = _median(runs, "ms_per_token")
    e = _median(runs, "tokens_per_rt")
    extra = _median(runs, "compute_ms_per_window") - _median(plain_runs, "compute_ms_per_window")
    predicted = model.predict(cell.stages, cell.rtt_ms, extra, e)
    issue = model.predict_issue(cell.stages, cell.rtt_ms, extra, e)
    plain = _median(plain_runs, "ms_per_token")
    base = plain_runs[0].tokens
    return {
        **_common(cell, model),
        "table": "speculative",
        "strategy": strategy,
        "active_strategy": runs[-1].active_strategy,
        "measured_ms_per_token": round(measured, 3),
        "predicted_ms_per_token": round(predicted, 3),
        "rel_error": round(_rel(measured, predicted), 4),
        "within_tolerance": abs(_rel(measured, predicted)) <= TOLERANCE,
        "predicted_issue_ms_per_token": round(issue, 3),
        "rel_error_issue": round(_rel(measured, issue), 4),
        "tokens_per_round_trip": round(e, 3),
        "extra_compute_ms_per_window": round(extra, 3),
        "speedup_vs_plain": round(plain / measured, 3),
        "windows_stale": sum(r.windows_stale for r in runs),
        "identical_to_plain": all(r.tokens == base for r in [*runs, *plain_runs]),
        "runs_ms_per_token": [round(r.ms_per_token, 3) for r in runs],
    }


def _flag(row: dict[str, Any]) -> str:
    if row["in_sample"] and row["table"] == "plain":
        return "fit"
    return "ok" if row["within_tolerance"] else "OUT"


def markdown(report: dict[str, Any]) -> str:
    """The two tables as Markdown, for docs/benchmarks.md."""
    m = report["model"]
    out = [
        f"C = {m['C_ms']:.2f} ms, P = {m['P_ms']:.3f} ms per lane message "
        f"(issue's P' = {m['P_issue_ms']:.3f} ms per stage boundary)\n",
        "| stages | RTT ms | measured ms/token | corrected model | error | issue's model | error |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in (r for r in report["rows"] if r["table"] == "plain"):
        out.append(
            f"| {r['stages']} | {r['rtt_ms']:g} | {r['measured_ms_per_token']:.2f} | "
            f"{r['predicted_ms_per_token']:.2f} | {100 * r['rel_error']:+.1f} % {_flag(r)} | "
            f"{r['predicted_issue_ms_per_token']:.2f} | {100 * r['rel_error_issue']:+.1f} % |"
        )
    out += [
        "\n| stages | RTT ms | best strategy | measured ms/token | × plain | tokens/round trip "
        "| model | error | same tokens |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in (r for r in report["rows"] if r["table"] == "speculative"):
        out.append(
            f"| {r['stages']} | {r['rtt_ms']:g} | {r['strategy']} | "
            f"{r['measured_ms_per_token']:.2f} | {r['speedup_vs_plain']:.2f} | "
            f"{r['tokens_per_round_trip']:.2f} | {r['predicted_ms_per_token']:.2f} | "
            f"{100 * r['rel_error']:+.1f} % {_flag(r)} | "
            f"{'yes' if r['identical_to_plain'] else '**NO**'} |"
        )
    return "\n".join(out)


def _print(report: dict[str, Any]) -> None:
    c, m = report["conditions"], report["model"]
    print(
        f"meshd bench pipeline — greedy, prompt {c['prompt']} ({c['prompt_tokens']} tokens), "
        f"{c['tokens']} tokens per run, median of {c['repeats']}, load {c['load_average_before']}"
    )
    print(
        f"C = {m['C_ms']:.2f} ms   P = {m['P_ms']:.3f} ms per lane message   "
        f"P' = {m['P_issue_ms']:.3f} ms per boundary (issue's formula)"
    )
    print(f"corrected: {m['corrected']}\nissue's:   {m['issue']}")
    print(
        f"\n{'S':>2} {'RTT':>5} {'strategy':>13} {'measured':>9} {'model':>8} {'error':>7} "
        f"{'':>4} {'issue':>8} {'error':>7} {'tok/rt':>6} {'x plain':>7} {'same':>4}"
    )
    for r in report["rows"]:
        speedup = r.get("speedup_vs_plain")
        same = r.get("identical_to_plain", True)
        print(
            f"{r['stages']:>2} {r['rtt_ms']:>5g} {r['strategy']:>13} "
            f"{r['measured_ms_per_token']:>9.2f} {r['predicted_ms_per_token']:>8.2f} "
            f"{100 * r['rel_error']:>+6.1f}% {_flag(r):>4} "
            f"{r['predicted_issue_ms_per_token']:>8.2f} {100 * r['rel_error_issue']:>+6.1f}% "
            f"{r['tokens_per_round_trip']:>6.2f} "
            f"{'' if speedup is None else f'{speedup:.2f}':>7} {'yes' if same else 'NO':>4}"
        )
    print(f"\n{c['wall_s']} s, load average {c['load_average_before']} → {c['load_average_after']}")
