"""Real `meshd serve` daemons behind Linux NATs: a 2-stage generation over punched and relayed lanes.

The topology is tests/net/netns.py's: an introducer daemon I on the public address, daemons A
and B each behind its own MASQUERADE router. A and B bind their private LAN addresses (so the
address they advertise cannot be dialed from the other side), have mDNS off, and `--join` I
only. Memory budgets force a 2-stage split over A and B (I can hold no stage), and the request
goes to A, so A coordinates over the A-B lane. The daemons' dial policy tries the advertised
address, fails, and asks I for an introduction: with plain MASQUERADE the punch gives a
direct lane; with `--random-fully` (symmetric NAT) the lane runs through I's relay. Both
generations equal single-node greedy decoding. Those two need root (skipped with the reason
otherwise); the dial-policy tests at the end run anywhere, in one process on loopback.
"""

from __future__ import annotations

import hashlib
import pathlib
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import torch
import trio
from nacl.bindings import crypto_scalarmult_base

from meshd.bench.single_node import generate as single_node_generate
from meshd.cli.supervisor import (
    DaemonError,
    ServeProcess,
    kill_all,
    settled_plan,
    stage_budget,
    started,
    wait_until,
    write_secret_file,
)
from meshd.config.tables import NatDialConfig
from meshd.mesh.member import MemberInfo
from meshd.model.builtin import builtin_model_dir
from meshd.model.checkpoint import Checkpoint
from meshd.model.stage import StageModel
from meshd.model.tokenizer import Tokenizer
from meshd.net.endpoint import open_endpoint
from meshd.net.lane_table import PeerUnreachable
from meshd.node.control_client import GenerateOp, request_lines
from meshd.node.dialing import LaneKind, LanePath, NodeLanes, pick_introducers
from protocol.config import LaneConfig
from protocol.gossip import Status
from protocol.handshake import psk_from_secret
from tests.net import netns
from tests.node.daemons import SECRET

INTRODUCER_PORT = 7000
PROMPT = "def fibonacci(n):\n"
MAX_TOKENS = 24
SETTLE_TIMEOUT_S = 40.0


def two_stage_budget() -> int:
    """A per-node memory budget where 2 nodes hold the built-in model and 1 cannot."""
    return stage_budget(str(builtin_model_dir()), 2)


def ns_daemon(
    topo: netns.NatTopology, namespace: str, tmp: pathlib.Path, name: str, *args: str
) -> ServeProcess:
    """One `meshd serve` process inside a namespace; its control socket is on the shared disk."""
    secret_file = write_secret_file(tmp / f"{name}.secret", SECRET)
    flags = ["--no-mdns-enabled", "--api-host", "127.0.0.1", "--api-port", "0", *args]
    return ServeProcess(tmp, name, secret_file, flags, prefix=topo.exec_prefix(namespace))


def settled_two_stage_plan(daemons: list[ServeProcess], stage_keys: set[str]) -> bool:
    """Every daemon agrees on a 2-stage plan over `stage_keys`, each stage loaded."""
    agreed = settled_plan(daemons)
    return agreed is not None and {s["key"] for s in agreed} == stage_keys


@pytest.fixture(scope="module")
def namespaces() -> None:
    """Skip (before loading any model) when this machine cannot build the NAT topology."""
    try:
        netns.check_available()
    except netns.TopologyUnavailable as exc:
        pytest.skip(f"NAT namespaces unavailable: {exc}")


@pytest.fixture(scope="module")
def budget() -> int:
    return two_stage_budget()


@pytest.fixture(scope="module")
def expected() -> tuple[list[int], list[int]]:
    """The prompt and single-node greedy decoding of it, in this process."""
    torch.set_num_threads(1)
    prompt = Tokenizer.open(builtin_model_dir()).encode(PROMPT)
    checkpoint = Checkpoint.open(builtin_model_dir())
    stage = StageModel.load(checkpoint, 0, checkpoint.config.num_layers, device="cpu")
    return prompt, single_node_generate([stage], prompt, MAX_TOKENS).tokens


