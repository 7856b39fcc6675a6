"""Load GGUF files written by llama.cpp's own tools with meshd, and compare (not in CI).

    .venv/bin/python scripts/gguf_converter_check.py --llama-cpp SRC [--bin BIN] [--work DIR]

SRC is llama.cpp's source tree (the llama-cpp-python 0.3.36 sdist vendors it under
vendor/llama.cpp); BIN, optional, holds its built `llama-quantize`, `llama-tokenize` and the
`meshd-greedy` helper of scripts/bench_llamacpp. For the built-in model (MTP heads dropped,
its byte-level BPE's pre-tokenizer mapped to "gpt-2") and random checkpoints of each family
(with the built-in tokenizer), `convert_hf_to_gguf.py` writes f32 and q8_0 files; meshd opens
them and prints whether config, tokenizer and F32 logits equal the directory's, and the Q8_0
agreement. With BIN: llama-quantize's Q6_K/Q5_K_M/Q4_K_M/Q4_0 of the built-in model, greedy
agreement with fp32 and with llama.cpp on the same file, and llama-tokenize's ids vs meshd's
for the byte-level BPE and for a SentencePiece ("llama") vocabulary trained on docs/*.md.
The results of one run are in docs/model-runtime.md ("GGUF files").
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
from typing import Any

import msgspec
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from meshd.bench.checkpoints import make_checkpoint  # noqa: E402
from meshd.bench.gguf_writer import write_sentencepiece_gguf, write_vocab_gguf  # noqa: E402
from meshd.bench.single_node import generate  # noqa: E402
from meshd.bench.tokenizer_dirs import SP_TEXTS, byte_level_dir, sentencepiece_dir  # noqa: E402
from meshd.model.builtin import builtin_model_dir  # noqa: E402
from meshd.model.files import open_checkpoint, open_tokenizer  # noqa: E402
from meshd.model.stage import StageModel  # noqa: E402

FAMILIES = ["llama", "llama3_rope", "qwen2", "qwen3", "mistral"]
PROMPTS = [
    "Once upon a time", "The little dog", "She said", "In the morning, the sun",
    "Tom and Lily went to the park", "One day, a girl named", "The cat was very", "He wanted to",
]  # fmt: skip
TEXTS = [
    "Once upon a time, there was a little girl named Lily.",
    "  leading spaces, trailing spaces  ",
    "tabs\tand\nnewlines\n\n\nand  double  spaces",
    "Numbers: 3 33 333 3333 3.14159 1,000,000",
    "Unicode: héllo wörld, naïve café, 日本語のテキスト, нещо на Български",
    "Emoji 🚀🦙 and joiners 😶\u200d🌫️!",
    "Contractions: I've, you're, he'll, she'd, it's, we'RE, THEY'LL",
    "<|user|>\nHi there<|end|>\n<|assistant|>\n",
]
# Run inside the converter's process: meshd's byte-level BPE has no entry in its table of
# pre-tokenizer hashes ("gpt-2" is the right one), and there is no tokenizer.model, so
# sentencepiece (not installed) is never needed.
CONVERTER = """
import runpy, sys
from pathlib import Path
src = Path(sys.argv.pop(1))
sys.path[:0] = [str(src), str(src / "gguf-py")]
import conversion.base as base
original_pre = base.TextModel.get_vocab_base_pre
def pre(self, tokenizer):
    try:
        return original_pre(self, tokenizer)
    except NotImplementedError:
        return "gpt-2"
base.TextModel.get_vocab_base_pre = pre
original_sp = base.TextModel._set_vocab_sentencepiece
def sentencepiece(self, *args, **kwargs):
    if not (self.dir_model / "tokenizer.model").is_file():
        raise FileNotFoundError("no tokenizer.model")
    return original_sp(self, *args, **kwargs)
