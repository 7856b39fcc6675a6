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

The model's terms, in ms per token (per verify window, which is one token without speculation):
- C: time of one window without the network: the stages' compute, as their own timings report
  it, plus O, the coordinator's own loop (O = TPOT − compute in the 1-stage RTT-0 cell). C is
  taken per cell from its stage timings, so the background load's effect on compute, which no
  network model can know, is not counted as model error; the constant-C variant (C of the
  1-stage RTT-0 cell everywhere) is reported next to it.
- P: cost of one lane message beyond the emulated delay (encode, encrypt, loopback UDP,
  decrypt, decode, trio wake-ups, the next stage's queue), fitted by least squares to the RTT-0
  cells with S ≥ 2: TPOT(S, 0) − C = H(S)·P. `P_direct_ms` is the same cost read straight from
  the coordinator's timestamps: (round trip − Σ stage compute − Σ stage queue)/H − RTT/2.
- corrected model: TPOT = C + H(S)·(RTT/2 + P).
- the issue's model: TPOT = C + (S−1)·(2·RTT + P'), with its own P' per stage boundary fitted
  the same way, TPOT(S, 0) − C = (S−1)·P'. It charges two round trips per boundary; the chain
  above pays RTT/2 per message, so at RTT > 0 it over-predicts (at S = 2: 2·RTT, really RTT).
Only the RTT-0 cells are fitted; every cell at RTT > 0 is predicted out of sample.

Speculation: a verify window that commits E tokens (measured tokens per round trip) pays the
per-window costs once: TPOT ≈ (C_w + H(S)·(RTT/2 + P)) / E, where C_w is that cell's compute
per window (wider windows cost more) plus O. Pipelined windows (depth 2) overlap round trips,
which this depth-1 formula does not credit, so it over-predicts where they pay off.
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

import msgspec
import trio

from meshd.bench.harness import (
    add_model_option,
    add_quantization_option,
    load_draft,
    median,
    model_dir,
    resolve_quantization,
)
from meshd.coord.coordinator import GenerationRequest
from meshd.coord.local import LocalPipeline, open_local_pipeline
from meshd.model.files import open_tokenizer
from meshd.sim.workloads import workloads
from meshd.speculative.config import DRAFT_STRATEGIES, STRATEGIES, SpecConfig

