"""What one forward pass costs by its width, for a whole checkpoint on this machine's CPU.

    python scripts/pass_widths.py ~/.cache/meshd/models/Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf

Loads the checkpoint as the coordinator loads a draft model (every layer, one process), writes
a 64-token context, then times passes of 1, 2, 5 and 9 tokens (a plain token, and verify
windows of 1, 4 and 8 drafts), `--rounds` times each, interleaved; prints the median ms per
width, the ratio to the one-token pass and the load average. `auto`'s prior for an unmeasured
verify pass (`AutoTuning.verify_token_prior`) comes from these ratios (docs/speculative.md).

    python scripts/pass_widths.py $M/Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf --widths 1 16 64 128 --one-row

`--one-row` returns the last row's logits only, as a draft's prefill does: the ratios per token
written are `AutoTuning.draft_write_prior`'s measurement.

    python scripts/pass_widths.py $M/...gguf --threads 1 --cpu --rounds 9 --widths 1 2 3 4 5 6 8 9

`--threads 1` computes on one thread, as a bench stage does; `--cpu` times the calling thread's
CPU time instead of the wall clock, which other tenants of a shared machine disturb less (on
one thread only: other threads' time is not counted). Widths alternate in order and reversed.
(The models come first: a list option takes every word after it.)

    python scripts/pass_widths.py $M/Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf --threads 1 --rounds 15 --widths 1 2 --vocab-tokens 0 32768

`--vocab-tokens` times the passes with the draft scoring that many first ids (`spec.draft_vocab_tokens`;
0 = the whole vocabulary), the settings interleaved within each round; a line per setting.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from meshd.speculative.draft import DraftModel

WIDTHS = (1, 2, 5, 9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--widths", type=int, nargs="+", default=list(WIDTHS))
    parser.add_argument("--one-row", action="store_true", help="logits of the last row only")
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads (0: torch's)")
    parser.add_argument("--cpu", action="store_true", help="time CPU, not wall (1 thread)")
    parser.add_argument(
        "--vocab-tokens", type=int, nargs="+", default=[0], help="draft vocabularies (0: all)"
    )
    args = parser.parse_args()
    widths: list[int] = args.widths
    if args.cpu and args.threads != 1:
        parser.error("--cpu needs --threads 1 (another thread's CPU time is not counted)")
    clock = time.thread_time if args.cpu else time.perf_counter
    for path in args.models:
        model = DraftModel.load(path, quantization="gguf")
        if args.threads:
            model.stage.governor = None  # the count asked for, not the governor's choice
            torch.set_num_threads(args.threads)
        settings: list[int] = args.vocab_tokens
        session = model.open(64 + args.rounds * sum(widths) * len(settings) + 8)
        model.rows(session, 0, list(range(100, 164)), 1)
        vocabs = {v: model.vocab(v, range(100, 164)) for v in settings}
        pos = 64
        seconds: dict[tuple[int, int], list[float]] = {(v, w): [] for v in settings for w in widths}
        for round_ in range(args.rounds):
            for width in widths if round_ % 2 == 0 else widths[::-1]:
                for v in settings if round_ % 2 == 0 else settings[::-1]:
                    started = clock()
                    rows = 1 if args.one_row else width
                    model.rows(session, pos, list(range(200, 200 + width)), rows, vocabs[v])
                    seconds[v, width].append(clock() - started)
                    pos += width
        model.close(session)
        for v in settings:
            medians = {w: statistics.median(seconds[v, w]) for w in widths}
            one = medians[widths[0]]
            cells = " ".join(
                f"{w}: {medians[w] * 1e3:.1f} ms ({medians[w] / one:.2f}x, "
                f"{medians[w] / w / one:.3f}x a token)"
                for w in widths
            )
            name = os.path.basename(path) + ("" if settings == [0] else f", vocab {v or 'all'}")
            print(f"{name}: {cells}; load {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
