"""Remote garbage into a lane raises only RemoteProtocolError (or is dropped) and harms nothing."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshd.sim.lane_pair import pair
from protocol.datagram import KIND_DATA, KIND_REFUSAL, KIND_RESPONSE
from protocol.errors import RemoteProtocolError
from protocol.lane import Lane, MessageReceived

# One established pair shared by the examples: garbage must leave it working.
_NET, _A, _B = pair()
_A.send_message(1, b"genuine message")
_SAMPLES = [data for data, _ in _A.datagrams_to_send(_NET.now)]
for _data in _SAMPLES:
    _B.receive_datagram(_data, "a", _NET.now)


def feed(lane: Lane, data: bytes, now: float) -> None:
    with contextlib.suppress(RemoteProtocolError):
        lane.receive_datagram(data, "a", now)


@settings(max_examples=150)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_raise_only_remote_errors(data: bytes) -> None:
    feed(_B, data, _NET.now)
    assert _B.is_established


@settings(max_examples=150)
@given(
    st.sampled_from([KIND_DATA, KIND_RESPONSE, KIND_REFUSAL]),
    st.binary(min_size=5, max_size=120),
)
def test_garbage_with_a_plausible_header_is_refused(kind: int, rest: bytes) -> None:
    lane_id = _B.local_lane_id.to_bytes(4, "big")
    feed(_B, bytes([kind, rest[0]]) + lane_id + rest[1:], _NET.now)
    assert _B.is_established


@settings(max_examples=120)
@given(st.data())
def test_mutated_genuine_datagrams_are_refused_and_the_originals_still_deliver(
    data: st.DataObject,
) -> None:
    payload = data.draw(st.binary(min_size=1, max_size=3000))
    _A.send_message(3, payload)
    genuine = [datagram for datagram, _ in _A.datagrams_to_send(_NET.now)]
    # Draws must not depend on the shared lane's state, or hypothesis cannot replay them.
    victim = bytearray(genuine[data.draw(st.integers(0, 63)) % len(genuine)])
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(0, 1 << 16)) % len(victim)
        victim[i] ^= data.draw(st.integers(1, 255))
    feed(_B, bytes(victim), _NET.now)
    for datagram in genuine:
        _B.receive_datagram(datagram, "a", _NET.now)
    for datagram, _ in _B.datagrams_to_send(_NET.now):
        _A.receive_datagram(datagram, "b", _NET.now)
    events = []
    while (event := _B.next_event()) is not None:
        events.append(event)
    assert [e.data for e in events if isinstance(e, MessageReceived)][-1:] == [payload]
    assert _B.is_established and _A.is_established


@pytest.mark.parametrize("cut", [0, 1, 6, 14, 29, 30])
def test_truncated_datagrams_are_refused(cut: int) -> None:
    with pytest.raises(RemoteProtocolError):
        _B.receive_datagram(_SAMPLES[0][:cut], "a", _NET.now)
