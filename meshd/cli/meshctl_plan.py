"""`meshctl plan`: the current plan, explained (stages, hops, figures, options weighed)."""

from __future__ import annotations

import argparse
from typing import Any

from meshd.cli.meshctl_common import add_socket_argument, run_op


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `meshctl plan`."""
    add_socket_argument(parser)


def run(args: argparse.Namespace) -> int:
    """Print the plan's explanation."""
    from meshd.node.control_client import PlanOp

    def show(reply: dict[str, Any]) -> None:
        print(reply["plan"] if reply["plan"] is not None else f"no plan: {reply['error']}")

    return run_op(args, PlanOp(), show)
