"""`meshd bench threads`: decode on one thread, on N, and as the stage's governor chooses.

One process, one stage holding the whole model, greedy, batch 1. The three contestants
alternate (1, N, governed, 1, ...) so that machine noise hits them alike; medians and ratios
are reported, with the governor's choice at the end. Run it on a quiet machine and on a busy one
(e.g. beside `stress`-like load on the other cores): the governor should match the faster of
the fixed settings in both.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from meshd.bench.decode import RANDOM_CONFIGS, _checkpoint_dir
from meshd.bench.harness import alternate, print_report
from meshd.bench.single_node import generate
from meshd.model.files import open_checkpoint
from meshd.model.quant import NAMES, check_quantization
from meshd.model.stage import StageModel


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `meshd bench threads`."""
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", help="checkpoint directory or .gguf file (default: built-in)")
    source.add_argument("--random-config", choices=sorted(RANDOM_CONFIGS))
    parser.add_argument("--quantization", choices=NAMES, default="none")
    parser.add_argument("--threads", type=int, default=2, help="N (default 2)")
    parser.add_argument("--tokens", type=int, default=128, help="new tokens per run")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    """Entry point."""
    if args.threads < 2:
        raise SystemExit("meshd bench threads: --threads must be at least 2")
    with _checkpoint_dir(args) as (directory, label):
        quantization = check_quantization(args.quantization)
        report = bench(directory, quantization, args.threads, args.tokens, args.rounds)
    report["model"] = label
    print_report(report, args.json, _print)
    return 0


def bench(
    directory: Any, quantization: str, threads: int, tokens: int, rounds: int
) -> dict[str, Any]:
    """Alternating runs of the three settings; tok/s medians, ratios, the governor's choice."""
    checkpoint = open_checkpoint(directory)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)  # the stage governs the threads it loads with
    try:
        stage = StageModel.load(
            checkpoint, 0, checkpoint.config.num_layers, quantization=quantization
        )
        governor = stage.governor
        assert governor is not None
        prompt = list(range(10, 20))

        def fixed(n: int) -> float:
            stage.governor = None
            torch.set_num_threads(n)
            return timed()

        def governed() -> float:
            stage.governor = governor
            return timed()

        def timed() -> float:
            start = time.perf_counter()
            generate([stage], prompt, tokens)
            return tokens / (time.perf_counter() - start)

        generate([stage], prompt, 8)  # warm-up
        runs = alternate(
            {"1": lambda: fixed(1), str(threads): lambda: fixed(threads), "governed": governed},
            rounds,
        )
    finally:
        torch.set_num_threads(previous)
    medians = {name: statistics.median(values) for name, values in runs.items()}
    return {
        "quantization": quantization,
        "threads": threads,
        "tokens": tokens,
        "rounds": rounds,
        "tok_s": {name: round(v, 2) for name, v in medians.items()},
        "runs_tok_s": {name: [round(v, 2) for v in values] for name, values in runs.items()},
        "ratio_n_vs_1": round(medians[str(threads)] / medians["1"], 3),
        "ratio_governed_vs_best_fixed": round(
            medians["governed"] / max(medians["1"], medians[str(threads)]), 3
        ),
        "governor_decode_threads": governor.current(1),
    }


def _print(report: dict[str, Any]) -> None:
    print(
        f"model: {report['model']} ({report['quantization']}), {report['tokens']} tokens, "
        f"{report['rounds']} alternating rounds"
    )
    for name, value in report["tok_s"].items():
        label = "governed" if name == "governed" else f"{name} thread(s)"
        print(f"  {label:<12} {value:8.1f} tok/s")
    print(
        f"  {report['threads']} vs 1: {report['ratio_n_vs_1']:.2f}x; governed vs the faster "
        f"fixed setting: {report['ratio_governed_vs_best_fixed']:.2f}x (decode now on "
        f"{report['governor_decode_threads']} thread(s))"
    )
