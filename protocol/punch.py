"""NAT traversal without I/O: introductions, punch probes, relayed datagrams, relay policy.

Two nodes behind NATs meet through an introducer I that both hold lanes to. A asks I
(`IntroduceRequest`, on the lane's NAT stream); I answers both A and B at the same moment with
an `Introduction`: the other's observed (post-NAT) address as I sees it, a fresh punch nonce
and a relay session id. Both then send PROBE datagrams to each other's observed address; the
first probe A receives proves the path, and A opens an ordinary lane handshake to where it came
from. If no probe arrives, A opens the lane through I instead: lane datagrams travel wrapped in
RELAY datagrams, and I forwards them between the two addresses it registered for the session.
The lane inside stays end-to-end Noise: I only ever sees ciphertext.

    PROBE    [0x07][0x00][0 u32][nonce 16][tag 16]                      38 bytes
    RELAY    [0x08][0x00][relay session id u32] inner datagram           to the relay
    RELAYED  [0x09][0x00][relay session id u32] inner datagram           from the relay

A probe's tag is keyed by the mesh PSK and the nonce, so only mesh members can punch, and a
probe is only good for the introduction that chose its nonce. The relay session id sits where
every other kind carries its receiver-chosen id (bytes 2..6): the relay chose it.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from protocol.datagram import KIND_PROBE, KIND_RELAY, KIND_RELAYED, MAX_DATAGRAM_BYTES
from protocol.errors import (
    InvalidConfig,
    LocalProtocolError,
    RemoteProtocolError,
    UndecryptableError,
)

NONCE_BYTES = 16
TAG_BYTES = 16
HEADER_BYTES = 6
PROBE_BYTES = HEADER_BYTES + NONCE_BYTES + TAG_BYTES
KEY_BYTES = 32
MAX_NAT_MESSAGE_BYTES = 512
MAX_HOST_CHARS = 64
MAX_REASON_CHARS = 200


class PunchConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How hard to punch and how much to relay (every number with its unit)."""

    # Probes go out every probe_interval_s for at most punch_duration_s. During the first
    # open_phase_s they carry ip_ttl open_ttl: enough to cross our own NAT (creating the
    # mapping) but not to reach the peer's NAT, where an unsolicited probe would make Linux
    # conntrack give the peer's own outgoing flow a different port.
    probe_interval_s: float = 0.05
    punch_duration_s: float = 2.5
    open_phase_s: float = 0.2
    open_ttl: int = 2
    # The handshake to a punched address must finish within this, or we relay.
    direct_handshake_timeout_s: float = 1.5
    # An introduction not answered within this fails.
    introduction_timeout_s: float = 2.0
    # Punches this node answers at once (each sends punch_duration_s / probe_interval_s probes).
    max_concurrent_punches: int = 8
    # Relay limits at an introducer: sessions held at once, each session's sustained rate and
    # burst, and how long an unused session lives.
    relay_max_sessions: int = 64
    relay_rate_bytes_per_s: float = 16 * 1024 * 1024
    relay_burst_bytes: int = 4 * 1024 * 1024
    relay_idle_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        positive = {
            "probe_interval_s": self.probe_interval_s,
            "punch_duration_s": self.punch_duration_s,
            "direct_handshake_timeout_s": self.direct_handshake_timeout_s,
            "introduction_timeout_s": self.introduction_timeout_s,
            "relay_rate_bytes_per_s": self.relay_rate_bytes_per_s,
            "relay_burst_bytes": self.relay_burst_bytes,
            "relay_idle_timeout_s": self.relay_idle_timeout_s,
        }
        for name, value in positive.items():
            if value <= 0:
                raise InvalidConfig(f"{name} must be positive, got {value}")
        if not 0 <= self.open_phase_s < self.punch_duration_s:
            raise InvalidConfig("open_phase_s must lie in [0, punch_duration_s)")
        if not 1 <= self.open_ttl <= 255:
            raise InvalidConfig("open_ttl must lie in 1..255")
        if self.max_concurrent_punches < 1:
            raise InvalidConfig("max_concurrent_punches must be at least 1")
        if self.relay_max_sessions < 0:
            raise InvalidConfig("relay_max_sessions must not be negative")


# -- messages on the lane's NAT stream ------------------------------------------------------
class IntroduceRequest(msgspec.Struct, frozen=True, tag="introduce"):
    """Ask the receiving node to introduce us to `target` (an X25519 static key)."""

    target: bytes


class Introduction(msgspec.Struct, frozen=True, tag="introduction"):
    """Sent by the introducer to both sides at once.

    `initiator` is true for the side that asked: it opens the lane; the other side probes
    and accepts. `observed_host`/`observed_port` are where the introducer sees the receiver.
    """

    peer: bytes
    peer_host: str
    peer_port: int
    observed_host: str
    observed_port: int
    nonce: bytes
    relay_session: int
    initiator: bool


