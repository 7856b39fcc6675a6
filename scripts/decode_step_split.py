"""Where a decode step's time goes on a GGUF file, and block-kernel builds compared on it.

    PYTHONPATH=. python scripts/decode_step_split.py split FILE.gguf [--threads T]
    PYTHONPATH=. python scripts/decode_step_split.py ab FILE.gguf OLD.so NEW.so [--threads T]
        [--tokens N] [--rounds R]

`split` decodes 64 tokens three times and reports, per token, the calling thread's CPU time
and the wall time of the layer call (`meshd_layers`: every decoder layer's products, norms,
RoPE and attention in one C call), of the head's product, of the sampler (the greedy pick) and
of the rest (Python, the embedding lookup). CPU time leaves out the time other tenants held the core.

`ab` runs one decode step's block products (every 2-D tensor of the file in file order: each
layer's, then the head; one token; prefetching for weights streamed from memory where they
exceed the last-level cache, as a stage does) through two builds of the block library (e.g. the cached
`~/.cache/meshd/kernels/blocks-avx512-*.so` of two commits), alternating, and reports the
median wall and CPU ms per step of each, the CPU ms per weight type, and whether their outputs
are bit-identical. `--tokens N` (N > 1) multiplies N tokens at once, as a prefill chunk does, and
leaves out the head (a prefill computes logits for the last position only).
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader

from meshd.bench.single_node import Sampler, generate
from meshd.model.files import open_checkpoint
from meshd.model.gguf_matrix import GgufMatrix
from meshd.model.kernel_layers import KernelLayers
from meshd.model.kernels.blocks import last_level_cache_bytes
from meshd.model.stage import StageModel


def split(path: str) -> None:
    checkpoint = open_checkpoint(path)
    n_layers = checkpoint.config.num_layers
    stage = StageModel.load(checkpoint, 0, n_layers, quantization=checkpoint.default_quantization)
    acc: dict[str, float] = collections.defaultdict(float)

    def timed(cls: Any, name: str, key: str) -> None:
        inner = getattr(cls, name)

        def run(*args: Any, **kwargs: Any) -> Any:
            cpu, wall = time.thread_time(), time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                acc[key] += time.thread_time() - cpu
                acc[key + " wall"] += time.perf_counter() - wall

        setattr(cls, name, run)

    timed(KernelLayers, "run", "layers")
    timed(GgufMatrix, "mm", "head")  # the layers' products run inside the C call
    timed(Sampler, "__call__", "sampler")  # the greedy pick over the vocabulary
    prompt, n = list(range(100, 107)), 64
    generate([stage], prompt, 16)
    for _ in range(3):
        acc.clear()
        cpu, wall = time.thread_time(), time.perf_counter()
        generate([stage], prompt, n)
        cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
        rest = cpu - acc["layers"] - acc["head"] - acc["sampler"]
        print(
            f"ms/token: CPU {cpu / n * 1e3:.2f} (wall {wall / n * 1e3:.2f}); layer call "
            f"{acc['layers'] / n * 1e3:.2f} (wall {acc['layers wall'] / n * 1e3:.2f}), head "
            f"{acc['head'] / n * 1e3:.2f} (wall {acc['head wall'] / n * 1e3:.2f}), sampler "
            f"{acc['sampler'] / n * 1e3:.2f}, rest {rest / n * 1e3:.2f}"
        )


Step = tuple[Callable[[dict[str, float]], None], list[torch.Tensor]]


def _step(lib_path: str, path: str, threads: int, tokens: int) -> Step:
    lib = ctypes.CDLL(lib_path)
    mm = lib.meshd_blocks_mm_threads
    p, i64, c = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    mm.argtypes = [c, p, i64, i64, p, i64, p, p, c]
    reader = GGUFReader(path)
    names = {t.name for t in reader.tensors}
    calls = []
    outs = []
    scratch = np.zeros(1 << 24, np.uint8)
    inputs: dict[int, torch.Tensor] = {}
    for t in reader.tensors:
        if len(t.shape) != 2 or (t.name == "token_embd.weight" and "output.weight" in names):
            continue  # a tied head is the embedding table; an untied table is only looked up
        if tokens > 1 and t.name in ("output.weight", "token_embd.weight"):
            continue  # the head: a prefill takes the last position's logits only
        k, n = int(t.shape[0]), int(t.shape[1])
        gen = torch.Generator().manual_seed(k)
        x = inputs.setdefault(k, torch.randn(tokens, k, generator=gen))
        y = torch.empty(tokens, n)
        data = np.asarray(t.data).reshape(-1).view(np.uint8)
        args = (int(t.tensor_type), data.ctypes.data, k, n, x.data_ptr(), tokens, y.data_ptr())
        calls.append((t.tensor_type.name, args, data))
        outs.append(y)

    # As a stage that loads these matrices tells the library (blocks.note_step_weights).
    llc = last_level_cache_bytes()
    lib.meshd_blocks_set_streaming(int(llc is not None and sum(d.nbytes for *_, d in calls) > llc))

    def step(by_type: dict[str, float]) -> None:
        assert inputs  # the activations the calls point into live as long as the step
        for name, args, _ in calls:
            c = time.thread_time()
            mm(*args, scratch.ctypes.data, threads)
            by_type[name] = by_type.get(name, 0.0) + time.thread_time() - c

    return step, outs


def ab(path: str, old: str, new: str, threads: int, tokens: int = 1, rounds: int = 15) -> None:
    steps = [_step(lib, path, threads, tokens) for lib in (old, new)]
    wall: list[list[float]] = [[], []]
    cpu: list[list[float]] = [[], []]
    types: list[collections.defaultdict[str, list[float]]] = [
        collections.defaultdict(list) for _ in steps
    ]
    repeat = 3 if tokens == 1 else 1
    for step, _ in steps:
        step({})
    for _ in range(rounds):
        for i, (step, _) in enumerate(steps):
            by_type: dict[str, float] = {}
            w, c = time.perf_counter(), time.thread_time()
            for _ in range(repeat):
                step(by_type)
            wall[i].append((time.perf_counter() - w) / repeat * 1e3)
            cpu[i].append((time.thread_time() - c) / repeat * 1e3)
            for name, seconds in by_type.items():
                types[i][name].append(seconds / repeat * 1e3)
    for i, lib in enumerate((old, new)):
        per_type = ", ".join(
            f"{name} {statistics.median(v):.2f}" for name, v in sorted(types[i].items())
        )
        print(
            f"{os.path.basename(lib)}: ms/step wall median {statistics.median(wall[i]):.2f} "
            f"(min {min(wall[i]):.2f}), CPU median {statistics.median(cpu[i]):.2f} "
            f"(CPU by type: {per_type})"
        )
    print(f"old / new, wall: {statistics.median(wall[0]) / statistics.median(wall[1]):.3f}")
    same = all(torch.equal(a, b) for a, b in zip(steps[0][1], steps[1][1], strict=True))
    print(f"bit-identical outputs: {same}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("split", "ab"))
    parser.add_argument("model")
    parser.add_argument("libraries", nargs="*", help="ab: the two block library builds")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=1, help="ab: tokens per product")
    parser.add_argument("--rounds", type=int, default=15, help="ab: alternating rounds")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.mode == "split":
        split(args.model)
    else:
        if len(args.libraries) != 2:
            parser.error("ab needs two library paths")
        ab(args.model, args.libraries[0], args.libraries[1], args.threads, args.tokens, args.rounds)


if __name__ == "__main__":
    main()
