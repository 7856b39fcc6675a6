#!/usr/bin/env python3
"""Decode speed of quantized stages at 1 and 2 threads, side by side in one process.

    python scripts/quant_speed.py --model DIR --tokens 64 --rounds 3
    python scripts/quant_speed.py --model DIR --quantizations none q8_0 q4_0 q4_k
    python scripts/quant_speed.py --random-config large     # writes the 246M checkpoint first

Every (quantization, threads) cell decodes the same greedy tokens once per round, cells in a
rotating order, so a noisy shared machine slows them alike; medians of the rounds are printed
with each cell's ratio to fp32 at 1 thread. The same figures one at a time:
`meshd bench decode --model DIR --quantization Q --threads N --no-transformers --json`.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

# As meshd/__init__.py does, before torch loads libgomp: idle OpenMP workers sleep.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

from meshd.bench.decode import write_random_checkpoint
from meshd.bench.single_node import generate
from meshd.model.checkpoint import Checkpoint
from meshd.model.stage import StageModel
from meshd.model.threads import useful_threads


def measure(
    directory: pathlib.Path,
    tokens: int,
    rounds: int,
    threads: list[int],
    quantizations: tuple[str, ...] = ("none", "q8_0", "q4_k"),
) -> dict:
    checkpoint = Checkpoint.open(directory)
    n = checkpoint.config.num_layers
    stages = {
        q: StageModel.load(checkpoint, 0, n, device="cpu", quantization=q) for q in quantizations
    }
    prompt = list(range(5, 17))
    cells = [(q, t) for q in stages for t in threads]
    rates: dict[tuple[str, int], list[float]] = {cell: [] for cell in cells}
    used: dict[tuple[str, int], int] = {}
    for stage in stages.values():
        generate([stage], prompt, 4)  # warm-up
    for r in range(rounds):
        for q, t in cells[r % len(cells) :] + cells[: r % len(cells)]:
            used[(q, t)] = useful_threads(t, checkpoint.config, torch.float32, q)
            torch.set_num_threads(used[(q, t)])
            started = time.perf_counter()
            generate([stages[q]], prompt, tokens)
            rates[(q, t)].append(tokens / (time.perf_counter() - started))
            print(f"round {r}: {q} x {t} threads {rates[(q, t)][-1]:.2f} tok/s", file=sys.stderr)
    base = statistics.median(rates[(quantizations[0], threads[0])])
    return {
        "model": str(directory),
        "tokens": tokens,
        "rounds": rounds,
        "weight_bytes": {q: s.weight_bytes for q, s in stages.items()},
        "cells": [
            {
                "quantization": q,
                "threads": t,
                "threads_used": used[(q, t)],
                "tok_s": round(statistics.median(rates[(q, t)]), 2),
                "runs": [round(x, 2) for x in rates[(q, t)]],
                f"vs_{quantizations[0]}_{threads[0]}_thread": round(
                    statistics.median(rates[(q, t)]) / base, 2
                ),
            }
            for q, t in cells
        ],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", type=pathlib.Path)
    source.add_argument("--random-config", choices=("small", "large"))
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, nargs="*", default=[1, 2])
    parser.add_argument(
        "--quantizations", nargs="+", default=["none", "q8_0", "q4_k"], help="the first is the base"
    )
    args = parser.parse_args()
    quantizations = tuple(args.quantizations)
    if args.model is not None:
        report = measure(args.model, args.tokens, args.rounds, args.threads, quantizations)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            write_random_checkpoint(pathlib.Path(tmp), args.random_config)
            report = measure(
                pathlib.Path(tmp), args.tokens, args.rounds, args.threads, quantizations
            )
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