TOLERANCE = 0.15  # the issue's goal: measured within 15 % of the model
P_GOAL_MS = 1.0  # the issue's goal: protocol cost per hop on loopback
PROMPT_KIND = "prose"  # the fixed prompt: the first prose workload (a stdlib docstring)
WARMUP_TOKENS = 8


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `meshd bench pipeline`."""
    add_model_option(parser)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--markdown", action="store_true", help="print Markdown tables")
    parser.add_argument(
        "--quick", action="store_true", help="RTT 0/20 ms, 16 tokens, 1 repeat, auto (< 60 s)"
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
    parser.add_argument(
        "--speculative-draft-model",
        default="",
        help="draft model (dir or .gguf) for the draft strategies and auto; without one they "
        "are left out",
    )
    add_quantization_option(parser, auto=True)


def run(args: argparse.Namespace) -> int:
    """Run every cell, fit the model, print the tables."""
    directory = model_dir(args)
    quantization = resolve_quantization(args.quantization, directory)
    # The calibration cells (1 stage and RTT 0) are always measured.
    stages = sorted({1, *(args.stages or [1, 2, 3])})
    rtts = sorted({0.0, *(args.rtt_ms or ([0.0, 20.0] if args.quick else [0.0, 5.0, 20.0, 50.0]))})
    tokens = args.tokens or (16 if args.quick else 64)
    repeats = args.repeats or (1 if args.quick else 3)
    default = ["auto"] if args.quick else [s for s in STRATEGIES if s != "disabled"]
    candidates = [s for s in (args.strategies or default) if s != "disabled"]
    unknown = sorted(set(candidates) - set(STRATEGIES))
    if unknown:
        raise SystemExit(f"unknown strategies: {', '.join(unknown)}")
    draft_path = args.speculative_draft_model
    if not draft_path:
        candidates = [s for s in candidates if s not in DRAFT_STRATEGIES]
    cells = [Cell(s, r) for s in stages for r in rtts]
    report = trio.run(
        _measure, directory, cells, tokens, repeats, candidates, quantization, draft_path
    )
    report["draft_model"] = draft_path
    report["quantization"] = quantization
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
    """Fitted protocol costs: P per lane message (corrected), P' per stage boundary (issue's)."""

    p_ms: float
    p_issue_ms: float

    def predict(self, c_ms: float, stages: int, rtt_ms: float, tokens_per_rt: float = 1.0) -> float:
        """Corrected model, ms per token: (C + H(S)·(RTT/2 + P)) / E."""
        return (c_ms + hops(stages) * (rtt_ms / 2 + self.p_ms)) / tokens_per_rt

    def predict_issue(
        self, c_ms: float, stages: int, rtt_ms: float, tokens_per_rt: float = 1.0
    ) -> float:
        """The issue's model, ms per token: (C + (S−1)·(2·RTT + P')) / E."""
        return (c_ms + (stages - 1) * (2 * rtt_ms + self.p_issue_ms)) / tokens_per_rt


def fit_model(excess_ms: dict[int, float]) -> PipelineModel:
    """Least-squares P and P' from TPOT − C at RTT 0, by stage count (S ≥ 2 used)."""
    points = [(s, d) for s, d in excess_ms.items() if s > 1]
    if not points:
        return PipelineModel(0.0, 0.0)
    p = sum(hops(s) * d for s, d in points) / sum(hops(s) ** 2 for s, _ in points)
    p_issue = sum((s - 1) * d for s, d in points) / sum((s - 1) ** 2 for s, _ in points)
    return PipelineModel(p, p_issue)


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
    model_dir: str,
    cells: list[Cell],
    tokens: int,
    repeats: int,
    candidates: list[str],
    quantization: str = "none",
    draft_path: str = "",
) -> dict[str, Any]:
    tokenizer = open_tokenizer(model_dir)
    draft = load_draft(draft_path, quantization) if draft_path else None
    spec = SpecConfig(draft_model=draft_path)
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
                    model_dir,
                    cell.stages,
                    rtt_s=cell.rtt_ms / 1000,
                    wire_dtype="f16",
                    quantization=quantization,
                    draft=draft,
                )
            )
        mtp = next(iter(pipes.values())).checkpoint.config.num_mtp_layers
        for cell in cells:  # warm-up: lanes open, threads start, caches fill
            await _generate(pipes[cell], prompt, WARMUP_TOKENS, "disabled", mtp, spec)
        for r in range(repeats):
            # Rotate the order each pass, so no cell always runs right after another.
            for cell in cells[r % len(cells) :] + cells[: r % len(cells)]:
                for strategy in strategies:  # interleaved within the cell too
                    result = await _generate(pipes[cell], prompt, tokens, strategy, mtp, spec)
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
    pipe: LocalPipeline,
    prompt: list[int],
    n: int,
    strategy: str,
    mtp: int,
    spec: SpecConfig | None = None,
) -> RunResult:
    stamps: list[float] = []
    out: list[int] = []

    async def on_tokens(new: list[int]) -> None:
        stamps.append(time.perf_counter())
        out.extend(new)

    request = GenerationRequest(
        prompt=prompt,
        max_tokens=n,
        spec=msgspec.structs.replace(spec or SpecConfig(), strategy=strategy),
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
@dataclass(frozen=True)
class Fit:
    """What the report predicts with: O, the constant C, and P fitted both ways."""

    o_ms: float  # the coordinator's own time per window (1-stage RTT-0 cell)
    c_constant_ms: float  # TPOT of the 1-stage RTT-0 cell
    timed: PipelineModel  # P fitted with C per cell from stage timings (the primary model)
    constant: PipelineModel  # P fitted with the constant C


def _median(runs: list[RunResult], attr: str) -> float:
    return median(getattr(r, attr) for r in runs)


def _rel(measured: float, predicted: float) -> float:
    return (measured - predicted) / predicted


def _fit(cells: list[Cell], plain: dict[Cell, list[RunResult]]) -> Fit:
    base = plain[Cell(1, 0.0)]
    c0 = _median(base, "ms_per_token")
    o = c0 - _median(base, "compute_ms_per_window")
    zero = [c for c in cells if c.rtt_ms == 0.0]
    tpot = {c: _median(plain[c], "ms_per_token") for c in zero}
    timed = {c.stages: tpot[c] - _median(plain[c], "compute_ms_per_window") - o for c in zero}
    return Fit(o, c0, fit_model(timed), fit_model({c.stages: tpot[c] - c0 for c in zero}))


def _report(
    cells: list[Cell], candidates: list[str], runs: dict[tuple[Cell, str], list[RunResult]]
) -> dict[str, Any]:
    plain = {cell: runs[(cell, "disabled")] for cell in cells}
    fit = _fit(cells, plain)
    rows = [_row(cell, "disabled", plain[cell], plain[cell], fit) for cell in cells]
    every = [_row(c, s, runs[(c, s)], plain[c], fit) for c in cells for s in candidates]
    best = []
    for cell in cells:
        mine = [r for r in every if (r["stages"], r["rtt_ms"]) == (cell.stages, cell.rtt_ms)]
        if mine:
            best.append(min(mine, key=lambda r: r["measured_ms_per_token"]))
    direct = [r["P_direct_ms"] for r in rows if r["rtt_ms"] == 0 and r["P_direct_ms"] is not None]
    tested = [r for r in rows if not r["in_sample"]]
    return {
        "rows": rows + best,
        "candidates": every,
        "model": {
            "O_ms": round(fit.o_ms, 3),
            "C_ms": round(fit.c_constant_ms, 3),
            "P_ms": round(fit.timed.p_ms, 3),
            "P_issue_ms": round(fit.timed.p_issue_ms, 3),
            "P_constant_c_ms": round(fit.constant.p_ms, 3),
            "P_direct_ms": round(statistics.median(direct), 3) if direct else None,
            "corrected": "C + H(S)*(RTT/2 + P); H(S) = S one-way messages for S >= 2, 0 for S = 1",
            "issue": "C + (S-1)*(2*RTT + P')",
            "P_goal_met": fit.timed.p_ms <= P_GOAL_MS,
            "plain_cells_tested": len(tested),
            "plain_cells_within_tolerance": sum(r["within_tolerance"] for r in tested),
        },
    }


def _row(
    cell: Cell, strategy: str, runs: list[RunResult], plain: list[RunResult], fit: Fit
) -> dict[str, Any]:
    """One cell and strategy: measured, the three predictions and their errors."""
    measured = _median(runs, "ms_per_token")
    e = _median(runs, "tokens_per_rt")
    compute = _median(runs, "compute_ms_per_window")
    c_w = compute + fit.o_ms
    extra = compute - _median(plain, "compute_ms_per_window")  # Δc of wider windows
    predicted = fit.timed.predict(c_w, cell.stages, cell.rtt_ms, e)
    issue = fit.timed.predict_issue(c_w, cell.stages, cell.rtt_ms, e)
    constant = fit.constant.predict(fit.c_constant_ms + extra, cell.stages, cell.rtt_ms, e)
    direct = None
    if cell.stages > 1:
        network = _median(runs, "network_ms_per_window")
        direct = network / hops(cell.stages) - cell.rtt_ms / 2
    row: dict[str, Any] = {
        "stages": cell.stages,
        "rtt_ms": cell.rtt_ms,
        "hops": hops(cell.stages),
        "table": "plain" if strategy == "disabled" else "speculative",
        "strategy": strategy,
        "measured_ms_per_token": round(measured, 3),
        "predicted_ms_per_token": round(predicted, 3),
        "rel_error": round(_rel(measured, predicted), 4),
        "within_tolerance": abs(_rel(measured, predicted)) <= TOLERANCE,
        "predicted_issue_ms_per_token": round(issue, 3),
        "rel_error_issue": round(_rel(measured, issue), 4),
        "predicted_constant_c_ms_per_token": round(constant, 3),
        "rel_error_constant_c": round(_rel(measured, constant), 4),
        "C_ms": round(c_w, 3),
        "compute_ms_per_window": round(compute, 3),
        "O_ms": round(fit.o_ms, 3),
        "P_ms": round(fit.timed.p_ms, 3),
        "P_issue_ms": round(fit.timed.p_issue_ms, 3),
        "P_direct_ms": None if direct is None else round(direct, 3),
        "tokens_per_round_trip": round(e, 3),
        "in_sample": strategy == "disabled" and cell.rtt_ms == 0.0,
        "runs_ms_per_token": [round(r.ms_per_token, 3) for r in runs],
    }
    if strategy != "disabled":
        base = plain[0].tokens
        row["active_strategy"] = runs[-1].active_strategy
        row["speedup_vs_plain"] = round(_median(plain, "ms_per_token") / measured, 3)
        row["windows_stale"] = sum(r.windows_stale for r in runs)
        row["identical_to_plain"] = all(r.tokens == base for r in [*runs, *plain])
    return row


def _flag(row: dict[str, Any]) -> str:
    if row["in_sample"]:
        return "fit"
    return "ok" if row["within_tolerance"] else "OUT"


def _pct(x: float) -> str:
    return f"{100 * x:+.1f} %"


def markdown(report: dict[str, Any]) -> str:
    """The two tables as Markdown, for docs/benchmarks.md."""
    m = report["model"]
    out = [
        f"O = {m['O_ms']:.2f} ms, constant C = {m['C_ms']:.2f} ms, P = {m['P_ms']:.3f} ms per "
        f"lane message (read from timestamps: {m['P_direct_ms']} ms; with constant C: "
        f"{m['P_constant_c_ms']:.3f} ms), issue's P' = {m['P_issue_ms']:.3f} ms per boundary\n",
        "| stages | RTT ms | measured ms/token | C ms | corrected model | error "
        "| issue's model | error | constant-C model | error |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in (r for r in report["rows"] if r["table"] == "plain"):
        out.append(
            f"| {r['stages']} | {r['rtt_ms']:g} | {r['measured_ms_per_token']:.2f} | "
            f"{r['C_ms']:.2f} | {r['predicted_ms_per_token']:.2f} | "
            f"{_pct(r['rel_error'])} {_flag(r)} | {r['predicted_issue_ms_per_token']:.2f} | "
            f"{_pct(r['rel_error_issue'])} | {r['predicted_constant_c_ms_per_token']:.2f} | "
            f"{_pct(r['rel_error_constant_c'])} |"
        )
    out += [
        "\n| stages | RTT ms | best strategy | measured ms/token | × plain | tokens/round trip "
        "| corrected model | error | issue's model | error | same tokens |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in (r for r in report["rows"] if r["table"] == "speculative"):
        out.append(
            f"| {r['stages']} | {r['rtt_ms']:g} | {r['strategy']} | "
            f"{r['measured_ms_per_token']:.2f} | {r['speedup_vs_plain']:.2f} | "
            f"{r['tokens_per_round_trip']:.2f} | {r['predicted_ms_per_token']:.2f} | "
            f"{_pct(r['rel_error'])} {_flag(r)} | {r['predicted_issue_ms_per_token']:.2f} | "
            f"{_pct(r['rel_error_issue'])} | {'yes' if r['identical_to_plain'] else '**NO**'} |"
        )
    return "\n".join(out)


def _print(report: dict[str, Any]) -> None:
    c, m = report["conditions"], report["model"]
    print(
        f"meshd bench pipeline — greedy, prompt {c['prompt']} ({c['prompt_tokens']} tokens), "
        f"{c['tokens']} tokens per run, median of {c['repeats']}, load {c['load_average_before']}"
    )
    print(
        f"O = {m['O_ms']:.2f} ms   constant C = {m['C_ms']:.2f} ms   P = {m['P_ms']:.3f} ms per "
        f"lane message (timestamps: {m['P_direct_ms']}; constant C: {m['P_constant_c_ms']:.3f})"
        f"   P' = {m['P_issue_ms']:.3f} ms per boundary"
    )
    print(f"corrected: {m['corrected']}\nissue's:   {m['issue']}")
    print(
        f"\n{'S':>2} {'RTT':>4} {'strategy':>12} {'measured':>8} {'C':>6} {'model':>7} "
        f"{'error':>8} {'':>3} {'issue':>7} {'error':>8} {'const-C':>7} {'error':>8} "
        f"{'P_dir':>6} {'tok/rt':>6} {'x plain':>7} {'same':>4}"
    )
    for r in report["rows"]:
        speedup = r.get("speedup_vs_plain")
        direct = r["P_direct_ms"]
        print(
            f"{r['stages']:>2} {r['rtt_ms']:>4g} {r['strategy']:>12} "
            f"{r['measured_ms_per_token']:>8.2f} {r['C_ms']:>6.2f} "
            f"{r['predicted_ms_per_token']:>7.2f} {_pct(r['rel_error']):>8} {_flag(r):>3} "
            f"{r['predicted_issue_ms_per_token']:>7.2f} {_pct(r['rel_error_issue']):>8} "
            f"{r['predicted_constant_c_ms_per_token']:>7.2f} {_pct(r['rel_error_constant_c']):>8} "
            f"{'' if direct is None else f'{direct:.2f}':>6} {r['tokens_per_round_trip']:>6.2f} "
            f"{'' if speedup is None else f'{speedup:.2f}':>7} "
            f"{'yes' if r.get('identical_to_plain', True) else 'NO':>4}"
        )
    print(
        f"\n{m['plain_cells_within_tolerance']} of {m['plain_cells_tested']} out-of-sample plain "
        f"cells within {100 * TOLERANCE:.0f} %; P ≤ {P_GOAL_MS} ms: "
        f"{'met' if m['P_goal_met'] else 'not met'}"
    )
    print(f"{c['wall_s']} s, load average {c['load_average_before']} → {c['load_average_after']}")
