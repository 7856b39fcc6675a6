"""`meshd bench spec`: speculative strategies side by side over a real stage pipeline.

For each stage count and emulated RTT, one in-process pipeline on loopback (real lanes, real
stage hosts, userspace-emulated latency) runs every strategy on every workload, interleaved,
greedy, in rounds that repeat until `disabled` has decoded for `--min-seconds` (a 96-token
run on one fast node lasts ~0.3 s, too short to time alone on a shared machine). Reported per
row, as medians over prompts and rounds: decode tokens/s, the ratio to `disabled` in the same
round, accepted/drafted, tokens per verify round trip, stale windows — and whether the text
equals `disabled`'s (speculation must never change it). `auto`'s row also names the
cell's best single strategy and gives `auto` against it, paired within each round. `draft` and `draft-ngram` run with
`--speculative-draft-model`, on the built-in model with its shipped draft by default (and
`auto` weighs the draft there); without a draft model they are left out. The single-stage rows also time
`transformers` `generate()` with and without `prompt_lookup_num_tokens` on the same checkpoint.
With `--temperature T --seed N` every run is sampled with that seed instead of greedy: the
identity check then says whether one seed gives the same text under every strategy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from typing import Any

import msgspec
import torch
import trio

from meshd.bench.harness import (
    add_model_option,
    add_quantization_option,
    load_draft,
    model_dir,
    resolve_quantization,
)
from meshd.coord.coordinator import GenerationRequest
from meshd.coord.local import open_local_pipeline
from meshd.model.files import open_checkpoint, open_tokenizer
from meshd.model.tokenizer import Tokenizer
from meshd.sim.workloads import Workload, workloads
from meshd.speculative.config import (
    DRAFT_STRATEGIES,
    STRATEGIES,
    SpecConfig,
    add_spec_arguments,
    resolve_spec_config,
    spec_cli_values,
)
from protocol.config import LaneConfig
from protocol.messages import Sampling

KINDS = ("edit", "completion", "prose", "chat")
# The pipeline's lanes are loopback between tasks of this one process: one goes quiet only when
# the process is starved of CPU (a shared machine under `nice`), which must not end the bench
# with a lost route (it did, at the default 1.5 s).
# A real model's prefill of a long prompt (the draft's too, on the coordinator's thread), on a
# starved shared machine, can outlast the default reply timeout and session lease (30 s), and
# the lanes' 30 s: the bench waits where a daemon would give up.
BENCH_REPLY_TIMEOUT_S = 600.0
BENCH_LANES = LaneConfig(dead_after_s=BENCH_REPLY_TIMEOUT_S)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `meshd bench spec`."""
    add_model_option(parser)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--quick", action="store_true", help="2 stages, RTT 20 ms, 1 prompt")
    parser.add_argument("--stages", type=int, nargs="*", default=None)
    parser.add_argument("--rtt-ms", type=float, nargs="*", default=None)
    parser.add_argument("--tokens", type=int, default=None, help="tokens generated per run")
    parser.add_argument("--prompts", type=int, default=None, help="prompts per workload")
    parser.add_argument(
        "--workloads", nargs="*", choices=KINDS, default=list(KINDS), help="workload kinds"
    )
    parser.add_argument("--strategies", nargs="*", default=list(STRATEGIES))
    parser.add_argument("--no-transformers", action="store_true")
    add_quantization_option(parser, auto=True)
    parser.add_argument("--markdown", action="store_true", help="print Markdown tables")
    parser.add_argument(
        "--min-seconds",
        type=float,
        default=None,
        help="repeat a prompt's round of strategies until disabled has decoded this long "
        "(default 4; 0 with --quick): short runs on a shared machine are mostly noise",
    )
    parser.add_argument("--max-rounds", type=int, default=10, help="most rounds per prompt")
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sample every run at this temperature with --seed (0: greedy); the report says "
        "whether every strategy's text equals disabled's",
    )
    parser.add_argument("--seed", type=int, default=0, help="the sampled runs' seed")
    # Every strategy runs with these settings (the strategy flag itself is --strategies).
    add_spec_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Run the matrix and print it."""
    directory = model_dir(args)
    quantization = resolve_quantization(args.quantization, directory)
    stages = args.stages or ([2] if args.quick else [1, 2, 3])
    rtts = args.rtt_ms or ([20.0] if args.quick else [0.0, 5.0, 20.0, 50.0])
    tokens = args.tokens or (48 if args.quick else 96)
    prompts = args.prompts or (1 if args.quick else 2)
    strategies = [s for s in STRATEGIES if s in args.strategies]
    if "disabled" not in strategies:
        strategies.insert(0, "disabled")
    loads = workloads(prompts, tuple(k for k in KINDS if k in args.workloads))
    min_s = args.min_seconds if args.min_seconds is not None else (0.0 if args.quick else 4.0)
    rounds = Rounds(min_s, max(1, args.max_rounds))
    overrides = {k: v for k, v in spec_cli_values(args).items() if k != "strategy"}
    spec = resolve_spec_config({}, {}, overrides, {})
    if not spec.draft_model and not args.model:
        # The built-in model drafts with its shipped draft (`auto` weighs it too).
        from meshd.model.builtin import builtin_draft_dir

        spec = msgspec.structs.replace(spec, draft_model=str(builtin_draft_dir()))
    if not spec.draft_model:
        strategies = [s for s in strategies if s not in DRAFT_STRATEGIES]
    report = trio.run(
        _matrix,
        directory,
        stages,
        rtts,
        tokens,
        loads,
        strategies,
        rounds,
        spec,
        quantization,
        Sampling(temperature=max(0.0, args.temperature), seed=args.seed),
    )
    report["spec_overrides"] = overrides
    report["draft_model"] = spec.draft_model
    report["quantization"] = quantization
    if 1 in stages and not args.no_transformers:
        report["transformers"] = _transformers_rows(directory, loads, tokens)
    if args.json:
        print(json.dumps(report))
    elif args.markdown:
        print(markdown(report, strategies))
    else:
        _print(report, strategies)
    return 0


@dataclass(frozen=True)
class Rounds:
    """How often a prompt's strategies run, interleaved: until `disabled` has decoded for
    `min_seconds` in all, at most `max_rounds` times (once when min_seconds is 0)."""

    min_seconds: float = 4.0
    max_rounds: int = 10

    def more(self, done: int, disabled_decode_s: float) -> bool:
        """Whether to run another round after `done` rounds."""
        return done < self.max_rounds and disabled_decode_s < self.min_seconds


async def _matrix(
    model_dir: str,
    stage_counts: list[int],
    rtts_ms: list[float],
    tokens: int,
    loads: list[Workload],
    strategies: list[str],
    rounds: Rounds = Rounds(0.0, 1),
    spec: SpecConfig | None = None,
    quantization: str = "none",
    sampling: Sampling | None = None,
) -> dict[str, Any]:
    settings = spec or SpecConfig()
    sampling = sampling or Sampling()
    checkpoint = open_checkpoint(model_dir)
    tokenizer = open_tokenizer(model_dir)
    mtp_depth = checkpoint.config.num_mtp_layers
    eos = frozenset(tokenizer.eos_ids)
    rows: list[dict[str, Any]] = []
    samples: dict[str, str] = {}
    draft = (
        load_draft(settings.draft_model, quantization)
        if settings.draft_model and any(s in DRAFT_STRATEGIES or s == "auto" for s in strategies)
        else None
    )
    # One stage is one node, which computes on all its cores as a daemon does; several stages
    # in this process stand for several machines, one core each (`open_local_pipeline`).
    cores = torch.get_num_threads()
    for stages in stage_counts:
        for rtt_ms in rtts_ms:
            async with open_local_pipeline(
                model_dir,
                stages,
                rtt_s=rtt_ms / 1000,
                torch_threads=cores if stages == 1 else 1,
                wire_dtype="f16",
                eos_ids=eos,
                quantization=quantization,
                draft=draft,
                lane_config=BENCH_LANES,
                session_lease_s=BENCH_REPLY_TIMEOUT_S,
            ) as pipe:
                pipe.coordinator.reply_timeout_s = BENCH_REPLY_TIMEOUT_S
                # Warm-up: lanes open, threads start, caches fill.
                warm = encode_workload(tokenizer, loads[0])
                await generate(pipe, warm, 8, "disabled", mtp_depth, settings)
                for load in loads:
                    ids = encode_workload(tokenizer, load)
                    done, disabled_s = 0, 0.0
                    while done == 0 or rounds.more(done, disabled_s):
                        # Interleaved, one strategy after another; each round starts one
                        # strategy later, so none always runs first (after a pause, say).
                        turn = done % len(strategies)
                        results = {}
                        for strategy in strategies[turn:] + strategies[:turn]:
                            results[strategy] = await generate(
                                pipe, ids, tokens, strategy, mtp_depth, settings, sampling
                            )
                        base = results["disabled"]
                        disabled_s += base["decode_s"]
                        samples.setdefault(load.kind, tokenizer.decode(base["tokens"]))
                        rows += _runs(stages, rtt_ms, load, done, results)
                        done += 1
    return {
        "rows": _aggregate(rows),
        "runs": rows,
        "samples": samples,
        "tokens": tokens,
        "sampling": {"temperature": sampling.temperature, "seed": sampling.seed},
        # Whether every run's text was `disabled`'s of its prompt and round (the same seed).
        "identical_texts": all(r["identical_to_disabled"] for r in rows),
    }


def encode_workload(tokenizer: Tokenizer, load: Workload) -> list[int]:
    """The prompt's ids: a chat through the model's chat template where it has one."""
    if load.messages and tokenizer.chat_template is not None:
        return tokenizer.encode_chat([{"role": r, "content": c} for r, c in load.messages])
    return tokenizer.encode(load.prompt)


def _runs(
    stages: int, rtt_ms: float, load: Workload, round_: int, results: dict[str, dict[str, Any]]
) -> list[dict[str, Any]]:
    """One record per strategy of a round; ratios against that round's `disabled`."""
    base = results["disabled"]
    return [
        {
            "stages": stages,
            "rtt_ms": rtt_ms,
            "workload": load.kind,
            "prompt": load.name,
            "round": round_,
            "strategy": strategy,
            "decode_tok_s": r["tok_s"],
            "ratio_vs_disabled": r["tok_s"] / base["tok_s"],
            "acceptance": r["acceptance"],
            "drafted": r["drafted"],
            "accepted": r["accepted"],
            "tokens_per_round_trip": r["tpr"],
            "windows_stale": r["stale"],
            "draft_s_per_token": r["draft_s_per_token"],
            "identical_to_disabled": r["tokens"] == base["tokens"],
        }
        for strategy, r in results.items()
    ]