base.TextModel._set_vocab_sentencepiece = sentencepiece
sys.argv[0] = str(src / "convert_hf_to_gguf.py")
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp", type=pathlib.Path, required=True, help="llama.cpp source")
    parser.add_argument("--bin", type=pathlib.Path, help="llama.cpp binaries (optional)")
    parser.add_argument("--work", type=pathlib.Path, help="scratch directory (default: a temp dir)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    work = args.work or pathlib.Path(tempfile.mkdtemp(prefix="meshd-gguf-"))
    work.mkdir(parents=True, exist_ok=True)
    prepare(work)
    for model in ["builtin", *FAMILIES]:
        for outtype in ("f32", "q8_0"):
            convert(args.llama_cpp, work / model, work / f"{model}-{outtype}.gguf", outtype)
        compare_conversions(work, model)
    if args.bin is not None:
        quantized(work, args.bin)
        tokenizers_vs_llama_cpp(work, args.bin)
    return 0


def prepare(work: pathlib.Path) -> None:
    builtin = work / "builtin"
    shutil.rmtree(builtin, ignore_errors=True)
    shutil.copytree(builtin_model_dir(), builtin)
    weights = load_file(builtin / "model.safetensors")
    kept = {k: v for k, v in weights.items() if not k.startswith("mtp.")}
    save_file(kept, builtin / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((builtin / "config.json").read_text())
    config.pop("num_nextn_predict_layers", None)
    (builtin / "config.json").write_text(json.dumps(config))
    for family in FAMILIES:
        directory = work / family
        shutil.rmtree(directory, ignore_errors=True)
        make_checkpoint(directory, family, seed=9, vocab_size=4096, bos_token_id=0, eos_token_id=0)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(builtin_model_dir() / name, directory / name)


def convert(src: pathlib.Path, model: pathlib.Path, out: pathlib.Path, outtype: str) -> None:
    command = [sys.executable, "-c", CONVERTER, str(src), str(model), "--outtype", outtype]
    result = subprocess.run(
        [*command, "--outfile", str(out)], capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        raise SystemExit(f"convert_hf_to_gguf.py failed on {model}: {result.stderr[-2000:]}")


def logits(stage: StageModel, ids: list[int]) -> torch.Tensor:
    stage.open_session("check", len(ids) + 1)
    try:
        out = stage.forward("check", 0, torch.tensor(ids)).logits
    finally:
        stage.close_session("check")
    assert out is not None
    return out


def compare_conversions(work: pathlib.Path, model: str) -> None:
    directory = open_checkpoint(work / model)
    tokenizer = open_tokenizer(work / model)
    reference = StageModel.load(directory, 0, directory.config.num_layers)
    expected = directory.config
    if model == "mistral":  # the converter writes Mistral as `llama`, without its window
        layers = expected.num_layers
        expected = msgspec.structs.replace(
            expected, family="llama", sliding_window=None, sliding_layers=(False,) * layers
        )
    for outtype in ("f32", "q8_0"):
        path = work / f"{model}-{outtype}.gguf"
        checkpoint = open_checkpoint(path)
        gguf_tokenizer = open_tokenizer(path)
        stage = StageModel.load(checkpoint, 0, checkpoint.config.num_layers)
        prompts = [tokenizer.encode(t) for t in TEXTS[:3]]
        if model == "mistral":
            prompts = [p[:6] for p in prompts]  # within the window the converter dropped
        row = {
            "model": model,
            "file": outtype,
            "default_quantization": checkpoint.default_quantization,
            "config_equal": checkpoint.config
            == msgspec.structs.replace(expected, eos_token_ids=checkpoint.config.eos_token_ids),
            "tokenizer_equal": all(gguf_tokenizer.encode(t) == tokenizer.encode(t) for t in TEXTS),
            "logits_exact": all(
                torch.equal(logits(stage, p), logits(reference, p)) for p in prompts
            ),
            "min_logits_cosine": round(
                min(
                    float(F.cosine_similarity(logits(stage, p), logits(reference, p), dim=-1).min())
                    for p in prompts
                ),
                6,
            ),
        }
        print(json.dumps(row))


def quantized(work: pathlib.Path, bin_dir: pathlib.Path) -> None:
    env = dict(os.environ, LD_LIBRARY_PATH=str(bin_dir))
    for kind in ("Q6_K", "Q5_K_M", "Q4_K_M", "Q4_0"):
        subprocess.run(
            [str(bin_dir / "llama-quantize"), str(work / "builtin-f32.gguf"),
             str(work / f"builtin-{kind}.gguf"), kind],
            env=env, capture_output=True, check=True,
        )  # fmt: skip
    tokenizer = open_tokenizer(work / "builtin")
    directory = open_checkpoint(work / "builtin")
    reference = StageModel.load(directory, 0, directory.config.num_layers)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    fp32 = [generate([reference], p, 32).tokens for p in prompts]
    for kind in ("f32", "q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q4_0"):
        path = work / f"builtin-{kind}.gguf"
        checkpoint = open_checkpoint(path)
        stage = StageModel.load(checkpoint, 0, checkpoint.config.num_layers)
        ours = [generate([stage], p, 32).tokens for p in prompts]
        theirs = [_llama_greedy(bin_dir, env, path, p, 32) for p in prompts]
        row: dict[str, Any] = {
            "file": kind,
            "bytes": path.stat().st_size,
            "default_quantization": checkpoint.default_quantization,
            "types": dict(collections.Counter(i.dtype for i in checkpoint.tensors.values())),
            "vs_fp32": _agreement(ours, fp32),
            "min_logits_cosine_vs_fp32": round(
                min(
                    float(F.cosine_similarity(logits(stage, p), logits(reference, p), dim=-1).min())
                    for p in prompts
                ),
                5,
            ),
            "vs_llama_cpp_same_file": _agreement(ours, theirs),
        }
        print(json.dumps(row))


def _llama_greedy(
    bin_dir: pathlib.Path, env: dict[str, str], path: pathlib.Path, ids: list[int], n: int
) -> list[int] | None:
    command = [str(bin_dir / "meshd-greedy"), str(path), str(n), "1", ",".join(map(str, ids))]
    result = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if result.returncode != 0 or not result.stdout.strip():
        return None
    return [int(x) for x in result.stdout.strip().splitlines()[-1].split(",")]


def _agreement(a: list[list[int]], b: list[list[int] | None]) -> dict[str, float] | str:
    if any(x is None for x in b):
        return "llama.cpp failed"
    pairs = [(u, v) for u, v in zip(a, b, strict=True) if v is not None]
    n = len(pairs[0][0])
    return {
        "identical": round(
            statistics.mean(sum(x == y for x, y in zip(u, v, strict=True)) / n for u, v in pairs), 3
        ),
        "first_divergence_median": statistics.median(
            next((i for i, (x, y) in enumerate(zip(u, v, strict=True)) if x != y), n)
            for u, v in pairs
        ),
    }


def tokenizers_vs_llama_cpp(work: pathlib.Path, bin_dir: pathlib.Path) -> None:
    env = dict(os.environ, LD_LIBRARY_PATH=str(bin_dir))

    def llama_ids(path: pathlib.Path, text: str) -> list[int]:
        command = [str(bin_dir / "llama-tokenize"), "-m", str(path), "-p", text, "--ids"]
        result = subprocess.run(
            [*command, "--no-escape", "--log-disable"], env=env, capture_output=True, text=True,
            check=True,
        )  # fmt: skip
        return [int(x) for x in result.stdout.strip().splitlines()[-1].strip("[]").split(",") if x]

    builtin = work / "builtin-f32.gguf"
    ours = open_tokenizer(builtin)
    differ = [t for t in TEXTS if ours.encode(t) != llama_ids(builtin, t)]
    print(json.dumps({"tokenizer": "gpt2 (built-in)", "texts": len(TEXTS), "differ": differ}))
    lines = [
        line.strip()
        for doc in sorted((REPO / "docs").glob("*.md"))
        for line in doc.read_text().splitlines()
        if len(line.strip()) > 20
    ]
    sample = [t for t in lines[::10] + TEXTS if t]
    for pre in ("llama-bpe", "qwen2"):
        src = byte_level_dir(work / pre, pre, lines, vocab_size=3000)
        path = write_vocab_gguf(src, work / f"{pre}.gguf", pre)
        bpe = open_tokenizer(path)
        differ = [t for t in sample if bpe.encode(t) != llama_ids(path, t)]
        print(json.dumps({"tokenizer": f"gpt2 + {pre}", "texts": len(sample), "differ": differ}))
    src = sentencepiece_dir(work / "sentencepiece", lines, vocab_size=3000)
    path = write_sentencepiece_gguf(src, work / "sentencepiece.gguf")
    sp = open_tokenizer(path)
    sample = [t for t in lines[::10] + SP_TEXTS if t]
    differ = [t for t in sample if sp.encode(t) != llama_ids(path, t)]
    print(
        json.dumps(
            {
                "tokenizer": "llama (SentencePiece BPE, 3000 pieces)",
                "texts": len(sample),
                "differ": differ,
            }
        )
    )


if __name__ == "__main__":
    sys.exit(main())
