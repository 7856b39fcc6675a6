"""Train meshd's built-in code model (Llama + DeepSeek-V3-style MTP heads) on CPU.

The corpus is the running interpreter's standard library source. The result is an ordinary
Hugging Face directory (config.json, model.safetensors, tokenizer files) plus `mtp.*` tensors
that `LlamaForCausalLM.from_pretrained` ignores and meshd's runtime uses as draft heads.

    python -m meshd_train --out meshd/model/builtin      # or scripts/train_builtin.py
    python -m meshd_train --tiny --out /tmp/tiny         # seconds; used by the tests
    python -m meshd_train distill --out meshd/model/builtin_draft   # its draft model

Everything is seeded: the corpus order, the tokenizer, the init and the batch order (drawn
per step from `seed` and the step number, so a resumed run sees the same batches).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from meshd_train.config import TINY, TrainConfig
from meshd_train.loop import train


def parse_args(argv: list[str] | None = None) -> tuple[TrainConfig, argparse.Namespace]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("meshd/model/builtin"))
    p.add_argument("--tiny", action="store_true", help="a seconds-long run for tests")
    p.add_argument("--checkpoint", type=Path, default=None, help="save/resume file")
    p.add_argument("--stop-step", type=int, default=None, help="export early at this step")
    p.add_argument(
        "--init-from",
        type=Path,
        default=None,
        help="start phase 3 from this exported phase-2 directory (e.g. the previous built-in)",
    )
    p.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="override a TrainConfig field, e.g. --set steps=300 hidden_size=256",
    )
    args = p.parse_args(argv)
    cfg = TINY if args.tiny else TrainConfig()
    fields = {f.name: f.type for f in dataclasses.fields(TrainConfig)}
    for item in args.set:
        key, _, value = item.partition("=")
        if key not in fields:
            p.error(f"unknown field {key}")
        kind = {"int": int, "float": float, "bool": lambda v: v.lower() in ("1", "true")}
        cfg = dataclasses.replace(cfg, **{key: kind[str(fields[key])](value)})
    return cfg, args


def main(argv: list[str] | None = None) -> None:
    args_in = sys.argv[1:] if argv is None else argv
    if args_in[:1] == ["distill"]:  # the built-in model's draft (meshd_train.distill)
        from meshd_train.distill import main as distill_main

        distill_main(args_in[1:])
        return
    cfg, args = parse_args(argv)
    train(cfg, args.out, args.checkpoint, stop_step=args.stop_step, init_from=args.init_from)
