"""The graceful stop of a daemon (SIGTERM, `systemctl stop`), in the order that loses nothing.

1. Stop admitting: new requests get 503 with `Retry-After`, the stage refuses new sessions and
   the node stops offering the model, so every plan (and every new request, on any node)
   moves to the spare at once; the spare loads the layers meanwhile.
2. Let this node's own requests finish, for up to `graceful_timeout_s`, while its stage and
   lanes keep serving everyone's open sessions. Requests still running then end with a 503
   (an error event and `[DONE]` in a stream), and close their sessions.
3. The stage serves its remaining sessions (other coordinators' requests) until they end or
   the same deadline passes, then stops: those sessions get `stage_stopped`, and their
   coordinators continue on the spare at once (no dead-lane wait, unlike a crash).
4. The caller then cancels the daemon (API, control socket, lanes).
"""

from __future__ import annotations

import logging
from typing import Protocol

import trio

from meshd.node.node import MeshNode

log = logging.getLogger(__name__)


class Generations(Protocol):
    """The node's running generations: a `NodeBackend`, or every model's (`MeshCatalog`)."""

    @property
    def in_flight(self) -> int: ...

    async def wait_idle(self) -> None: ...

    async def abort_all(self) -> None: ...


async def stop_gracefully(node: MeshNode, backend: Generations, timeout_s: float) -> None:
    """Run steps 1-3 (see the module docstring); returns when the daemon may exit."""
    deadline = trio.current_time() + timeout_s
    node.commands.begin_stop()
    with trio.move_on_at(deadline):
        await backend.wait_idle()
    if backend.in_flight:
        node.events.note(
            "stopping",
            node.node_key,
            f"{backend.in_flight} requests still running after {timeout_s:g} s: ending them",
        )
        await backend.abort_all()
    with trio.move_on_at(deadline):
        for model in node.models:
            await model.slot.drain()
    await node.commands.finish_stop()
