"""DATA packets: header checks, replay window, key updates across reordering."""

import pytest

from protocol.errors import RemoteProtocolError
from protocol.packet import (
    HEADER_BYTES,
    KeySchedule,
    ReplayWindow,
    next_key,
    parse_header,
    seal_packet,
)

KEY_A, KEY_B = bytes(range(32)), bytes(range(1, 33))


def schedules() -> tuple[KeySchedule, KeySchedule]:
    return KeySchedule(KEY_A, KEY_B, 0.0, 1.0), KeySchedule(KEY_B, KEY_A, 0.0, 1.0)


def open_packet(keys: KeySchedule, datagram: bytes, now: float = 0.0) -> bytes:
    flags, _, number = parse_header(datagram)
    return keys.open(datagram, flags, number, now)


def test_sealed_packet_opens_and_tampering_fails() -> None:
    a, b = schedules()
    datagram = seal_packet(a, 77, 5, b"\x01")
    assert parse_header(datagram) == (0, 77, 5)
    assert open_packet(b, datagram) == b"\x01"
    for i in (0, 1, 6, HEADER_BYTES, len(datagram) - 1):
        bad = bytearray(datagram)
        bad[i] ^= 0x01
        with pytest.raises(RemoteProtocolError):
            open_packet(b, bytes(bad))


def test_reserved_flags_are_refused() -> None:
    a, _ = schedules()
    datagram = bytearray(seal_packet(a, 1, 1, b"\x01"))
    datagram[1] |= 0x80
    with pytest.raises(RemoteProtocolError, match="reserved"):
        parse_header(bytes(datagram))


def test_receiver_follows_a_key_update_and_keeps_old_keys_for_reordered_packets() -> None:
    a, b = schedules()
    old = seal_packet(a, 9, 10, b"\x01")
    a.update_send(0.0)
    new = seal_packet(a, 9, 11, b"\x01")
    assert parse_header(new)[0] == 1 and a.send_key == next_key(KEY_A)
    assert open_packet(b, new, now=0.1) == b"\x01"
    assert b.recv_generation == 1 and b.send_generation == 1  # the receiver followed
    assert open_packet(b, old, now=0.5) == b"\x01"  # reordered, within retention
    late = seal_packet(KeySchedule(KEY_A, KEY_B, 0.0, 1.0), 9, 8, b"\x01")
    with pytest.raises(RemoteProtocolError, match="discarded"):
        open_packet(b, late, now=1.2)  # previous keys are gone after retention_s


def test_updates_wait_until_the_peer_followed() -> None:
    a, b = schedules()
    assert a.may_update()
    a.update_send(0.0)
    assert not a.may_update()
    open_packet(b, seal_packet(a, 1, 0, b"\x01"))
    open_packet(a, seal_packet(b, 1, 0, b"\x01"))
    assert a.may_update() and a.recv_generation == 1


def test_replay_window_accepts_each_number_once_and_refuses_the_too_old() -> None:
    window = ReplayWindow(64)
    for number in (5, 3, 100, 99):
        assert window.is_fresh(number)
        window.record(number)
        assert not window.is_fresh(number)
    assert window.is_fresh(37) and not window.is_fresh(36)  # 100 - 64 = 36 is out
    for number in range(101, 400):
        window.record(number)
    assert not window.is_fresh(100) and window.is_fresh(400)


def test_short_and_foreign_datagrams_are_refused() -> None:
    for data in (b"", b"\x04" * 10, b"\x02" + bytes(40)):
        with pytest.raises(RemoteProtocolError):
            parse_header(data)


def test_packet_protection_is_the_noise_aead_byte_for_byte() -> None:
    from protocol.noise import aead_decrypt, aead_encrypt
    from protocol.packet import protect, unprotect

    header, plaintext = bytes(range(14)), bytes(range(200)) * 7
    datagram = protect(KEY_A, header, 2**40 + 3, plaintext)
    assert datagram == header + aead_encrypt(KEY_A, 2**40 + 3, header, plaintext)
    assert bytes(unprotect(KEY_A, datagram, 2**40 + 3)) == plaintext
    assert aead_decrypt(KEY_A, 2**40 + 3, header, datagram[14:]) == plaintext
    with pytest.raises(RemoteProtocolError):
        unprotect(KEY_A, datagram, 2**40 + 4)
