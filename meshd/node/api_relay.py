"""The daemon's model catalog: the models it coordinates, every model the mesh serves, and API
requests relayed over lanes (`API_STREAM`, `protocol/api_relay.py`) to a node that holds a
model this one does not.

A node that holds a model's files coordinates that model's requests itself. A request for a
model it does not hold goes to a healthy member that offers the model (the one serving a stage
of it first, then by id: the same choice on every node), which runs it through its own API
(marked relayed: never relayed again) and streams the answer back; the asker sends the bytes
on unchanged. A holder lost before it answered is replaced by the next; one lost mid-answer
cuts the response (an error event in a stream, like any stage failure past recovery).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from meshd.api.auth import IN_PROCESS
from meshd.api.backend import MeshBackend
from meshd.api.routing import RELAYED_HEADER, RelayCut, RelayedResponse, ServedModel
from meshd.net.lane_table import PeerUnreachable
from protocol import api_relay
from protocol.api_relay import (
    MAX_BODY_CHUNK_BYTES,
    ApiBody,
    ApiCancel,
    ApiEnd,
    ApiHead,
    ApiMessage,
    ApiRequest,
)
from protocol.streams import API_STREAM

if TYPE_CHECKING:
    from starlette.types import ASGIApp

    from meshd.node.generation import NodeBackend
    from meshd.node.node import MeshNode

log = logging.getLogger(__name__)

# How often a waiting relay checks that the holder's lane is still up. A relay waits as long
# as the holder's lane lives: a whole (unstreamed) answer comes only when its generation ends,
# and the holder's own limits (recovery_timeout_s, its API's) bound that.
LANE_CHECK_S = 0.5


@dataclass
class _Pending:
    holder: bytes  # lane key
    send: trio.MemorySendChannel[ApiMessage]
    receive: trio.MemoryReceiveChannel[ApiMessage]


@dataclass
class RelayStats:
    """Relayed requests, both ways."""

    sent: int = 0  # relayed to a holder, which answered
    served: int = 0  # relayed here by another node, and run
    failed: int = 0  # no holder answered


class MeshCatalog:
    """`meshd.api.routing.ModelCatalog` on a running node."""

    def __init__(self, node: MeshNode, backends: Sequence[NodeBackend], api_key: str | None):
        self.node = node
        self.backends = list(backends)
        self.api_key = api_key
        self.app: ASGIApp | None = None  # this node's API app, to run relayed requests
        self.stats = RelayStats()
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        # Relayed requests running here, by (asker, id): set when the asker's client is gone.
        self._serving: dict[tuple[bytes, int], trio.Event] = {}
        self._nursery: trio.Nursery | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Take API_STREAM messages until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self.node.peers.streams[API_STREAM] = (api_relay.decode, self._on_message)
            task_status.started()
            await trio.sleep_forever()

    # ---- every model's generations (a graceful stop waits for them all) --------------------
    @property
    def in_flight(self) -> int:
        """Generations this node coordinates now, every model's."""
        return sum(b.in_flight for b in self.backends)

    async def wait_idle(self) -> None:
        """Return once no generation of any model runs here."""
        while self.in_flight:
            for backend in self.backends:
                await backend.wait_idle()

    async def abort_all(self) -> None:
        """End every model's running generations (the node is stopping)."""
        for backend in self.backends:
            await backend.abort_all()

    # ---- the catalog ---------------------------------------------------------------------
    def local(self, name: str) -> MeshBackend | None:
        for backend in self.backends:
            if name in (backend.model_name, backend.model_id):
                return backend
        return None

    def served(self) -> Sequence[ServedModel]:
        out = [ServedModel(b.model_name, b.model_id, b.max_context_tokens) for b in self.backends]
        seen = {m.model_id for m in out}
        for _node_id, info in sorted(self.node.membership.view().items()):
            if not info.healthy or info.capacity is None:
                continue
            for holding in info.capacity.models:
                if holding.model_id not in seen:
                    seen.add(holding.model_id)
                    out.append(ServedModel(holding.name or holding.model_id, holding.model_id))
        return out

    def holders(self, name: str) -> list[bytes]:
        """Lane keys of the healthy members offering `name` (not this node): the ones serving a
        stage of it first, then by id."""
        ranked = []
        for node_id, info in sorted(self.node.membership.view().items()):
            if node_id == self.node.node_key or not info.healthy or info.capacity is None:
                continue
            for holding in info.capacity.models:
                if name in (holding.name, holding.model_id):
                    ranked.append((not holding.loaded, node_id))
                    break
        return [self.node.keys.x_of(node_id) for _, node_id in sorted(ranked)]

    async def relay(self, name: str, method: str, path: str, body: bytes) -> RelayedResponse | None:
        tried = 0
        for holder in self.holders(name):
            tried += 1
            request = next(self._ids)
            send, receive = trio.open_memory_channel[ApiMessage](math.inf)
            self._pending[request] = _Pending(holder, send, receive)
            try:
                await self._send(holder, ApiRequest(request, method, path, body))
                head = await self._next(request)
            except (PeerUnreachable, _HolderLost) as exc:
                log.info("relay of %s to %s failed: %s", name, holder.hex()[:16], exc)
                self._pending.pop(request, None)
                continue
            if not isinstance(head, ApiHead):
                self._pending.pop(request, None)
                continue
            self.stats.sent += 1
            return RelayedResponse(head.status, list(head.headers), self._body(request))
        if tried:
            self.stats.failed += 1
            raise _unavailable(name)
        return None

    async def _body(self, request: int) -> AsyncIterator[bytes]:
        done = False
        try:
            while True:
                message = await self._next(request)
                if isinstance(message, ApiBody):
                    yield message.data
                elif isinstance(message, ApiEnd):
                    done = True
                    if message.error:
                        log.info("relayed request %d cut by its holder: %s", request, message.error)
                        raise RelayCut(message.error)
                    return
        except _HolderLost as exc:
            done = True
            log.info("relayed request %d: %s", request, exc)
            raise RelayCut(str(exc)) from None
        finally:
            pending = self._pending.pop(request, None)
            if not done and pending is not None:
                with (
                    trio.CancelScope(shield=True),
                    trio.move_on_after(1.0),
                    contextlib.suppress(PeerUnreachable),
                ):
                    await self._send(pending.holder, ApiCancel(request))

    async def _next(self, request: int) -> ApiMessage:
        pending = self._pending[request]
        while True:
            with trio.move_on_after(LANE_CHECK_S):
                return await pending.receive.receive()
            if self.node.peers.lane(pending.holder) is None:
                raise _HolderLost(f"the lane to {pending.holder.hex()[:16]} is gone")

    async def _send(self, key: bytes, message: ApiMessage) -> None:
        await self.node.peers.send_bytes(key, API_STREAM, api_relay.encode(message))

    # ---- messages ----------------------------------------------------------------------
    def _on_message(self, message: ApiMessage, lane_key: bytes) -> None:
        if isinstance(message, ApiRequest):
            gone = trio.Event()
            self._serving[(lane_key, message.request)] = gone
            assert self._nursery is not None
            self._nursery.start_soon(self._serve, message, lane_key, gone)
        elif isinstance(message, ApiCancel):
            cancelled = self._serving.get((lane_key, message.request))
            if cancelled is not None:
                cancelled.set()  # the API sees the client disconnect, as from a direct client
        else:
            pending = self._pending.get(message.request)
            if pending is not None and pending.holder == lane_key:
                pending.send.send_nowait(message)

    async def _serve(self, request: ApiRequest, asker: bytes, gone: trio.Event) -> None:
        """Run a relayed request through this node's own API and stream the answer back."""
        error = ""
        try:
            await self._run_app(request, asker, gone)
            if gone.is_set():
                error = "cancelled by the asker"
        except PeerUnreachable:
            return  # the asker is gone: nothing to tell
        except Exception as exc:  # any failure reaches the asker as a cut response
            log.exception("relayed request failed")
            error = f"{type(exc).__name__}: {exc}"[:200]
        finally:
            self._serving.pop((asker, request.request), None)
        self.stats.served += 1
        with contextlib.suppress(PeerUnreachable):
            await self._send(asker, ApiEnd(request.request, error))

    async def _run_app(self, request: ApiRequest, asker: bytes, gone: trio.Event) -> None:
        assert self.app is not None, "MeshCatalog.app must be set before requests arrive"
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(request.body)).encode()),
            (RELAYED_HEADER.encode(), b"1"),
        ]
        if self.api_key:
            headers.append((b"authorization", f"Bearer {self.api_key}".encode()))
        scope: dict[str, Any] = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": request.method,
            "scheme": "http",
            "path": request.path,
            "raw_path": request.path.encode(),
            "root_path": "",
            "query_string": b"",
            "headers": headers,
            "client": ("mesh-relay", 0),
            "server": ("mesh-relay", 0),
            IN_PROCESS: True,
        }
        delivered = False
        finished = trio.Event()

        async def receive() -> dict[str, Any]:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": request.body, "more_body": False}
            async with trio.open_nursery() as either:  # the asker's cancel, or the end

                async def wait(event: trio.Event) -> None:
                    await event.wait()
                    either.cancel_scope.cancel()

                either.start_soon(wait, gone)
                either.start_soon(wait, finished)
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                pairs = [
                    (k.decode("latin-1"), v.decode("latin-1"))
                    for k, v in message.get("headers", [])
                ]
                await self._send(asker, ApiHead(request.request, message["status"], pairs))
            elif message["type"] == "http.response.body":
                data = message.get("body", b"")
                for i in range(0, len(data), MAX_BODY_CHUNK_BYTES):
                    chunk = data[i : i + MAX_BODY_CHUNK_BYTES]
                    await self._send(asker, ApiBody(request.request, chunk))
                if not message.get("more_body", False):
                    finished.set()  # the exchange is over: a disconnect now is its normal end

        try:
            await self.app(scope, receive, send)  # type: ignore[arg-type]
        finally:
            finished.set()


def model_catalog(node: MeshNode, first: NodeBackend, api_key: str | None) -> MeshCatalog:
    """The catalog of `node`: `first` (its first model's backend) and a backend per further
    model it holds."""
    from meshd.node.generation import NodeBackend

    more = [NodeBackend(node, model) for model in node.models[1:]]
    return MeshCatalog(node, [first, *more], api_key)


class _HolderLost(Exception):
    pass


def _unavailable(name: str) -> Exception:
    from meshd.api.errors import ApiError, retry_headers

    return ApiError(
        503,
        f"the mesh cannot serve `{name}` now: no node holding it answered",
        type="server_error",
        code="service_unavailable",
        headers=retry_headers(1.0),
    )
