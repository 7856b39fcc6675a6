"""Two builds of the block library on one single-token product that stays in cache.

    PYTHONPATH=. python scripts/block_ab.py TYPE IN OUT OLD.so NEW.so [--rounds 11] [--calls 300]
        [--tokens 1] [--from FILE.gguf --tensor NAME]

A random [OUT, IN] matrix of TYPE (Q4_0, Q4_1, Q8_0, ...: what `gguf.quants` quantizes) is
multiplied by one token (`--tokens N`: N at once, as a prefill chunk) through
`meshd_blocks_mm_threads` of each build (e.g. the cached
`~/.cache/meshd/kernels/blocks-avx512-*.so` of two commits), 1 thread, rounds alternating; per
build the median calling-thread CPU µs per call (ctypes call included, ~2 µs), the weight GB/s
that makes, and whether the two builds' outputs are bit-identical. A matrix of a few hundred kB
stays in L2 between calls, so this measures a tile's compute, not the memory stream
(`scripts/decode_step_split.py ab` runs a whole decode step's products). `--from FILE --tensor
NAME` takes the first OUT rows of that tensor of a GGUF file instead (TYPE and IN must be its
own): the K-quants, which gguf-py cannot quantize, on real weights.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import gguf.quants
import numpy as np
from gguf import GGMLQuantizationType, GGUFReader


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("type")
    ap.add_argument("k", type=int)
    ap.add_argument("n", type=int)
    ap.add_argument("libraries", nargs=2)
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--from", dest="path", help="a GGUF file to take the rows from")
    ap.add_argument("--tensor", help="the tensor of --from")
    args = ap.parse_args()
    qtype = GGMLQuantizationType[args.type]
    rng = np.random.default_rng(0)
    if args.path:
        tensor = next(t for t in GGUFReader(args.path).tensors if t.name == args.tensor)
        if tensor.tensor_type != qtype or int(tensor.shape[0]) != args.k:
            raise SystemExit(f"{args.tensor} is {tensor.tensor_type.name} x {tensor.shape[0]}")
        data = np.asarray(tensor.data).reshape(-1).view(np.uint8)
        raw = np.ascontiguousarray(data[: args.n * data.size // int(tensor.shape[1])])
    else:
        w = rng.standard_normal((args.n, args.k)).astype(np.float32)
        raw = np.ascontiguousarray(gguf.quants.quantize(w, qtype)).view(np.uint8)
    x = rng.standard_normal((args.tokens, args.k)).astype(np.float32)
    p, i64, c = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    libs = [ctypes.CDLL(path) for path in args.libraries]
    for lib in libs:
        lib.meshd_blocks_scratch_bytes.argtypes = [c, i64, i64]
        lib.meshd_blocks_scratch_bytes.restype = i64
    need = max(lib.meshd_blocks_scratch_bytes(int(qtype), args.k, args.tokens) for lib in libs)
    scratch = np.zeros(need, np.uint8)
    calls, outs = [], []
    for lib in libs:
        mm = lib.meshd_blocks_mm_threads
        mm.argtypes = [c, p, i64, i64, p, i64, p, p, c]
        y = np.zeros((args.tokens, args.n), np.float32)
        outs.append(y)
        calls.append((mm, (int(qtype), raw.ctypes.data, args.k, args.n, x.ctypes.data,
                           args.tokens, y.ctypes.data, scratch.ctypes.data, 1)))  # fmt: skip
    times: list[list[float]] = [[] for _ in calls]
    for _ in range(args.rounds):
        for i, (mm, call) in enumerate(calls):
            start = time.thread_time()
            for _ in range(args.calls):
                mm(*call)
            times[i].append((time.thread_time() - start) / args.calls * 1e6)
    for path, t in zip(args.libraries, times, strict=True):
        med = statistics.median(t)
        print(
            f"{path}: {med:.1f} µs/call CPU (min {min(t):.1f}), {raw.nbytes / med / 1e3:.1f} GB/s"
        )
    print(f"old / new: {statistics.median(times[0]) / statistics.median(times[1]):.3f}")
    print(f"bit-identical outputs: {np.array_equal(outs[0], outs[1])}")


if __name__ == "__main__":
    main()
