"""What a product of 1, 2, 3, 4 and 8 tokens costs per GGML block type of a GGUF file.

    PYTHONPATH=. python scripts/widths_by_type.py FILE.gguf [--threads 2] [--rounds 5]

Every layer matrix of the file, as stored, grouped by its block type; for each group and token
count, the median wall time of one product of every matrix of the group (`BlockMatrix.mm` on
`--threads` threads, the weights streamed as a stage streams them), and its ratio to one token.
A verify window of k drafts is a pass of k + 1 tokens, a draft's catch-up after a window one of
2: what these ratios are close to 1 for is what speculation on this CPU can buy
(docs/model-runtime.md, "Narrow windows in 4-row tiles").
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import numpy as np
import torch
from gguf import GGUFReader

from meshd.model.kernels.blocks import BlockMatrix, block_kernels

TOKENS = (1, 2, 3, 4, 8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    block_kernels().set_streaming(1)
    groups: dict[str, list[BlockMatrix]] = collections.defaultdict(list)
    for t in GGUFReader(args.path).tensors:
        if t.name.startswith("blk.") and len(t.shape) == 2:
            data = np.ascontiguousarray(np.asarray(t.data).reshape(-1).view(np.uint8))
            in_f, out_f = int(t.shape[0]), int(t.shape[1])
            groups[t.tensor_type.name].append(BlockMatrix(data, t.tensor_type, in_f, out_f))
    print(f"{args.threads} thread(s), {args.rounds} rounds, median ms per product of the group")
    for name, matrices in groups.items():
        mb = sum(m.nbytes for m in matrices) / 1e6
        times = []
        for tokens in TOKENS:
            xs = [torch.randn(tokens, m.in_features) for m in matrices]
            for m, x in zip(matrices, xs, strict=True):
                m.mm(x)  # untimed: the first products of a process pay its start-up
            rounds = []
            for _ in range(args.rounds):
                start = time.perf_counter()
                for m, x in zip(matrices, xs, strict=True):
                    m.mm(x)
                rounds.append(time.perf_counter() - start)
            times.append(statistics.median(rounds) * 1e3)
        cells = "  ".join(
            f"t{n} {v:6.2f} ({v / times[0]:.2f})" for n, v in zip(TOKENS, times, strict=True)
        )
        print(f"{name:5} {len(matrices):3} matrices {mb:6.1f} MB  {cells}")


if __name__ == "__main__":
    main()
