"""The daemon's small parts: refusing to start without a secret, systemd notify, lanes
carrying gossip and pipeline messages side by side, callers dialing one dead peer at once
sharing one failed attempt, gossip that arrives while the node stops dropped, not raised."""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import sys

import trio
import trio.testing

from meshd.mesh.identity import NodeIdentity
from meshd.mesh.membership import Membership
from meshd.net.endpoint import open_endpoint
from meshd.net.lane_table import LaneTable, PeerUnreachable
from meshd.node.gossip_driver import GossipDriver, KeyBook
from meshd.node.notify import Notifier
from protocol import gossip
from protocol.config import LaneConfig
from protocol.messages import Message, NodeHello
from protocol.streams import GOSSIP_STREAM
from tests.node.daemons import REPO


def test_serve_refuses_to_start_without_a_mesh_secret(tmp_path: pathlib.Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-m", "meshd.cli.main", "serve", "--state-dir", str(tmp_path / "s")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert "no mesh secret" in result.stderr and "mesh_secret_file" in result.stderr


def test_notify_sends_ready_status_and_watchdog_to_the_socket(tmp_path: pathlib.Path) -> None:
    path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as server:
        server.bind(path)
        server.settimeout(5)
        notifier = Notifier({"NOTIFY_SOCKET": path})
        notifier.send(READY="1", STATUS="serving")
        notifier.send(WATCHDOG="1")
        assert server.recv(4096) == b"READY=1\nSTATUS=serving"
        assert server.recv(4096) == b"WATCHDOG=1"
    assert notifier.watchdog_interval_s({"WATCHDOG_USEC": "2000000"}) == 1.0
    silent = Notifier({})
    silent.send(READY="1")
    assert not silent.enabled and silent.sent == 0


async def test_one_lane_carries_gossip_and_pipeline_messages_by_stream() -> None:
    a, b = NodeIdentity.generate(), NodeIdentity.generate()
    psk = b"k" * 32
    got_gossip: list[tuple[gossip.GossipMessage, bytes]] = []
    got_pipeline: list[tuple[Message, bytes]] = []
    done = trio.Event()

    def on_gossip(message: gossip.GossipMessage, sender: bytes) -> None:
        got_gossip.append((message, sender))
        if got_pipeline:
            done.set()

    def on_pipeline(message: Message, sender: bytes) -> None:
        got_pipeline.append((message, sender))
        if got_gossip:
            done.set()

    async with (
        open_endpoint(static_private=a.x25519_private, psk=psk) as ea,
        open_endpoint(static_private=b.x25519_private, psk=psk) as eb,
        trio.open_nursery() as nursery,
    ):
        pa = LaneTable(ea, a.x25519_public, lambda m, k: None)
        pb = LaneTable(
            eb, b.x25519_public, on_pipeline, streams={GOSSIP_STREAM: (gossip.decode, on_gossip)}
        )
        await nursery.start(pa.run)
        await nursery.start(pb.run)
        pa.addresses[b.x25519_public] = eb.local_address
        await pa.send_gossip(b.x25519_public, gossip.Want(node_ids=[a.public_key]))
        await pa.send(b.x25519_public, NodeHello(a.public_key))
        with trio.fail_after(5):
            await done.wait()
        nursery.cancel_scope.cancel()
    assert got_gossip == [(gossip.Want(node_ids=[a.public_key]), a.x25519_public)]
    assert got_pipeline == [(NodeHello(a.public_key), a.x25519_public)]


async def test_two_nodes_dialing_each_other_at_once_keep_the_same_lane() -> None:
    a, b = NodeIdentity.generate(), NodeIdentity.generate()
    psk = b"k" * 32
    async with (
        open_endpoint(static_private=a.x25519_private, psk=psk) as ea,
        open_endpoint(static_private=b.x25519_private, psk=psk) as eb,
        trio.open_nursery() as nursery,
    ):
        pa = LaneTable(ea, a.x25519_public, lambda m, k: None)
        pb = LaneTable(eb, b.x25519_public, lambda m, k: None)
        await nursery.start(pa.run)
        await nursery.start(pb.run)
        pa.addresses[b.x25519_public] = eb.local_address
        pb.addresses[a.x25519_public] = ea.local_address
        async with trio.open_nursery() as both:
            both.start_soon(pa.lane_to, b.x25519_public)
            both.start_soon(pb.lane_to, a.x25519_public)

        def one_lane() -> bool:
            """Each side holds a lane to the other and it is the same lane from both ends:
            one side's local id is the other's remote id."""
            lane_a, lane_b = pa.lane(b.x25519_public), pb.lane(a.x25519_public)
            return (
                lane_a is not None
                and lane_b is not None
                and lane_a.lane.local_lane_id == lane_b.lane.remote_lane_id
                and lane_a.lane.remote_lane_id == lane_b.lane.local_lane_id
            )

        with trio.fail_after(5):
            while not one_lane():  # noqa: ASYNC110 (lane tables have no change event)
                await trio.sleep(0.01)
        # Settled: the crossing handshakes leave no second lane that replaces it later.
        settled = pa.lane(b.x25519_public)
        with trio.fail_after(5):
            await trio.testing.wait_all_tasks_blocked(cushion=0.05)
        assert pa.lane(b.x25519_public) is settled and one_lane()
        nursery.cancel_scope.cancel()


async def test_callers_dialing_a_dead_peer_at_once_share_one_failed_attempt() -> None:
    # Gossip queues a message per round for a member that just died: each message's task
    # waits for the lane. They must fail together when the one dial fails, not each start a
    # dial of its own after it (N handshake timeouts in a row, N tasks held that long).
    a, dead = NodeIdentity.generate(), NodeIdentity.generate()
    config = LaneConfig(handshake_timeout_s=1.0)
    failed: list[float] = []
    async with (
        open_endpoint(static_private=a.x25519_private, psk=b"k" * 32, lane_config=config) as ea,
        trio.open_nursery() as nursery,
    ):
        table = LaneTable(ea, a.x25519_public, lambda m, k: None)
        await nursery.start(table.run)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as black_hole:
            black_hole.bind(("127.0.0.1", 0))  # answers nothing, as a killed node's port
            table.addresses[dead.x25519_public] = black_hole.getsockname()
            start = trio.current_time()

            async def send() -> None:
                try:
                    await table.send_gossip(dead.x25519_public, gossip.Want(node_ids=[]))
                except PeerUnreachable:
                    failed.append(trio.current_time() - start)

            async with trio.open_nursery() as senders:
                for _ in range(4):
                    senders.start_soon(send)
        nursery.cancel_scope.cancel()
    assert len(failed) == 4
    # One handshake timeout for all four (each in turn would take four).
    assert max(failed) < 2 * config.handshake_timeout_s, failed


async def test_gossip_a_lane_reader_delivers_while_the_node_stops_is_dropped() -> None:
    # At shutdown the gossip driver's nursery closes to new tasks when its last child ends,
    # and a lane reader (still running) can deliver a Ping before the driver's task resumes:
    # the Ack it triggers must be dropped, not spawned on the closed nursery (a RuntimeError
    # in the reader that made a SIGTERMed daemon exit with status 1).
    a, b = NodeIdentity.generate(), NodeIdentity.generate()
    keys = KeyBook()
    lane_key = keys.x_of(b.public_key)
    ping = gossip.Ping(seq=1, updates=[])
    async with open_endpoint(static_private=a.x25519_private, psk=b"k" * 32) as endpoint:
        peers = LaneTable(endpoint, a.x25519_public, lambda m, k: None)
        for _ in range(20):  # the reader lands in that gap in about half the stops
            membership = Membership(
                a.public_key, address="127.0.0.1:1", sign=a.sign, verify=NodeIdentity.verify,
                now=trio.current_time(),
            )  # fmt: skip
            driver = GossipDriver(membership, peers, keys, lambda e: None, rtt_report_interval_s=1)
            stopped = trio.Event()
            scope = trio.CancelScope()

            async def run_driver(
                driver: GossipDriver, scope: trio.CancelScope, done: trio.Event
            ) -> None:
                with scope:
                    await driver.run()
                done.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(run_driver, driver, scope, stopped)
                await trio.testing.wait_all_tasks_blocked()
                scope.cancel()
                while not stopped.is_set():  # a reader delivering at every scheduling step
                    driver.on_gossip(ping, lane_key)
                    await trio.lowlevel.checkpoint()


async def test_sigterm_stops_gracefully_and_a_second_one_stops_at_once() -> None:
    from meshd.cli.serve import _stop_on_sigterm

    async def run(graceful_blocks: bool) -> list[str]:
        steps: list[str] = []
        began = trio.Event()

        async def graceful() -> None:
            steps.append("graceful")
            began.set()
            if graceful_blocks:
                await trio.sleep_forever()  # a stop that would take its whole grace
            steps.append("drained")

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                await nursery.start(_stop_on_sigterm, nursery.cancel_scope, Notifier({}), graceful)
                os.kill(os.getpid(), signal.SIGTERM)
                await began.wait()
                if graceful_blocks:
                    os.kill(os.getpid(), signal.SIGTERM)  # the operator insists
                await trio.sleep_forever()  # the daemon's work, until the stop cancels it
        return steps

    assert await run(graceful_blocks=False) == ["graceful", "drained"]
    assert await run(graceful_blocks=True) == ["graceful"]
