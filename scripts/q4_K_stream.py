"""One token against a GGUF file's streamed Q4_K (or Q6_K) tensors: llama.cpp's own kernel and
builds of meshd's block library, alternating, on one thread.

    PYTHONPATH=. python scripts/q4_K_stream.py FILE.gguf LIB.so [LIB.so ...] [--width K]
        [--type Q4_K] [--rounds 9] [--cache-rows N]

Every 2-D tensor of TYPE in the file's layers (the embedding and the output head left out;
`--width K`: only those K values wide) is multiplied by one random token, tensor after tensor
as a decode step reads them, in one pass of several hundred MB: far beyond the last-level
cache, so each pass streams the weights from memory. For Q4_K and Q4_0, llama.cpp's
`ggml_gemv_q4_K_8x8_q8_K` / `ggml_gemv_q4_0_8x8_q8_0` (its defaults on x86) run on a copy
repacked as llama.cpp repacks at load (`meshd.bench.llamacpp_q8.q4_K_x8`, `q4_0_x8`) from its `libggml-cpu.so` (scripts/bench_llamacpp
builds it; `--ggml` another build's, e.g. its `build-avx2`). Each library (e.g. the cached `~/.cache/meshd/kernels/blocks-avx512-*.so` of two
commits) runs `meshd_blocks_mm_threads` on the rows as stored, in streaming mode as a stage
sets it. Prints per candidate the median ms per pass, the GB/s of weights that makes, the
ratio to the first candidate, and whether the libraries' outputs are bit-identical.
`--cache-rows N` takes the first N rows of the first tensor instead, a product that stays in
cache: the kernels' compute without the memory stream.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader

from meshd.bench.llamacpp_q8 import q4_0_x8, q4_K_x8, q8_0_bytes

_GGML_CPU = "~/.cache/meshd-llamacpp/*/build/bin/libggml-cpu.so"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path")
    ap.add_argument("libraries", nargs="+")
    ap.add_argument("--width", type=int, help="only tensors this many values wide")
    ap.add_argument("--type", default="Q4_K")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--ggml", help="llama.cpp's libggml-cpu.so (default: the native build's)")
    ap.add_argument("--cache-rows", type=int, help="the first N rows of the first tensor")
    args = ap.parse_args()
    qtype = GGMLQuantizationType[args.type]
    mats: list[tuple[np.ndarray, int, int]] = []
    for tensor in GGUFReader(args.path).tensors:
        k, n = int(tensor.shape[0]), int(tensor.shape[1]) if len(tensor.shape) == 2 else 0
        if tensor.tensor_type != qtype or n == 0 or n % 8 or not tensor.name.startswith("blk."):
            continue
        if args.width is None or k == args.width:
            mats.append(
                (np.ascontiguousarray(np.asarray(tensor.data).reshape(-1).view(np.uint8)), k, n)
            )
    if not mats:
        raise SystemExit(f"no {qtype.name} layer tensors of that width in {args.path}")
    if args.cache_rows:
        raw, k, n = mats[0]
        rows = min(args.cache_rows, n)
        mats = [(np.ascontiguousarray(raw[: rows * raw.nbytes // n]), k, rows)]
    total = sum(raw.nbytes for raw, _, _ in mats)
    passes = max(3, int(3e8 // total)) if args.cache_rows else 3
    p, c, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    rng = np.random.default_rng(0)
    xs = {k: rng.standard_normal(k).astype(np.float32) for _, k, _ in mats}
    calls: dict[str, Callable[[], None]] = {}
    found = [args.ggml] if args.ggml else sorted(glob.glob(os.path.expanduser(_GGML_CPU)))
    if qtype in (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q4_0) and found:
        ggml = ctypes.CDLL(found[-1])
        ggml.ggml_cpu_init()
        q8: dict[int, np.ndarray] = {}
        if qtype == GGMLQuantizationType.Q4_K:
            gemv = ggml.ggml_gemv_q4_K_8x8_q8_K
            packed = [q4_K_x8(raw, n, k) for raw, k, n in mats]
            ggml.quantize_row_q8_K.argtypes = [p, p, i64]
            for k, x in xs.items():
                q8[k] = np.zeros(k // 256 * 292, np.uint8)
                ggml.quantize_row_q8_K(x.ctypes.data, q8[k].ctypes.data, k)
        else:
            gemv = ggml.ggml_gemv_q4_0_8x8_q8_0
            packed = [q4_0_x8(raw, n, k) for raw, k, n in mats]
            for k, x in xs.items():
                q8[k] = np.ascontiguousarray(q8_0_bytes(x[None])).reshape(-1)
        gemv.argtypes = [c, p, ctypes.c_size_t, p, p, c, c]
        got = [np.zeros(n, np.float32) for _, _, n in mats]

        def llamacpp() -> None:
            for (_, k, n), pk, y in zip(mats, packed, got, strict=True):
                gemv(k, y.ctypes.data, 0, pk.ctypes.data, q8[k].ctypes.data, 1, n)

        calls["llama.cpp"] = llamacpp
    outs: list[list[np.ndarray]] = []
    for path in args.libraries:
        lib = ctypes.CDLL(path)
        lib.meshd_blocks_mm_threads.argtypes = [c, p, i64, i64, p, i64, p, p, c]
        lib.meshd_blocks_scratch_bytes.argtypes = [c, i64, i64]
        lib.meshd_blocks_scratch_bytes.restype = i64
        lib.meshd_blocks_set_streaming.argtypes = [c]
        lib.meshd_blocks_set_streaming(0 if args.cache_rows else 1)
        need = max(lib.meshd_blocks_scratch_bytes(int(qtype), k, 1) for _, k, _ in mats)
        scratch = np.zeros(need, np.uint8)
        ys = [np.zeros(n, np.float32) for _, _, n in mats]
        outs.append(ys)

        def run(
            lib: ctypes.CDLL = lib, scratch: np.ndarray = scratch, ys: list[np.ndarray] = ys
        ) -> None:
            for (raw, k, n), y in zip(mats, ys, strict=True):
                lib.meshd_blocks_mm_threads(int(qtype), raw.ctypes.data, k, n, xs[k].ctypes.data,
                                            1, y.ctypes.data, scratch.ctypes.data, 1)  # fmt: skip

        calls[Path(path).name] = run
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(args.rounds):
        for name, call in calls.items():
            start = time.perf_counter()
            for _ in range(passes):
                call()
            times[name].append((time.perf_counter() - start) / passes)
    print(f"{qtype.name}, {len(mats)} tensors, {total / 1e6:.0f} MB per pass")
    first = statistics.median(next(iter(times.values())))
    for name, t in times.items():
        med = statistics.median(t)
        print(
            f"  {name:40s} {med * 1e3:8.2f} ms  {total / med / 1e9:5.1f} GB/s  ÷ first {med / first:.3f}"
        )
    same = all(np.array_equal(a, b) for o in outs[1:] for a, b in zip(outs[0], o, strict=True))
    print(f"  libraries bit-identical: {same}")


if __name__ == "__main__":
    main()
