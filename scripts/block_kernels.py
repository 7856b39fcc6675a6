"""Per-call time of meshd's GGUF block kernels against torch's fp32 matmul of the same shape.

    PYTHONPATH=. python scripts/block_kernels.py [--tokens 1] [--rounds 7] [--json]
        [--ggml DIR]   (DIR holding a llama.cpp build's libggml-base.so and libggml-cpu.so)

For each kernel path this CPU runs, each type (Q4_0, Q8_0 by default) and 1 and 2 threads:
the median time of one `BlockMatrix.mm` call on [tokens, in] activations and the GB/s of
weights it streams (the matrix's stored bytes / time), next to torch.nn.functional.linear on
the same shape in fp32. Rounds alternate between the candidates, so a neighbour's load on a
shared machine falls on all of them alike; each figure is the median over rounds of the
median over a round's calls.

With --ggml, ggml itself runs as a kernel library too: one ggml_mul_mat graph per shape and type
(built once; each call is ggml_graph_compute_with_ctx on the same tensors, i.e. ggml's
activation quantization and vec_dot or its llamafile GEMM, without llama.cpp's repacked Q4_0
buffers), and the table gains `vs ggml`: max |meshd - ggml| / max |ggml| over the outputs.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import gguf.quants
import numpy as np
import torch
from gguf import GGMLQuantizationType

from meshd.model.kernels.blocks import BlockMatrix, runnable_paths

SHAPES = ((576, 1536), (1536, 576), (2048, 8192))  # (in_features, out_features)


class _GgmlParams(ctypes.Structure):
    _fields_ = [
        ("mem_size", ctypes.c_size_t),
        ("mem_buffer", ctypes.c_void_p),
        ("no_alloc", ctypes.c_bool),
    ]


class Ggml:
    """ggml's CPU backend through its C API (a matrix product as a one-node graph)."""

    def __init__(self, directory: Path) -> None:
        mode = ctypes.RTLD_GLOBAL
        self.base = ctypes.CDLL(str(directory / "libggml-base.so"), mode=mode)
        self.cpu = ctypes.CDLL(str(directory / "libggml-cpu.so"), mode=mode)
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        b = self.base
        b.ggml_init.argtypes, b.ggml_init.restype = [_GgmlParams], p
        b.ggml_new_tensor_2d.argtypes = [p, ctypes.c_int, i64, i64]
        b.ggml_new_tensor_2d.restype = p
        b.ggml_get_data.argtypes, b.ggml_get_data.restype = [p], p
        b.ggml_mul_mat.argtypes, b.ggml_mul_mat.restype = [p, p, p], p
        b.ggml_new_graph.argtypes, b.ggml_new_graph.restype = [p], p
        b.ggml_build_forward_expand.argtypes = [p, p]
        b.ggml_free.argtypes = [p]
        self.cpu.ggml_graph_compute_with_ctx.argtypes = [p, p, ctypes.c_int]
        self.cpu.ggml_graph_compute_with_ctx.restype = ctypes.c_int
        self.cpu.ggml_cpu_init()

    def matmul(
        self, raw: np.ndarray, qtype: int, k: int, n: int, x: np.ndarray
    ) -> tuple[Callable[[], object], np.ndarray]:
        """A call computing x · Wᵀ with ggml (weights and x copied into its context once), and
        the array its output lands in."""
        b, t = self.base, x.shape[0]
        ctx = b.ggml_init(_GgmlParams(raw.nbytes + x.nbytes * 2 + t * n * 4 + (64 << 20)))
        w = b.ggml_new_tensor_2d(ctx, qtype, k, n)
        a = b.ggml_new_tensor_2d(ctx, 0, k, t)
        ctypes.memmove(b.ggml_get_data(w), raw.ctypes.data, raw.nbytes)
        ctypes.memmove(b.ggml_get_data(a), x.ctypes.data, x.nbytes)
        out = b.ggml_mul_mat(ctx, w, a)
        graph = b.ggml_new_graph(ctx)
        b.ggml_build_forward_expand(graph, out)
        y = np.ctypeslib.as_array(
            ctypes.cast(b.ggml_get_data(out), ctypes.POINTER(ctypes.c_float)), shape=(t, n)
        )
        compute = self.cpu.ggml_graph_compute_with_ctx

        def call() -> object:
            return compute(ctx, graph, torch.get_num_threads())

        return call, y


