"""NAT traversal between two hosts behind Linux NATs, each node in its own process.

The topology (tests/net/netns.py) puts an introducer on a public address and hostA, hostB
behind iptables MASQUERADE routers. With plain MASQUERADE (port-preserving, endpoint-independent
mapping in practice) the hosts punch through and talk directly; with `--random-fully` (a fresh
random port per flow: symmetric NAT) the punch cannot work and the lane goes through the
introducer's relay, still end-to-end encrypted. Needs root; skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest

from tests.net import nat_role, netns

pytestmark = pytest.mark.netns

REPO = Path(__file__).resolve().parents[2]
INTRODUCER_PORT = 7000
EVENT_TIMEOUT_S = 15.0


class Node:
    """One role's process inside a namespace, read as JSON lines."""

    def __init__(self, topo: netns.NatTopology, namespace: str, role: str) -> None:
        self.role = role
        self.stderr: IO[str] = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed in stop())
        target = f"{netns.PUBLIC_INTRODUCER}:{INTRODUCER_PORT}"
        command = [sys.executable, "-m", "tests.net.nat_role", role, target]
        self.proc = subprocess.Popen(
            topo.exec_prefix(namespace) + command,
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
        )

    def expect(self, event: str, timeout_s: float = EVENT_TIMEOUT_S) -> dict[str, Any]:
        """The next line with this event (fails with the process's stderr on timeout)."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select([self.proc.stdout], [], [], left)
            if not ready:
                break
            line = self.proc.stdout.readline()
            if not line:
                break
            fields: dict[str, Any] = json.loads(line)
            if fields.get("event") == event:
                return fields
        self.stderr.seek(0)
        pytest.fail(f"{self.role}: no {event!r} event; stderr:\n{self.stderr.read()[-3000:]}")

    def send(self, line: str) -> None:
        """Write one line to the process's stdin."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        """End the process (it holds no state worth a graceful exit)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.stderr.close()


def _topology(random_fully: bool) -> Iterator[netns.NatTopology]:
    try:
        topo = netns.build(random_fully=random_fully)
    except netns.TopologyUnavailable as exc:
        pytest.skip(f"NAT namespaces unavailable: {exc}")
    try:
        yield topo
    finally:
        topo.delete()


@pytest.fixture
def masquerade() -> Iterator[netns.NatTopology]:
    """Both NATs port-preserving MASQUERADE."""
    yield from _topology(random_fully=False)


@pytest.fixture
def symmetric() -> Iterator[netns.NatTopology]:
    """Both NATs MASQUERADE --random-fully (a new random port for every flow)."""
    yield from _topology(random_fully=True)


def _run_three(topo: netns.NatTopology) -> dict[str, dict[str, Any]]:
    """Start introducer, responder (hostB) and requester (hostA); collect their results."""
    nodes: list[Node] = []
    try:
        introducer = Node(topo, topo.pub, "introducer")
        nodes.append(introducer)
        introducer.expect("ready")
        responder = Node(topo, topo.host_b, "responder")
        nodes.append(responder)
        responder.expect("ready")
        requester = Node(topo, topo.host_a, "requester")
        nodes.append(requester)
        results = {
            "connected": requester.expect("connected"),
            "echoed": requester.expect("echoed"),
            "lane": responder.expect("lane"),
        }
        introducer.send("report")
        results["report"] = introducer.expect("report")
        return results
    finally:
        for node in reversed(nodes):
            node.stop()


def test_masquerade_nats_punch_a_direct_lane(masquerade: netns.NatTopology) -> None:
    """Behind port-preserving NATs, A and B talk directly: B sees A at natA's public address."""
    results = _run_three(masquerade)
    connected, lane, report = results["connected"], results["lane"], results["report"]
    print(f"\ndirect lane through MASQUERADE NATs opened in {connected['took_s']} s")
    assert connected["path"] == "direct"
    assert connected["addr"][0] == netns.NAT_WAN["B"]
    assert lane == {"event": "lane", "relayed": False, "addr": lane["addr"]}
    assert lane["addr"][0] == netns.NAT_WAN["A"]
    assert results["echoed"]["exact"] is True
    # Silent past the NATs' UDP mapping lifetime: the lane's keepalives held the mappings.
    assert nat_role.IDLE_S > netns.UDP_MAPPING_TIMEOUT_S
    assert results["echoed"]["after_idle_exact"] is True
    # Nothing of theirs went through the introducer.
    assert report["forwarded_datagrams"] == 0
    assert report["introductions"] == 1


def test_symmetric_nats_fall_back_to_an_encrypted_relay(symmetric: netns.NatTopology) -> None:
    """With --random-fully the punch fails; the lane runs through I, which sees only ciphertext."""
    results = _run_three(symmetric)
    connected, lane, report = results["connected"], results["lane"], results["report"]
    print(f"\nrelayed lane through symmetric NATs opened in {connected['took_s']} s")
    assert connected["path"] == "relayed"
    assert connected["addr"] == [netns.PUBLIC_INTRODUCER, INTRODUCER_PORT]
    assert lane["relayed"] is True
    assert lane["addr"] == [netns.PUBLIC_INTRODUCER, INTRODUCER_PORT]
    assert results["echoed"]["exact"] is True
    assert results["echoed"]["after_idle_exact"] is True
    # Every test message crossed the relay, yet its plaintext never appeared there, and the
    # introducer holds lanes to A and B only: no lane state (so no keys) for the A-B lane.
    assert report["forwarded_bytes"] > sum(nat_role.MESSAGE_SIZES)
    assert report["plaintext_seen"] is False
    own_lanes = sorted(nat_role.public_key(r).hex() for r in ("requester", "responder"))
    assert report["lane_peers"] == own_lanes
