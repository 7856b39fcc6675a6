"""`meshctl kill NODE [--drain]`: stop NODE's stage at once (as a crash would) or after its
sessions end; the mesh re-plans without it until `meshctl recover`."""

from __future__ import annotations

import argparse
from typing import Any

from meshd.cli.meshctl_common import add_socket_argument, run_op


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `meshctl kill`."""
    add_socket_argument(parser)
    parser.add_argument("node", help="node key prefix (hex, as `meshctl status` shows)")
    parser.add_argument("--drain", action="store_true", help="wait for its sessions first")


def run(args: argparse.Namespace) -> int:
    """Send the kill."""
    from meshd.node.control_client import KillOp

    def show(reply: dict[str, Any]) -> None:
        if reply.get("drain"):
            print(
                f"draining {reply['node'][:16]}: its stage stops when its open sessions end "
                "(`meshctl status` shows it)"
            )
        else:
            print(f"killed {reply['node'][:16]}")

    return run_op(args, KillOp(node=args.node, drain=args.drain), show)
