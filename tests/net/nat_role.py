"""One node of the NAT tests, run inside a network namespace as its own process.

Usage: python -m tests.net.nat_role ROLE INTRODUCER_HOST:PORT, ROLE one of introducer, responder,
requester. Keys derive from the role names, so each process knows the others' keys without an
exchange. Prints one JSON object per line: `{"event": "ready"}` once serving, then results.

- introducer: binds INTRODUCER_HOST:PORT and serves introductions and relaying. On a line
  `report` on stdin it prints its relay counters, the node keys of its own lanes, and whether
  any plaintext the others exchanged ever appeared in a datagram it forwarded.
- responder: opens a lane to the introducer, then echoes every message on the test stream
  (`echo:` + data) and reports the address the requester's lane arrives from.
- requester: opens a lane to the introducer, calls `connect_via` to the responder, reports
  the path, then sends messages of several sizes, checks the echoes byte for byte, stays
  quiet for IDLE_S (past the NAT mapping lifetime) and exchanges once more, and stays up
  until stdin closes.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
from collections.abc import Hashable
from typing import Any

import trio
from nacl.bindings import crypto_scalarmult_base

from meshd.net.endpoint import Address, open_endpoint
from meshd.net.lane_table import LaneTable
from meshd.net.punch import NatTraversal
from protocol import punch
from protocol.datagram import KIND_RELAY
from protocol.handshake import psk_from_secret

PSK = psk_from_secret("nat traversal test mesh")
TEST_STREAM = 5
# The plaintext marker every test message starts with: the relay must never see it.
MARKER = b"PLAINTEXT-MARKER-7f3a"
MESSAGE_SIZES = (10, 1000, 5000, 200_000)
# Silence on the test stream before a last exchange: longer than the routers' UDP mapping
# lifetime (tests/net/netns.py), so only the lanes' keepalives can hold the mappings.
IDLE_S = 3.5


def private_key(role: str) -> bytes:
    """The X25519 static key of a role (deterministic, test-only)."""
    return hashlib.blake2s(role.encode(), key=b"meshd nat test").digest()


def public_key(role: str) -> bytes:
    """The X25519 public key of a role."""
    return crypto_scalarmult_base(private_key(role))


def say(**fields: Any) -> None:
    """Print one JSON line for the test."""
    print(json.dumps(fields), flush=True)


def messages() -> list[bytes]:
    """The test messages (seeded, so the echo check is exact)."""
    rng = random.Random(7)
    return [MARKER + rng.randbytes(size) for size in MESSAGE_SIZES]


async def stdin_lines() -> trio.abc.ReceiveStream:
    """Standard input as a trio stream."""
    return trio.lowlevel.FdStream(os.dup(0))


async def run(role: str, introducer: Address) -> None:
    """Play `role` until stdin closes (or, for the requester, until done)."""
    bind = introducer if role == "introducer" else ("0.0.0.0", 0)
    received: trio.MemorySendChannel[tuple[bytes, bytes]]
    received, inbox = trio.open_memory_channel[tuple[bytes, bytes]](64)
    async with (
        open_endpoint(static_private=private_key(role), psk=PSK, bind=bind) as endpoint,
        trio.open_nursery() as nursery,
    ):
        streams = {TEST_STREAM: (bytes, lambda data, key: received.send_nowait((data, key)))}
        peers = LaneTable(endpoint, public_key(role), lambda m, k: None, streams=streams)
        nat = NatTraversal(peers)
        await nursery.start(peers.run)
        await nursery.start(nat.run)
        if role == "introducer":
            forwarded = watch_relay(endpoint)
            say(event="ready")
            await report_on_request(nat, peers, forwarded)
        else:
            peers.addresses[public_key("introducer")] = introducer
            await peers.lane_to(public_key("introducer"))
            say(event="ready")
            if role == "responder":
                await respond(peers, inbox)
            else:
                await request(nat, peers, inbox)
                await until_stdin_closes()  # keep the lanes up for the introducer's report
        nursery.cancel_scope.cancel()


async def until_stdin_closes() -> None:
    """Return once standard input reaches its end."""
    stream = await stdin_lines()
    while await stream.receive_some():
        pass


def watch_relay(endpoint: Any) -> list[bytes]:
    """Keep a copy of every RELAY datagram the introducer is handed (observation only)."""
    seen: list[bytes] = []
    forward = endpoint.datagram_handlers[KIND_RELAY]

    def observe(data: bytes, addr: Address, now: float) -> str | None:
        seen.append(data)
        return forward(data, addr, now)

    endpoint.datagram_handlers[KIND_RELAY] = observe
    return seen


async def report_on_request(nat: NatTraversal, peers: LaneTable, forwarded: list[bytes]) -> None:
    """Answer `report` lines on stdin until it closes."""
    stream = await stdin_lines()
    buffer = b""
    while chunk := await stream.receive_some():
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            if line.strip() == b"report":
                stats = nat.relay.stats
                say(
                    event="report",
                    relay_sessions=stats.sessions_opened,
                    forwarded_datagrams=stats.forwarded_datagrams,
                    forwarded_bytes=stats.forwarded_bytes,
                    seen_relay_datagrams=len(forwarded),
                    plaintext_seen=any(MARKER in d for d in forwarded),
                    lane_peers=sorted(key.hex() for key in peers.connected),
                    introductions=nat.stats.introductions_made,
                )


def where(addr: Hashable) -> list[object]:
    """Host and port a lane's datagrams come from: the peer's, or the relay's."""
    if isinstance(addr, punch.RelayPath):
        return list(addr.via)
    assert isinstance(addr, tuple)
    return list(addr[:2])


