"""Join tokens: one string that lets a new node into the mesh.

A token carries the mesh secret, one or more bootstrap addresses (`host:port` of nodes to
contact first) and an optional expiry:

    meshd1-<base64url(msgpack [secret, addresses, expires_unix] || checksum)>

The checksum (4 bytes of keyed BLAKE2s) catches a mistyped or truncated token before the node
tries to use it. The token IS the mesh secret: anyone holding it can join and read the mesh's
traffic, so treat it like a password. The expiry only stops stale tokens from being pasted by
mistake; it is not a security boundary (whoever has the token has the secret). To shut someone
out, rotate the mesh secret or revoke their node key.
"""

from __future__ import annotations

import base64
import binascii
import datetime
import hashlib
import ipaddress
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec

PREFIX = "meshd1-"
CHECKSUM_BYTES = 4
# Mesh secrets shorter than this are refused everywhere (they could be guessed).
MIN_SECRET_CHARS = 16
MAX_SECRET_BYTES = 1024
MAX_ADDRESSES = 16
_CHECKSUM_KEY = b"meshd join token v1"
_HOSTNAME_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")

Address = tuple[str, int]


class JoinTokenError(ValueError):
    """A join token is malformed, damaged, expired, or cannot be made from the inputs."""


class AddressError(ValueError):
    """A peer address is not `host:port`, `[ipv6]:port` or a bare host with a default port."""


@dataclass(frozen=True)
class JoinToken:
    """What a join token carries (the secret is kept out of the repr)."""

    secret: str = field(repr=False)
    addresses: tuple[Address, ...]
    expires_unix: int | None = None

    def expired(self, now_unix: float) -> bool:
        """True when the token has an expiry and `now_unix` is at or past it."""
        return self.expires_unix is not None and now_unix >= self.expires_unix


class _Payload(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    secret: str
    addresses: list[str]
    expires_unix: int | None


def parse_peer_address(text: str, default_port: int | None = None) -> Address:
    """Parse `host:port`, `[ipv6]:port`, or a bare host/IPv6 address using `default_port`.

    The host is an IP address or a DNS name; the port is 1..65535.
    """
    text = text.strip()
    port_text: str | None
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise AddressError(f"peer address {text!r}: expected [ipv6]:port")
        port_text = rest[1:] if rest else None
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    else:
        host, port_text = text, None  # a bare host, or a bare IPv6 address
    _check_host(host, text)
    if port_text is None:
        if default_port is None:
            raise AddressError(f"peer address {text!r} has no port: write host:port")
        return host, default_port
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise AddressError(f"peer address {text!r}: port must be a number in 1..65535")
    return host, int(port_text)


def format_peer_address(address: Address) -> str:
    """`host:port`, with brackets around an IPv6 host."""
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _check_host(host: str, text: str) -> None:
    try:
        ipaddress.ip_address(host)
        return
    except ValueError:
        pass
    labels = host.rstrip(".").split(".")
    if not host or len(host) > 253 or not all(_HOSTNAME_LABEL.match(x) for x in labels):
        raise AddressError(f"peer address {text!r}: {host!r} is not an IP address or host name")


def make_join_token(
    secret: str, addrs: Sequence[str | Address], expires_unix: int | None = None
) -> str:
    """A `meshd1-...` token holding the mesh secret, bootstrap addresses and an expiry."""
    if len(secret) < MIN_SECRET_CHARS or len(secret.encode("utf-8")) > MAX_SECRET_BYTES:
        raise JoinTokenError(
            f"the mesh secret must have at least {MIN_SECRET_CHARS} characters "
            f"and at most {MAX_SECRET_BYTES} bytes"
        )
    if not 1 <= len(addrs) <= MAX_ADDRESSES:
        raise JoinTokenError(f"a join token needs 1..{MAX_ADDRESSES} bootstrap addresses")
    try:
        parsed = [a if isinstance(a, tuple) else parse_peer_address(a) for a in addrs]
        for host, port in parsed:
            _check_host(host, host)
            if not 1 <= port <= 65535:
                raise AddressError(f"port {port} of {host!r} is not in 1..65535")
    except AddressError as exc:
        raise JoinTokenError(str(exc)) from None
    if expires_unix is not None and expires_unix < 0:
        raise JoinTokenError("expires_unix must be a Unix time (seconds, >= 0)")
    payload = msgspec.msgpack.encode(
        _Payload(secret, [format_peer_address(a) for a in parsed], expires_unix)
    )
    body = base64.urlsafe_b64encode(payload + _checksum(payload)).rstrip(b"=")
    return PREFIX + body.decode("ascii")


def decode_join_token(text: str) -> JoinToken:
    """Decode and check a token's format and checksum, without looking at its expiry."""
    text = text.strip()
    if not text.startswith(PREFIX):
        if re.match(r"^meshd\d+-", text):
            raise JoinTokenError(
                f"join token version {text.split('-')[0]!r} is not supported by this meshd "
                f"(it reads {PREFIX!r}); upgrade meshd or ask for a {PREFIX} token"
            )
        raise JoinTokenError(f"not a meshd join token: it must start with {PREFIX!r}")
    body = text[len(PREFIX) :]
    damaged = "join token is damaged ({}): copy it again in full"
    try:
        raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
    except (binascii.Error, ValueError):
        raise JoinTokenError(damaged.format("not base64url")) from None
    # The decoder skips stray characters and unused low bits; only the canonical spelling
    # counts, so every changed character is caught.
    if base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii") != body:
        raise JoinTokenError(damaged.format("not canonical base64url"))
    payload, checksum = raw[:-CHECKSUM_BYTES], raw[-CHECKSUM_BYTES:]
    if len(raw) <= CHECKSUM_BYTES or _checksum(payload) != checksum:
        raise JoinTokenError(damaged.format("checksum mismatch"))
    try:
        decoded = msgspec.msgpack.decode(payload, type=_Payload)
        addresses = tuple(parse_peer_address(a) for a in decoded.addresses)
    except (msgspec.DecodeError, AddressError) as exc:
        raise JoinTokenError(f"join token is malformed: {exc}") from None
    if not decoded.secret or not addresses:
        raise JoinTokenError("join token is malformed: it lacks the secret or addresses")
    return JoinToken(decoded.secret, addresses, decoded.expires_unix)


def parse_join_token(text: str, *, now_unix: float | None = None) -> JoinToken:
    """Decode a token and refuse it when expired (`now_unix` defaults to the wall clock)."""
    token = decode_join_token(text)
    now = time.time() if now_unix is None else now_unix
    if token.expired(now):
        assert token.expires_unix is not None
        when = datetime.datetime.fromtimestamp(token.expires_unix, datetime.UTC)
        raise JoinTokenError(
            f"join token expired at {when:%Y-%m-%d %H:%M:%S} UTC "
            f"({now - token.expires_unix:.0f} s ago): ask for a fresh one"
        )
    return token


def _checksum(payload: bytes) -> bytes:
    return hashlib.blake2s(payload, digest_size=CHECKSUM_BYTES, key=_CHECKSUM_KEY).digest()
