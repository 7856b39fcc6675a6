"""`meshd bench mtp`: what the last stage's MTP heads cost per window, next to a pass.

One process, the whole model as one stage, greedy one-token decode (the case where the heads'
cost weighs most: a window with no drafts). Two sessions decode the same prompt in
alternating blocks, one with the drafter's row reuse (what meshd runs) and one re-running
every row from `b-k` with logits for all rows (`reuse_rows=False`, meshd's drafter before),
so noise from a shared machine hits both alike. Reported: medians per window of the 1-token
pass and of each drafter, their ratios, and how often the depth-1 draft equals the next
greedy token (the heads' acceptance on this text).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from meshd.bench.harness import add_model_option, add_quantization_option, model_dir
from meshd.model.files import open_checkpoint, open_tokenizer
from meshd.model.kernels.blocks import argmax_rows
from meshd.model.stage import StageModel
from meshd.stage.mtp_drafter import MtpDrafter

DEFAULT_PROMPT = (
    'def heappush(heap, item):\n    """Push item onto heap, maintaining the heap invariant."""'
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `meshd bench mtp`."""
    add_model_option(parser)
    parser.add_argument("--tokens", type=int, default=150, help="tokens decoded per session")
    parser.add_argument("--block", type=int, default=5, help="tokens per alternation block")
    parser.add_argument("--want", type=int, default=None, help="drafts asked (default: depth)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    add_quantization_option(parser)


@dataclass
class _Session:
    name: str
    drafter: MtpDrafter
    pos: int
    token: int
    draft: list[int]
    pass_s: list[float]
    mtp_s: list[float]
    history: list[list[int]]
    hits: int = 0


def run(args: argparse.Namespace) -> int:
    """Measure and print."""
    torch.set_num_threads(args.threads)
    directory = model_dir(args)
    report = measure(directory, args.prompt, args.tokens, args.block, args.want, args.quantization)
    if args.json:
        print(json.dumps(report))
    else:
        print(
            f"meshd bench mtp — {report['mtp_depths']} MTP depths, {report['want']} drafts "
            f"asked, {report['tokens']} greedy tokens per session, medians per window\n"
            f"  1-token pass               {report['pass_ms']:.3f} ms\n"
            f"  MTP heads, rows reused     {report['mtp_reuse_ms']:.3f} ms "
            f"({report['reuse_vs_pass']:.2f}x the pass)\n"
            f"  MTP heads, all rows again  {report['mtp_full_ms']:.3f} ms "
            f"({report['full_vs_pass']:.2f}x the pass)\n"
            f"  reused / all again         {report['reuse_vs_full']:.2f}\n"
            f"  depth-1 draft = next token {report['depth1_hit_rate']:.2f}\n"
            f"  same drafts both ways      {report['same_drafts']}"
        )
    return 0


def measure(
    model_dir: str,
    prompt: str,
    tokens: int,
    block: int,
    want: int | None,
    quantization: str = "none",
) -> dict[str, Any]:
    """Decode `tokens` greedy tokens in two sessions, alternating blocks; the report."""
    checkpoint = open_checkpoint(model_dir)
    stage = StageModel.load(checkpoint, 0, checkpoint.config.num_layers, quantization=quantization)
    depth = len(stage.mtp)
    if depth == 0:
        raise SystemExit(f"{model_dir}: the checkpoint has no MTP depths")
    wanted = depth if want is None else max(1, min(want, depth))
    ids = open_tokenizer(model_dir).encode(prompt)
    sessions = [
        _open(stage, MtpDrafter(stage, reuse_rows=reuse), name, ids, tokens, wanted)
        for name, reuse in (("reuse", True), ("full", False))
    ]
    for _ in range(0, tokens, max(1, block)):
        for s in sessions:
            for _ in range(block):
                _step(stage, s, wanted)
    reuse, full = sessions
    pass_ms = statistics.median(reuse.pass_s + full.pass_s) * 1e3
    reuse_ms = statistics.median(reuse.mtp_s) * 1e3
    full_ms = statistics.median(full.mtp_s) * 1e3
    return {
        "model": model_dir,
        "mtp_depths": depth,
        "want": wanted,
        "tokens": len(reuse.mtp_s),
        "pass_ms": pass_ms,
        "mtp_reuse_ms": reuse_ms,
        "mtp_full_ms": full_ms,
        "reuse_vs_pass": reuse_ms / pass_ms,
        "full_vs_pass": full_ms / pass_ms,
        "reuse_vs_full": reuse_ms / full_ms,
        "depth1_hit_rate": reuse.hits / max(1, len(reuse.mtp_s)),
        # Row reuse must not change a single draft.
        "same_drafts": reuse.history == full.history,
    }


def _open(
    stage: StageModel, drafter: MtpDrafter, name: str, ids: list[int], tokens: int, want: int
) -> _Session:
    stage.open_session(name, len(ids) + tokens + 8)
    drafter.open(name)
    out = stage.forward(name, 0, torch.tensor(ids), logits_last_n=1)
    assert out.logits is not None
    token = argmax_rows(out.logits[-1])[0]
    draft = drafter.after_window(name, 0, ids, out.hidden, token, want)
    return _Session(name, drafter, len(ids), token, draft, [], [], [draft])


def _step(stage: StageModel, s: _Session, want: int) -> None:
    t0 = time.perf_counter()
    out = stage.forward(s.name, s.pos, torch.tensor([s.token]))
    t1 = time.perf_counter()
    assert out.logits is not None
    nxt = argmax_rows(out.logits[-1])[0]
    s.hits += bool(s.draft) and s.draft[0] == nxt
    s.draft = s.drafter.after_window(s.name, s.pos, [s.token], out.hidden, nxt, want)
    s.history.append(s.draft)
    s.pass_s.append(t1 - t0)
    s.mtp_s.append(time.perf_counter() - t1)
    s.pos += 1
    s.token = nxt
