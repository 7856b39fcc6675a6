"""`meshd config show`: the configuration `meshd serve` would run with, from the same sources.

It reads the file, the environment and the flags as `meshd serve` does (docs/configuration.md)
and prints the merged configuration as TOML (or JSON with `--json`), secrets replaced by
"<redacted>"; a configuration error is one line on stderr and exit status 2, as at start.
"""

from __future__ import annotations

import argparse
import os
import sys

from meshd.config import ConfigError, add_config_arguments, load_config_from_args, render

EXIT_CONFIG_ERROR = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`show`, `--json`, and every flag `meshd serve` takes."""
    parser.add_argument("action", choices=("show",), help="show: print the effective config")
    parser.add_argument("--json", action="store_true", help="print JSON instead of TOML")
    add_config_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Print the effective configuration, or the one-line error that would stop the daemon."""
    try:
        config = load_config_from_args(args, os.environ)
    except ConfigError as exc:
        print(f"meshd config: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    sys.stdout.write(render(config, as_json=args.json))
    return 0
