"""mDNS discovery over python-zeroconf, inside a network namespace each test creates.

Every network test runs its zeroconf sockets in a fresh namespace whose only interface is its
own `lo` (brought up with MULTICAST on), so no mDNS can reach the host's interfaces. Each node
binds a different loopback address (127.0.0.1, .2, ...), as daemons sharing a host would.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import replace
from functools import partial
from typing import Any

import pytest
import trio
import zeroconf
from hypothesis import given
from hypothesis import strategies as st

from meshd.mesh.discovery import (
    SERVICE_TYPE,
    DiscoveredPeer,
    Discovery,
    DiscoveryConfig,
    MalformedAdvertisement,
    PeerChange,
    call_in_netns,
    encode_txt,
    instance_name,
    mesh_hash_for,
    open_discovery,
    parse_advertisement,
    resolve_interfaces,
)
from protocol import PROTOCOL_VERSION
from protocol.handshake import psk_from_secret

MESH_A = mesh_hash_for(psk_from_secret("discovery test mesh A"))
MESH_B = mesh_hash_for(psk_from_secret("discovery test mesh B"))
DISCOVERY_BOUND_S = 2.0
# Several daemons sharing one address: see test_late_joiner_finds_and_is_found.
SHARED_ADDRESS_BOUND_S = 4.0
REMOVAL_BOUND_S = 1.0

_netns_ids = itertools.count()


@pytest.fixture
def netns() -> Iterator[str]:
    """A fresh network namespace with only `lo` (up, multicast on); deleted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("needs root: mDNS tests run in their own network namespace (ip netns add)")
    if shutil.which("ip") is None:
        pytest.skip("needs iproute2 (`ip`) to create a network namespace")
    name = f"meshd-mdns-{os.getpid()}-{next(_netns_ids)}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot create a network namespace: {made.stderr.strip()}")
    try:
        lo_up = ["ip", "-n", name, "link", "set", "lo", "up", "multicast", "on"]
        subprocess.run(lo_up, check=True, capture_output=True, timeout=10)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def node_id(i: int) -> str:
    return hashlib.blake2s(f"node {i}".encode(), digest_size=8).hexdigest()


def fingerprint(i: int) -> str:
    return hashlib.blake2s(f"key {i}".encode()).hexdigest()


def node(i: int, netns: str, *, mesh: str = MESH_A, **overrides: Any) -> dict[str, Any]:
    """open_discovery arguments for test node i, bound to 127.0.0.i in the namespace."""
    kwargs: dict[str, Any] = dict(
        node_id=node_id(i),
        key_fingerprint=fingerprint(i),
        mesh_hash=mesh,
        port=7400 + i,
        interfaces=[f"127.0.0.{i}"],
        netns=netns,
    )
    kwargs.update(overrides)
    return kwargs


async def next_event(
    disc: Discovery, match: Callable[[DiscoveredPeer], bool], log: list[DiscoveredPeer]
) -> DiscoveredPeer:
    """The next event satisfying `match`; every event read is appended to `log`."""
    async for peer in disc.peers():
        log.append(peer)
        if match(peer):
            return peer
    raise AssertionError("discovery ended")


def drain(disc: Discovery, log: list[DiscoveredPeer]) -> None:
    """Append the events already delivered but not yet read."""
    while True:
        try:
            log.append(disc.peers().receive_nowait())
        except trio.WouldBlock:
            return


def announced(disc: Discovery) -> bool:
    """Whether `disc` sent the last of its three announcements (zeroconf's registration
    future, which the discovery holds, is done)."""
    future = disc._announcing
    return isinstance(future, asyncio.Future) and future.done()


async def wait_for(condition: Callable[[], bool]) -> None:
    """Poll a counter until it holds; callers bound this with fail_after."""
    while not condition():  # noqa: ASYNC110 - counters have no event to wait on
        await trio.sleep(0.02)


# --- the TXT schema (pure) ---------------------------------------------------------------