def run_mesh(random_fully: bool, tmp: pathlib.Path, budget: int, prompt: list[int]) -> Any:
    """Start I, A, B behind the NATs, generate on A; statuses and the result after it."""
    try:
        topo = netns.build(random_fully=random_fully)
    except netns.TopologyUnavailable as exc:
        pytest.skip(f"NAT namespaces unavailable: {exc}")
    daemons: list[ServeProcess] = []
    try:
        public = f"{netns.PUBLIC_INTRODUCER}:{INTRODUCER_PORT}"
        # I can hold no stage (a 1-byte budget): it only introduces and relays.
        i_args = ["--listen-host", netns.PUBLIC_INTRODUCER, "--listen-port", str(INTRODUCER_PORT)]
        daemons.append(ns_daemon(topo, topo.pub, tmp, "I", *i_args, "--memory-budget-bytes", "1"))
        for side, ns in (("A", topo.host_a), ("B", topo.host_b)):
            lan = ["--listen-host", netns.HOST_LAN[side], "--listen-port", "0"]
            joins = ["--memory-budget-bytes", str(budget), "--join", public]
            daemons.append(ns_daemon(topo, ns, tmp, side, *lan, *joins))
        started(daemons)
        a, b = daemons[1], daemons[2]
        keys = {d.key() for d in daemons}

        def all_alive() -> bool:
            return all(d.alive_members() == keys for d in daemons)

        try:
            wait_until(all_alive, SETTLE_TIMEOUT_S, "three alive members in every view", poll_s=0.2)
            wait_until(
                lambda: settled_two_stage_plan(daemons, {a.key(), b.key()}),
                SETTLE_TIMEOUT_S,
                "a settled 2-stage plan over A and B",
                poll_s=0.2,
            )
        except DaemonError as exc:
            logs = "\n".join(f"--- {d.name}\n{d.log_tail(3000)}" for d in daemons)
            raise AssertionError(f"{exc}\n{logs}") from None
        op = GenerateOp(prompt=prompt, max_tokens=MAX_TOKENS, ignore_eos=True)
        relayed_before = daemons[0].status()["nat"]["relay_forwarded_datagrams"]
        t0 = time.monotonic()
        final = list(request_lines(a.socket, op, timeout_s=60))[-1]
        took_s = time.monotonic() - t0
        status = {d.name: d.status() for d in daemons}
        status["I"]["nat"]["relayed_before_generation"] = relayed_before
        return final, took_s, status, {d.name: d.key() for d in daemons}
    finally:
        kill_all(reversed(daemons))
        topo.delete()


@pytest.mark.netns
@pytest.mark.slow
def test_masquerade_nats_punch_a_direct_lane_for_the_pipeline(
    namespaces: None, tmp_path: pathlib.Path, budget: int, expected: tuple[list[int], list[int]]
) -> None:
    prompt, reference = expected
    final, took_s, status, keys = run_mesh(False, tmp_path, budget, prompt)
    print(f"\n2-stage generation over a punched lane: {MAX_TOKENS} tokens in {took_s:.2f} s")
    assert final["ok"], final
    assert final["tokens"] == reference
    a_to_b = next(m for m in status["A"]["members"] if m["key"] == keys["B"])
    b_to_a = next(m for m in status["B"]["members"] if m["key"] == keys["A"])
    assert a_to_b["lane_up"] and b_to_a["lane_up"]
    # Direct: each side's datagrams go to the other's NAT, never to the introducer.
    assert a_to_b["lane_path"] in ("direct", "punched")
    assert b_to_a["lane_path"] in ("direct", "punched")
    assert a_to_b["lane_remote"].split(":")[0] == netns.NAT_WAN["B"]
    assert b_to_a["lane_remote"].split(":")[0] == netns.NAT_WAN["A"]
    # The side that dialed knows its lane was punched, and who introduced it.
    punched = [m for m in (a_to_b, b_to_a) if m["lane_path"] == "punched"]
    assert punched and all(m["lane_via"] == keys["I"] for m in punched)
    assert status["I"]["nat"]["introductions_made"] >= 1
    # Nothing passes through the introducer's relay during the generation (a relayed pipeline
    # would show at least 2 * MAX_TOKENS datagrams: each plain-decoding window crosses the A-B
    # hop twice). Full-suite runs once saw exactly 5: A and B had both asked I for an
    # introduction, the first punch gave the lane, and the other side probed on unanswered
    # and then sent its 5 handshake initiations through the relay; it now takes the lane
    # that arrived (test_two_nodes_traversing_to_each_other_at_once_relay_nothing).
    nat = status["I"]["nat"]
    assert nat["relay_forwarded_datagrams"] == nat["relayed_before_generation"], nat


