"""NAT traversal without I/O: probe tags, NAT message codec, relay policy (virtual clock)."""

from __future__ import annotations

import contextlib
import itertools
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol import punch
from protocol.datagram import KIND_RELAYED, peek_kind
from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.handshake import psk_from_secret

KEY = punch.probe_key(psk_from_secret("mesh one"))
OTHER_MESH = punch.probe_key(psk_from_secret("mesh two"))
NONCE = bytes(range(16))
A, B, STRANGER = ("198.18.1.2", 4000), ("198.18.2.2", 5000), ("198.18.9.9", 4000)
KEYS = (b"a" * 32, b"b" * 32)


def table(**overrides: Any) -> punch.RelayTable:
    ids = itertools.count(1)
    return punch.RelayTable(config=punch.PunchConfig(**overrides), new_id=lambda: next(ids))


def test_a_probe_is_good_only_for_its_mesh_and_its_punch() -> None:
    probe = punch.make_probe(KEY, NONCE)
    assert len(probe) == punch.PROBE_BYTES and peek_kind(probe) == 0x07
    assert punch.verify_probe(KEY, probe) == NONCE
    with pytest.raises(RemoteProtocolError):
        punch.verify_probe(OTHER_MESH, probe)
    # The nonce is part of the tag's key: rewriting it (to reuse a probe) breaks the tag.
    moved = probe[:6] + bytes(16) + probe[22:]
    with pytest.raises(RemoteProtocolError):
        punch.verify_probe(KEY, moved)


@given(st.binary(max_size=80))
def test_garbage_probes_raise_only_remote_errors(data: bytes) -> None:
    try:
        punch.verify_probe(KEY, data)
    except RemoteProtocolError:
        return
    assert data == punch.make_probe(KEY, data[6:22])


def test_nat_messages_round_trip_and_garbage_is_remote_error() -> None:
    intro = punch.Introduction(b"k" * 32, "198.18.1.2", 4000, "198.18.2.2", 5000, NONCE, 7, True)
    for message in (
        punch.IntroduceRequest(b"t" * 32),
        intro,
        punch.IntroductionRefused(b"t" * 32, "full"),
    ):
        assert punch.decode(punch.encode(message)) == message
    with pytest.raises(LocalProtocolError):
        punch.encode(punch.IntroduceRequest(b"short"))
    for garbage in (b"", b"\xc1", b"\x81\xa4type\xa9introduce", bytes(600)):
        with pytest.raises(RemoteProtocolError):
            punch.decode(garbage)


@given(st.binary(max_size=600))
def test_any_bytes_decode_or_raise_remote_error(data: bytes) -> None:
    with contextlib.suppress(RemoteProtocolError):
        punch.decode(data)


def test_relay_forwards_between_the_two_registered_ends_only() -> None:
    relay = table()
    session = relay.open_session((A, B), KEYS, now=0.0)
    assert session is not None
    inner = b"\x04ciphertext"
    out = relay.forward(punch.RelayPath(A, session).wrap(inner)[0], A, now=0.1)
    assert out is not None
    data, destination = out
    assert destination == B and data[0] == KIND_RELAYED and punch.unwrap(data) == (session, inner)
    back = relay.forward(punch.RelayPath(B, session).wrap(b"\x04reply")[0], B, now=0.2)
    assert back is not None and back[1] == A
    # A third address, or an unknown session, gets nothing forwarded.
    assert relay.forward(punch.RelayPath(A, session).wrap(inner)[0], STRANGER, now=0.3) is None
    assert relay.forward(punch.RelayPath(A, session + 1).wrap(inner)[0], A, now=0.3) is None
    assert relay.stats.dropped_wrong_source == 1 and relay.stats.dropped_unknown_session == 1
    # A relayed datagram is never forwarded again (no loops through relays).
    with pytest.raises(RemoteProtocolError):
        relay.forward(data, A, now=0.4)


def test_relay_limits_rate_sessions_and_forgets_idle_sessions() -> None:
    relay = table(relay_rate_bytes_per_s=1000, relay_burst_bytes=1500, relay_max_sessions=1)
    session = relay.open_session((A, B), KEYS, now=0.0)
    assert session is not None
    assert relay.open_session((A, STRANGER), KEYS, now=0.0) is None  # full
    datagram = punch.RelayPath(A, session).wrap(bytes(1000))[0]
    assert relay.forward(datagram, A, now=0.0) is not None
    assert relay.forward(datagram, A, now=0.0) is None  # burst spent
    assert relay.forward(datagram, A, now=0.6) is not None  # refilled at 1000 B/s
    assert relay.stats.dropped_over_rate == 1
    later = 0.6 + punch.PunchConfig().relay_idle_timeout_s + 1
    assert relay.open_session((A, STRANGER), KEYS, now=later) is not None  # the idle one expired
    assert relay.forward(datagram, A, now=later) is None


def test_config_rejects_nonsense() -> None:
    with pytest.raises(LocalProtocolError):
        punch.PunchConfig(probe_interval_s=0)
    with pytest.raises(LocalProtocolError):
        punch.PunchConfig(open_phase_s=3.0, punch_duration_s=2.0)
    with pytest.raises(LocalProtocolError):
        punch.PunchConfig(open_ttl=0)
