"""`meshd bench concurrency`: aggregate decode throughput of concurrent streams, batched or not.

One in-process 2-stage pipeline of the built-in model (real lanes, real stage hosts, one
coordinator) runs 1, 2, 4 and 8 concurrent greedy generations, each of a different prompt,
with stage batching off and on, interleaved in the same process (this machine is shared and
noisy: compare the ratios, not the absolute figures). Reported per row: aggregate decode
tokens/s over all streams, its ratio to one stream in the same mode and to unbatched at the
same count, p50/p99 per-token latency, the largest batch a stage ran, and whether every
stream's text equals the unbatched run's (batching must never change it).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import trio

from meshd.bench.harness import (
    add_model_option,
    add_quantization_option,
    load_draft,
    model_dir,
    print_report,
    resolve_quantization,
)
from meshd.coord.coordinator import GenerationRequest
from meshd.coord.local import LocalPipeline, open_local_pipeline
from meshd.model.files import open_tokenizer
from meshd.model.tokenizer import Tokenizer
from meshd.sim.workloads import workloads
from meshd.speculative.config import DRAFT_STRATEGIES, STRATEGIES, SpecConfig

PROMPT_TOKENS = 48  # prompts are cut to this, so prefill is a small part of each run


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `meshd bench concurrency`."""
    add_model_option(parser)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--quick", action="store_true", help="fewer tokens, one repeat (< 60 s)")
    parser.add_argument("--streams", type=int, nargs="*", default=[1, 2, 4, 8])
    parser.add_argument("--tokens", type=int, default=None, help="tokens generated per stream")
    parser.add_argument("--repeats", type=int, default=None, help="runs per cell (best kept)")
    parser.add_argument("--rtt-ms", type=float, default=0.0, help="emulated RTT per hop")
    parser.add_argument("--strategy", default="disabled", choices=list(STRATEGIES))
    parser.add_argument(
        "--speculative-draft-model",
        default="",
        help="draft model (dir or .gguf) for --strategy draft, draft-ngram or auto",
    )
    add_quantization_option(parser, auto=True)


def run(args: argparse.Namespace) -> int:
    """Run the matrix and print it."""
    directory = model_dir(args)
    quantization = resolve_quantization(args.quantization, directory)
    tokens = args.tokens or (32 if args.quick else 64)
    repeats = args.repeats or (1 if args.quick else 3)
    if args.strategy in DRAFT_STRATEGIES and not args.speculative_draft_model:
        raise SystemExit(f"--strategy {args.strategy} needs --speculative-draft-model")
    report = trio.run(
        _matrix,
        directory,
        sorted(set(args.streams)),
        tokens,
        repeats,
        args.rtt_ms,
        args.strategy,
        quantization,
        args.speculative_draft_model,
    )
    report["quantization"] = quantization
    report["draft_model"] = args.speculative_draft_model
    print_report(report, args.json, _print)
    return 0


