#!/usr/bin/env python3
"""Seconds from a process's start until its model is open as `meshd serve` opens it, with and
without `meshd.model.files.prepare` (hashing and the tokenizer started before torch imports).

    python scripts/start_open.py MODEL.gguf [--rounds 3]

Each round runs, alternating, `prepare` and `plain` in fresh processes: on a new state dir
(`fresh`: every tensor hashed) and again on it (`restart`). A run does what the daemon does
before its trio loop: `check_model`, (`prepare`), the daemon's imports (torch, node, API),
`open_checkpoint`, then the tokenizer and model shape (`tokenizer_and_shape`, the model id
included). Prints each run (`--phases`: and the seconds of each step), the medians and the
load average.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

T0 = time.monotonic()


def child(model: str, state: pathlib.Path, mode: str) -> None:
    marks: list[tuple[str, float]] = []

    def mark(what: str) -> None:
        marks.append((what, time.monotonic()))

    from meshd.cli.serve import check_model
    from meshd.model.digests import set_cache_dir

    mark("import meshd.cli.serve (config)")
    check_model(model)
    mark("check_model")
    set_cache_dir(state / "models")
    if mode == "prepare":
        from meshd.model.files import prepare

        prepare(model)
    import torch

    mark("import torch")
    import meshd.api.openai
    import meshd.api.server
    import meshd.node.node  # noqa: F401  (the daemon's imports)

    mark("import node and API")
    from meshd.model.files import open_checkpoint
    from meshd.node.models import tokenizer_and_shape

    checkpoint = open_checkpoint(model)
    mark("open_checkpoint")
    cpu = torch.device("cpu")
    tokenizer_and_shape(checkpoint, model, torch.float32, "gguf", torch.float32, cpu)
    mark("tokenizer and model id")
    last = T0
    for what, at in marks:
        print(f"  {what}: {at - last:.2f} s")
        last = at
    print(f"{time.monotonic() - T0:.3f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--phases", action="store_true", help="print each run's phases")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.model, pathlib.Path(args.child[0]), args.child[1])
        return 0
    times: dict[tuple[str, str], list[float]] = {}
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for round_no in range(args.rounds):
        for mode in ("prepare", "plain"):
            state = pathlib.Path(tempfile.mkdtemp(prefix="meshd-open-"))
            try:
                for kind in ("fresh", "restart"):
                    out = subprocess.run(
                        [sys.executable, __file__, args.model, "--child", str(state), mode],
                        capture_output=True, text=True, check=True,
                    )  # fmt: skip
                    *phases, total = out.stdout.splitlines()
                    seconds = float(total)
                    times.setdefault((mode, kind), []).append(seconds)
                    print(
                        f"round {round_no + 1} {mode} {kind}: {seconds:.2f} s "
                        f"(load {os.getloadavg()[0]:.2f})",
                        flush=True,
                    )
                    if args.phases:
                        print("\n".join(phases), flush=True)
            finally:
                shutil.rmtree(state, ignore_errors=True)
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for (mode, kind), values in times.items():
        runs = ", ".join(f"{v:.2f}" for v in values)
        print(f"{mode} {kind}: median {statistics.median(values):.2f} s ({runs})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