def _timed(fn: Callable[[], object], budget_s: float, clock: Callable[[], float]) -> float:
    """Median seconds per call over about `budget_s` of calls (at least 5)."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 5 or time.perf_counter() - start < budget_s:
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1, help="activation rows per call")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--budget", type=float, default=0.05, help="seconds per candidate per round")
    ap.add_argument("--types", default="Q4_0,Q8_0")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--shapes", default=",".join(f"{k}x{n}" for k, n in SHAPES))
    ap.add_argument("--paths", default=",".join(runnable_paths()), help="kernel paths to run")
    ap.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="cpu: the calling thread's CPU time (1 thread only; on a shared machine it leaves "
        "out the time another tenant holds the core)",
    )
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--ggml", type=Path, help="a llama.cpp build's directory of libggml*.so")
    args = ap.parse_args()
    types = [GGMLQuantizationType[name] for name in args.types.split(",")]
    paths = [p for p in args.paths.split(",") if p]
    thread_counts = [int(v) for v in args.threads.split(",")]
    if args.clock == "cpu" and thread_counts != [1]:
        ap.error("--clock cpu measures one thread: pass --threads 1")
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    rng = np.random.default_rng(0)
    ggml = Ggml(args.ggml) if args.ggml else None
    rows = []
    agreement: dict[tuple[str, str, str], float] = {}
    for k, n in shapes:
        w = rng.standard_normal((n, k)).astype(np.float32)
        x = torch.from_numpy(rng.standard_normal((args.tokens, k)).astype(np.float32))
        wt = torch.from_numpy(w)
        cands: dict[tuple[str, str], tuple[Callable[[], object], int]] = {
            ("torch", "F32"): (functools.partial(torch.nn.functional.linear, x, wt), w.nbytes)
        }
        for qtype in types:
            raw = np.ascontiguousarray(gguf.quants.quantize(w, qtype)).view(np.uint8).reshape(-1)
            for path in paths:
                m = BlockMatrix(raw, qtype, k, n, path=path)
                cands[(path, qtype.name)] = (functools.partial(m.mm, x), m.nbytes)
            if ggml is not None:
                call, y = ggml.matmul(raw, int(qtype), k, n, x.numpy())
                call()
                for path in paths:
                    ours = BlockMatrix(raw, qtype, k, n, path=path).mm(x).numpy()
                    diff = float(np.abs(ours - y).max() / np.abs(y).max())
                    agreement[(f"{k}x{n}", qtype.name, path)] = diff
                cands[("ggml", qtype.name)] = (call, raw.nbytes)
        for threads in thread_counts:
            torch.set_num_threads(threads)
            per: dict[tuple[str, str], list[float]] = {key: [] for key in cands}
            for _ in range(args.rounds):
                for key, (fn, _nbytes) in cands.items():
                    per[key].append(_timed(fn, args.budget, clock))
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
                        "vs ggml": agreement.get((f"{k}x{n}", tname, kernel)),
                    }
                )
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    head = f"{'in x out':>10} {'type':>5} {'kernel':>9} {'thr':>3} {'us/call':>9} {'GB/s':>6}"
    print(head + ("  vs ggml" if ggml else ""))
    for r in rows:
        diff = r["vs ggml"]
        print(
            f"{r['shape']:>10} {r['type']:>5} {r['kernel']:>9} {r['threads']:>3} "
            f"{r['us']:>9} {r['GB/s']:>6}" + (f"  {diff:.1e}" if diff is not None else "")
        )


if __name__ == "__main__":
    main()
