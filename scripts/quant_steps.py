#!/usr/bin/env python3
"""Decode-step time of one whole-model stage per quantization, side by side in one process.

    python scripts/quant_steps.py --model DIR --quantizations q8_0 q4_0 q4_k --rounds 12

Every quantization's stage is loaded once (load time printed to stderr), its thread governor
off; each round times 8 single-token steps of every stage at 1 and at 2 threads, stages in a
rotating order, so a noisy shared machine slows them alike. Prints the medians as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

# As meshd/__init__.py does, before torch loads libgomp: idle OpenMP workers sleep.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

from meshd.model.files import open_checkpoint
from meshd.model.stage import StageModel

STEPS = 8  # single-token steps per cell and round


def measure(directory: pathlib.Path, quantizations: list[str], rounds: int) -> dict:
    checkpoint = open_checkpoint(directory)
    n = checkpoint.config.num_layers
    stages: dict[str, StageModel] = {}
    for q in quantizations:
        started = time.perf_counter()
        stages[q] = StageModel.load(checkpoint, 0, n, device="cpu", quantization=q)
        stages[q].governor = None
        took = time.perf_counter() - started
        print(f"{q}: loaded in {took:.1f} s ({stages[q].layer_kernel})", file=sys.stderr)
    for stage in stages.values():
        stage.open_session("s", STEPS * (2 * rounds + 1))
        for i in range(STEPS):  # warm-up
            stage.forward("s", i, torch.tensor([5 + i]))
    times: dict[tuple[str, int], list[float]] = {(q, t): [] for q in stages for t in (1, 2)}
    pos = STEPS
    for r in range(rounds):
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for q in (
                quantizations[r % len(quantizations) :] + quantizations[: r % len(quantizations)]
            ):
                started = time.perf_counter()
                for k in range(STEPS):
                    stages[q].forward("s", pos + k, torch.tensor([7 + k]))
                times[(q, threads)].append((time.perf_counter() - started) / STEPS * 1000)
            pos += STEPS
    return {
        "model": str(directory),
        "rounds": rounds,
        "weight_bytes": {q: s.weight_bytes for q, s in stages.items()},
        "cells": [
            {
                "quantization": q,
                "threads": t,
                "ms_per_token": round(statistics.median(v), 2),
                "min_ms": round(min(v), 2),
            }
            for (q, t), v in times.items()
        ],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=pathlib.Path, required=True)
    parser.add_argument("--quantizations", nargs="+", default=["q8_0", "q4_0"])
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args()
    print(json.dumps(measure(args.model, args.quantizations, args.rounds), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
