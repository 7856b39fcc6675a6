#!/usr/bin/env python3
"""Batch-1 matrix-vector kernels torch offers on this CPU, timed over a 246M Llama's matrices.

    python scripts/quant_kernels.py [THREADS] [LAYERS]     # defaults: 1 thread, 8 layers

Each line: median ms over 10 (3 for the slow ones) passes over LAYERS x (q/k/v 1024x1536,
o 1024x1024, gate/up 1024x5632, down 2816x1024), and parameters streamed per second. The
figures behind meshd's former int8/int4 kernels (docs/benchmarks.md, "Quantization"); meshd
now quantizes into ggml's block formats (docs/model-runtime.md, "Quantized stages").
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable

# As meshd/__init__.py does, before torch loads libgomp: idle OpenMP workers sleep.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

Run = Callable[[torch.Tensor], torch.Tensor]


def timeit(name: str, runs: list[tuple[int, Run]], params: int, reps: int = 10) -> None:
    xs = {i: torch.randn(1, i) for i, _ in runs}

    def once() -> None:
        for i, fn in runs:
            fn(xs[i])

    once()
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        once()
        times.append(time.perf_counter() - started)
    ms = statistics.median(times) * 1e3
    print(f"{name:40s} {ms:8.2f} ms  {params / ms / 1e6:6.2f} Gparam/s", flush=True)


def int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.abs().amax(1) / 127
    return torch.round(w / scale[:, None]).to(torch.int8), scale


def fbgemm(w: torch.Tensor, reduce_range: bool) -> Run:
    q, scale = int8_rows(w)
    zeros = torch.zeros(w.shape[0], dtype=torch.long)
    qw = torch._make_per_channel_quantized_tensor(q, scale.double(), zeros, 0)
    packed = torch.ops.quantized.linear_prepack(qw, None)
    return lambda x: torch.ops.quantized.linear_dynamic(x, packed, reduce_range)


def int8pack(w: torch.Tensor, dtype: torch.dtype) -> Run:
    q, scale = int8_rows(w)
    s = scale.to(dtype)
    return lambda x: torch.ops.aten._weight_int8pack_mm(x.to(dtype), q, s)


def int4pack(w: torch.Tensor, dtype: torch.dtype, group: int = 64) -> Run:
    out_f, in_f = w.shape
    g = w.reshape(out_f, in_f // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.reshape(out_f, in_f), 1)
    sz = torch.stack([scale.t(), (lo + 8 * scale).t()], -1).contiguous().to(dtype)
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(dtype), packed, group, sz)


def main() -> None:
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
    layers = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    shapes = [(1024, 1536), (1024, 1024), (1024, 5632), (2816, 1024)] * layers  # [in, out]
    ws = [torch.randn(o, i) * 0.02 for i, o in shapes]  # [out, in]
    params = sum(w.numel() for w in ws)

    def each(make: Callable[[torch.Tensor], Run]) -> list[tuple[int, Run]]:
        return [(w.shape[1], make(w)) for w in ws]

    def mm_of(m: torch.Tensor) -> Run:
        return lambda x: torch.mm(x.to(m.dtype), m)

    fp32 = [w.t().contiguous() if w.shape[0] > w.shape[1] else w.t() for w in ws]
    timeit("fp32 mm (meshd's layout)", [(m.shape[0], mm_of(m)) for m in fp32], params)
    bf16 = [m.to(torch.bfloat16) for m in fp32]
    timeit("bf16 mm", [(m.shape[0], mm_of(m)) for m in bf16], params)
    del bf16
    for engine in ("x86", "onednn"):
        torch.backends.quantized.engine = engine
        for rr in (False, True):
            runs = each(lambda w, rr=rr: fbgemm(w, rr))
            timeit(f"{engine} linear_dynamic reduce_range={rr}", runs, params)
    torch.backends.quantized.engine = "x86"
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        runs = each(lambda w, dtype=dtype: int8pack(w, dtype))
        timeit(f"_weight_int8pack_mm {name}", runs, params, reps=3)
        runs = each(lambda w, dtype=dtype: int4pack(w, dtype))
        timeit(f"_weight_int4pack_mm_for_cpu {name}", runs, params, reps=3)


if __name__ == "__main__":
    main()