class IntroductionRefused(msgspec.Struct, frozen=True, tag="refused"):
    """The introducer cannot introduce us to `target` (no lane to it, relay full, ...)."""

    target: bytes
    reason: str


NatMessage = IntroduceRequest | Introduction | IntroductionRefused

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(NatMessage)


def _check(message: NatMessage) -> None:
    if isinstance(message, Introduction):
        _check_introduction(message)
        return
    if len(message.target) != KEY_BYTES:
        raise RemoteProtocolError("a node key is 32 bytes")
    if isinstance(message, IntroductionRefused) and len(message.reason) > MAX_REASON_CHARS:
        raise RemoteProtocolError("refusal reason too long")


def _check_introduction(message: Introduction) -> None:
    if len(message.peer) != KEY_BYTES or len(message.nonce) != NONCE_BYTES:
        raise RemoteProtocolError("introduction with a bad key or nonce length")
    for host, port in (
        (message.peer_host, message.peer_port),
        (message.observed_host, message.observed_port),
    ):
        if not 0 < len(host) <= MAX_HOST_CHARS or not 0 < port < 65536:
            raise RemoteProtocolError("introduction with a bad address")
    if not 0 < message.relay_session < 1 << 32:
        raise RemoteProtocolError("relay session id out of range")


def encode(message: NatMessage) -> bytes:
    """Encode a NAT message; LocalProtocolError if it breaks a limit (our bug)."""
    try:
        _check(message)
    except RemoteProtocolError as exc:
        raise LocalProtocolError(str(exc)) from None
    return _encoder.encode(message)


def decode(data: bytes) -> NatMessage:
    """Decode and validate a NAT message; anything malformed raises RemoteProtocolError."""
    if len(data) > MAX_NAT_MESSAGE_BYTES:
        raise RemoteProtocolError("NAT message too large")
    try:
        message = _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise RemoteProtocolError(f"malformed NAT message: {exc}") from None
    _check(message)
    return message


# -- probes ---------------------------------------------------------------------------------
def probe_key(psk: bytes) -> bytes:
    """The key probes of this mesh are tagged with (before mixing in each nonce)."""
    return hashlib.blake2s(b"meshd punch probe v1", key=psk).digest()


def _probe_tag(key: bytes, nonce: bytes, body: bytes) -> bytes:
    per_punch = hashlib.blake2s(nonce, key=key).digest()
    return hashlib.blake2s(body, key=per_punch, digest_size=TAG_BYTES).digest()


def make_probe(key: bytes, nonce: bytes) -> bytes:
    """A PROBE datagram for the punch that chose `nonce`."""
    if len(nonce) != NONCE_BYTES:
        raise LocalProtocolError("a punch nonce is 16 bytes")
    body = bytes([KIND_PROBE, 0]) + bytes(4) + nonce
    return body + _probe_tag(key, nonce, body)


def probe_nonce(datagram: bytes) -> bytes:
    """The nonce a probe claims (not yet verified); RemoteProtocolError if malformed."""
    if len(datagram) != PROBE_BYTES or datagram[0] != KIND_PROBE:
        raise RemoteProtocolError("not a punch probe")
    return datagram[HEADER_BYTES : HEADER_BYTES + NONCE_BYTES]


def verify_probe(key: bytes, datagram: bytes) -> bytes:
    """The nonce of a genuine probe; UndecryptableError if its tag is wrong (a forgery, or
    another mesh's), RemoteProtocolError if it is not a probe."""
    nonce = probe_nonce(datagram)
    body, tag = datagram[:-TAG_BYTES], datagram[-TAG_BYTES:]
    if not hmac.compare_digest(tag, _probe_tag(key, nonce, body)):
        raise UndecryptableError("probe not tagged with this mesh's secret and nonce")
    return nonce


# -- relayed datagrams ----------------------------------------------------------------------
@dataclass(frozen=True)
class RelayPath:
    """A lane address meaning "through relay `via`, in session `session_id`".

    Lanes take any hashable address, so a relayed lane is an ordinary lane whose address is
    one of these; the endpoint wraps what it sends there in RELAY datagrams.
    """

    via: tuple[str, int]
    session_id: int

    def wrap(self, inner: bytes) -> tuple[bytes, tuple[str, int]]:
        """The RELAY datagram carrying `inner` and where it goes."""
        return _frame(KIND_RELAY, self.session_id, inner), self.via


def _frame(kind: int, session_id: int, inner: bytes) -> bytes:
    return bytes([kind, 0]) + session_id.to_bytes(4, "big") + inner


