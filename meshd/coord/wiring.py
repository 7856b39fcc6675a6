"""How one node's parts hear their messages: the wiring the daemon and the local pipeline share.

A node may coordinate requests (a `Coordinator`) and host a stage; its lane table hands every
pipeline message to `NodeWiring.dispatch`: replies and stage errors go to the coordinator,
node-level messages to the handlers the node registers (the daemon's hello and operator
commands), everything else to the stage. When a lane dies, the coordinator fails the windows
in flight to that peer, and the stage frees the sessions that peer coordinates here (it can
never close them now).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

from meshd.coord.coordinator import Coordinator
from protocol.messages import Message, StageError, VerifyReply

Handler = Callable[[Message, bytes], None]


class HostedStage(Protocol):
    """What the wiring needs of a stage (`StageHost`, or the daemon's `StageSlot`)."""

    def handle(self, message: Message, sender_key: bytes, /) -> None: ...

    def free_coordinator(self, coordinator: bytes, /) -> object: ...


class NodeWiring:
    """Routes a node's messages to its coordinator, its stage and its own handlers."""

    def __init__(
        self,
        *,
        coordinator: Coordinator | None = None,
        stage: HostedStage | None = None,
        handlers: Mapping[type[Message], Handler] | None = None,
    ) -> None:
        self.coordinator = coordinator
        self.stage = stage
        self.handlers = dict(handlers or {})

    def dispatch(self, message: Message, sender: bytes) -> None:
        """Deliver one message that arrived from `sender` (a lane key)."""
        handler = self.handlers.get(type(message))
        if handler is not None:
            handler(message, sender)
        elif isinstance(message, VerifyReply | StageError):
            if self.coordinator is not None:
                self.coordinator.handle(message, sender)
        elif self.stage is not None:
            self.stage.handle(message, sender)

    def on_lane_lost(self, key: bytes, _lane: object) -> None:
        """`LaneTable.on_lane_lost`: see `lane_lost`."""
        self.lane_lost(key)

    def lane_lost(self, key: bytes) -> None:
        """The lane to `key` died: fail what waits on it here, free what it left here."""
        if self.coordinator is not None:
            self.coordinator.peer_lost(key)
        if self.stage is not None:
            self.stage.free_coordinator(key)