def test_txt_round_trips_and_rejects_inconsistent_records() -> None:
    txt = encode_txt(
        node_id=node_id(1), key_fingerprint=fingerprint(1), mesh_hash=MESH_A, port=7401, version=3
    )
    props = {k.encode(): v.encode() for k, v in txt.items()}
    peer = parse_advertisement(instance_name(node_id(1)), props, 7401, ["10.0.0.1"])
    assert peer == DiscoveredPeer(node_id(1), fingerprint(1), ("10.0.0.1",), 7401, MESH_A, 3)
    with pytest.raises(MalformedAdvertisement, match="SRV port"):
        parse_advertisement(instance_name(node_id(1)), props, 9999, ["10.0.0.1"])
    with pytest.raises(MalformedAdvertisement, match="does not match node id"):
        parse_advertisement(instance_name(node_id(2)), props, 7401, ["10.0.0.1"])
    with pytest.raises(MalformedAdvertisement, match="no address"):
        parse_advertisement(instance_name(node_id(1)), props, 7401, [])


def test_mesh_hash_separates_meshes_and_does_not_carry_the_psk() -> None:
    psk = psk_from_secret("discovery test mesh A")
    assert MESH_A == mesh_hash_for(psk) != MESH_B
    assert psk.hex()[:16] not in MESH_A


@pytest.mark.parametrize(
    "field,value",
    [("node_id", "has.dot"), ("node_id", ""), ("key_fingerprint", "XYZ"), ("port", 0)],
)
async def test_invalid_own_fields_raise_before_touching_the_network(
    field: str, value: object
) -> None:
    kwargs = node(1, "no-such-namespace-is-ever-entered")
    kwargs[field] = value
    with pytest.raises(ValueError, match="cannot advertise"):
        async with open_discovery(**kwargs):
            raise AssertionError("must not open")


def test_config_rejects_out_of_range_tuning() -> None:
    with pytest.raises(ValueError, match="resolve_workers"):
        DiscoveryConfig(resolve_workers=0)
    with pytest.raises(ValueError, match="resolve_timeout_s"):
        DiscoveryConfig(resolve_timeout_s=0.0)


_keys = st.sampled_from([b"v", b"id", b"fp", b"mh", b"port"]) | st.binary(max_size=6)
_values = st.none() | st.binary(max_size=70) | st.text("0123456789abcdefXZ-+_ .", max_size=70)


@given(
    props=st.dictionaries(_keys, _values.map(lambda v: v.encode() if isinstance(v, str) else v)),
    srv_port=st.none() | st.integers(-1, 70000),
)
def test_garbage_txt_raises_only_malformed_advertisement(
    props: dict[bytes, bytes | None], srv_port: int | None
) -> None:
    with contextlib.suppress(MalformedAdvertisement):
        parse_advertisement("x._meshd._udp.local.", props, srv_port, ["10.0.0.1"])


# --- over mDNS in a namespace ------------------------------------------------------------


async def test_three_nodes_find_each_other_within_2s(netns: str) -> None:
    nodes = [node(i, netns) for i in (1, 2, 3)]
    found_after_s: dict[str, float] = {}
    everyone_found = trio.Event()
    first_events: dict[str, dict[str, DiscoveredPeer]] = {}
    start = trio.current_time()

    async def run(kwargs: dict[str, Any]) -> None:
        me = kwargs["node_id"]
        others = {n["node_id"] for n in nodes} - {me}
        seen: dict[str, DiscoveredPeer] = {}
        async with open_discovery(**kwargs) as disc:
            async for peer in disc.peers():
                assert peer.node_id != me, "a node must not discover itself"
                seen.setdefault(peer.node_id, peer)
                if set(seen) >= others:
                    break
            found_after_s[me] = trio.current_time() - start
            first_events[me] = seen
            if len(found_after_s) == len(nodes):
                everyone_found.set()
            await everyone_found.wait()  # keep advertising until the others are done

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            for kwargs in nodes:
                nursery.start_soon(run, kwargs)
    slowest = max(found_after_s.values())
    times = ", ".join(f"{t:.3f}" for t in sorted(found_after_s.values()))
    print(f"\nthree nodes found each other after {times} s")
    assert slowest < DISCOVERY_BOUND_S
    by_id = {n["node_id"]: n for n in nodes}
    for seen in first_events.values():
        for peer_id, peer in seen.items():
            expected = by_id[peer_id]
            assert peer.change is PeerChange.ADDED
            assert peer.addresses == tuple(expected["interfaces"])
            assert peer.port == expected["port"]
            assert peer.key_fingerprint == expected["key_fingerprint"]
            assert (peer.mesh_hash, peer.version) == (MESH_A, PROTOCOL_VERSION)


