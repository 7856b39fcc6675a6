"""`meshd serve`: run the daemon (lanes, discovery, membership, planning, stages, control)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

import trio

from meshd.config import ConfigError, NodeConfig, add_config_arguments, load_config_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every config key as a flag (see docs/configuration.md)."""
    add_config_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Load the config, refuse to start without a mesh secret, then serve until stopped."""
    try:
        config = load_config_from_args(args, os.environ)
        config.read_mesh_secret()
    except ConfigError as exc:
        print(f"meshd serve: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        trio.run(serve, config)
    except KeyboardInterrupt:
        return 0
    return 0


def model_name(model: str) -> str:
    """What the API calls the model: the directory's name, or `meshd-builtin`."""
    return os.path.basename(os.path.normpath(model)) if model else "meshd-builtin"


async def serve(config: NodeConfig) -> None:
    """Run one daemon until cancelled."""
    # Imported here so `meshd --help` and config errors stay fast (torch is heavy).
    from meshd.api.openai import create_app
    from meshd.api.server import serve_api
    from meshd.model.builtin import builtin_model_dir
    from meshd.node.control import serve_control
    from meshd.node.generation import NodeBackend
    from meshd.node.node import MeshNode
    from meshd.node.notify import Notifier

    model_dir = config.model or str(builtin_model_dir())
    name = model_name(config.model)
    node = MeshNode(config, model_dir=model_dir)
    backend = NodeBackend(node, model_name=name)
    notifier = Notifier()
    async with trio.open_nursery() as nursery:
        await nursery.start(node.run)
        await nursery.start(serve_control, node, backend, str(config.control_socket_path()))
        app = create_app(backend, api_key=config.read_api_key(), spec=config.spec)
        api = await nursery.start(serve_api, app, config.api_host, config.api_port)
        notifier.send(READY="1", STATUS=f"node {node.identity.node_id} serving on {api.base_url}")
        print(
            f"meshd: node {node.identity.node_id} api {api.base_url} "
            f"listening on {node.lane_address}",
            flush=True,
        )
        interval = notifier.watchdog_interval_s()
        if interval is not None:
            while True:
                notifier.send(WATCHDOG="1")
                await trio.sleep(interval)