def _prompts(tokenizer: Tokenizer, count: int) -> list[list[int]]:
    texts = [w.prompt for w in workloads(3)]
    ids = [tokenizer.encode(t)[:PROMPT_TOKENS] for t in texts]
    # More streams than prompts: shift the cut, so every stream still has its own prompt.
    return [ids[i % len(ids)][i // len(ids) :] for i in range(count)]


async def _matrix(
    model_dir: str,
    streams: list[int],
    tokens: int,
    repeats: int,
    rtt_ms: float,
    strategy: str,
    quantization: str = "none",
    draft_path: str = "",
) -> dict[str, Any]:
    tokenizer = open_tokenizer(model_dir)
    prompts = _prompts(tokenizer, max(streams))
    rows: list[dict[str, Any]] = []
    draft = load_draft(draft_path, quantization) if draft_path else None
    spec = SpecConfig(strategy=strategy, draft_model=draft_path)
    async with open_local_pipeline(
        model_dir,
        2,
        rtt_s=rtt_ms / 1000,
        wire_dtype="f16",
        quantization=quantization,
        draft=draft,
    ) as pipe:
        mtp = pipe.checkpoint.config.num_mtp_layers
        await _streams(pipe, prompts[:2], 8, spec, mtp, batching=True)  # warm-up
        for n in streams:
            best: dict[bool, dict[str, Any]] = {}
            for _ in range(repeats):
                for batching in (False, True):  # interleaved: noise hits both alike
                    r = await _streams(pipe, prompts[:n], tokens, spec, mtp, batching)
                    if batching not in best or r["tok_s"] > best[batching]["tok_s"]:
                        best[batching] = r
            for batching in (False, True):
                r = best[batching]
                rows.append(
                    {
                        "streams": n,
                        "batching": batching,
                        "decode_tok_s": r["tok_s"],
                        "p50_token_ms": r["p50_ms"],
                        "p99_token_ms": r["p99_ms"],
                        "largest_batch": r["largest_batch"],
                        "identical_to_unbatched": r["outputs"] == best[False]["outputs"],
                    }
                )
    single = {row["batching"]: row["decode_tok_s"] for row in rows if row["streams"] == 1}
    unbatched = {row["streams"]: row["decode_tok_s"] for row in rows if not row["batching"]}
    for row in rows:
        one = single.get(row["batching"])
        row["ratio_vs_1_stream"] = row["decode_tok_s"] / one if one else None
        row["ratio_vs_unbatched"] = row["decode_tok_s"] / unbatched[row["streams"]]
    return {
        "rows": rows,
        "tokens_per_stream": tokens,
        "repeats": repeats,
        "rtt_ms": rtt_ms,
        "strategy": strategy,
        "stages": 2,
    }


async def _streams(
    pipe: LocalPipeline,
    prompts: list[list[int]],
    tokens: int,
    spec: SpecConfig,
    mtp: int,
    batching: bool,
) -> dict[str, Any]:
    """Run one generation per prompt, all at once; throughput, latencies and outputs."""
    for host in pipe.hosts:
        host.batching = batching
        host.stats.largest_batch = 0
    outputs: list[list[int]] = [[] for _ in prompts]
    first: list[float] = [0.0] * len(prompts)
    last: list[float] = [0.0] * len(prompts)
    gaps: list[float] = []

    async def one(i: int) -> None:
        async def on_tokens(new: list[int]) -> None:
            now = time.perf_counter()
            if outputs[i]:
                # Tokens committed together share the wait since the previous commit.
                gaps.extend([(now - last[i]) / len(new)] * len(new))
            else:
                first[i] = now
            last[i] = now
            outputs[i].extend(new)

        request = GenerationRequest(
            prompt=prompts[i],
            max_tokens=tokens,
            spec=spec,
            mtp_depth=mtp,
            eos_ids=frozenset(),  # fixed length: every run decodes the same count
        )
        await pipe.coordinator.generate(pipe.route, request, on_tokens)

    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(one, i)
    decoded = sum(len(o) - 1 for o in outputs)  # the first token came from prefill
    span = max(last) - min(first)
    gaps.sort()
    return {
        "tok_s": decoded / span if span > 0 else 0.0,
        "p50_ms": 1e3 * statistics.median(gaps) if gaps else None,
        "p99_ms": 1e3 * gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))] if gaps else None,
        "largest_batch": max(host.stats.largest_batch for host in pipe.hosts),
        "outputs": outputs,
    }


def _print(report: dict[str, Any]) -> None:
    print(
        f"meshd bench concurrency: 2 stages, {report['tokens_per_stream']} tokens/stream, "
        f"RTT {report['rtt_ms']} ms, strategy {report['strategy']}, best of {report['repeats']}"
    )
    header = (
        f"{'streams':>7} {'batching':>8} {'tok/s':>8} {'x 1 stream':>10} {'x unbatched':>11} "
        f"{'p50 ms':>7} {'p99 ms':>7} {'batch':>5} {'same':>5}"
    )
    print(header)
    for row in report["rows"]:
        ratio = row["ratio_vs_1_stream"]
        print(
            f"{row['streams']:>7} {'on' if row['batching'] else 'off':>8} "
            f"{row['decode_tok_s']:>8.1f} {ratio if ratio is not None else float('nan'):>10.2f} "
            f"{row['ratio_vs_unbatched']:>11.2f} {row['p50_token_ms'] or 0:>7.2f} "
            f"{row['p99_token_ms'] or 0:>7.2f} {row['largest_batch']:>5} "
            f"{'yes' if row['identical_to_unbatched'] else 'NO':>5}"
        )