@pytest.mark.parametrize(
    "shared_address,bound_s",
    [(False, DISCOVERY_BOUND_S), (True, SHARED_ADDRESS_BOUND_S)],
    ids=["own-address", "shared-127.0.0.1"],
)
async def test_late_joiner_finds_and_is_found(
    netns: str, shared_address: bool, bound_s: float
) -> None:
    """A node started after the others stopped announcing is found through queries.

    With its own address the startup (QU) query is answered by unicast at once. When every
    node shares 127.0.0.1, those unicast replies all land on one socket bound to
    127.0.0.1:5353 (the kernel picks one per source/destination pair), often a sibling's, and
    the joiner learns the others from its next (multicast) query about 1 s after starting;
    that answer may itself wait a second when the record was multicast just before.
    """
    address = (lambda i: ["127.0.0.1"]) if shared_address else (lambda i: [f"127.0.0.{i}"])
    log: list[DiscoveredPeer] = []
    with trio.fail_after(10):
        async with (
            open_discovery(**node(1, netns, interfaces=address(1))) as a,
            open_discovery(**node(2, netns, interfaces=address(2))) as b,
        ):
            await next_event(a, lambda p: p.node_id == node_id(2), log)
            await next_event(b, lambda p: p.node_id == node_id(1), log)
            await wait_for(lambda: announced(a) and announced(b))
            joined_at = trio.current_time()
            async with open_discovery(**node(3, netns, interfaces=address(3))) as c:
                seen: set[str] = set()
                while seen != {node_id(1), node_id(2)}:
                    seen.add((await next_event(c, lambda p: True, log)).node_id)
                await next_event(a, lambda p: p.node_id == node_id(3), log)
                await next_event(b, lambda p: p.node_id == node_id(3), log)
                took_s = trio.current_time() - joined_at
    print(f"\nlate joiner ({'shared' if shared_address else 'own'} address): {took_s:.3f} s")
    assert took_s < bound_s


async def test_nodes_of_another_mesh_are_not_reported(netns: str) -> None:
    events_a: list[DiscoveredPeer] = []
    with trio.fail_after(10):
        async with (
            open_discovery(**node(1, netns, interfaces=["lo"])) as a,
            open_discovery(**node(2, netns)),
            open_discovery(**node(3, netns, mesh=MESH_B)) as c,
        ):
            assert a.addresses == ("127.0.0.1",)  # "lo" resolved inside the namespace
            await next_event(a, lambda p: p.node_id == node_id(2), events_a)
            # The foreign advert did arrive and was examined (so this test can fail) ...
            await wait_for(lambda: a.stats.foreign_mesh_adverts >= 1)
            await wait_for(lambda: c.stats.foreign_mesh_adverts >= 2)
            assert [p.node_id for p in a.known_peers()] == [node_id(2)]
            assert c.known_peers() == []
            drain(a, events_a)
    # ... and was never reported.
    assert node_id(3) not in {p.node_id for p in events_a}


@pytest.mark.parametrize("how", ["exit", "cancel"])
async def test_stopped_node_is_reported_removed(netns: str, how: str) -> None:
    events: list[DiscoveredPeer] = []
    stop = trio.Event()

    async def run_b(task_status: trio.TaskStatus[trio.CancelScope]) -> None:
        with trio.CancelScope() as scope:
            async with open_discovery(**node(2, netns)):
                task_status.started(scope)
                await stop.wait()

    with trio.fail_after(10):
        async with open_discovery(**node(1, netns)) as a, trio.open_nursery() as nursery:
            b_scope = await nursery.start(run_b)
            await next_event(a, lambda p: p.node_id == node_id(2), events)
            stopped_at = trio.current_time()
            if how == "exit":
                stop.set()
            else:
                b_scope.cancel()
            gone = await next_event(a, lambda p: p.removed, events)
            took_s = trio.current_time() - stopped_at
    print(f"\nremoval ({how}) reported after {took_s:.3f} s")
    assert gone.node_id == node_id(2)
    assert gone.change is PeerChange.REMOVED
    assert took_s < REMOVAL_BOUND_S
    assert a.known_peers() == []


