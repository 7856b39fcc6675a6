"""mDNS discovery: advertise this daemon and browse for others, bridged into trio.

mDNS is a hint, never trusted: a discovered peer is only an address to try a lane handshake
with. python-zeroconf's synchronous API runs its own asyncio loop in a background thread; its
browser calls us back on a thread of its own. Those callbacks reach trio through
`trio.from_thread.run_sync` with the run's token, and every blocking zeroconf call (open,
register, resolve, close) goes through `trio.to_thread.run_sync`.

    async with open_discovery(node_id=..., key_fingerprint=..., mesh_hash=..., port=...,
                              interfaces=["127.0.0.1"]) as disc:
        async for peer in disc.peers():
            ...  # peer.change is ADDED, UPDATED or REMOVED

The TXT schema (`v`, `id`, `fp`, `mh`, `port`) is documented in docs/discovery.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import enum
import hashlib
import ipaddress
import logging
import math
import os
import re
import socket
import threading
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from functools import partial
from typing import TypeVar

import ifaddr
import msgspec
import trio
import zeroconf

from protocol import PROTOCOL_VERSION

log = logging.getLogger(__name__)

SERVICE_TYPE = "_meshd._udp.local."
# Domain label of the mesh hash: a keyed hash of this label under the PSK, so the hash
# identifies the mesh without being usable as (or revealing) the secret.
MESH_HASH_LABEL = b"meshd mdns mesh hash v1"

_NODE_ID = re.compile(r"[A-Za-z0-9_-]{1,63}")
_HEX = re.compile(r"[0-9a-f]+")
_FINGERPRINT_HEX_CHARS = (16, 128)
_MESH_HASH_HEX_CHARS = (16, 64)

T = TypeVar("T")


class DiscoveryConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """mDNS discovery (the daemon's `[mdns]` table); the defaults find peers on a LAN or
    loopback well under 2 s. Validated on construction (ValueError naming the field)."""

    # Announce this node and browse for peers of the same mesh.
    enabled: bool = True
    # Addresses of the interfaces to announce and browse on; empty = every non-loopback one.
    interfaces: tuple[str, ...] = ()
    # How long to wait for a peer's SRV/TXT/A records when they were not in its announcement.
    resolve_timeout_s: float = 1.0
    # Minimum gap between periodic browse queries after the startup burst (python-zeroconf
    # sends its first queries at ~0.1 s, 1 s, 4 s and 9 s regardless).
    browse_interval_s: float = 10.0
    # Names resolved concurrently, so a few silent advertisers cannot stall real peers.
    resolve_workers: int = 4
    # Events buffered for `peers()` before resolution waits for the consumer.
    event_buffer: int = 64
    # Upper bound on unregister + close at shutdown (goodbyes take ~0.25 s).
    close_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        for name in self.interfaces:
            if not name.strip() or name != name.strip():
                raise ValueError(f"interfaces: bad entry {name!r}")
        for key in ("resolve_timeout_s", "browse_interval_s", "close_timeout_s"):
            if not 0 < getattr(self, key) <= 3600:
                raise ValueError(f"{key} must be in (0, 3600] seconds")
        for key in ("resolve_workers", "event_buffer"):
            if not 1 <= getattr(self, key) <= 1024:
                raise ValueError(f"{key} must be in 1..1024")


class PeerChange(enum.Enum):
    """What happened to a discovered peer."""

    ADDED = "added"
    UPDATED = "updated"
    REMOVED = "removed"


@dataclass(frozen=True)
class DiscoveredPeer:
    """A daemon of our mesh seen by mDNS (a hint: verify it with a lane handshake)."""

    node_id: str
    key_fingerprint: str
    addresses: tuple[str, ...]
    port: int
    mesh_hash: str
    version: int
    change: PeerChange = PeerChange.ADDED

    @property
    def removed(self) -> bool:
        """True when the peer said goodbye (or stopped matching our mesh)."""
        return self.change is PeerChange.REMOVED


@dataclass
class DiscoveryStats:
    """Counters for the operator; garbage is counted and dropped, never raised."""

    malformed_adverts: int = 0
    foreign_mesh_adverts: int = 0
    resolve_failures: int = 0


class MalformedAdvertisement(ValueError):
    """A `_meshd._udp` advertisement whose name or TXT record breaks the schema."""


def mesh_hash_for(psk: bytes) -> str:
    """The mesh hash advertised in TXT `mh`: keyed BLAKE2s of a domain label under the PSK.

    Nodes of other meshes are told apart without the secret being revealed; a low-entropy
    mesh secret could still be guessed offline from it, so secrets should be random.
    """
    if not psk:
        raise ValueError("the PSK must not be empty")
    return hashlib.blake2s(MESH_HASH_LABEL, key=psk, digest_size=16).hexdigest()


def instance_name(node_id: str) -> str:
    """The mDNS instance name of a node."""
    return f"{node_id}.{SERVICE_TYPE}"


def _check_hex(value: str, bounds: tuple[int, int], what: str) -> str:
    low, high = bounds
    if not (low <= len(value) <= high and len(value) % 2 == 0 and _HEX.fullmatch(value)):
        raise MalformedAdvertisement(f"{what} must be {low}-{high} lower-case hex chars")
    return value


def encode_txt(
    *, node_id: str, key_fingerprint: str, mesh_hash: str, port: int, version: int
) -> dict[str, str]:
    """The TXT properties for our advertisement; raises ValueError on an invalid field."""
    txt = {
        "v": str(version),
        "id": node_id,
        "fp": key_fingerprint,
        "mh": mesh_hash,
        "port": str(port),
    }
    # Whatever we send must parse on the other side: validate with the receiving parser.
    try:
        _parse_fields({k.encode(): v.encode() for k, v in txt.items()})
    except (MalformedAdvertisement, UnicodeEncodeError) as exc:
        raise ValueError(f"cannot advertise: {exc}") from None
    return txt


def _parse_fields(properties: Mapping[bytes, bytes | None]) -> tuple[str, str, str, int, int]:
    """(node_id, fingerprint, mesh_hash, port, version) from TXT, or MalformedAdvertisement."""
    fields: dict[str, str] = {}
    for key in ("v", "id", "fp", "mh", "port"):
        raw = properties.get(key.encode())
        if raw is None:
            raise MalformedAdvertisement(f"TXT key {key!r} missing or without a value")
        try:
            fields[key] = raw.decode("ascii")
        except UnicodeDecodeError:
            raise MalformedAdvertisement(f"TXT key {key!r} is not ASCII") from None
    if not _NODE_ID.fullmatch(fields["id"]):
        raise MalformedAdvertisement("node id must be 1-63 chars of [A-Za-z0-9_-]")
    fingerprint = _check_hex(fields["fp"], _FINGERPRINT_HEX_CHARS, "key fingerprint")
    mesh_hash = _check_hex(fields["mh"], _MESH_HASH_HEX_CHARS, "mesh hash")
    port = _parse_int(fields["port"], 1, 65535, "port")
    version = _parse_int(fields["v"], 0, 65535, "version")
    return fields["id"], fingerprint, mesh_hash, port, version


def _parse_int(text: str, low: int, high: int, what: str) -> int:
    # Digits only: int() would also accept "+1", " 1" and "1_0".
    if not (1 <= len(text) <= 5 and text.isdigit()):
        raise MalformedAdvertisement(f"{what} must be a decimal number")
    value = int(text)
    if not low <= value <= high:
        raise MalformedAdvertisement(f"{what} {value} out of range {low}-{high}")
    return value


def parse_advertisement(
    name: str,
    properties: Mapping[bytes, bytes | None],
    srv_port: int | None,
    addresses: list[str],
) -> DiscoveredPeer:
    """Check one resolved advertisement against the schema; raises MalformedAdvertisement.

    The instance name must be the node id's, the TXT port must match the SRV port, and at
    least one address must be present, so one node id maps to one consistent record.
    """
    node_id, fingerprint, mesh_hash, port, version = _parse_fields(properties)
    if name.lower() != instance_name(node_id).lower():
        raise MalformedAdvertisement(f"instance name {name!r} does not match node id {node_id}")
    if srv_port != port:
        raise MalformedAdvertisement(f"TXT port {port} differs from SRV port {srv_port}")
    if not addresses:
        raise MalformedAdvertisement("no address records")
    try:
        parsed = {ipaddress.ip_address(a) for a in addresses}
    except ValueError:
        raise MalformedAdvertisement(f"bad address in {addresses!r}") from None
    # Sorted: zeroconf lists addresses most recent first, which would make refreshes look
    # like updates.
    ordered = tuple(str(a) for a in sorted(parsed, key=lambda a: (a.version, int(a))))
    return DiscoveredPeer(node_id, fingerprint, ordered, port, mesh_hash, version)


def resolve_interfaces(interfaces: list[str]) -> list[str]:
    """IPv4 addresses to bind mDNS to: each entry is an IPv4 address or an interface name.

    An empty list means every non-loopback IPv4 address. Runs in the calling thread's network
    namespace. Raises ValueError for IPv6, unknown names, or when nothing is left.
    """
    adapters = ifaddr.get_adapters()
    by_name = {a.name: [ip.ip for ip in a.ips if isinstance(ip.ip, str)] for a in adapters}
    out: list[str] = []
    if not interfaces:
        for addrs in by_name.values():
            out += [a for a in addrs if not ipaddress.IPv4Address(a).is_loopback]
    for entry in interfaces:
        try:
            addr = ipaddress.ip_address(entry)
        except ValueError:
            if entry not in by_name:
                raise ValueError(f"unknown interface {entry!r} (have {sorted(by_name)})") from None
            out += by_name[entry]
            continue
        if addr.version != 4:
            raise ValueError(f"mDNS discovery binds IPv4 only, got {entry!r}")
        out.append(str(addr))
    out = list(dict.fromkeys(out))
    if not out:
        raise ValueError(f"no IPv4 address to advertise on interfaces {interfaces!r}")
    return out


_CLONE_NEWNET = 0x40000000


def _enter_netns(name: str) -> None:
    """Move the calling thread into the network namespace /run/netns/NAME."""
    path = os.path.join("/run/netns", name)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), path)
    finally:
        os.close(fd)


def call_in_netns(netns: str | None, fn: Callable[[], T]) -> T:
    """Run `fn` in a fresh thread inside network namespace `netns` (None: right here).

    Namespaces are per thread on Linux; sockets keep the namespace they were created in. The
    thread is discarded afterwards, so no pooled thread is ever left in the namespace.
    Blocking: call it from `trio.to_thread.run_sync`.
    """
    if netns is None:
        return fn()
    result: list[T] = []
    errors: list[BaseException] = []

    def body() -> None:
        try:
            _enter_netns(netns)
            result.append(fn())
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=body, name=f"meshd-netns-{netns}", daemon=True)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return result[0]


class _Listener(zeroconf.ServiceListener):
    """Runs on python-zeroconf's browser thread: forward each change into trio."""

    def __init__(self, mark: Callable[[str, PeerChange], None], token: trio.lowlevel.TrioToken):
        self._mark = mark
        self._token = token

    def _post(self, name: str, change: PeerChange) -> None:
        # RunFinishedError: trio is gone, so nothing is listening any more.
        with contextlib.suppress(trio.RunFinishedError):
            trio.from_thread.run_sync(self._mark, name, change, trio_token=self._token)

    def add_service(self, zc: zeroconf.Zeroconf, type_: str, name: str) -> None:
        self._post(name, PeerChange.ADDED)

    def update_service(self, zc: zeroconf.Zeroconf, type_: str, name: str) -> None:
        self._post(name, PeerChange.UPDATED)

    def remove_service(self, zc: zeroconf.Zeroconf, type_: str, name: str) -> None:
        self._post(name, PeerChange.REMOVED)


class Discovery:
    """A running advertisement and browser; made by `open_discovery`."""

    def __init__(
        self,
        *,
        node_id: str,
        mesh_hash: str,
        addresses: list[str],
        config: DiscoveryConfig,
        zc: zeroconf.Zeroconf,
    ) -> None:
        self.node_id = node_id
        self.mesh_hash = mesh_hash
        self.addresses = tuple(addresses)
        self.config = config
        self.stats = DiscoveryStats()
        self._zc = zc
        self._own_name = instance_name(node_id).lower()
        self._known: dict[str, DiscoveredPeer] = {}
        # Latest unprocessed change per name: bursts for one name coalesce, and the queue
        # holds each name at most once, so its size is bounded by distinct names.
        self._pending: dict[str, PeerChange] = {}
        self._busy: set[str] = set()
        self._names_send, self._names_recv = trio.open_memory_channel[str](math.inf)
        self._events_send, self._events_recv = trio.open_memory_channel[DiscoveredPeer](
            config.event_buffer
        )
        self._closing = False
        # The announcement task; held so it is not garbage-collected mid-way.
        self._announcing: object = None

    def peers(self) -> trio.MemoryReceiveChannel[DiscoveredPeer]:
        """Peer events (ADDED, UPDATED, REMOVED) for our mesh; ourselves excluded.

        One consumer is expected; it ends when the discovery block exits.
        """
        return self._events_recv

    def known_peers(self) -> list[DiscoveredPeer]:
        """The peers currently believed present, as last reported."""
        return list(self._known.values())

    def _mark(self, name: str, change: PeerChange) -> None:
        """(trio thread) Note a change reported by the browser."""
        if self._closing:
            return
        name = name.lower()
        queued = name in self._pending
        self._pending[name] = change
        if not queued and name not in self._busy:
            self._names_send.send_nowait(name)

    async def _resolve_worker(self) -> None:
        async for name in self._names_recv:
            change = self._pending.pop(name, None)
            if change is None:
                continue
            self._busy.add(name)
            try:
                await self._apply(name, change)
            finally:
                self._busy.discard(name)
                if name in self._pending:
                    self._names_send.send_nowait(name)

    async def _apply(self, name: str, change: PeerChange) -> None:
        if name == self._own_name:
            return
        if change is PeerChange.REMOVED:
            await self._forget(name)
            return
        peer = await self._resolve(name)
        if peer is None:
            return
        if peer.mesh_hash != self.mesh_hash:
            self.stats.foreign_mesh_adverts += 1
            await self._forget(name)
            return
        old = self._known.get(name)
        if old is not None and replace(old, change=PeerChange.ADDED) == peer:
            return  # a refresh with nothing new
        if old is not None:
            peer = replace(peer, change=PeerChange.UPDATED)
        self._known[name] = replace(peer, change=PeerChange.ADDED)
        await self._events_send.send(peer)

    async def _resolve(self, name: str) -> DiscoveredPeer | None:
        """Fetch and check a name's records; garbage is counted, never raised."""
        timeout_ms = max(1, round(self.config.resolve_timeout_s * 1000))
        try:
            info = await trio.to_thread.run_sync(
                partial(self._zc.get_service_info, SERVICE_TYPE, name, timeout=timeout_ms),
                abandon_on_cancel=True,
            )
        except zeroconf.Error as exc:
            log.debug("mDNS: cannot resolve %r: %r", name, exc)
            info = None
        if info is None:
            self.stats.resolve_failures += 1
            return None
        try:
            return parse_advertisement(
                name, info.properties, info.port, info.parsed_addresses(zeroconf.IPVersion.V4Only)
            )
        except MalformedAdvertisement as exc:
            self.stats.malformed_adverts += 1
            log.debug("mDNS: ignoring %r: %s", name, exc)
            await self._forget(name)
            return None

    async def _forget(self, name: str) -> None:
        old = self._known.pop(name, None)
        if old is not None:
            await self._events_send.send(replace(old, change=PeerChange.REMOVED))


def _open_zeroconf(interfaces: list[str]) -> tuple[zeroconf.Zeroconf, list[str]]:
    """(blocking) Bind python-zeroconf to the IPv4 addresses of the chosen interfaces only."""
    addresses = resolve_interfaces(interfaces)
    zc = zeroconf.Zeroconf(
        interfaces=list(addresses), ip_version=zeroconf.IPVersion.V4Only, use_asyncio=False
    )
    return zc, addresses


def _start(
    zc: zeroconf.Zeroconf,
    info: zeroconf.ServiceInfo | None,
    listener: _Listener,
    config: DiscoveryConfig,
) -> tuple[zeroconf.ServiceBrowser, object]:
    """(blocking) Browse first, then announce (`info`; None: browse only), so simultaneous
    starters hear each other."""
    browser = zeroconf.ServiceBrowser(
        zc, SERVICE_TYPE, listener=listener, delay=round(config.browse_interval_s * 1000)
    )
    if info is None:
        return browser, None
    assert zc.loop is not None
    # Node ids are unique per key, so skip the ~1.2 s conflict probing (trust comes from the
    # handshake anyway), and return once the first of three announcements is queued.
    registered = asyncio.run_coroutine_threadsafe(
        zc.async_register_service(info, cooperating_responders=True), zc.loop
    )
    try:
        return browser, registered.result(timeout=config.close_timeout_s)
    except BaseException:
        browser.cancel()
        raise


def _close(zc: zeroconf.Zeroconf, browser: zeroconf.ServiceBrowser | None) -> None:
    """(blocking) Stop browsing, send goodbyes (unregister) and close the sockets."""
    if browser is not None:
        browser.cancel()
    zc.close()


@asynccontextmanager
async def open_discovery(
    *,
    node_id: str,
    key_fingerprint: str,
    mesh_hash: str,
    port: int,
    interfaces: list[str],
    config: DiscoveryConfig | None = None,
    version: int = PROTOCOL_VERSION,
    netns: str | None = None,
    advertise: bool = True,
) -> AsyncIterator[Discovery]:
    """Advertise this node on `interfaces` (unless not `advertise`: a node that only looks
    for peers, e.g. a `mesh:ID` node fetching its manifest before it starts) and browse for
    peers of the same mesh.

    `interfaces`: IPv4 addresses or interface names (empty: all non-loopback). `netns`: name
    of a network namespace (/run/netns/NAME) to open the mDNS sockets in; for tests. On exit,
    even by cancellation, the service is unregistered (goodbye packets) and zeroconf closed.
    """
    config = config or DiscoveryConfig()
    txt = encode_txt(
        node_id=node_id,
        key_fingerprint=key_fingerprint,
        mesh_hash=mesh_hash,
        port=port,
        version=version,
    )
    zc, addresses = await trio.to_thread.run_sync(
        call_in_netns, netns, partial(_open_zeroconf, interfaces)
    )
    disc = Discovery(
        node_id=node_id, mesh_hash=mesh_hash, addresses=addresses, config=config, zc=zc
    )
    info = zeroconf.ServiceInfo(
        SERVICE_TYPE,
        instance_name(node_id),
        port=port,
        properties=txt,
        server=f"meshd-{node_id}.local.",
        addresses=[socket.inet_aton(a) for a in addresses],
    )
    listener = _Listener(disc._mark, trio.lowlevel.current_trio_token())
    browser: zeroconf.ServiceBrowser | None = None
    try:
        browser, disc._announcing = await trio.to_thread.run_sync(
            _start, zc, info if advertise else None, listener, config
        )
        async with trio.open_nursery() as nursery:
            for _ in range(config.resolve_workers):
                nursery.start_soon(disc._resolve_worker)
            try:
                yield disc
            finally:
                disc._closing = True
                nursery.cancel_scope.cancel()
    finally:
        disc._closing = True
        disc._events_send.close()  # sync: an await here could be cancelled before cleanup
        with trio.CancelScope(shield=True), trio.move_on_after(config.close_timeout_s) as scope:
            await trio.to_thread.run_sync(_close, zc, browser, abandon_on_cancel=True)
        if scope.cancelled_caught:
            log.warning("mDNS: close took over %.1f s; abandoned", config.close_timeout_s)
