#!/usr/bin/env python3
"""Quality of quantized stages against fp32: the figures in docs/model.md ("Quantization").

    python scripts/quant_quality.py              # markdown tables on stdout
    python scripts/quant_quality.py --json

On the built-in model, with meshd's own runtime (`StageModel`), for each of none/q8_0/q4_k/q4_0
(`int8` names q8_0, `int4` q4_k) and fp32 weights with a float16 KV cache:
- held-out bits per byte: the held-out files of `meshd_train.evaluate`, scored as it scores them
  (consecutive windows of the model's context), nats / ln 2 / the UTF-8 bytes of the tokens;
- greedy agreement with fp32: 50 evenly spaced held-out prompts of 32 tokens, 64 new tokens
  each; mean tokens until the first divergence (64 when none), and the share of the 50
  continuations identical to fp32's in all 64 tokens.
On tiny random checkpoints of each family (the tests' `make_checkpoint`): cosine similarity of
each position's logits with fp32's over a 48-token sequence (mean and minimum), and the share
of positions whose argmax agrees.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.nn import functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from meshd.bench.single_node import generate  # noqa: E402
from meshd.model.builtin import builtin_model_dir  # noqa: E402
from meshd.model.checkpoint import Checkpoint  # noqa: E402
from meshd.model.stage import StageModel  # noqa: E402

VARIANTS: dict[str, dict[str, object]] = {
    "fp32": {"quantization": "none"},
    "fp32, float16 KV": {"quantization": "none", "kv_dtype": torch.float16},
    "q8_0": {"quantization": "q8_0"},
    "q4_k": {"quantization": "q4_k"},
    "q4_0": {"quantization": "q4_0"},
}
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def load(checkpoint: Checkpoint, options: dict[str, object]) -> StageModel:
    n = checkpoint.config.num_layers
    return StageModel.load(checkpoint, 0, n, device="cpu", **options)  # type: ignore[arg-type]


@torch.inference_mode()
def bits_per_byte(stage: StageModel, stream: torch.Tensor, sizes: torch.Tensor) -> float:
    """Held-out bits per byte in consecutive windows of the model's context (+1 target)."""
    nats, nbytes = 0.0, 0
    window = stage.config.max_position_embeddings
    for start in range(0, len(stream) - 1, window):
        seq = stream[start : start + window + 1].long()
        if len(seq) < 2:
            break
        stage.open_session("bpb", len(seq))
        out = stage.forward("bpb", 0, seq[:-1])
        stage.close_session("bpb")
        assert out.logits is not None
        target = seq[1:]
        nats += F.cross_entropy(out.logits, target, reduction="sum").item()
        nbytes += int(sizes[target].sum())
    return nats / math.log(2) / nbytes


def prompts(stream: torch.Tensor, n: int = 50, length: int = 32) -> list[list[int]]:
    """`n` evenly spaced held-out prompts of `length` tokens (as meshd_train.evaluate's loop check)."""
    step = (len(stream) - length) // n
    return [stream[i * step : i * step + length].tolist() for i in range(n)]


def agreement(reference: list[list[int]], other: list[list[int]]) -> dict[str, float]:
    """Mean tokens until the first divergence, and the share of identical continuations."""
    firsts = [
        next((i for i, (a, b) in enumerate(zip(r, o, strict=True)) if a != b), len(r))
        for r, o in zip(reference, other, strict=True)
    ]
    same = sum(r == o for r, o in zip(reference, other, strict=True))
    return {"tokens_until_divergence": sum(firsts) / len(firsts), "identical": same / len(firsts)}


def builtin_report(new_tokens: int) -> dict[str, dict[str, float]]:
    from tokenizers import Tokenizer

    from meshd_train import evaluate

    directory = builtin_model_dir()
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    stream, _note = evaluate.heldout_stream(directory, tok)
    sizes = evaluate.token_bytes(tok)
    checkpoint = Checkpoint.open(directory)
    starts = prompts(stream)
    rows: dict[str, dict[str, float]] = {}
    reference: list[list[int]] = []
    for name, options in VARIANTS.items():
        stage = load(checkpoint, options)
        started = time.perf_counter()
        bpb = bits_per_byte(stage, stream, sizes)
        greedy = [generate([stage], p, new_tokens).tokens for p in starts]
        if not reference:
            reference = greedy
        rows[name] = {
            "bits_per_byte": bpb,
            **agreement(reference, greedy),
            "weight_bytes": stage.weight_bytes,
            "kv_bytes_per_token": stage.kv_bytes_per_token,
            "seconds": time.perf_counter() - started,
        }
    base = rows["fp32"]["bits_per_byte"]
    for row in rows.values():
        row["bits_per_byte_vs_fp32"] = row["bits_per_byte"] / base - 1
    return rows


@torch.inference_mode()
def family_report() -> dict[str, dict[str, float]]:
    from meshd.bench.checkpoints import make_checkpoint

    rows: dict[str, dict[str, float]] = {}
    ids = torch.randint(0, 256, (48,), generator=torch.Generator().manual_seed(5))
    for family in FAMILIES:
        with tempfile.TemporaryDirectory() as tmp:
            make_checkpoint(Path(tmp), family, seed=3)
            checkpoint = Checkpoint.open(Path(tmp))
            logits = {}
            for name in ("fp32", "q8_0", "q4_k", "q4_0"):
                stage = load(checkpoint, VARIANTS[name])
                stage.open_session("cos", len(ids))
                out = stage.forward("cos", 0, ids).logits
                assert out is not None
                logits[name] = out
        for name in ("q8_0", "q4_k", "q4_0"):
            cos = F.cosine_similarity(logits[name], logits["fp32"], dim=-1)
            same = logits[name].argmax(-1) == logits["fp32"].argmax(-1)
            rows[f"{family} {name}"] = {
                "cosine_mean": cos.mean().item(),
                "cosine_min": cos.min().item(),
                "argmax_agreement": same.float().mean().item(),
            }
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    report = {"builtin": builtin_report(args.new_tokens), "families": family_report()}
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print("Built-in model, meshd runtime, 1 thread:\n")
    print(
        "| stage | held-out bits/byte | vs fp32 | greedy: mean tokens until first divergence "
        f"(of {args.new_tokens}) | identical continuations | weight bytes | KV bytes/token |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, r in report["builtin"].items():
        print(
            f"| {name} | {r['bits_per_byte']:.4f} | {r['bits_per_byte_vs_fp32']:+.2%} | "
            f"{r['tokens_until_divergence']:.1f} | {r['identical']:.0%} | "
            f"{r['weight_bytes']:,} | {r['kv_bytes_per_token']:,} |"
        )
    print("\nTiny random checkpoints, logits vs fp32 over 48 positions:\n")
    print("| family, stage | cosine mean | cosine min | argmax agreement |")
    print("|---|---|---|---|")
    for name, r in report["families"].items():
        print(
            f"| {name} | {r['cosine_mean']:.5f} | {r['cosine_min']:.5f} | "
            f"{r['argmax_agreement']:.0%} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