GARBAGE_TXT: list[bytes | dict[str, str]] = [
    b"",  # no TXT at all
    b"\x40\xff\xfe\x00",  # a length byte running past the end
    b"\x05v=\xff\xfe\x07",  # non-ASCII value
    {"v": "1", "id": "someone-else", "fp": "ab" * 16, "mh": MESH_A, "port": "7409"},  # id != name
    {"v": "1", "id": "{id}", "fp": "not hex!", "mh": MESH_A, "port": "7409"},
    {"v": "1", "id": "{id}", "fp": "ab" * 16, "mh": MESH_A, "port": "+7409"},
    {"v": "1", "id": "{id}", "fp": "ab" * 16, "mh": MESH_A, "port": "7000"},  # SRV says 7409
    {"v": "99999999", "id": "{id}", "fp": "ab" * 16, "mh": MESH_A, "port": "7409"},
]


def _plain_zeroconf(netns: str, address: str) -> zeroconf.Zeroconf:
    """(blocking) A python-zeroconf instance of our own, not meshd's, inside the namespace."""
    return call_in_netns(
        netns,
        lambda: zeroconf.Zeroconf(
            interfaces=[address], ip_version=zeroconf.IPVersion.V4Only, use_asyncio=False
        ),
    )


def _register(zc: zeroconf.Zeroconf, info: zeroconf.ServiceInfo, *, update: bool = False) -> None:
    """(blocking) Announce without waiting for the whole announcement series."""
    assert zc.loop is not None
    if update:
        announce = zc.async_update_service(info)
    else:
        announce = zc.async_register_service(info, cooperating_responders=True)
    asyncio.run_coroutine_threadsafe(announce, zc.loop).result(timeout=5)


def _advertise_garbage(netns: str) -> zeroconf.Zeroconf:
    """(blocking) A foreign advertiser at 127.0.0.9 with broken TXT records."""
    zc = _plain_zeroconf(netns, "127.0.0.9")
    for i, txt in enumerate(GARBAGE_TXT):
        name = f"garbage{i}"
        props = {k: v.format(id=name) for k, v in txt.items()} if isinstance(txt, dict) else txt
        info = zeroconf.ServiceInfo(
            SERVICE_TYPE,
            f"{name}.{SERVICE_TYPE}",
            port=7409,
            properties=props,
            server="garbage.local.",
            parsed_addresses=["127.0.0.9"],
        )
        _register(zc, info)
    return zc


async def test_garbage_txt_from_a_foreign_advertiser_is_ignored(netns: str) -> None:
    events: list[DiscoveredPeer] = []
    garbage = await trio.to_thread.run_sync(_advertise_garbage, netns)
    try:
        with trio.fail_after(10):
            async with open_discovery(**node(1, netns)) as a, open_discovery(**node(2, netns)):
                await next_event(a, lambda p: p.node_id == node_id(2), events)
                # Every broken advert was resolved and rejected, none crashed the browser.
                await wait_for(lambda: a.stats.malformed_adverts >= len(GARBAGE_TXT))
                assert [p.node_id for p in a.known_peers()] == [node_id(2)]
                drain(a, events)
    finally:
        await trio.to_thread.run_sync(garbage.close)
    assert [p.node_id for p in events] == [node_id(2)]


def _node_info(i: int, port: int) -> zeroconf.ServiceInfo:
    txt = encode_txt(
        node_id=node_id(i), key_fingerprint=fingerprint(i), mesh_hash=MESH_A, port=port, version=1
    )
    return zeroconf.ServiceInfo(
        SERVICE_TYPE,
        instance_name(node_id(i)),
        port=port,
        properties=txt,
        server=f"plain-{i}.local.",
        parsed_addresses=[f"127.0.0.{i}"],
    )


