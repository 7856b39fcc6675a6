"""`meshd bench perplexity`: a model's perplexity and next-token argmax on given text or ids.

    meshd bench perplexity --model FILE.gguf --text prose.txt --tokens 256 --json
    meshd bench perplexity --model FILE.gguf --token-ids ids.json --json

The ids run through meshd's own runtime as a daemon holding the whole model would run them:
one `StageModel` with every layer, the checkpoint's default quantization (what `meshd serve`
chooses for the file: `Checkpoint.default_quantization`) unless `--quantization` names one,
fp32 activations and KV (the daemon's defaults; `--kv-dtype float16` keeps the KV cache in f16,
as llama.cpp does by default and a daemon does with `kv_dtype = "float16"`). Each context window of ids is one
session, fed in passes of at most `--batch` ids (default 512, the decode loop's prefill
chunk; 256 ids are one pass) with logits kept for every position.

`--text`: the file is tokenized with the model's tokenizer with its special tokens, so a BOS
is put first exactly when the model's metadata asks for one (`tokenizer.ggml.add_bos_token`
of a GGUF file, the post-processor of a tokenizer.json), as llama.cpp's `llama-perplexity`
tokenizes; then the first `--tokens` ids are kept. `--token-ids`: a JSON list of ints, scored
as given (`--tokens` still truncates), so that two engines score one input.

Report (`--json`): `tokens` (the ids scored), `nll` (mean natural-log negative likelihood of
ids 1..n-1 given the ids before them), `ppl` = exp(nll), `top1` (the argmax id of the logits at
positions 0..n-2, each the prediction for the next id) and `n` (ids scored).
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import time
from dataclasses import dataclass
from typing import Any

import torch

from meshd.bench.harness import model_dir, print_report
from meshd.model.files import open_checkpoint, open_tokenizer
from meshd.model.kernels.blocks import argmax_rows
from meshd.model.quant import NAMES, check_quantization
from meshd.model.stage import StageModel
from meshd.model.threads import configure_threads

DEFAULT_BATCH = 512
KV_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Scored:
    """Per-position results of one scoring run over ids `[n]`."""

    nll: list[float]  # -log p(ids[i+1] | ids[..i]) for i in 0..n-2
    top1: list[int]  # argmax of the logits at position i, for i in 0..n-2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `meshd bench perplexity`."""
    parser.add_argument("--model", default=None, help="checkpoint dir or .gguf (default: built-in)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--text", type=pathlib.Path, help="a text file, tokenized by the model")
    source.add_argument(
        "--token-ids", type=pathlib.Path, help="a JSON file holding a list of token ids"
    )
    parser.add_argument(
        "--tokens", type=int, default=None, help="score only the first N ids (default: all)"
    )
    parser.add_argument(
        "--quantization",
        choices=("auto", *NAMES),
        default="auto",
        help="stage weight format (default auto: the checkpoint's own, as meshd serve chooses)",
    )
    parser.add_argument(
        "--batch",
        type=int,
        default=DEFAULT_BATCH,
        help=f"ids per forward pass within a context window (default {DEFAULT_BATCH})",
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="compute threads (0 = all; default: torch's)"
    )
    parser.add_argument(
        "--kv-dtype",
        choices=tuple(KV_DTYPES),
        default="float32",
        help="the KV cache's element type (default float32, the daemon's)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    """Entry point: read the ids, load the stage, score, report."""
    path = model_dir(args)
    checkpoint = open_checkpoint(path)
    quantization = check_quantization(
        checkpoint.default_quantization if args.quantization == "auto" else args.quantization
    )
    source: dict[str, Any]
    if args.text is not None:
        tokenizer = open_tokenizer(path)
        text = args.text.read_text(encoding="utf-8")
        ids = tokenizer.encode(text)
        plain = tokenizer.encode(text, add_special_tokens=False)
        bos = tokenizer.bos_id is not None and ids[:1] == [tokenizer.bos_id] != plain[:1]
        source = {"text": str(args.text), "bos_added": bos}
    else:
        ids = _read_ids(args.token_ids)
        source = {"token_ids": str(args.token_ids)}
    if args.tokens is not None:
        ids = ids[: args.tokens]
    vocab = checkpoint.config.vocab_size
    if len(ids) < 2:
        raise SystemExit(f"meshd bench perplexity: need at least 2 ids to score, got {len(ids)}")
    if bad := [t for t in ids if not 0 <= t < vocab]:
        raise SystemExit(f"meshd bench perplexity: ids outside the vocabulary ({vocab}): {bad[:5]}")
    if args.threads is not None:
        configure_threads(args.threads, checkpoint.config, torch.float32, quantization)
    started = time.perf_counter()
    stage = StageModel.load(
        checkpoint,
        0,
        checkpoint.config.num_layers,
        dtype=torch.float32,
        quantization=quantization,
        kv_dtype=KV_DTYPES[args.kv_dtype],
    )
    loaded = time.perf_counter()
    context = checkpoint.config.max_position_embeddings
    scored = score(stage, ids, context=context, batch=args.batch)
    nll = math.fsum(scored.nll) / len(scored.nll)
    report = {
        "model": path,
        "quantization": quantization,
        "kv_dtype": args.kv_dtype,
        **source,
        "tokens": ids,
        "nll": nll,
        "ppl": math.exp(nll),
        "top1": scored.top1,
        "n": len(ids),
        "context": context,
        "load_s": round(loaded - started, 3),
        "score_s": round(time.perf_counter() - loaded, 3),
        "threads": torch.get_num_threads(),
    }
    print_report(report, args.json, _print_report)
    return 0


def _read_ids(path: pathlib.Path) -> list[int]:
    data = json.loads(path.read_text())
    if isinstance(data, dict):
        data = data.get("tokens")
    if not isinstance(data, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in data
    ):
        raise SystemExit(
            f"meshd bench perplexity: {path}: expected a JSON list of token ids "
            "(or an object with one under 'tokens')"
        )
    return data


def score(stage: StageModel, ids: list[int], *, context: int, batch: int = DEFAULT_BATCH) -> Scored:
    """Negative log-likelihood and argmax at every position of `ids` through `stage` (which
    holds every layer). Windows of `context` ids are separate sessions; the logits at a
    window's last position still predict the next window's first id."""
    if not (stage.is_first and stage.is_last):
        raise ValueError("scoring needs one stage holding every layer")
    nll: list[float] = []
    top1: list[int] = []
    target = torch.tensor([*ids[1:], 0], dtype=torch.long)  # the last row predicts nothing
    for start in range(0, len(ids), context):
        window = ids[start : start + context]
        session = f"perplexity-{start}"
        stage.open_session(session, len(window))
        try:
            for offset in range(0, len(window), batch):
                part = torch.tensor(window[offset : offset + batch], dtype=torch.long)
                out = stage.forward(session, offset, part.to(stage.device))
                assert out.logits is not None
                logits = out.logits.float().cpu()
                first = start + offset
                rows = min(len(part), len(ids) - 1 - first)  # positions with a next id
                logp = torch.log_softmax(logits[:rows], dim=-1)
                picked = logp.gather(1, target[first : first + rows, None])[:, 0]
                nll += (-picked.double()).tolist()
                top1 += argmax_rows(logits[:rows])
        finally:
            stage.close_session(session)
    return Scored(nll, top1)


def _print_report(report: dict[str, Any]) -> None:
    print(
        f"{report['model']} ({report['quantization']}): perplexity {report['ppl']:.4f} "
        f"(mean nll {report['nll']:.5f}) over {report['n'] - 1} predicted of {report['n']} ids"
    )
