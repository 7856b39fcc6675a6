"""A draft model's one-token pass ungoverned (every thread) against governed (`ThreadGovernor`).

Loads the draft as the coordinator does (`DraftModel.load`), then times one-token passes in
alternating blocks with its stage's governor off and on, and prints each side's median, mean
and 90th percentile. Run it on a busy machine to see what the governor saves, on a quiet one
to see what it costs:

    python scripts/draft_threads.py ~/.cache/meshd/models/Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from meshd.model.governor import ThreadGovernor
from meshd.speculative.draft import DraftModel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("draft", help="draft checkpoint or GGUF file")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--passes", type=int, default=15, help="passes per block")
    args = parser.parse_args()
    threads = torch.get_num_threads()
    draft = DraftModel.load(
        args.draft, quantization="gguf" if args.draft.endswith(".gguf") else "none"
    )
    governor = ThreadGovernor(threads) if threads > 1 else None
    session = draft.open(16 + 2 * args.rounds * args.passes + 32)
    draft.next_logits(session, 0, list(range(100, 116)))
    position = 16
    times: dict[str, list[float]] = {"every thread": [], "governed": []}
    for block in range(args.rounds * 2):
        name = ("every thread", "governed")[(block + block // 2) % 2]  # ABBA order
        draft.stage.governor = governor if name == "governed" else None
        if name == "every thread":
            torch.set_num_threads(threads)
        for _ in range(args.passes):
            start = time.perf_counter()
            draft.next_logits(session, position, [5])
            times[name].append(time.perf_counter() - start)
            position += 1
    for name, seconds in times.items():
        ordered = sorted(seconds)
        print(
            f"{name:13} median {1000 * statistics.median(ordered):7.1f} ms  "
            f"mean {1000 * statistics.mean(ordered):7.1f}  "
            f"p90 {1000 * ordered[int(0.9 * len(ordered))]:7.1f}"
        )
    with open("/proc/loadavg") as f:
        print("load average", " ".join(f.read().split()[:3]), "threads", threads)


if __name__ == "__main__":
    main()