async def generate(
    pipe: Any,
    ids: list[int],
    n: int,
    strategy: str,
    mtp: int,
    spec: SpecConfig | None = None,
    sampling: Sampling | None = None,
) -> dict[str, Any]:
    """One request of exactly `n` tokens through a local pipeline with `strategy` (the other
    speculative keys from `spec`), greedy unless `sampling` says otherwise: its tokens,
    decode time and speed, and the speculation counters, as the bench's cells record them."""
    out: list[int] = []

    async def on_tokens(t: list[int]) -> None:
        out.extend(t)

    request = GenerationRequest(
        prompt=ids,
        max_tokens=n,
        sampling=sampling or Sampling(),
        spec=msgspec.structs.replace(spec or SpecConfig(), strategy=strategy),
        mtp_depth=mtp,
        eos_ids=frozenset(),  # fixed length, so every strategy decodes the same count
    )
    t0 = time.perf_counter()
    result = await pipe.coordinator.generate(pipe.route, request, on_tokens)
    wall = time.perf_counter() - t0
    tel = result.telemetry
    decode_s = tel.decode_s or max(1e-9, wall - tel.prompt_s)
    return {
        "tokens": result.tokens,
        "decode_s": decode_s,
        "tok_s": max(1, len(result.tokens) - 1) / decode_s,
        "acceptance": tel.acceptance,
        "drafted": tel.drafted_tokens,
        "accepted": tel.accepted_tokens,
        "tpr": tel.tokens_per_round_trip,
        "stale": tel.windows_stale,
        "draft_s_per_token": tel.draft_s_per_token,
    }


