"""Per-call time of meshd's GGUF block kernels against torch's fp32 matmul of the same shape.

    PYTHONPATH=. python scripts/block_kernels.py [--tokens 1] [--rounds 7] [--json]

For each kernel path this CPU runs, each type (Q4_0, Q8_0 by default) and 1 and 2 threads:
the median time of one `BlockMatrix.mm` call on [tokens, in] activations and the GB/s of
weights it streams (the matrix's stored bytes / time), next to torch.nn.functional.linear on
the same shape in fp32. Rounds alternate between the candidates, so a neighbour's load on a
shared machine falls on all of them alike; each figure is the median over rounds of the
median over a round's calls.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable

import gguf.quants
import numpy as np
import torch
from gguf import GGMLQuantizationType

from meshd.model.kernels.blocks import BlockMatrix, runnable_paths

SHAPES = ((576, 1536), (1536, 576), (2048, 8192))  # (in_features, out_features)


def _timed(fn: Callable[[], object], budget_s: float) -> float:
    """Median seconds per call over about `budget_s` of calls (at least 5)."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 5 or time.perf_counter() - start < budget_s:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1, help="activation rows per call")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--budget", type=float, default=0.05, help="seconds per candidate per round")
    ap.add_argument("--types", default="Q4_0,Q8_0")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--shapes", default=",".join(f"{k}x{n}" for k, n in SHAPES))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    types = [GGMLQuantizationType[name] for name in args.types.split(",")]
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    rng = np.random.default_rng(0)
    rows = []
    for k, n in shapes:
        w = rng.standard_normal((n, k)).astype(np.float32)
        x = torch.from_numpy(rng.standard_normal((args.tokens, k)).astype(np.float32))
        wt = torch.from_numpy(w)
        cands: dict[tuple[str, str], tuple[Callable[[], object], int]] = {
            ("torch", "F32"): (functools.partial(torch.nn.functional.linear, x, wt), w.nbytes)
        }
        for qtype in types:
            raw = np.ascontiguousarray(gguf.quants.quantize(w, qtype)).view(np.uint8).reshape(-1)
            for path in runnable_paths():
                m = BlockMatrix(raw, qtype, k, n, path=path)
                cands[(path, qtype.name)] = (functools.partial(m.mm, x), m.nbytes)
        for threads in (int(v) for v in args.threads.split(",")):
            torch.set_num_threads(threads)
            per: dict[tuple[str, str], list[float]] = {key: [] for key in cands}
            for _ in range(args.rounds):
                for key, (fn, _nbytes) in cands.items():
                    per[key].append(_timed(fn, args.budget))
            for (kernel, tname), times in per.items():
                sec = statistics.median(times)
                nbytes = cands[(kernel, tname)][1]
                rows.append(
                    {
                        "shape": f"{k}x{n}",
                        "type": tname,
                        "kernel": kernel,
                        "threads": threads,
                        "tokens": args.tokens,
                        "us": round(sec * 1e6, 1),
                        "GB/s": round(nbytes / sec / 1e9, 2),
                        "MB": round(nbytes / 1e6, 2),
                    }
                )
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"{'in x out':>10} {'type':>5} {'kernel':>9} {'thr':>3} {'us/call':>9} {'GB/s':>6}")
    for r in rows:
        print(
            f"{r['shape']:>10} {r['type']:>5} {r['kernel']:>9} {r['threads']:>3} "
            f"{r['us']:>9} {r['GB/s']:>6}"
        )


if __name__ == "__main__":
    main()