@pytest.mark.netns
@pytest.mark.slow
def test_symmetric_nats_relay_the_pipeline_through_the_introducer(
    namespaces: None, tmp_path: pathlib.Path, budget: int, expected: tuple[list[int], list[int]]
) -> None:
    prompt, reference = expected
    final, took_s, status, keys = run_mesh(True, tmp_path, budget, prompt)
    print(f"\n2-stage generation over a relayed lane: {MAX_TOKENS} tokens in {took_s:.2f} s")
    assert final["ok"], final
    assert final["tokens"] == reference
    public = f"{netns.PUBLIC_INTRODUCER}:{INTRODUCER_PORT}"
    for here, there in (("A", "B"), ("B", "A")):
        row = next(m for m in status[here]["members"] if m["key"] == keys[there])
        assert row["lane_up"], row
        assert row["lane_path"] == "relayed", row
        assert row["lane_via"] == keys["I"], row
        assert row["lane_remote"] == public, row
    nat = status["I"]["nat"]
    assert nat["relay_sessions_opened"] >= 1
    assert nat["relay_forwarded_bytes"] > 0


# ---- the dial policy in one process on loopback (no root needed) --------------------------

PSK = psk_from_secret("dial policy test mesh")
FAST_LANES = LaneConfig(handshake_timeout_s=1.0)
TEST_STREAM = 5


def _member(node_id: bytes, rtt_s: dict[bytes, float], status: Status = Status.ALIVE) -> MemberInfo:
    return MemberInfo(node_id, status, 1, "", None, rtt_s, True, 0.0)


def test_introducers_are_members_with_direct_lanes_listing_the_target_first() -> None:
    own, target = b"o" * 32, b"t" * 32
    near, far, silent, no_lane, sick = (bytes([c]) * 32 for c in b"nfslk")
    view = {
        own: _member(own, {target: 0.001}),
        target: _member(target, {}),
        far: _member(far, {target: 0.020}),
        near: _member(near, {target: 0.002}),
        silent: _member(silent, {}),
        no_lane: _member(no_lane, {target: 0.001}),
        sick: _member(sick, {target: 0.001}, Status.SUSPECT),
    }
    picked = pick_introducers(view, target, own=own, direct_lane=lambda key: key != no_lane)
    assert picked == [near, far, silent]


@asynccontextmanager
async def _node(role: str, **nat: Any) -> AsyncIterator[NodeLanes]:
    """A NodeLanes on its own loopback endpoint, with a key derived from `role`."""
    private = hashlib.blake2s(role.encode(), key=b"meshd dial test").digest()
    async with (
        open_endpoint(static_private=private, psk=PSK, lane_config=FAST_LANES) as endpoint,
        trio.open_nursery() as nursery,
    ):
        public = crypto_scalarmult_base(private)
        peers = NodeLanes(endpoint, public, lambda m, k: None, streams={}, nat=NatDialConfig(**nat))
        await nursery.start(peers.run)
        yield peers
        nursery.cancel_scope.cancel()


