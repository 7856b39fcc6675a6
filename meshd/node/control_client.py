"""The control API's requests and a blocking client (meshctl, tests); light to import.

The server is `meshd.node.control`. One request line (a tagged msgspec struct as JSON) goes
out; reply lines come back until one holds `ok`.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import msgspec


class StatusOp(msgspec.Struct, frozen=True, tag="status"):
    """The node's view: members, lanes, plan, stage, sessions, recent events."""


class PlanOp(msgspec.Struct, frozen=True, tag="plan"):
    """The current plan, explained."""


class KillOp(msgspec.Struct, frozen=True, tag="kill"):
    """Stop NODE's stage (node id prefix) at once, or after its sessions (`drain`)."""

    node: str
    drain: bool = False


class RecoverOp(msgspec.Struct, frozen=True, tag="recover"):
    """Let NODE host again (empty: every killed member) and re-plan."""

    node: str = ""


class GenerateOp(msgspec.Struct, frozen=True, tag="generate"):
    """Generate from token ids (or text) through this node's NodeBackend."""

    prompt: list[int] = []
    text: str = ""
    max_tokens: int = 32
    temperature: float = 0.0
    seed: int = 0
    strategy: str = "auto"
    ignore_eos: bool = False


Op = StatusOp | PlanOp | KillOp | RecoverOp | GenerateOp


class ControlError(Exception):
    """The daemon refused or failed an operation (`code` is machine-readable)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def request_lines(path: str, op: Op, *, timeout_s: float = 30.0) -> Iterator[dict[str, Any]]:
    """Send one op to the daemon at `path`; yield every reply line (the last holds `ok`)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        sock.connect(path)
        sock.sendall(msgspec.json.encode(op) + b"\n")
        buffer = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                raise ControlError("closed", "the daemon closed the connection without an answer")
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                reply: dict[str, Any] = msgspec.json.decode(line)
                yield reply
                if "ok" in reply:
                    return


def call(path: str, op: Op, *, timeout_s: float = 30.0) -> dict[str, Any]:
    """One op, its final reply; raises ControlError when the daemon says no."""
    replies = list(request_lines(path, op, timeout_s=timeout_s))
    reply = replies[-1]
    if not reply.get("ok"):
        raise ControlError(str(reply.get("code", "error")), str(reply.get("error", "")))
    return reply
