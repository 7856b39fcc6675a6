"""Join tokens: round trip, typos caught by the checksum, expiry, clear errors."""

from __future__ import annotations

import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshd.mesh.jointoken import (
    PREFIX,
    AddressError,
    JoinToken,
    JoinTokenError,
    decode_join_token,
    format_peer_address,
    make_join_token,
    parse_join_token,
    parse_peer_address,
)

SECRET = "correct horse battery staple 42"
ADDRS = ["192.168.1.10:7391", "[fd00::2]:7400", "gpu-box.lan:7391"]
B64URL = string.ascii_letters + string.digits + "-_"


def test_round_trip() -> None:
    token = make_join_token(SECRET, ADDRS, expires_unix=2_000_000_000)
    assert token.startswith(PREFIX) and token.isascii() and " " not in token
    parsed = parse_join_token(token, now_unix=1_900_000_000)
    assert parsed == JoinToken(
        SECRET,
        (("192.168.1.10", 7391), ("fd00::2", 7400), ("gpu-box.lan", 7391)),
        2_000_000_000,
    )


def test_without_expiry_never_expires() -> None:
    token = make_join_token(SECRET, [("10.0.0.1", 7391)])
    assert parse_join_token(token, now_unix=1e12).expires_unix is None
    assert parse_join_token(token).addresses == (("10.0.0.1", 7391),)  # wall clock


def test_surrounding_whitespace_from_copy_paste_is_ignored() -> None:
    token = make_join_token(SECRET, ADDRS)
    assert parse_join_token(f"  {token}\n").secret == SECRET


def _body_positions(token: str) -> range:
    return range(len(PREFIX), len(token))


def test_every_single_character_typo_is_caught() -> None:
    token = make_join_token(SECRET, ADDRS, expires_unix=2_000_000_000)
    mutants = []
    for i in _body_positions(token):
        # Every substitution by another character of the alphabet.
        mutants += [token[:i] + c + token[i + 1 :] for c in B64URL if c != token[i]]
        mutants.append(token[:i] + token[i + 1 :])  # dropped character
        mutants.append(token[:i] + "A" + token[i:])  # doubled/extra character
        if i + 1 < len(token) and token[i] != token[i + 1]:
            mutants.append(token[:i] + token[i + 1] + token[i] + token[i + 2 :])  # swap
    mutants.append(token[:-1] + "!")  # a character outside the alphabet
    mutants.append(token.replace("-", "+", 2))  # standard base64 instead of url-safe
    mutants = [m for m in mutants if m != token]
    assert len(mutants) > 65 * (len(token) - len(PREFIX))
    for mutant in mutants:
        with pytest.raises(JoinTokenError, match=r"damaged|malformed|start with"):
            decode_join_token(mutant)


def test_truncated_token_is_caught() -> None:
    token = make_join_token(SECRET, ADDRS)
    for cut in (len(PREFIX), len(PREFIX) + 3, len(token) // 2, len(token) - 1):
        with pytest.raises(JoinTokenError):
            decode_join_token(token[:cut])


def test_expiry() -> None:
    token = make_join_token(SECRET, ADDRS, expires_unix=1_700_000_000)
    assert parse_join_token(token, now_unix=1_699_999_999).secret == SECRET
    with pytest.raises(JoinTokenError, match=r"expired at 2023-11-14 22:13:20 UTC \(60 s ago\)"):
        parse_join_token(token, now_unix=1_700_000_060)
    with pytest.raises(JoinTokenError, match="expired"):
        parse_join_token(token, now_unix=1_700_000_000)
    # Decoding alone ignores the expiry (what the token says is still readable).
    assert decode_join_token(token).expired(1_700_000_060)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "must start with 'meshd1-'"),
        ("hello", "must start with 'meshd1-'"),
        ("MESHD1-abcd", "must start with 'meshd1-'"),
        ("meshd2-AAAA", "version 'meshd2' is not supported"),
        ("meshd1-", "damaged"),
        ("meshd1-!!!!", "damaged"),
    ],
)
def test_bad_tokens_have_clear_errors(text: str, message: str) -> None:
    with pytest.raises(JoinTokenError, match=message):
        parse_join_token(text)


def test_making_a_token_checks_its_inputs() -> None:
    with pytest.raises(JoinTokenError, match="at least 16 characters"):
        make_join_token("", ADDRS)
    with pytest.raises(JoinTokenError, match="at least 16 characters"):
        make_join_token("hunter2", ADDRS)
    with pytest.raises(JoinTokenError, match="bootstrap addresses"):
        make_join_token(SECRET, [])
    with pytest.raises(JoinTokenError, match="no port"):
        make_join_token(SECRET, ["10.0.0.1"])
    with pytest.raises(JoinTokenError, match="not an IP address or host name"):
        make_join_token(SECRET, [("bad host", 1)])
    with pytest.raises(JoinTokenError, match=r"1\.\.65535"):
        make_join_token(SECRET, [("10.0.0.1", 0)])


def test_repr_hides_the_secret() -> None:
    token = parse_join_token(make_join_token(SECRET, ADDRS))
    assert SECRET not in repr(token) and "192.168.1.10" in repr(token)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("10.0.0.1:7391", ("10.0.0.1", 7391)),
        (" node-2.local:1 ", ("node-2.local", 1)),
        ("[::1]:65535", ("::1", 65535)),
        ("10.0.0.1", ("10.0.0.1", 9)),
        ("::1", ("::1", 9)),
        ("[fe80::1]", ("fe80::1", 9)),
        ("host", ("host", 9)),
    ],
)
def test_peer_addresses(text: str, expected: tuple[str, int]) -> None:
    assert parse_peer_address(text, default_port=9) == expected
    assert parse_peer_address(format_peer_address(expected)) == expected


@pytest.mark.parametrize(
    "text", ["host:0", "host:65536", "host:x", "[::1", "[::1]x", "bad_host:1", "-a:1", ":7391"]
)
def test_bad_peer_addresses(text: str) -> None:
    with pytest.raises(AddressError):
        parse_peer_address(text, default_port=9)


def test_peer_address_needs_a_port_without_default() -> None:
    with pytest.raises(AddressError, match="no port"):
        parse_peer_address("10.0.0.1")


@settings(max_examples=60)
@given(
    secret=st.text(min_size=16, max_size=200).filter(lambda s: len(s.encode()) <= 1024),
    ports=st.lists(st.integers(1, 65535), min_size=1, max_size=16),
    expires=st.none() | st.integers(0, 2**40),
)
def test_round_trip_property(secret: str, ports: list[int], expires: int | None) -> None:
    addrs = [(f"10.0.{i}.1", port) for i, port in enumerate(ports)]
    token = decode_join_token(make_join_token(secret, addrs, expires))
    assert token == JoinToken(secret, tuple(addrs), expires)
