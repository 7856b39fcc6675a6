"""`meshd version`."""

from __future__ import annotations

import argparse

import meshd
from protocol import PROTOCOL_VERSION


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No options."""


def run(args: argparse.Namespace) -> int:
    """Print package and protocol versions."""
    print(f"meshd {meshd.__version__} (protocol {PROTOCOL_VERSION})")
    return 0
