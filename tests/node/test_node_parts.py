"""A `MeshNode` in-process: every part exists once `run_node` hands the node over, each takes its
table of the configuration, and the node carries out `Duty`'s decisions on its real stage."""

from __future__ import annotations

import pathlib
from collections.abc import Callable

import trio

from meshd.config import load_config
from meshd.model.builtin import builtin_model_dir
from meshd.node.basis import NodeBasis
from meshd.node.duty import Mode
from meshd.node.node import MeshNode, run_node
from tests.node.daemons import SECRET


async def _wait(
    node: MeshNode, done: Callable[[], bool], timeout_s: float = 60.0, *, replan: bool = False
) -> None:
    """Wait for `done()` after each re-plan (asking for one each time with `replan`)."""
    with trio.fail_after(timeout_s):
        while not done():
            if replan:
                node.planning.request()
            await node.planning.wait_change(1.0)


async def test_parts_take_their_tables_and_duty_drives_the_stage(tmp_path: pathlib.Path) -> None:
    config = load_config(
        {
            "mesh_secret": SECRET,
            "listen_host": "127.0.0.1",
            "listen_port": 0,
            "mdns.enabled": False,
            "stage.max_sessions": 3,
            "nat.yield_s": 0.5,
            "punch.open_ttl": 4,
            "membership.dead_retention_s": 90.0,
            "drain_timeout_s": 5.0,
        },
        {"MESHD_STATE_DIR": str(tmp_path / "state")},
        None,
    )
    basis = NodeBasis.load(config, str(builtin_model_dir()))
    layers = (0, basis.models[0].shape.num_layers)
    async with trio.open_nursery() as nursery:
        node: MeshNode = await nursery.start(run_node, config, basis)
        assert node.models[0].slot.host_config.max_sessions == 3
        assert node.peers.nat_config.yield_s == 0.5 and node.peers.nat.config.open_ttl == 4
        assert node.membership.config.dead_retention_s == 90.0
        assert node.lane_address.startswith("127.0.0.1:")

        # A lone node plans itself alone and loads every layer.
        await _wait(node, lambda: node.models[0].slot.layers == layers)
        assert node.models[0].duty.mode(node.models[0].slot.layers) is Mode.SERVING
        assert node.capacity().models and node.capacity().models[0].loaded

        # kill --drain with no session open: the drain ends at once and the stage stops.
        await node.commands.apply("kill", True)
        await _wait(node, lambda: node.commands.disabled)
        assert node.models[0].slot.layers is None and not node.commands.draining
        assert not node.capacity().models and not node.models[0].slot.refuse_new_sessions
        assert [e.detail for e in node.events if e.kind == "killed"] == ["drained"]

        # recover: the node offers the model again (its record is re-signed at membership's
        # pace), and a plan made after that loads its stage. A lone node hears no membership
        # events to re-plan on, so the test asks for the re-plans a peer's news would cause.
        await node.commands.apply("recover", False)
        await _wait(node, lambda: node.models[0].slot.layers == layers, replan=True)
        assert not node.commands.disabled and node.capacity().models

        # kill at once: the stage stops now, and no plan brings it back until recover.
        await node.commands.apply("kill", False)
        assert node.models[0].slot.layers is None and node.commands.disabled
        node.planning.request()
        await node.planning.wait_change(10.0)
        assert node.models[0].slot.layers is None
        nursery.cancel_scope.cancel()
