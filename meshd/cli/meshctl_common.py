"""What every meshctl command shares: finding the daemon's control socket, printing errors."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

CONTROL_SOCKET_ENV = "MESHCTL_SOCKET"


def add_socket_argument(parser: argparse.ArgumentParser) -> None:
    """`--socket PATH` (default $MESHCTL_SOCKET, else the config's control_socket)."""
    parser.add_argument(
        "--socket",
        default=None,
        help=f"the daemon's control socket (default ${CONTROL_SOCKET_ENV}, else from the config)",
    )


def socket_path(args: argparse.Namespace) -> str:
    """The control socket to talk to."""
    if args.socket:
        return str(args.socket)
    if os.environ.get(CONTROL_SOCKET_ENV):
        return os.environ[CONTROL_SOCKET_ENV]
    from meshd.config import load_config

    config = load_config({}, os.environ, os.environ.get("MESHD_CONFIG"))
    return str(config.control_socket_path())


def run_op(args: argparse.Namespace, op: Any, show: Callable[[dict[str, Any]], None]) -> int:
    """Send `op`, show the reply; errors go to stderr with exit status 1."""
    from meshd.node.control_client import ControlError, call

    try:
        reply = call(socket_path(args), op)
    except (ControlError, OSError) as exc:
        print(f"meshctl: {exc}", file=sys.stderr)
        return 1
    show(reply)
    return 0
