"""The `meshd` command.

Subcommands live in their own modules and are imported only when chosen, so `meshd --help`
stays fast and a benchmark's heavy imports (torch, aioquic, transformers) load only for it.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

# name -> (module, help). Each module exposes `add_arguments(parser)` and `run(args) -> int`.
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("meshd.cli.demo", "run the local mesh demo on a real 135M model (SmolLM2)"),
    "serve": ("meshd.cli.serve", "run the daemon"),
    "config": ("meshd.cli.config_show", "show the configuration `serve` would run with"),
    "version": ("meshd.cli.version", "print the version"),
}

# `meshd bench NAME`: name -> (module, help), same module contract as COMMANDS.
BENCHES: dict[str, tuple[str, str]] = {
    "spec": ("meshd.bench.spec", "speculative strategies over a stage pipeline"),
    "lanes": ("meshd.bench.lanes", "our lane vs aioquic vs raw UDP on loopback"),
    "fetch": (
        "meshd.bench.fetch",
        "weights over loopback lanes: MB/s, verify-window latency idle vs during a transfer",
    ),
    "decode": ("meshd.bench.decode", "single-node decode loop vs transformers generate()"),
    "perplexity": (
        "meshd.bench.perplexity",
        "perplexity and next-token argmax on text or token ids, as the daemon runs the model",
    ),
    "threads": (
        "meshd.bench.threads",
        "decode on 1 thread, on N, and as the stage's thread governor chooses",
    ),
    "mtp": ("meshd.bench.mtp", "the last stage's MTP heads per window, next to a pass"),
    "concurrency": (
        "meshd.bench.concurrency",
        "concurrent streams on a 2-stage pipeline, stage batching on vs off",
    ),
    "pipeline": (
        "meshd.bench.pipeline",
        "time per token for 1/2/3 stages at emulated RTTs, next to the cost model",
    ),
    "scale": (
        "meshd.bench.scale",
        "membership, failure detection and planner at 10-1000 nodes",
    ),
    "load": ("meshd.bench.load", "OpenAI endpoint under load: latency, errors, KV leaks"),
    "chaos": (
        "meshd.bench.chaos",
        "real daemons SIGKILLed, SIGTERMed and restarted under load: errors, recovery, leaks",
    ),
    "plot": ("meshd.bench.plot", "draw saved --json reports (docs/bench/) as PNGs"),
}


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line (exit status 2), like every other start-up error of meshd."""

    def error(self, message: str) -> NoReturn:
        """Print `PROG: error: MESSAGE (see PROG --help)` and exit 2."""
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _load(module: str) -> tuple[Callable[[argparse.ArgumentParser], None], Callable[..., int]]:
    mod = importlib.import_module(module)
    return mod.add_arguments, mod.run


def build_parser() -> argparse.ArgumentParser:
    """Build the full argument parser (imports each chosen subcommand lazily)."""
    parser = _Parser(prog="meshd", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        p.set_defaults(_module=module)
    bench = sub.add_parser("bench", help="run a benchmark (side by side, ratios reported)")
    bench_sub = bench.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for name, (module, help_text) in BENCHES.items():
        p = bench_sub.add_parser(name, help=help_text)
        p.set_defaults(_module=module)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `meshd` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    # Parse once to find the subcommand, then let it add its own arguments and parse again.
    # Help waits for the second parse, so `meshd bench X --help` lists X's own options.
    first = [a for a in argv if a not in ("-h", "--help")]
    wants_help = len(first) < len(argv)
    module = None
    if first:
        try:
            module = getattr(parser.parse_known_args(first)[0], "_module", None)
        except SystemExit:
            if not wants_help:
                raise
    if module is None and wants_help:
        parser.parse_args(argv)  # prints the help of the deepest group named, and exits 0
    if module is None:
        parser.print_help()
        return 2
    add_arguments, run = _load(module)
    # Rebuild with the chosen subcommand's arguments attached.
    parser = build_parser()
    target = _find_subparser(parser, argv)
    add_arguments(target)
    args = parser.parse_args(argv)
    return int(run(args) or 0)


def _find_subparser(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.ArgumentParser:
    current = parser
    for token in argv:
        actions = [a for a in current._actions if isinstance(a, argparse._SubParsersAction)]
        if not actions:
            break
        choices = actions[0].choices
        if token in choices:
            current = choices[token]
    return current


if __name__ == "__main__":
    raise SystemExit(main())
