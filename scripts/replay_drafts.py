"""Replay draft strategies over a model's greedy output: tokens committed per verify window.

    python scripts/replay_drafts.py                  # built-in model, the bench's 6 prompts
    python scripts/replay_drafts.py --window 12 --dir /path/to/checkpoint

Greedy output is fixed whatever drafts a window carries (speculation is lossless), so a
proposer can be judged offline: decode each `meshd bench spec` prompt once, record the MTP
draft the last stage would send after every committed token (meshd's own StageModel and
MtpDrafter, fp32), then walk the output window by window: a window drafts up to `--window`
tokens, commits its accepted prefix plus one, and the next proposal starts there. No network,
no timing, no policy: only how many tokens each strategy's drafts would commit per round
trip. `old mtp-simple` is the rule before the copy-agreement change (MTP prefix + tail of
`extension_tokens`, always), kept here as the reference.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from meshd.model.builtin import builtin_model_dir
from meshd.model.files import open_checkpoint, open_tokenizer
from meshd.model.stage import StageModel
from meshd.sim.workloads import workloads
from meshd.speculative.config import SpecConfig
from meshd.speculative.ngram import NgramSimple
from meshd.speculative.strategies import make_proposer
from meshd.stage.mtp_drafter import MtpDrafter


class Drafter(Protocol):
    """The part of a proposer a replay drives."""

    def reset(self, prompt: Sequence[int]) -> None: ...
    def observe(self, committed: Sequence[int]) -> None: ...
    def propose(self, max_tokens: int, mtp_draft: Sequence[int] = ()) -> list[int]: ...


def greedy_with_drafts(
    stage: StageModel, prompt: list[int], tokens: int, depth: int
) -> tuple[list[int], list[list[int]]]:
    """Greedy output and, after each output token, the MTP draft of the tokens after it."""
    sid = "replay"
    stage.open_session(sid, len(prompt) + tokens + 1)
    drafter = MtpDrafter(stage)
    drafter.open(sid)
    try:
        head = prompt[:-1]
        if head:
            out = stage.forward(sid, 0, torch.tensor(head))
            drafter.after_window(sid, 0, head, out.hidden, None, 0)
        log, drafts = list(prompt), []
        for _ in range(tokens):
            base = len(log) - 1
            out = stage.forward(sid, base, torch.tensor([log[-1]]))
            assert out.logits is not None
            token = int(out.logits[-1].argmax())
            drafts.append(drafter.after_window(sid, base, [log[-1]], out.hidden, token, depth))
            log.append(token)
        return log[len(prompt) :], drafts
    finally:
        drafter.close(sid)
        stage.close_session(sid)


def replay(
    prompt: list[int],
    truth: list[int],
    mtp: list[list[int]],
    make: Callable[[], Drafter],
    window: int,
) -> float:
    """Tokens committed per window (after the first output token, which prefill samples)."""
    proposer = make()
    proposer.reset([*prompt, truth[0]])
    n, windows = 1, 0
    while n < len(truth):
        drafts = proposer.propose(window, mtp[n - 1])[:window]
        accepted = 0
        while accepted < len(drafts) and n + accepted < len(truth):
            if drafts[accepted] != truth[n + accepted]:
                break
            accepted += 1
        committed = truth[n : n + accepted + 1]
        proposer.observe(committed)
        n += len(committed)
        windows += 1
    return (len(truth) - 1) / max(1, windows)


class OldMtpSimple:
    """mtp-simple before the copy-agreement rule: MTP draft, then an n-gram tail, always."""

    def __init__(self, config: SpecConfig) -> None:
        self.tail = NgramSimple(config)
        self.depth, self.extension = config.mtp_depth, config.extension_tokens
        self.draft: list[int] = []

    def reset(self, prompt: Sequence[int]) -> None:
        self.tail.reset(prompt)

    def observe(self, committed: Sequence[int]) -> None:
        self.tail.observe(committed)

    def propose(self, max_tokens: int, mtp_draft: Sequence[int] = ()) -> list[int]:
        head = list(mtp_draft[: min(self.depth, max_tokens)])
        room = min(self.extension, max_tokens - len(head))
        return head + (self.tail.propose_after(head, room) if room > 0 else [])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default=str(builtin_model_dir()), help="HF checkpoint dir")
    parser.add_argument("--window", type=int, default=8, help="most drafts per window")
    parser.add_argument("--tokens", type=int, default=96, help="greedy tokens per prompt")
    parser.add_argument("--prompts", type=int, default=2, help="prompts per workload")
    args = parser.parse_args()
    torch.set_num_threads(2)
    checkpoint = open_checkpoint(args.dir)
    tokenizer = open_tokenizer(args.dir)
    depth = min(2, checkpoint.config.num_mtp_layers)
    stage = StageModel.load(checkpoint, 0, checkpoint.config.num_layers, device="cpu")
    window = args.window
    rows: dict[str, Callable[[], Drafter]] = {
        "ngram-simple": lambda: make_proposer("ngram-simple", SpecConfig()),
        "mtp": lambda: make_proposer("mtp", SpecConfig(mtp_depth=depth)),
        "old mtp-simple, ext 4": lambda: OldMtpSimple(
            SpecConfig(mtp_depth=depth, extension_tokens=4)
        ),
        "old mtp-simple, ext 6": lambda: OldMtpSimple(
            SpecConfig(mtp_depth=depth, extension_tokens=6)
        ),
        "mtp-simple, ext 4": lambda: make_proposer(
            "mtp-simple", SpecConfig(mtp_depth=depth, extension_tokens=4)
        ),
        "mtp-simple, ext 6": lambda: make_proposer(
            "mtp-simple", SpecConfig(mtp_depth=depth, extension_tokens=6)
        ),
        "mtp-cache, ext 6": lambda: make_proposer(
            "mtp-cache", SpecConfig(mtp_depth=depth, extension_tokens=6)
        ),
    }
    loads = workloads(args.prompts)
    cases = []
    for load in loads:
        prompt = tokenizer.encode(load.prompt)
        truth, mtp = greedy_with_drafts(stage, prompt, args.tokens, depth)
        cases.append((f"{load.kind}: {load.name}", prompt, truth, mtp))
    print(
        f"tokens committed per window, windows of at most {window} drafts, {args.tokens} "
        f"greedy tokens per prompt, MTP depth {depth}\n"
    )
    print("| strategy | " + " | ".join(name for name, *_ in cases) + " |")
    print("| --- |" + " --- |" * len(cases))
    for label, make in rows.items():
        cells = [f"{replay(p, t, m, make, window):.2f}" for _, p, t, m in cases]
        print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