def _drain(sock: socket.socket) -> int:
    """How many datagrams wait on `sock` (read and dropped)."""
    sock.setblocking(False)
    count = 0
    while True:
        try:
            sock.recv(65536)
        except BlockingIOError:
            return count
        count += 1


async def test_a_failed_direct_dial_goes_through_a_member_and_is_remembered() -> None:
    async with _node("introducer") as intro, _node("a", yield_s=0.0) as a, _node("b") as b:
        for side in (a, b):
            side.addresses[intro.own_key] = intro.endpoint.local_address
            await side.lane_to(intro.own_key)
        # B's advertised address answers nothing: the direct dial times out.
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as black_hole:
            black_hole.bind(("127.0.0.1", 0))
            a.addresses[b.own_key] = black_hole.getsockname()
            a.introducers = lambda target: [intro.own_key]

            start = trio.current_time()
            lane = await a.lane_to(b.own_key)
            first_s = trio.current_time() - start
            path = a.path_of(b.own_key)
            assert path is not None and path.kind is LaneKind.PUNCHED
            assert path.via == intro.own_key
            assert first_s >= FAST_LANES.handshake_timeout_s  # it tried direct first
            assert _drain(black_hole) >= 1  # its initiation went to B's advertised address
            got = trio.Event()
            b.streams[TEST_STREAM] = (bytes, lambda data, key: got.set())
            await a.send_bytes(b.own_key, TEST_STREAM, b"x")
            with trio.fail_after(2):
                await got.wait()  # the lane carries messages
            # B only accepted a lane: to it, the punched lane is an ordinary direct one.
            assert b.path_of(a.own_key) == LanePath(LaneKind.DIRECT, None, 0.0)

            # Lost and needed again: straight to the introducer, no direct timeout this time.
            far_end = b.lane(a.own_key)
            lane.close("test")
            with trio.fail_after(5):
                await lane.terminated()
                if far_end is not None:
                    await far_end.terminated()
            _drain(black_hole)
            await a.lane_to(b.own_key)
            assert _drain(black_hole) == 0  # no initiation to the dead address this time
            assert a.nat.stats.punches_direct == 2


async def test_without_an_introducer_the_dial_fails_with_both_reasons() -> None:
    async with _node("a") as a, _node("b") as b:
        with pytest.raises(PeerUnreachable, match=r"no address known.*no member to introduce"):
            await a.lane_to(b.own_key)


async def test_two_nodes_traversing_to_each_other_at_once_relay_nothing() -> None:
    # Each side's advertised address is a black hole, and each dials the other: the larger
    # key first (it yields to nobody here), the smaller a moment later, so both ask the
    # introducer. The first punch gives the one lane; the other side must take it and stop,
    # not probe on unanswered and then handshake through the relay (a datagram the
    # introducer forwards for nothing, five with the default handshake timeout).
    async with (
        _node("introducer") as intro,
        _node("a", yield_s=0.0) as a,
        _node("b", yield_s=0.0) as b,
    ):
        larger, smaller = (a, b) if a.own_key > b.own_key else (b, a)
        for side in (a, b):
            side.addresses[intro.own_key] = intro.endpoint.local_address
            await side.lane_to(intro.own_key)
            side.introducers = lambda target: [intro.own_key]
        holes = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(2)]
        with holes[0], holes[1]:
            for hole, (side, other) in zip(holes, ((a, b), (b, a)), strict=True):
                hole.bind(("127.0.0.1", 0))
                side.addresses[other.own_key] = hole.getsockname()
            async with trio.open_nursery() as dials:
                dials.start_soon(larger.lane_to, smaller.own_key)
                await trio.sleep(0.15)
                dials.start_soon(smaller.lane_to, larger.own_key)
        lane_a, lane_b = a.lane(b.own_key), b.lane(a.own_key)
        assert lane_a is not None and lane_b is not None
        assert lane_a.lane.local_lane_id == lane_b.lane.remote_lane_id  # one lane
        assert intro.nat.stats.introductions_made == 2  # both asked
        assert intro.nat.relay.stats.forwarded_datagrams == 0
