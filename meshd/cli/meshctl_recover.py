"""`meshctl recover [NODE]`: let NODE (default: every killed member) host again; re-plan."""

from __future__ import annotations

import argparse
from typing import Any

from meshd.cli.meshctl_common import add_socket_argument, run_op


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `meshctl recover`."""
    add_socket_argument(parser)
    parser.add_argument("node", nargs="?", default="", help="node key prefix (default: all)")


def run(args: argparse.Namespace) -> int:
    """Send the recover."""
    from meshd.node.control_client import RecoverOp

    def show(reply: dict[str, Any]) -> None:
        nodes = ", ".join(n[:16] for n in reply["nodes"]) or "no killed node"
        print(f"recovered {nodes}")

    return run_op(args, RecoverOp(node=args.node), show)
