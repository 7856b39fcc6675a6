"""`meshctl plan`: the current plan, explained (stages, hops, figures, options weighed)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from meshd.cli.meshctl_common import add_socket_argument, run_op


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `meshctl plan`."""
    add_socket_argument(parser)
    parser.add_argument("--json", action="store_true", help="print the raw reply as JSON")


def run(args: argparse.Namespace) -> int:
    """Print the plan's explanation."""
    from meshd.node.control_client import PlanOp

    def show(reply: dict[str, Any]) -> None:
        if args.json:
            print(json.dumps(reply, indent=2))
            return
        models = reply.get("models") or []
        if len(models) <= 1:
            print(reply["plan"] if reply["plan"] is not None else f"no plan: {reply['error']}")
            return
        for i, m in enumerate(models):  # a mesh serving several models: each one's plan
            print(("\n" if i else "") + f"== model {m['name']} ({m['model_id'][:16]})")
            print(m["plan"] if m["plan"] is not None else f"no plan: {m['error']}")

    return run_op(args, PlanOp(), show)
