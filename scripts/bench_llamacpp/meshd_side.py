"""meshd's side, run with meshd's own Python: checkpoints, prompt ids, greedy tokens.

    python meshd_side.py builtin-for-converter OUT   # the built-in model minus its mtp.* tensors
    python meshd_side.py write-large OUT             # the 246M random Llama + the built-in tokenizer
    python meshd_side.py prompt MODEL_DIR            # the prompt ids `meshd bench decode` uses
    python meshd_side.py greedy MODEL N THREADS IDS  # meshd's greedy tokens (MODEL: dir or .gguf)

Each prints one JSON value on stdout. The harness itself imports nothing of meshd (it runs with
any Python); it calls this file with meshd's virtualenv.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import sys
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def builtin_for_converter(out: pathlib.Path) -> dict[str, Any]:
    """A copy of the built-in model that llama.cpp's converter accepts.

    The converter maps every tensor name it is given and fails on meshd's multi-token
    prediction heads (`mtp.*`), which llama.cpp's llama architecture has no place for; they
    play no part in plain decoding, so the copy leaves them out (and the config's count).
    """
    from safetensors.torch import load_file, save_file

    from meshd.model.builtin import builtin_model_dir

    src = builtin_model_dir()
    out.mkdir(parents=True, exist_ok=True)
    for name in (*TOKENIZER_FILES, "generation_config.json"):
        if (src / name).is_file():
            shutil.copy(src / name, out / name)
    config = json.loads((src / "config.json").read_text())
    config.pop("num_nextn_predict_layers", None)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tensors = load_file(src / "model.safetensors")
    kept = {k: v for k, v in tensors.items() if not k.startswith("mtp.")}
    save_file(kept, out / "model.safetensors", metadata={"format": "pt"})
    return {"source": str(src), "dropped": len(tensors) - len(kept), "kept": len(kept)}


def write_large(out: pathlib.Path) -> dict[str, Any]:
    """meshd's `large` random checkpoint, with the built-in tokenizer beside it.

    A random checkpoint has no tokenizer; the converter needs one for the GGUF vocabulary and
    `meshd bench pipeline` for its prompt. The built-in's 4096 ids all lie inside the 32000-id
    vocabulary (the converter pads the rest).
    """
    from meshd.bench.decode import write_random_checkpoint
    from meshd.model.builtin import builtin_model_dir

    out.mkdir(parents=True, exist_ok=True)
    write_random_checkpoint(out, "large")
    for name in TOKENIZER_FILES:
        shutil.copy(builtin_model_dir() / name, out / name)
    return {"dir": str(out)}


def prompt(model_dir: pathlib.Path) -> list[int]:
    from meshd.bench.decode import DEFAULT_PROMPT, prompt_ids
    from meshd.model.checkpoint import Checkpoint

    config = Checkpoint.open(model_dir).config
    return list(prompt_ids(model_dir, DEFAULT_PROMPT, config.vocab_size))


def greedy(model: pathlib.Path, n: int, threads: int, ids: list[int]) -> list[int]:
    """meshd's greedy tokens after `ids`, fp32, all layers in one stage (as `bench decode`)."""
    import torch

    from meshd.bench.single_node import generate
    from meshd.model.checkpoint import Checkpoint
    from meshd.model.stage import StageModel

    torch.set_num_threads(threads)
    checkpoint = Checkpoint.open(model)
    stage = StageModel.load(checkpoint, 0, checkpoint.config.num_layers, device="cpu")
    return list(generate([stage], ids, n).tokens)


def main(argv: list[str]) -> None:
    command, *rest = argv
    result: Any
    if command == "builtin-for-converter":
        result = builtin_for_converter(pathlib.Path(rest[0]))
    elif command == "write-large":
        result = write_large(pathlib.Path(rest[0]))
    elif command == "prompt":
        result = prompt(pathlib.Path(rest[0]))
    elif command == "greedy":
        ids = [int(t) for t in rest[3].split(",")]
        result = greedy(pathlib.Path(rest[0]), int(rest[1]), int(rest[2]), ids)
    else:
        raise SystemExit(f"unknown command {command}")
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
