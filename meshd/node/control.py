"""The control API on a Unix socket (mode 0600) for meshctl: one JSON object per line.

The request types and the blocking client live in `control_client.py` (meshctl imports only
that, so it starts fast). A client writes one request line (a tagged msgspec struct) and reads reply lines until one
holds `ok`. Most operations answer with one line; `generate` (for tests and operators) first
streams `{"tokens": [...]}` lines as tokens commit. Only the socket's owner can connect, so the
API needs no key of its own.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Iterator
from typing import Any

import msgspec
import trio

from meshd.api.backend import ServiceUnavailable
from meshd.coord.coordinator import GenerationRequest
from meshd.node.control_client import (
    ControlError,
    GenerateOp,
    KillOp,
    Op,
    PlanOp,
    RecoverOp,
    StatusOp,
)
from meshd.node.generation import NodeBackend
from meshd.node.node import MeshNode
from meshd.node.status import model_plans, node_status
from meshd.plan import NoFeasiblePlan
from meshd.speculative.config import SpecConfig, SpecConfigError
from protocol.messages import Sampling

log = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 1 << 20


_decoder = msgspec.json.Decoder(Op)


async def serve_control(
    node: MeshNode,
    backend: NodeBackend,
    path: str,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Listen on the Unix socket at `path` until cancelled."""
    with _unlinking(path):
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)  # the socket is born 0600: no window for others
        try:
            await sock.bind(path)
        finally:
            os.umask(old_umask)
        os.chmod(path, 0o600)
        sock.listen(16)
        listener = trio.SocketListener(sock)
        task_status.started()

        async def handler(stream: trio.SocketStream) -> None:
            await _serve_one(node, backend, stream)

        await trio.serve_listeners(handler, [listener])


@contextlib.contextmanager
def _unlinking(path: str) -> Iterator[None]:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # a stale socket from a previous run
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


async def _serve_one(node: MeshNode, backend: NodeBackend, stream: trio.SocketStream) -> None:
    async with stream:
        try:
            line = await _read_line(stream)
            op = _decoder.decode(line)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            await _write(stream, {"ok": False, "code": "bad_request", "error": str(exc)})
            return
        try:
            result = await _handle(node, backend, op, stream)
            await _write(stream, {"ok": True, **result})
        except ControlError as exc:
            await _write(stream, {"ok": False, "code": exc.code, "error": str(exc)})
        except ServiceUnavailable as exc:
            reply = {"ok": False, "code": "service_unavailable", "error": exc.reason}
            await _write(stream, {**reply, "retry_after_s": exc.retry_after_s})
        except trio.BrokenResourceError:
            pass


async def _read_line(stream: trio.SocketStream) -> bytes:
    data = b""
    while b"\n" not in data:
        chunk = await stream.receive_some(65536)
        if not chunk:
            break
        data += chunk
        if len(data) > MAX_REQUEST_BYTES:
            raise ValueError("request too large")
    return data.split(b"\n", 1)[0]


async def _write(stream: trio.SocketStream, obj: Any) -> None:
    await stream.send_all(msgspec.json.encode(obj) + b"\n")


async def _handle(
    node: MeshNode, backend: NodeBackend, op: Op, stream: trio.SocketStream
) -> dict[str, Any]:
    if isinstance(op, StatusOp):
        return {"status": node_status(node, backend)}
    if isinstance(op, PlanOp):
        models = model_plans(node)  # every model's, this node's first first
        return {"plan": models[0]["plan"], "error": models[0]["error"], "models": models}
    if isinstance(op, KillOp):
        target = resolve_node(node, op.node)
        await node.commands.send(target, "kill", op.drain)
        return {"node": target.hex(), "drain": op.drain}
    if isinstance(op, RecoverOp):
        targets = [resolve_node(node, op.node)] if op.node else killed_members(node)
        for target in targets:
            await node.commands.send(target, "recover", False)
        return {"nodes": [t.hex() for t in targets]}
    return await _generate(backend, op, stream)


def resolve_node(node: MeshNode, prefix: str) -> bytes:
    """The one member whose key (hex) starts with `prefix` (ControlError otherwise)."""
    prefix = prefix.lower()
    matches = [k for k in node.membership.view() if k.hex().startswith(prefix)]
    if len(matches) != 1:
        what = "no member" if not matches else f"{len(matches)} members"
        raise ControlError("unknown_node", f"{what} with an id starting {prefix!r}")
    return matches[0]


def killed_members(node: MeshNode) -> list[bytes]:
    """Members that offer no model now (stopped by the operator)."""
    out = []
    for key, info in node.membership.view().items():
        if info.healthy and info.capacity is not None and not info.capacity.models:
            out.append(key)
    if node.commands.disabled and node.node_key not in out:
        out.append(node.node_key)
    return out


async def _generate(
    backend: NodeBackend, op: GenerateOp, stream: trio.SocketStream
) -> dict[str, Any]:
    prompt = op.prompt or backend.tokenizer.encode(op.text)
    if not prompt:
        raise ControlError("bad_request", "empty prompt")
    eos = frozenset() if op.ignore_eos else frozenset(backend.tokenizer.eos_ids)
    try:
        # The node's draft model, so `draft` strategies work here as over the API.
        spec = SpecConfig(strategy=op.strategy, draft_model=backend.node.config.spec.draft_model)
    except SpecConfigError as exc:
        raise ControlError("bad_request", str(exc)) from None
    request = GenerationRequest(
        prompt=prompt,
        max_tokens=op.max_tokens,
        sampling=Sampling(temperature=op.temperature, seed=op.seed),
        spec=spec,
        eos_ids=eos,
        mtp_depth=backend.mtp_depth,
    )

    async def on_tokens(tokens: list[int]) -> None:
        await _write(stream, {"tokens": tokens})

    try:
        result = await backend.generate(request, on_tokens)
    except NoFeasiblePlan as exc:  # defensive: the backend turns these into 503s
        raise ServiceUnavailable(str(exc)) from exc
    return {"tokens": result.tokens, "finish_reason": result.finish_reason}