def _aggregate(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (stages, rtt, workload, strategy): medians over prompts and rounds."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["stages"], r["rtt_ms"], r["workload"], r["strategy"]), []).append(r)
    rows = []
    for (stages, rtt, workload, strategy), items in groups.items():
        drafted = sum(i["drafted"] for i in items)
        accepted = sum(i["accepted"] for i in items)
        tprs = [i["tokens_per_round_trip"] for i in items if i["tokens_per_round_trip"]]
        rows.append(
            {
                "stages": stages,
                "rtt_ms": rtt,
                "workload": workload,
                "strategy": strategy,
                "decode_tok_s": round(statistics.median(i["decode_tok_s"] for i in items), 2),
                "ratio_vs_disabled": round(
                    statistics.median(i["ratio_vs_disabled"] for i in items), 3
                ),
                # The spread of the per-round ratios (quartiles), and how many there were: on
                # a shared machine one pair of runs can differ widely (docs/speculative.md).
                "ratio_quartiles": _quartiles([i["ratio_vs_disabled"] for i in items]),
                "ratio_samples": len(items),
                "acceptance": round(accepted / drafted, 3) if drafted else None,
                "tokens_per_round_trip": round(statistics.median(tprs), 2) if tprs else None,
                "identical_to_disabled": all(i["identical_to_disabled"] for i in items),
            }
        )
    _versus_best_single(rows, runs)
    return rows


def _versus_best_single(rows: list[dict[str, Any]], runs: list[dict[str, Any]]) -> None:
    """Add to each `auto` row the cell's best single strategy (`disabled` included) by its
    median ratio to `disabled`, and `auto` against it: the quotient of the two medians
    (`ratio_vs_best_single`) and the median of the per-round quotients, auto's run over that
    strategy's run of the same prompt and round (`paired_ratio_vs_best_single`, with its
    quartiles). Runs of one round lie seconds apart, so the paired figure is spared most of
    a shared machine's drift in load between rounds; the two medians each carry it."""

    def cell(r: dict[str, Any]) -> tuple[Any, ...]:
        return (r["stages"], r["rtt_ms"], r["workload"])

    for row in rows:
        if row["strategy"] != "auto":
            continue
        singles = [r for r in rows if cell(r) == cell(row) and r["strategy"] != "auto"]
        if not singles:
            continue
        best = max(singles, key=lambda r: r["ratio_vs_disabled"])
        speed = {
            (r["prompt"], r.get("round", 0)): r["decode_tok_s"]
            for r in runs
            if cell(r) == cell(row) and r["strategy"] == best["strategy"]
        }
        paired = [
            r["decode_tok_s"] / speed[(r["prompt"], r.get("round", 0))]
            for r in runs
            if cell(r) == cell(row)
            and r["strategy"] == "auto"
            and (r["prompt"], r.get("round", 0)) in speed
        ]
        row["best_single"] = best["strategy"]
        row["ratio_vs_best_single"] = round(row["ratio_vs_disabled"] / best["ratio_vs_disabled"], 3)
        if paired:
            row["paired_ratio_vs_best_single"] = round(statistics.median(paired), 3)
            row["paired_ratio_vs_best_single_quartiles"] = _quartiles(paired)


def _quartiles(values: list[float]) -> list[float]:
    """[first quartile, third quartile] of `values` (both the value when there is one)."""
    if len(values) < 2:
        return [round(values[0], 3)] * 2 if values else []
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return [round(q1, 3), round(q3, 3)]


def _transformers_rows(model_dir: str, loads: list[Workload], tokens: int) -> list[dict[str, Any]]:
    import torch

    from meshd.bench.reference import transformers_model

    model = transformers_model(model_dir, torch.float32)  # a directory or a GGUF file
    tok = open_tokenizer(model_dir)
    rows = []
    for kind in KINDS:
        for load in [w for w in loads if w.kind == kind][:1]:
            ids = torch.tensor([encode_workload(tok, load)])
            for lookup in (0, 10):
                extra = {"prompt_lookup_num_tokens": lookup} if lookup else {}

                def timed(n: int, extra: dict[str, int] = extra, ids: Any = ids) -> float:
                    t0 = time.perf_counter()
                    with torch.inference_mode():
                        model.generate(
                            ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, **extra
                        )
                    return time.perf_counter() - t0

                timed(4)
                decode_s = timed(tokens) - timed(1)
                rows.append(
                    {
                        "workload": kind,
                        "strategy": f"transformers prompt_lookup={lookup}"
                        if lookup
                        else "transformers generate",
                        "decode_tok_s": round((tokens - 1) / max(decode_s, 1e-9), 2),
                    }
                )
    return rows


def _row(
    rows: list[dict[str, Any]], stages: int, rtt: float, kind: str, strategy: str
) -> dict[str, Any] | None:
    """The aggregated row of one cell of the table, if it was measured."""
    for r in rows:
        if (r["stages"], r["rtt_ms"], r["workload"], r["strategy"]) == (
            stages,
            rtt,
            kind,
            strategy,
        ):
            return r
    return None


def markdown(report: dict[str, Any], strategies: list[str]) -> str:
    """The rows as Markdown tables, one per (stages, RTT), for docs/speculative.md."""
    rows = report["rows"]
    out: list[str] = []
    for stages, rtt in sorted({(r["stages"], r["rtt_ms"]) for r in rows}):
        out.append(
            f"\n**{stages} stage(s), RTT {rtt:g} ms** — decode tok/s (× disabled), "
            "acceptance, tokens per verify round trip\n"
        )
        out.append("| strategy | " + " | ".join(KINDS) + " |")
        out.append("| --- |" + " --- |" * len(KINDS))
        for strategy in strategies:
            cells = []
            for kind in KINDS:
                r = _row(rows, stages, rtt, kind, strategy)
                if r is None:
                    cells.append("–")
                    continue
                acc = "–" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
                tpr = r["tokens_per_round_trip"]
                flag = "" if r["identical_to_disabled"] else " **MISMATCH**"
                cells.append(
                    f"{r['decode_tok_s']:.1f} ({r['ratio_vs_disabled']:.2f}×) {acc} "
                    f"{'–' if tpr is None else f'{tpr:.2f}'}{flag}"
                )
            out.append(f"| {strategy} | " + " | ".join(cells) + " |")
        spread = []
        for kind in KINDS:
            r = _row(rows, stages, rtt, kind, "auto")
            if r is not None and r.get("ratio_quartiles"):
                q1, q3 = r["ratio_quartiles"]
                spread.append(f"{kind} {q1:.2f}–{q3:.2f}× ({r['ratio_samples']} rounds)")
        if spread:
            out.append("\n`auto` ÷ `disabled` per round, quartiles: " + ", ".join(spread))
        versus = []
        for kind in KINDS:
            r = _row(rows, stages, rtt, kind, "auto")
            if r is not None and r.get("paired_ratio_vs_best_single") is not None:
                q1, q3 = r["paired_ratio_vs_best_single_quartiles"]
                versus.append(
                    f"{kind} {r['ratio_vs_best_single']:.2f} / "
                    f"{r['paired_ratio_vs_best_single']:.2f} ({q1:.2f}–{q3:.2f}, "
                    f"{r['best_single']})"
                )
        if versus:
            out.append(
                "\n`auto` ÷ best single strategy, of the medians / paired per round "
                "(quartiles, best): " + ", ".join(versus)
            )
    out.append(f"\n{_mode(report)}: {_identity(report)}")
    for row in report.get("transformers", []):
        out.append(
            f"\nsingle node, {row['strategy']}, {row['workload']}: {row['decode_tok_s']:.1f} tok/s"
        )
    return "\n".join(out)


def _mode(report: dict[str, Any]) -> str:
    """ "greedy", or the sampled runs' temperature and seed."""
    sampling = report.get("sampling") or {}
    if not sampling.get("temperature"):
        return "greedy"
    return f"sampled at T = {sampling['temperature']:g}, seed {sampling['seed']}"


def _identity(report: dict[str, Any]) -> str:
    """Whether every run's text equalled `disabled`'s (of its prompt and round)."""
    if report.get("identical_texts", True):
        return "every strategy's text identical to disabled's: yes"
    return "every strategy's text identical to disabled's: NO (see the MISMATCH cells)"


def _print(report: dict[str, Any], strategies: list[str]) -> None:
    rows = report["rows"]
    configs = sorted({(r["stages"], r["rtt_ms"]) for r in rows})
    print(
        f"meshd bench spec — {_mode(report)}, {report['tokens']} tokens per run, "
        "medians over prompts and rounds"
    )
    print(_identity(report))
    print("cell: decode tok/s (ratio to disabled in the same run) acceptance, tokens/round trip")
    for stages, rtt in configs:
        print(f"\n{stages} stage(s), RTT {rtt:g} ms")
        print(f"  {'strategy':14}" + "".join(f"{k:>34}" for k in KINDS))
        for strategy in strategies:
            cells = []
            for kind in KINDS:
                r = _row(rows, stages, rtt, kind, strategy)
                if r is None:
                    cells.append(f"{'-':>34}")
                    continue
                acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
                tpr = (
                    "-"
                    if r["tokens_per_round_trip"] is None
                    else f"{r['tokens_per_round_trip']:.2f}"
                )
                flag = "" if r["identical_to_disabled"] else " MISMATCH"
                cells.append(
                    f"{r['decode_tok_s']:8.1f} ({r['ratio_vs_disabled']:4.2f}x) {acc:>4} {tpr:>5}{flag}".rjust(
                        34
                    )
                )
            print(f"  {strategy:14}" + "".join(cells))
    for row in report.get("transformers", []):
        print(
            f"  single node, {row['strategy']:32} {row['workload']:>10}: {row['decode_tok_s']:.1f} tok/s"
        )
    print(f"\nsamples (disabled, {_mode(report)}):")
    for kind, text in report["samples"].items():
        snippet = text[:240].replace("\n", "\n    ")
        print(f"  [{kind}]\n    {snippet}")
