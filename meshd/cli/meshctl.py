"""The `meshctl` command: drives the local daemon over its control socket."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# name -> (module, help). Each module exposes `add_arguments(parser)` and `run(args) -> int`.
COMMANDS: dict[str, tuple[str, str]] = {
    "status": ("meshd.cli.meshctl_status", "members, lanes, plan, stages and sessions"),
    "plan": ("meshd.cli.meshctl_plan", "explain the current plan"),
    "kill": ("meshd.cli.meshctl_kill", "stop a node's stage (as a crash would, or --drain)"),
    "recover": ("meshd.cli.meshctl_recover", "let a killed node host again"),
}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `meshctl` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="meshctl", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        mod = importlib.import_module(module)
        p = sub.add_parser(name, help=help_text)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    args = parser.parse_args(argv)
    if not hasattr(args, "_run"):
        parser.print_help()
        return 2
    return int(args._run(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
