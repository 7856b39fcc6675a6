#!/usr/bin/env python3
"""Blend two exported built-in checkpoints of the same configuration: (1 − λ)·A + λ·B.

    python scripts/mix_builtin.py --a /tmp/p3 --b /tmp/p4 --lam 0.7 --out /tmp/mix

The shipped weights are phase 3 (edits; copies its prompt back, but loops on 98 % of greedy
continuations) blended with phase 4 (unlikelihood beside the edits; loops on 4 %, copies
almost nothing): every tensor is interpolated in f32 and rounded to the stored dtype, the
tokenizer and config come from B, and training_info.json is B's with a `mix` entry saying so.
See docs/model.md for the figures of each λ tried (scripts/eval_builtin.py).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import load_file, save_file


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", type=Path, required=True, help="exported directory, weight 1 − λ")
    ap.add_argument("--b", type=Path, required=True, help="exported directory, weight λ")
    ap.add_argument("--lam", type=float, required=True, help="weight of B, in [0, 1]")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if not 0.0 <= args.lam <= 1.0:
        ap.error("--lam must be in [0, 1]")
    a = load_file(args.a / "model.safetensors")
    b = load_file(args.b / "model.safetensors")
    if a.keys() != b.keys() or any(a[k].shape != b[k].shape for k in a):
        raise SystemExit("the two checkpoints do not have the same tensors")
    with safe_open(str(args.b / "model.safetensors"), "pt") as f:
        metadata = f.metadata()
    mixed = {
        k: ((1.0 - args.lam) * a[k].float() + args.lam * b[k].float()).to(b[k].dtype) for k in b
    }
    if args.out.exists():
        shutil.rmtree(args.out)
    shutil.copytree(args.b, args.out)
    save_file(mixed, str(args.out / "model.safetensors"), metadata=metadata)
    info_path = args.out / "training_info.json"
    info = json.loads(info_path.read_text())
    info["mix"] = {
        "lam": args.lam,
        "formula": "(1 - lam) * a + lam * b, per tensor in f32",
        "a_sha256": sha256(args.a / "model.safetensors"),
        "b_sha256": sha256(args.b / "model.safetensors"),
        "a_steps_completed": json.loads((args.a / "training_info.json").read_text()).get(
            "steps_completed"
        ),
        "b_steps_completed": info.get("steps_completed"),
    }
    info_path.write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    print(f"wrote {args.out} (λ = {args.lam})")


if __name__ == "__main__":
    main()
