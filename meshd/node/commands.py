"""`NodeCommands`: the operator's commands (`meshctl kill|recover`, SIGTERM) carried to every
model a node holds (each model's `Duty` decides what one does), or to another node's lane."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import trio

from meshd.net.lane_table import LaneTable
from meshd.node.gossip_driver import KeyBook
from meshd.node.held_model import HeldModel
from protocol.messages import StageCommand


@dataclass(eq=False)
class NodeCommands:
    """Commands to the node `node_key`, whose models are `models`; `send` reaches others."""

    models: Sequence[HeldModel]
    node_key: bytes
    peers: LaneTable
    keys: KeyBook
    nursery: trio.Nursery

    @property
    def disabled(self) -> bool:
        """Killed by the operator (or stopped): hosts nothing, offers nothing."""
        return all(model.duty.disabled for model in self.models)

    @property
    def draining(self) -> bool:
        """A drain or a stop is in progress."""
        return any(model.duty.draining for model in self.models)

    @property
    def stopping(self) -> bool:
        """SIGTERM: no new requests or sessions; see `meshd/node/shutdown.py`."""
        return any(model.duty.stopping for model in self.models)

    async def apply(self, action: str, drain: bool) -> None:
        """kill: stop hosting every model (after the sessions end with `drain`); recover:
        host again."""
        for model in self.models:
            await model.apply_command(action, drain, trio.current_time())

    async def send(self, node_id: bytes, action: str, drain: bool) -> None:
        """Deliver a kill/recover to `node_id` (this node itself, or over its lane)."""
        if node_id == self.node_key:
            if action == "kill" and drain:
                self.nursery.start_soon(self.apply, action, drain)  # answer at once
            else:
                await self.apply(action, drain)
            return
        command = StageCommand("kill" if action == "kill" else "recover", drain)
        await self.peers.send(self.keys.x_of(node_id), command)

    def begin_stop(self) -> None:
        """SIGTERM: admit nothing new and stop offering the models, so every plan (and every
        new request, anywhere) moves to a spare at once, while the stages keep serving the
        sessions they have; `finish_stop` ends it."""
        for model in self.models:
            model.begin_stop(trio.current_time())

    async def finish_stop(self) -> None:
        """Stop the stages: sessions still open get `stage_stopped`, and their coordinators
        continue on the spare (loaded since `begin_stop`)."""
        for model in self.models:
            await model.finish_stop(trio.current_time())
