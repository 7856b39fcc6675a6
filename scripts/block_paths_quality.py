"""Why the block-kernel paths score a GGUF file differently: per-product error and rounding chaos.

    PYTHONPATH=. python scripts/block_paths_quality.py matmuls FILE.gguf IDS.json [--tokens 64]
    PYTHONPATH=. python scripts/block_paths_quality.py jitter FILE.gguf IDS.json [--seeds 8]
    PYTHONPATH=. python scripts/block_paths_quality.py divergence FILE.gguf IDS.json [--tokens 32]
    PYTHONPATH=. python scripts/block_paths_quality.py flips FILE.gguf IDS.json
    PYTHONPATH=. python scripts/block_paths_quality.py formats

One forward pass over the ids (one window, `meshd bench perplexity`'s scoring) runs on the path
`MESHD_BLOCK_KERNELS` names, and every `GgufMatrix.mm` input is read on the way:

- `matmuls`: each 32-element-format tensor times those inputs (the first `--tokens` rows) on
  every path, against llama.cpp's block arithmetic summed in float64
  (`tests/model/llamacpp_q8.py`): per tensor shape, the largest error in eps (2^-24) of the
  sum of |terms| (fp32 summation order explains a few) and relative to the product's rms.
- `jitter`: perplexity with each product's input moved by at most one ulp per element (seeded),
  the first line unmoved: how far fp32 rounding noise alone moves the score on one path.
- `divergence`: the inputs of each product on the avx512 and avx2 paths side by side (relative
  difference, share of Q8 activation codes that differ) and their final logits.
- `formats`: random 37-row matrices of each 32-element format (k = 96, 544, 1568) times 1, 5
  and 9 heavy-tailed rows on every path, the largest error in eps of the sum of |terms| (no
  file needed; the other modes read one).
- `flips`: activation codes where ggml's reference quantizer (gguf.quants, ties away from zero)
  and llama.cpp's x86 one (127 / amax, ties to even) disagree.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import pathlib
from typing import Any

import gguf.quants
import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from meshd.bench.llamacpp_q8 import block_product, quantize_q8
from meshd.bench.perplexity import score
from meshd.model import gguf_matrix
from meshd.model.files import open_checkpoint
from meshd.model.kernels.blocks import BlockMatrix
from meshd.model.stage import StageModel

PATHS = ("portable", "avx2", "avx512")
_PLAIN_MM = gguf_matrix.GgufMatrix.mm


def _stage(path: str) -> tuple[Any, StageModel]:
    checkpoint = open_checkpoint(path)
    layers = checkpoint.config.num_layers
    return checkpoint, StageModel.load(
        checkpoint, 0, layers, dtype=torch.float32, quantization="gguf"
    )


def _hook(on_input: Any) -> None:
    def mm(self: gguf_matrix.GgufMatrix, x: torch.Tensor) -> torch.Tensor:
        x = on_input(self, x)
        return _PLAIN_MM(self, x)

    gguf_matrix.GgufMatrix.mm = mm  # type: ignore[method-assign]


def matmuls(args: argparse.Namespace, ids: list[int]) -> None:
    worst: dict[str, dict[str, list[float]]] = collections.defaultdict(
        lambda: {p: [0.0, 0.0] for p in PATHS}
    )
    copies: dict[int, dict[str, BlockMatrix]] = {}

    def check(self: gguf_matrix.GgufMatrix, x: torch.Tensor) -> torch.Tensor:
        rows = x.float().contiguous()[: args.tokens]
        for t in self.parts:
            key = f"{t.ggml_type.name}[{t.out_features}x{t.in_features}]"
            if id(t) not in copies:
                copies[id(t)] = {
                    p: BlockMatrix(t.data, t.ggml_type, t.in_features, t.out_features, p)
                    for p in PATHS
                }
            ref, bound = block_product(t.data, t.ggml_type, rows.numpy(), t.out_features)
            rms = float(np.sqrt((ref**2).mean()))
            for p in PATHS:
                err = np.abs(copies[id(t)][p].mm(rows).double().numpy() - ref)
                w = worst[key][p]
                w[0] = max(w[0], float((err / bound).max()) / 2.0**-24)
                w[1] = max(w[1], float(err.max()) / rms)
        return x

    _hook(check)
    checkpoint, stage = _stage(args.file)
    score(stage, ids, context=checkpoint.config.max_position_embeddings)
    print("tensor: path (max error in eps of sum |terms|, max error / rms of the product)")
    for key, row in worst.items():
        print(key, {p: (round(a, 1), f"{b:.1e}") for p, (a, b) in row.items()})


def jitter(args: argparse.Namespace, ids: list[int]) -> None:
    gen: list[torch.Generator | None] = [None]

    def move(self: gguf_matrix.GgufMatrix, x: torch.Tensor) -> torch.Tensor:
        g = gen[0]
        if g is None:
            return x
        r = torch.randint(-1, 2, x.shape, generator=g).to(x.dtype)
        return x * (1 + r * 2.0**-24)  # x or one of its neighbours

    _hook(move)
    checkpoint, stage = _stage(args.file)
    for seed in [None, *range(args.seeds)]:
        gen[0] = None if seed is None else torch.Generator().manual_seed(seed)
        s = score(stage, ids, context=checkpoint.config.max_position_embeddings)
        print(f"seed {seed}: ppl {math.exp(math.fsum(s.nll) / len(s.nll)):.4f}", flush=True)


def divergence(args: argparse.Namespace, ids: list[int]) -> None:
    seen: list[torch.Tensor] = []
    _hook(lambda self, x: seen.append(x.detach().clone()) or x)
    runs = {}
    for p in ("avx512", "avx2"):
        os.environ["MESHD_BLOCK_KERNELS"] = p
        _, stage = _stage(args.file)
        seen.clear()
        stage.open_session("s", len(ids))
        logits = stage.forward("s", 0, torch.tensor(ids[: args.tokens])).logits
        runs[p] = (list(seen), logits)
    for i, (a, b) in enumerate(zip(runs["avx512"][0], runs["avx2"][0], strict=True)):
        if i % 4 == 0 or i == len(seen) - 1:  # 4 products a layer (q/k/v first), the head last
            qa, qb = quantize_q8(a.numpy())[0], quantize_q8(b.numpy())[0]
            rel = float((a - b).abs().max() / a.abs().max())
            print(f"product {i:3d}: input rel. difference {rel:.1e}, codes differing "
                  f"{float(np.mean(qa != qb)):.1e}")  # fmt: skip
    la, lb = runs["avx512"][1], runs["avx2"][1]
    print(f"logits: max |difference| {float((la - lb).abs().max()):.3f}")


def flips(args: argparse.Namespace, ids: list[int]) -> None:
    count = [0, 0]

    def compare(self: gguf_matrix.GgufMatrix, x: torch.Tensor) -> torch.Tensor:
        rows = x.float().numpy()
        ref = gguf.quants.quantize(rows, T.Q8_0).reshape(rows.shape[0], -1, 34)[:, :, 2:]
        ours = quantize_q8(rows)[0].view(np.uint8)
        count[0] += int((ref != ours).sum())
        count[1] += ours.size
        return x

    _hook(compare)
    checkpoint, stage = _stage(args.file)
    score(stage, ids, context=checkpoint.config.max_position_embeddings)
    print(f"codes differing: {count[0]} of {count[1]}")


def formats(args: argparse.Namespace, ids: list[int]) -> None:
    rng = np.random.default_rng(1)
    for k in (96, 544, 1568):
        for qtype in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0):
            w = rng.standard_normal((37, k)).astype(np.float32)
            raw = np.ascontiguousarray(gguf.quants.quantize(w, qtype)).view(np.uint8).reshape(-1)
            worst = dict.fromkeys(PATHS, 0.0)
            for t in (1, 5, 9):
                x = rng.standard_normal((t, k)) * np.exp(rng.standard_normal((t, k)))
                x = x.astype(np.float32)
                ref, bound = block_product(raw, qtype, x, 37)
                for p in PATHS:
                    y = BlockMatrix(raw, qtype, k, 37, p).mm(torch.from_numpy(x)).double().numpy()
                    err = float((np.abs(y - ref) / bound).max()) / 2.0**-24
                    worst[p] = max(worst[p], round(err, 1))
            print(f"k {k} {qtype.name}: {worst}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=("matmuls", "jitter", "divergence", "flips", "formats"))
    ap.add_argument("file", nargs="?")
    ap.add_argument("ids", nargs="?")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--seeds", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(1)
    ids = json.loads(pathlib.Path(args.ids).read_text()) if args.ids else []
    globals()[args.mode](args, ids)


if __name__ == "__main__":
    main()