async def respond(peers: LaneTable, inbox: trio.MemoryReceiveChannel[tuple[bytes, bytes]]) -> None:
    """Echo test messages; report where the requester's lane comes from."""
    requester = public_key("requester")
    reported = False
    async for data, key in inbox:
        lane = peers.lane(key)
        if not reported and key == requester and lane is not None:
            relayed = isinstance(lane.addr, punch.RelayPath)
            say(event="lane", relayed=relayed, addr=where(lane.addr))
            reported = True
        await peers.send_bytes(key, TEST_STREAM, b"echo:" + data)


async def request(
    nat: NatTraversal, peers: LaneTable, inbox: trio.MemoryReceiveChannel[tuple[bytes, bytes]]
) -> None:
    """Connect through the introducer, exchange messages, report."""
    result = await nat.connect_via(public_key("introducer"), public_key("responder"))
    took_s = round(result.took_s, 3)
    say(event="connected", path=result.path.value, took_s=took_s, addr=where(result.lane.addr))
    exact = await exchange(peers, inbox, messages())
    await trio.sleep(IDLE_S)
    after_idle = await exchange(peers, inbox, [MARKER + b"after idle"])
    say(
        event="echoed",
        exact=exact,
        after_idle_exact=after_idle,
        count=len(MESSAGE_SIZES),
        stats=vars(nat.stats),
    )


async def exchange(
    peers: LaneTable,
    inbox: trio.MemoryReceiveChannel[tuple[bytes, bytes]],
    batch: list[bytes],
) -> bool:
    """Send each message to the responder; True if every echo came back byte for byte."""
    responder = public_key("responder")
    exact = True
    with trio.fail_after(10):
        for message in batch:
            await peers.send_bytes(responder, TEST_STREAM, message)
            data, key = await inbox.receive()
            exact = exact and key == responder and data == b"echo:" + message
    return exact


def main() -> None:
    """Parse the command line and run the role."""
    role = sys.argv[1]
    host, port = sys.argv[2].rsplit(":", 1)
    trio.run(run, role, (host, int(port)))


if __name__ == "__main__":
    main()