def unwrap(datagram: bytes) -> tuple[int, bytes]:
    """(session id, inner datagram) of a RELAY or RELAYED datagram."""
    if len(datagram) <= HEADER_BYTES or datagram[0] not in (KIND_RELAY, KIND_RELAYED):
        raise RemoteProtocolError("not a relay datagram")
    if len(datagram) > MAX_DATAGRAM_BYTES:
        raise RemoteProtocolError("relay datagram larger than any UDP payload")
    return int.from_bytes(datagram[2:6], "big"), datagram[HEADER_BYTES:]


Address = tuple[str, int]


@dataclass
class _Session:
    ends: tuple[Address, Address]
    keys: tuple[bytes, bytes]
    tokens: float
    refilled_at: float
    last_used: float
    forwarded_bytes: int = 0


# Why a relay drops a RELAY datagram (`RelayTable.route`): its session is unknown (expired, or
# never opened: a forgery), it came from neither of the session's two ends, or it exceeds the
# session's rate.
RELAY_DROP_REASONS: tuple[str, ...] = (
    "relay_unknown_session", "relay_wrong_source", "relay_over_rate",
)  # fmt: skip


@dataclass
class RelayStats:
    """What a relay did (for the operator and for tests)."""

    sessions_opened: int = 0
    sessions_refused: int = 0
    forwarded_datagrams: int = 0
    forwarded_bytes: int = 0
    dropped_unknown_session: int = 0
    dropped_wrong_source: int = 0
    dropped_over_rate: int = 0


@dataclass
class RelayTable:
    """An introducer's relay sessions: who may send through it, to whom, and how fast.

    It holds addresses and node keys only; it has no lane keys, so it can forward the lane
    between two peers but never read it. Time is passed in.
    """

    config: PunchConfig
    new_id: Callable[[], int]
    stats: RelayStats = field(default_factory=RelayStats)
    _sessions: dict[int, _Session] = field(default_factory=dict)

    @property
    def session_count(self) -> int:
        """Sessions currently held."""
        return len(self._sessions)

    def open_session(
        self, ends: tuple[Address, Address], keys: tuple[bytes, bytes], now: float
    ) -> int | None:
        """Register a session between two addresses; its id, or None if the relay is full."""
        self.expire(now)
        if len(self._sessions) >= self.config.relay_max_sessions:
            self.stats.sessions_refused += 1
            return None
        session_id = self.new_id()
        while not 0 < session_id < 1 << 32 or session_id in self._sessions:
            session_id = self.new_id()
        burst = float(self.config.relay_burst_bytes)
        self._sessions[session_id] = _Session(ends, keys, burst, now, now)
        self.stats.sessions_opened += 1
        return session_id

    def forward(self, datagram: bytes, source: Address, now: float) -> tuple[bytes, Address] | None:
        """The RELAYED datagram to send for a RELAY one from `source`, or None to drop it."""
        out = self.route(datagram, source, now)
        return None if isinstance(out, str) else out

    def route(self, datagram: bytes, source: Address, now: float) -> tuple[bytes, Address] | str:
        """The RELAYED datagram to send for a RELAY one from `source`, or why it is dropped
        (RELAY_DROP_REASONS), for the endpoint's counters. RemoteProtocolError if malformed."""
        session_id, inner = unwrap(datagram)
        if datagram[0] != KIND_RELAY:
            raise RemoteProtocolError("only RELAY datagrams are forwarded")
        session = self._sessions.get(session_id)
        if session is None:
            self.stats.dropped_unknown_session += 1
            return "relay_unknown_session"
        if source == session.ends[0]:
            destination = session.ends[1]
        elif source == session.ends[1]:
            destination = session.ends[0]
        else:
            self.stats.dropped_wrong_source += 1
            return "relay_wrong_source"
        cost = len(inner)
        elapsed = now - session.refilled_at
        session.tokens = min(
            float(self.config.relay_burst_bytes),
            session.tokens + elapsed * self.config.relay_rate_bytes_per_s,
        )
        session.refilled_at = now
        if session.tokens < cost:
            # Loss, as on any congested path: the lane's recovery slows down and resends.
            self.stats.dropped_over_rate += 1
            return "relay_over_rate"
        session.tokens -= cost
        session.last_used = now
        session.forwarded_bytes += cost
        self.stats.forwarded_datagrams += 1
        self.stats.forwarded_bytes += cost
        return _frame(KIND_RELAYED, session_id, inner), destination

    def expire(self, now: float) -> None:
        """Forget sessions unused for relay_idle_timeout_s."""
        cutoff = now - self.config.relay_idle_timeout_s
        for session_id in [s for s, v in self._sessions.items() if v.last_used < cutoff]:
            del self._sessions[session_id]