async def test_changed_advert_is_reported_updated(netns: str) -> None:
    """A peer re-announcing a new port (say, restarted without a goodbye) is an UPDATE."""
    log: list[DiscoveredPeer] = []
    plain = await trio.to_thread.run_sync(_plain_zeroconf, netns, "127.0.0.2")
    try:
        with trio.fail_after(10):
            async with open_discovery(**node(1, netns)) as a:
                await trio.to_thread.run_sync(_register, plain, _node_info(2, 7402))
                added = await next_event(a, lambda p: True, log)
                assert (added.change, added.port) == (PeerChange.ADDED, 7402)
                await trio.to_thread.run_sync(
                    partial(_register, plain, _node_info(2, 7502), update=True)
                )
                updated = await next_event(a, lambda p: True, log)
                assert (updated.change, updated.port) == (PeerChange.UPDATED, 7502)
                assert a.known_peers() == [replace(updated, change=PeerChange.ADDED)]
                await trio.to_thread.run_sync(plain.unregister_all_services)
                removed = await next_event(a, lambda p: True, log)
                assert (removed.change, removed.port) == (PeerChange.REMOVED, 7502)
    finally:
        await trio.to_thread.run_sync(plain.close)
    assert [p.change for p in log] == [PeerChange.ADDED, PeerChange.UPDATED, PeerChange.REMOVED]


def test_interface_choice_is_checked_inside_the_namespace(netns: str) -> None:
    assert call_in_netns(netns, lambda: resolve_interfaces(["lo", "127.0.0.5"])) == [
        "127.0.0.1",
        "127.0.0.5",
    ]
    with pytest.raises(ValueError, match="unknown interface"):
        call_in_netns(netns, lambda: resolve_interfaces(["eth0"]))
    with pytest.raises(ValueError, match="IPv4 only"):
        call_in_netns(netns, lambda: resolve_interfaces(["::1"]))
    # The default (all non-loopback) finds nothing in a namespace with only lo.
    with pytest.raises(ValueError, match="no IPv4 address"):
        call_in_netns(netns, lambda: resolve_interfaces([]))


@pytest.fixture
def linked_netns(netns: str) -> Iterator[tuple[str, str]]:
    """Two namespaces joined by a veth pair (10.77.0.1/24 <-> 10.77.0.2/24): a two-host LAN."""
    other = f"{netns}-b"
    steps = [
        ["ip", "netns", "add", other],
        [
            "ip",
            "-n",
            netns,
            "link",
            "add",
            "mdns-a",
            "type",
            "veth",
            "peer",
            "mdns-b",
            "netns",
            other,
        ],
        ["ip", "-n", netns, "addr", "add", "10.77.0.1/24", "dev", "mdns-a"],
        ["ip", "-n", other, "addr", "add", "10.77.0.2/24", "dev", "mdns-b"],
        ["ip", "-n", netns, "link", "set", "mdns-a", "up"],
        ["ip", "-n", other, "link", "set", "mdns-b", "up"],
        ["ip", "-n", other, "link", "set", "lo", "up"],
    ]
    try:
        for step in steps:
            subprocess.run(step, check=True, capture_output=True, timeout=10)
        yield netns, other
    finally:
        subprocess.run(["ip", "netns", "del", other], capture_output=True)


async def test_two_hosts_find_each_other_over_a_link(linked_netns: tuple[str, str]) -> None:
    """Across a real link: the default (all non-loopback) and an interface name both work."""
    ns_a, ns_b = linked_netns
    log: list[DiscoveredPeer] = []
    with trio.fail_after(10):
        start = trio.current_time()
        async with (
            open_discovery(**node(1, ns_a, interfaces=[])) as a,
            open_discovery(**node(2, ns_b, interfaces=["mdns-b"])) as b,
        ):
            assert (a.addresses, b.addresses) == (("10.77.0.1",), ("10.77.0.2",))
            seen_by_a = await next_event(a, lambda p: True, log)
            seen_by_b = await next_event(b, lambda p: True, log)
            took_s = trio.current_time() - start
    print(f"\ntwo namespaces over veth found each other after {took_s:.3f} s")
    assert (seen_by_a.node_id, seen_by_a.addresses) == (node_id(2), ("10.77.0.2",))
    assert (seen_by_b.node_id, seen_by_b.addresses) == (node_id(1), ("10.77.0.1",))
    assert took_s < DISCOVERY_BOUND_S
